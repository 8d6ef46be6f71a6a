"""Unit tests: ``distmoe export`` (``distmoe.export``): a run's checkpoint as a standalone Hugging Face model.

Run directories are laid out as the coordinator writes them (``config.toml``, ``checkpoints/round-<n>/`` written
by ``save_checkpoint`` with the server model's own ``save``), over a local checkpoint saved with
``save_pretrained``; a whole coordinator run exported is in ``tests/coordinator/test_coordinator.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from distmoe.checkpoint import save_checkpoint
from distmoe.cli import main
from distmoe.config import parse_run_config, to_toml
from distmoe.export import ExportError, export_run
from distmoe.model import expert_lora
from distmoe.model.adapters import server_model
from distmoe.model.build import build_model, hash_tensors
from distmoe.model.trainable import apply_trainable, load_trainable, spec_of


@pytest.fixture
def base(tiny):
    """``base(out, seed, dtype)``: a local checkpoint of the tiny architecture, saved with ``save_pretrained``."""
    return lambda out, seed, dtype=torch.float32: _base(tiny, out, seed, dtype)


@pytest.fixture
def run(tiny):
    """``run(run_dir, overrides, rounds)`` -> ``(cfg, server model, weights by round)``."""
    return lambda run_dir, overrides, rounds=(1, 2): _run(tiny, run_dir, overrides, rounds)


def _base(tiny, out: Path, seed: int, dtype=torch.float32) -> Path:
    model, tok = build_model(parse_run_config({**tiny, "run.seed": seed}).model)
    model.to(dtype).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def _run(tiny, run_dir: Path, overrides: dict, rounds=(1, 2)) -> tuple:
    """A run directory with checkpoints of ``rounds`` (adapters moved away from their no-op start)."""
    cfg = parse_run_config({**tiny, **overrides})
    run_dir.mkdir(parents=True)
    (run_dir / "config.toml").write_text(to_toml(cfg.as_flat()))
    sm = server_model(cfg.model)
    g = torch.Generator().manual_seed(1)
    weights = {}
    for rnd in rounds:
        w = {k: v + 0.05 * rnd * torch.randn(v.shape, generator=g) for k, v in sm.weights.items()}
        save_checkpoint(run_dir / "checkpoints", rnd, w, hash_tensors(w), write_model=lambda d, w=w: sm.save(d, w),
                        meta=sm.manifest_meta(), keep=5)
        weights[rnd] = w
    return cfg, sm, weights


def _logits(model, seed=0):
    ids = torch.randint(6, 100, (2, 9), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits.float()


def _adapted(model_cfg, weights, model_path=""):
    model = apply_trainable(build_model(model_cfg, model_path)[0], model_cfg)
    load_trainable(model, weights, spec_of(model, model_cfg.trainable))
    return model


def test_export_merges_adapters_into_a_standalone_checkpoint(tmp_path, base, run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    b = base(tmp_path / "base", seed=5)
    cfg, sm, weights = run(tmp_path / "run", {"model.path": str(b)})
    assert cfg.model.trainable == "lora" and sm.mode == "lora"  # `auto` with a checkpoint
    out = export_run(tmp_path / "run")
    assert out == tmp_path / "run" / "export" / "round-2"  # the latest checkpoint by default
    exported = AutoModelForCausalLM.from_pretrained(out)
    assert not any("lora" in n for n, _ in exported.named_parameters())
    party = _adapted(cfg.model, weights[2])
    stacks = expert_lora.expert_wrappers(party)  # the party's expert adapters run on the routed tokens
    assert stacks and all(type(w) is expert_lora.RoutedExpertsLoRA for w in stacks)
    adapted = _logits(party)
    torch.testing.assert_close(_logits(exported), adapted, rtol=1e-4, atol=1e-5)
    assert (adapted - _logits(build_model(cfg.model)[0])).abs().max() > 1e-3  # the adapters changed the model
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.encode("Compute 7+5") == build_model(cfg.model)[1].encode("Compute 7+5")
    # an earlier round, into a directory of one's choosing, with the base at another path (the same files)
    copy = base(tmp_path / "copy", seed=5)
    out1 = export_run(tmp_path / "run", round_num=1, out=tmp_path / "r1", model_path=str(copy))
    torch.testing.assert_close(_logits(AutoModelForCausalLM.from_pretrained(out1)),
                               _logits(_adapted(cfg.model, weights[1])), rtol=1e-4, atol=1e-5)
    assert not list(tmp_path.glob(".tmp-*")) and not list((tmp_path / "run" / "export").glob(".tmp-*"))


def test_export_keeps_the_base_dtype(tmp_path, base, run):
    from transformers import AutoModelForCausalLM

    b = base(tmp_path / "base", seed=5, dtype=torch.bfloat16)
    run(tmp_path / "run", {"model.path": str(b)}, rounds=(1,))
    out = export_run(tmp_path / "run")
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert AutoModelForCausalLM.from_pretrained(out, dtype="auto").dtype == torch.bfloat16


def test_export_of_the_tiny_default_and_of_a_full_model_run(tmp_path, run):
    from transformers import AutoModelForCausalLM

    cfg, _, weights = run(tmp_path / "lora", {"model.trainable": "lora"}, rounds=(1,))
    out = export_run(tmp_path / "lora")  # the tiny base rebuilt from the run's config (model.seed)
    torch.testing.assert_close(_logits(AutoModelForCausalLM.from_pretrained(out)),
                               _logits(_adapted(cfg.model, weights[1])), rtol=1e-4, atol=1e-5)
    cfg, sm, weights = run(tmp_path / "all", {}, rounds=(1,))
    assert sm.mode == "all"
    out = export_run(tmp_path / "all")  # model/ copied as it is
    ck = tmp_path / "all" / "checkpoints" / "round-1" / "model"
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in ck.iterdir())
    torch.testing.assert_close(_logits(AutoModelForCausalLM.from_pretrained(out)),
                               _logits(_adapted(cfg.model, weights[1])))


def test_a_routing_bias_run_is_refused_unless_the_bias_is_dropped_explicitly(tmp_path, capsys, run):
    """A ``model/`` checkpoint of a ``routing.balance = "bias"`` run holds one ``balance_bias`` per router, which
    the Hugging Face class cannot hold: export refuses, and with the flag writes weight files without it."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from distmoe.model.balance import install_bias

    cfg, sm, weights = run(tmp_path / "bias", {"routing.balance": "bias"}, rounds=(1,))
    bias_keys = [k for k in weights[1] if k.endswith("balance_bias")]
    assert len(bias_keys) == 2 and all(weights[1][k].abs().sum() > 0 for k in bias_keys)  # moved from zero
    with pytest.raises(ExportError, match=r"routing bias \(routing.balance = 'bias': 2 'balance_bias' tensors.*"
                                          r"--drop-routing-bias"):
        export_run(tmp_path / "bias")
    assert not (tmp_path / "bias" / "export").exists() or not any((tmp_path / "bias" / "export").iterdir())
    assert main(["export", str(tmp_path / "bias")]) == 2
    assert "--drop-routing-bias" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "bias"), "--drop-routing-bias"]) == 0
    out = Path(capsys.readouterr().out.strip())
    with safe_open(str(out / "model.safetensors"), framework="pt") as sf:
        keys = list(sf.keys())
    assert keys and not any(k.endswith("balance_bias") for k in keys)
    # the export is the trained model without its bias: the same logits as the trained weights with a zero bias
    loaded = AutoModelForCausalLM.from_pretrained(out)
    trained = _adapted(cfg.model, weights[1])
    install_bias(trained)
    with torch.no_grad():
        for k in bias_keys:
            trained.get_parameter(k).zero_()
    torch.testing.assert_close(_logits(loaded), _logits(trained))


def test_export_errors_say_what_is_wrong(tmp_path, capsys, base, run):
    with pytest.raises(ExportError, match="no such run directory"):
        export_run(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ExportError, match="no config.toml"):
        export_run(tmp_path / "empty")
    b = base(tmp_path / "base", seed=5)
    rd = tmp_path / "run"
    run(rd, {"model.path": str(b)}, rounds=(1,))
    with pytest.raises(ExportError, match="no checkpoint for round 7 \\(have: round-1\\)"):
        export_run(rd, round_num=7)
    other = base(tmp_path / "other", seed=6)  # same architecture, other weights
    with pytest.raises(ExportError, match="not the one run .* trained on"):
        export_run(rd, model_path=str(other))
    with pytest.raises(ExportError, match="not a directory"):
        export_run(rd, model_path=str(tmp_path / "nowhere"))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(ExportError, match="not an empty directory"):
        export_run(rd, out=tmp_path / "full")
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.toml").write_text((rd / "config.toml").read_text())
    with pytest.raises(ExportError, match="no checkpoint"):
        export_run(bare)
    adapter = rd / "checkpoints" / "round-1" / "adapter" / "adapter_model.safetensors"
    adapter.write_bytes(adapter.read_bytes()[:-8])
    with pytest.raises(ExportError, match="does not match its hash"):
        export_run(rd)
    # the command: one error line, status 2
    assert main(["export", str(tmp_path / "missing")]) == 2
    assert "error:" in capsys.readouterr().err


def test_a_sigmoid_routers_trained_bias_exports_in_its_own_slot(tmp_path, run):
    """DeepSeek-V3's router has its own correction bias: a ``routing.balance = "bias"`` run trains that tensor, so its
    ``model/`` checkpoint exports without ``--drop-routing-bias`` and the exported model routes as the trained one."""
    from transformers import AutoModelForCausalLM

    from distmoe.model.fabricate import write_checkpoint

    ckpt = write_checkpoint("deepseek_v3", tmp_path / "v3", seed=5)
    cfg, _, weights = run(tmp_path / "bias", {"model.path": str(ckpt), "model.trainable": "all",
                                              "routing.balance": "bias"}, rounds=(1,))
    keys = [k for k in weights[1] if k.endswith("e_score_correction_bias")]
    assert len(keys) == 1 and not [k for k in weights[1] if k.endswith("balance_bias")]
    out = export_run(tmp_path / "bias")  # no flag needed
    loaded = AutoModelForCausalLM.from_pretrained(out)
    torch.testing.assert_close(loaded.get_buffer(keys[0]), weights[1][keys[0]])  # the trained value, in its slot
    trained = _adapted(cfg.model, weights[1])
    torch.testing.assert_close(_logits(loaded), _logits(trained))
    with torch.no_grad():  # the bias matters: the checkpoint's own (untrained) bias routes differently
        loaded.get_buffer(keys[0]).copy_(AutoModelForCausalLM.from_pretrained(ckpt).get_buffer(keys[0]))
    assert not torch.allclose(_logits(loaded), _logits(trained))


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_a_sigmoid_family_lora_run_exports_merged(tmp_path, run, family):
    """The adapters of a DeepSeek-V3 / GLM-4.5 run (attention, routed experts, router) merge into the base: the export
    computes the adapted model's logits, its correction bias the checkpoint's own."""
    from transformers import AutoModelForCausalLM

    from distmoe.model.fabricate import write_checkpoint

    ckpt = write_checkpoint(family, tmp_path / family, seed=5)
    cfg, _, weights = run(tmp_path / "lora", {"model.path": str(ckpt), "model.trainable": "lora"}, rounds=(1,))
    assert any(".experts." in k for k in weights[1]) and any(".mlp.gate." in k for k in weights[1])
    out = export_run(tmp_path / "lora")
    loaded = AutoModelForCausalLM.from_pretrained(out)
    torch.testing.assert_close(_logits(loaded), _logits(_adapted(cfg.model, weights[1])), rtol=1e-4, atol=1e-5)
    base = AutoModelForCausalLM.from_pretrained(ckpt)
    for name, buf in base.named_buffers():
        if name.endswith("e_score_correction_bias"):
            torch.testing.assert_close(loaded.get_buffer(name), buf, rtol=0, atol=0)
