"""Unit tests: the server's model (``distmoe.model.adapters``): in ``lora`` mode the adapters only, built on the
meta device without reading a weight of the base; peft-format adapter checkpoints; merging adapters back."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from distmoe.config import parse_run_config
from distmoe.model.adapters import merge_adapters, server_model
from distmoe.model.base import base_fingerprint
from distmoe.model.build import ModelError, build_model, describe
from distmoe.model.trainable import (
    TrainableError,
    apply_trainable,
    load_trainable,
    spec_of,
    trainable_state,
)

ROOT = Path(__file__).resolve().parents[2]


def _ids(b=2, s=7, seed=0):
    return torch.randint(6, 100, (b, s), generator=torch.Generator().manual_seed(seed))


def _checkpoint(cfg, out: Path, seed: int = 7) -> Path:
    """A local checkpoint of the tiny architecture (weights of ``seed``), saved as a user would."""
    model, tok = build_model(parse_run_config({**{k: v for k, v in cfg.as_flat().items() if k != "model.trainable"},
                                               "run.seed": seed}).model)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def _party_model(model_cfg, weights):
    """What a party trains on: the full base, peft-wrapped, with the server's weights loaded."""
    model = apply_trainable(build_model(model_cfg)[0], model_cfg)
    load_trainable(model, weights, spec_of(model, model_cfg.trainable))
    return model.eval()


def _trained(weights: dict[str, torch.Tensor], seed: int = 3) -> dict[str, torch.Tensor]:
    """Adapters as after some training: lora_B no longer zero (so the adapter changes the model)."""
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in weights.items()}


def test_lora_server_model_holds_only_adapters_on_cpu(make_cfg):
    cfg = make_cfg(**{"model.trainable": "lora"}).model
    sm = server_model(cfg)
    assert sm.mode == "lora" and not sm.holds_base and sm.tokenizer is None
    assert {p.device.type for p in sm.module.parameters()} == {"meta"}  # no tensor of the base has storage
    party = spec_of(apply_trainable(build_model(cfg)[0], cfg), "lora")
    assert sm.tspec.shapes == party.shapes  # exactly the names and shapes the parties send
    assert sm.tspec.base_hash == base_fingerprint(cfg)  # what every party computes for its own base
    assert sm.mspec == describe(build_model(cfg)[0])
    assert list(sm.weights) == list(sm.tspec.keys)
    for name, t in sm.weights.items():
        assert t.dtype == torch.float32 and t.device.type == "cpu" and torch.isfinite(t).all()
        if ".lora_B." in name:
            assert not t.any(), name  # the adapter starts as a no-op
        else:  # peft's kaiming-uniform init of A: U(-1/sqrt(in), 1/sqrt(in))
            bound = 1 / math.sqrt(t.shape[1])
            assert t.abs().max() <= bound and t.std() > bound / 4, name
    again = server_model(cfg)
    assert all(torch.equal(again.weights[k], v) for k, v in sm.weights.items())  # deterministic per seed
    other = server_model(make_cfg(**{"model.trainable": "lora", "run.seed": 1}).model)
    a = next(k for k in sm.weights if ".lora_A." in k)
    assert not torch.equal(other.weights[a], sm.weights[a])


@pytest.mark.parametrize("mode", ["all", "router+experts"])
def test_full_modes_build_the_model_as_the_parties_do(make_cfg, mode, tmp_path):
    cfg = make_cfg(**{"model.trainable": mode}).model
    sm = server_model(cfg)
    party = apply_trainable(build_model(cfg)[0], cfg)
    assert sm.holds_base and sm.tspec == spec_of(party, mode, base_fingerprint(cfg))
    ref = trainable_state(party)
    assert sm.weights.keys() == ref.keys() and all(torch.equal(sm.weights[k], ref[k]) for k in ref)
    w = _trained(sm.weights)
    out = sm.save(tmp_path, w)
    assert out == tmp_path / "model" and "base_fingerprint" not in sm.manifest_meta()
    loaded = trainable_state(apply_trainable(build_model(cfg, model_path=str(out))[0], cfg))
    assert all(torch.equal(loaded[k], w[k]) for k in w)


def test_server_model_never_reads_the_base_weights(make_cfg, tmp_path):
    """A checkpoint whose weight file is garbage of the same name and size: the server builds the same adapters
    (names, shapes, values) as from the real file, since it reads config.json only."""
    cfg = make_cfg()
    real = _checkpoint(cfg, tmp_path / "real")
    broken = _checkpoint(cfg, tmp_path / "broken")
    weights = broken / "model.safetensors"
    weights.write_bytes(os.urandom(weights.stat().st_size))
    with pytest.raises(Exception):  # noqa: B017 - the file really is unusable as weights
        build_model(make_cfg(**{"model.path": str(broken)}).model)
    sm_real = server_model(make_cfg(**{"model.path": str(real)}).model)
    sm_broken = server_model(make_cfg(**{"model.path": str(broken)}).model)
    assert sm_real.mode == sm_broken.mode == "lora"
    assert sm_broken.tspec.shapes == sm_real.tspec.shapes and sm_broken.mspec == sm_real.mspec
    assert all(torch.equal(sm_broken.weights[k], v) for k, v in sm_real.weights.items())
    assert {p.device.type for p in sm_broken.module.parameters()} == {"meta"}
    assert sm_broken.base_fingerprint != sm_real.base_fingerprint  # the fingerprint covers the weight files
    real_cfg = make_cfg(**{"model.path": str(real)}).model
    party = spec_of(apply_trainable(build_model(real_cfg)[0], real_cfg), "lora")
    assert sm_real.tspec.shapes == party.shapes  # what the parties send, from the real weights
    with pytest.raises(ModelError, match="not a directory"):
        server_model(make_cfg(**{"model.path": str(tmp_path / "missing")}).model)


def test_fingerprint_is_the_files_not_the_directory(make_cfg, tmp_path):
    cfg = make_cfg()
    a = _checkpoint(cfg, tmp_path / "a")
    b = _checkpoint(cfg, tmp_path / "b")  # the same weights in another directory
    c = _checkpoint(cfg, tmp_path / "c", seed=8)
    fa, fb, fc = (base_fingerprint(make_cfg(**{"model.path": str(p)}).model) for p in (a, b, c))
    assert fa == fb != fc


def test_lora_adapters_are_saved_in_peft_format(make_cfg, tmp_path):
    """``adapter/`` loads with ``PeftModel.from_pretrained`` and gives the party's adapted model's logits."""
    from peft import PeftModel

    cfg = make_cfg(**{"model.trainable": "lora"}).model
    sm = server_model(cfg)
    w = _trained(sm.weights)
    out = sm.save(tmp_path, w)
    assert out == tmp_path / "adapter"
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    acfg = json.loads((out / "adapter_config.json").read_text())
    assert acfg["peft_type"] == "LORA" and acfg["r"] == cfg.lora_r and "mlp.experts.gate_up_proj" in \
        acfg["target_parameters"]
    assert sm.manifest_meta() == {"trainable": "lora", "layout": "adapter", "base_fingerprint": sm.base_fingerprint}
    loaded = PeftModel.from_pretrained(build_model(cfg)[0], str(out)).eval()
    params = dict(loaded.named_parameters())
    assert all(torch.equal(params[k], w[k]) for k in w)  # every adapter tensor, under the parties' names
    ids = _ids()
    with torch.no_grad():
        # peft's own expert forward against the party's routed one (expert_lora.py): the same sums, other rounding
        torch.testing.assert_close(loaded(input_ids=ids).logits, _party_model(cfg, w)(input_ids=ids).logits,
                                   rtol=1e-5, atol=1e-6)
    with pytest.raises(TrainableError):
        sm.save(tmp_path / "x", {k: v for k, v in list(w.items())[1:]})


def test_merged_adapters_give_the_adapted_logits(make_cfg, tmp_path):
    cfg = make_cfg(**{"model.trainable": "lora"}).model
    sm = server_model(cfg)
    w = _trained(sm.weights)
    merged, tok = merge_adapters(cfg, sm.save(tmp_path, w))
    assert not any("lora" in n for n, _ in merged.named_parameters())
    ids = _ids()
    with torch.no_grad():
        adapted = _party_model(cfg, w)(input_ids=ids).logits
        base = build_model(cfg)[0](input_ids=ids).logits
        got = merged(input_ids=ids).logits
    torch.testing.assert_close(got, adapted, rtol=1e-4, atol=1e-5)
    assert (got - base).abs().max() > 1e-3  # the experts', router's and attention adapters are in the weights


RSS_SCRIPT = """
import json, sys
import torch, transformers, peft  # noqa: F401  (imported before the baseline)
from transformers import AutoModelForCausalLM  # noqa: F401
from peft import get_peft_model  # noqa: F401
from distmoe.config import parse_run_config
from distmoe.model.adapters import server_model

def status(field):  # resident set (VmRSS) or its peak since the last reset (VmHWM), bytes
    with open("/proc/self/status") as fh:
        return next(int(x.split()[1]) * 1024 for x in fh if x.startswith(field + ":"))

cfg = parse_run_config({"model.path": sys.argv[1]}).model
server_model(parse_run_config({"model.trainable": "lora"}).model)  # warm up: lazy imports, tiny lora
with open("/proc/self/clear_refs", "w") as fh:
    fh.write("5")  # reset the peak resident set to the current one
before = status("VmRSS")
sm = server_model(cfg)
print(json.dumps({"before": before, "after": status("VmRSS"), "peak": status("VmHWM"), "n_params": sm.n_params,
                  "trainable": sm.tspec.numel, "devices": sorted({p.device.type for p in sm.module.parameters()})}))
"""


def _write_safetensors(path: Path, shapes: dict[str, tuple[int, ...]], dtype=torch.bfloat16) -> int:
    """A valid safetensors file written tensor by tensor (never the whole model in memory); returns its size."""
    code = {torch.bfloat16: "BF16", torch.float32: "F32"}[dtype]
    size = torch.tensor([], dtype=dtype).element_size()
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in shapes.items():
        n = math.prod(shape) * size
        header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    g = torch.Generator().manual_seed(0)
    with path.open("wb") as fh:
        fh.write(len(blob).to_bytes(8, "little"))
        fh.write(blob)
        for shape in shapes.values():
            fh.write((torch.randn(shape, generator=g) * 0.02).to(dtype).view(torch.uint8).numpy().tobytes())
    return path.stat().st_size


@pytest.mark.slow  # a real subprocess (imports torch, transformers and distmoe afresh)
def test_server_memory_stays_flat_as_the_base_grows(tmp_path):
    """A ~100M-parameter Qwen3-MoE checkpoint (bf16, ~200 MB of weights): the server's resident memory grows by
    a small fraction of the weights (the adapters plus a meta-device skeleton), measured in a fresh process."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    hf_cfg = Qwen3MoeConfig(vocab_size=2048, hidden_size=512, intermediate_size=512, moe_intermediate_size=512,
                            num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                            num_experts=32, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
                            tie_word_embeddings=False, dtype="bfloat16")
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(hf_cfg)
    shapes = {k: tuple(v.shape) for k, v in meta.state_dict().items()}
    n_params = sum(math.prod(s) for s in shapes.values())
    assert n_params > 100e6
    ck = tmp_path / "big"
    ck.mkdir()
    hf_cfg.save_pretrained(ck)
    weight_bytes = _write_safetensors(ck / "model.safetensors", shapes)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(RSS_SCRIPT), str(ck)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["n_params"] > n_params and got["devices"] == ["meta"]
    growth = got["peak"] - got["before"]  # peak resident memory of server_model over the process before it
    print(f"server RSS growth {growth / 2**20:.1f} MiB for a {n_params / 1e6:.0f}M-parameter base "
          f"({weight_bytes / 2**20:.0f} MiB of weights); adapters {got['trainable'] * 4 / 2**20:.1f} MiB")
    assert growth < 0.15 * weight_bytes, (growth, weight_bytes)


def test_lora_without_expert_adapters_for_large_bases(make_cfg):
    """model.lora-experts = false: attention and router adapters only; the server and the parties agree."""
    cfg = make_cfg(**{"model.trainable": "lora", "model.lora-experts": False}).model
    sm = server_model(cfg)
    party = spec_of(apply_trainable(build_model(cfg)[0], cfg), "lora")
    assert sm.tspec.shapes == party.shapes
    assert not any("experts" in k for k in sm.tspec.keys) and any("mlp.gate" in k for k in sm.tspec.keys)
    assert any("q_proj" in k for k in sm.tspec.keys)
    full = server_model(make_cfg(**{"model.trainable": "lora"}).model)
    assert sm.tspec.numel < full.tspec.numel
