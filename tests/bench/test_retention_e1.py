"""The continual-learning instrument (``bench/retention_e1.py``) and its pre-registered analysis
(``bench/e1_stats.py``): the paired tests, Holm, the equal-B-loss reading and B's length rule against values
worked by hand; forced routing reproduces the captured model exactly; a tiny end-to-end run writes every arm's
rows from one pre-B state and tabulates them.

Must not: run the experiment at its real size (the bench does that).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

_DIR = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(_DIR))


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, _DIR / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


st = _load("e1_stats")
e1 = _load("retention_e1")


def test_paired_matches_hand_computed_t_interval():
    t = st.paired([0.1, 0.2, 0.3])  # mean 0.2, sd 0.1, t_{0.975,2} = 4.302653
    assert t["mean"] == pytest.approx(0.2)
    assert t["hi"] - t["mean"] == pytest.approx(4.302653 * 0.1 / math.sqrt(3), rel=1e-5)
    assert t["p_t"] == pytest.approx(0.0742, abs=1e-3)  # t = 3.464, 2 df, two-sided
    assert t["p_wilcoxon"] == pytest.approx(0.25)  # the smallest exact two-sided p at n = 3
    with pytest.raises(ValueError, match="at least 2"):
        st.paired([0.1])


def test_complete_seeds_keeps_base_seed_units_of_several_bases_apart():
    rows = [{"seed": (b, s), "arm": a} for b in (1, 2) for s in (0, 1) for a in ("none", "distill")]
    rows += [{"seed": [3, 0], "arm": "none"}]  # a unit cut off before its second arm (JSON gives a list)
    assert st.complete_seeds(rows, ("none", "distill")) == ([(1, 0), (1, 1), (2, 0), (2, 1)], [(3, 0)])
    assert st.complete_seeds([{"seed": "2", "arm": "none"}], ("none",)) == ([2], [])


def test_holm_adjusts_step_down_and_stays_monotone():
    adj = st.holm({"a": 0.01, "b": 0.04, "c": 0.03})
    assert adj["a"] == (pytest.approx(0.03), 1)
    assert adj["c"] == (pytest.approx(0.06), 2)
    assert adj["b"] == (pytest.approx(0.06), 3)  # 0.04 x 1 raised to the running maximum


def test_compare_arms_claims_only_where_the_adjusted_interval_excludes_zero():
    res = st.compare_arms({"big": [0.50, 0.52, 0.51, 0.49], "null": [0.1, -0.1, 0.05, -0.04]})
    assert res["big"]["claimed"] == 1.0 and res["big"]["adj_lo"] > 0
    assert res["null"]["claimed"] == 0.0 and res["null"]["adj_lo"] < 0 < res["null"]["adj_hi"]
    assert res["big"]["adj_hi"] - res["big"]["adj_lo"] > res["big"]["hi"] - res["big"]["lo"]  # rank 1: 1 - 0.05/2


def test_equal_loss_interpolates_at_the_first_crossing():
    curve = [(3.0, 0.8), (2.0, 0.6), (1.0, 0.2)]
    assert st.at_equal_loss(curve, 1.5) == pytest.approx(0.4)
    assert st.at_equal_loss(curve, 3.5) == pytest.approx(0.8)
    assert st.at_equal_loss(curve, 0.5) is None


def test_length_rule_and_kept_fraction():
    assert st.kept_fraction(0.0, 0.8, 0.4) == pytest.approx(0.5)
    assert math.isnan(st.kept_fraction(0.1, 0.1, 0.0))
    assert st.choose_length({25: [0.9, 0.85], 50: [0.6, 0.5], 75: [0.3, 0.2], 100: [0.05, 0.0]}) == 50
    assert st.choose_length({25: [0.95], 50: [0.1]}) is None


def test_forced_routing_reproduces_the_captured_model(tmp_path):
    import torch

    from distmoe.config import parse_run_config
    from distmoe.data.formats import parse_line
    from distmoe.data.synth import disjoint_lookup
    from distmoe.data.template import collate, encode_example
    from distmoe.model.build import build_model, router_modules

    model, tok = build_model(parse_run_config({"run.seed": 0}).model)
    exs = [parse_line(o, f"t:{i}") for i, o in enumerate(disjoint_lookup(0, 1, 3)[0][1])]
    batches = [collate([encode_example(tok, e, 96) for e in exs], tok.pad_token_id)]
    forced = e1.capture_router(model, batches)
    before = e1.evaluate(model, batches)
    assert e1.evaluate(model, batches, forced) == pytest.approx(before)
    with torch.no_grad():
        for _, m in router_modules(model):
            m.weight.normal_()  # other routing: only the forced readout keeps the captured one
    assert e1.evaluate(model, batches, forced) != pytest.approx(e1.evaluate(model, batches))


@pytest.mark.integration  # a whole (tiny) E1 run: base, task A, every arm of B
def test_tiny_end_to_end_run_writes_paired_rows_and_a_table(tmp_path, capsys):
    out = tmp_path / "out"
    e1.main(["run", "--seeds", "0", "--warmup-steps", "1", "--keys", "2", "--steps-a", "1", "--a-round", "1",
             "--steps-b", "2", "--round", "1", "--arms", "none", "router-frozen", "experts-frozen",
             "--cache", str(tmp_path / "cache"), "--work", str(tmp_path / "work"), "--out", str(out)])
    rows = [json.loads(x) for x in (out / "rows.jsonl").read_text().splitlines()]
    arms = [(r["arm"], r["step"]) for r in rows]
    assert arms[:2] == [("base", 0), ("after-a", 0)]
    assert {("none", 2), ("router-frozen", 2), ("router-frozen+forced", 2), ("experts-frozen", 2)} <= set(arms)
    assert all(0.0 <= r["acc_a"] <= 1.0 and r["nll_a"] > 0 for r in rows)
    assert (tmp_path / "work" / "s0" / "pre-b.pt").is_file()
    e1.main(["table", "--out", str(out)])
    assert "B's length by the rule" in capsys.readouterr().out


def test_stage1_arms_use_the_library_mechanisms_and_an_expansion_does_not_leak_into_the_next_arm(tmp_path, capsys):
    """Every Stage 1 arm restarts from the same pre-B state: ``none`` after an expansion (which grows the model in
    place) reproduces ``none`` before it exactly; each arm sets up the library's mechanism as documented."""
    import torch

    arms_mod = _load("e1_arms")
    out = tmp_path / "out"
    e1.main(["run", "--seeds", "0", "--warmup-steps", "1", "--keys", "2", "--steps-a", "1", "--a-round", "1",
             "--steps-b", "1", "--round", "1", "--arms", "none", "anchor-50", "protect-0", "expand+anchor", "none",
             "--cache", str(tmp_path / "cache"), "--work", str(tmp_path / "work"), "--out", str(out)])
    rows = [json.loads(x) for x in (out / "rows.jsonl").read_text().splitlines()]
    nones = [r for r in rows if r["arm"] == "none"]
    assert len(nones) == 2 and nones[0] == nones[1]
    after = next(r for r in rows if r["arm"] == "after-a")
    anchor = torch.tensor(after["anchor"])  # [L, E]
    assert torch.allclose(anchor.sum(1), torch.ones(anchor.shape[0]), atol=1e-3)
    e1.main(["table1", "--out", str(out), "--length", "1", "--stage0", str(tmp_path / "none")])
    assert "B's length, fixed before the runs: 1." in capsys.readouterr().out

    model, _tok, cfg, _ = e1.load_base(argparse.Namespace(base_seed=0, warmup_steps=1, cache=str(tmp_path / "cache"),
                                                          lr=1e-3))
    layers, experts = anchor.shape
    pre = arms_mod.PreB(state={}, a_train=["a"], b_train=["b"], oracle_experts=anchor > 1, anchor=anchor)
    br = arms_mod.branch("anchor-50", model, pre, cfg.routing)
    assert br.routing.anchor_kl_coef == 50.0 and br.routing.anchor_granularity == "batch" and br.data == ["b"]
    assert arms_mod.branch("anchor-token", model, pre, cfg.routing).routing.anchor_granularity == "token"
    prot = arms_mod.branch("protect-0.3", model, pre, cfg.routing).retention
    assert prot.protect_lr_scale == 0.3 and torch.equal(prot.protected, anchor > 0.2)
    assert arms_mod.branch("replay", model, pre, cfg.routing).data == ["b", "a"]
    br = arms_mod.branch("expand+anchor", model, pre, cfg.routing)
    assert tuple(br.retention.frozen.shape) == (layers, experts + 2) and not br.retention.frozen[:, experts:].any()
    assert br.retention.frozen[:, :experts].all()  # every earlier expert frozen
    assert torch.allclose(br.anchor[:, :experts], anchor) and not br.anchor[:, experts:].any()  # none on the new
    with pytest.raises(ValueError, match="unknown arm"):
        arms_mod.branch("anchor-7", model, pre, cfg.routing)


def test_same_pre_b_names_only_the_seeds_that_start_b_from_the_same_state():
    tables = _load("e1_tables")

    def r(seed, arm, step, acc):
        return {"seed": seed, "arm": arm, "step": step, "acc_a": acc, "nll_a": 1.0, "acc_b": 0.0, "nll_b": 2.0}

    new = [r(0, "after-a", 0, 0.8), r(0, "none", 20, 0.2), r(1, "after-a", 0, 0.8), r(1, "none", 20, 0.3)]
    old = [r(0, "after-a", 0, 0.8), r(0, "none", 20, 0.2), r(1, "after-a", 0, 0.8), r(1, "none", 20, 0.31)]
    assert "exactly: [0] (of [0, 1])" in tables.same_pre_b(new, old, 20)


def test_rows_of_several_bases_pair_within_a_base(tmp_path):
    tables = _load("e1_tables")
    (tmp_path / "base.jsonl").write_text("".join(json.dumps({"base": b, "base_seed": s}) + "\n"
                                                 for b, s in (("b-x", 0), ("b-x2", 0), ("b-y", 1))))
    seed_of = tables.base_seeds(tmp_path)
    one = [{"seed": 0, "base": "b-x"}, {"seed": 1, "base": "b-x2"}]  # one base under two names
    assert tables.units(one, seed_of) == one  # one base: seeds stay as they are (the kept Stage 1 rows)
    two = one + [{"seed": 0, "base": "b-y"}]
    assert [r["seed"] for r in tables.units(two, seed_of)] == [(0, 0), (0, 1), (1, 0)]
    assert tables.units([{"seed": 0, "base": "b-z"}], {}) == [{"seed": 0, "base": "b-z"}]  # one base: no record needed
    with pytest.raises(SystemExit, match="b-z"):
        tables.units([{"seed": 0, "base": "b-z"}, {"seed": 0, "base": "b-x"}], seed_of)


def test_pairs_keep_t1_as_a_and_hold_b_apart():
    from distmoe.data.synth import disjoint_lookup, prompt_of

    pairs = _load("e1_pairs")
    assert pairs.pair_tasks("t1-t2", 3, 80) == disjoint_lookup(3, 2, 80)  # the default: exactly Stage 0's tasks
    (a_train, a_held), (b_train, b_held) = pairs.pair_tasks("t1-shift6", 3, 80)
    assert (a_train, a_held) == disjoint_lookup(3, 2, 80)[0]  # the same A, so the same pre-B state
    assert len(b_train) == len(b_held) == 480 and not {prompt_of(o) for o in b_train} & {prompt_of(o) for o in b_held}
    assert all(len(o["output"]) == 6 for o in b_held)
    b_train, b_held = pairs.pair_tasks("t1-arith", 3, 80)[1]  # arith from a wider operand window (0..13)
    assert len(b_train) == len(b_held) == 480 and not {prompt_of(o) for o in b_train} & {prompt_of(o) for o in b_held}
    assert all(o["output"].isdigit() for o in b_held)  # answers in arith's format
    with pytest.raises(ValueError, match="unknown pair"):
        pairs.pair_tasks("t1-t3", 3, 80)


def test_overlap_and_the_choice_rule_against_hand_values():
    import torch

    pairs = _load("e1_pairs")
    p = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25]], dtype=torch.float64)
    q = torch.tensor([[0.0, 0.0, 0.5, 0.5], [0.25, 0.25, 0.25, 0.25]], dtype=torch.float64)
    o = pairs.overlap(p, q)
    assert o["js"] == [1.0, 0.0] and o["intersection"] == [0.0, 1.0] and o["js_mean"] == 0.5
    r = [{"pair": "t1-t2", "runnable": True, "base_acc_b": 0.0, "js_mean": 0.9},  # same family: never chosen
         {"pair": "t1-arith", "runnable": False, "base_acc_b": 0.0, "js_mean": 0.8},  # cannot run
         {"pair": "t1-strings", "runnable": True, "base_acc_b": 0.9, "js_mean": 0.7},  # the base already answers it
         {"pair": "t1-shift6", "runnable": True, "base_acc_b": 0.0, "js_mean": 0.3}]
    assert pairs.choose(r) == "t1-shift6"
    assert pairs.choose(r[:3]) is None


def test_answer_routing_counts_only_the_positions_that_predict_an_answer(tmp_path):
    import torch

    from distmoe.data.formats import parse_line
    from distmoe.data.template import collate, encode_example

    pairs = _load("e1_pairs")
    model, tok, cfg, _ = e1.load_base(argparse.Namespace(base_seed=0, warmup_steps=1, cache=str(tmp_path / "cache"),
                                                         lr=1e-3))
    objs = pairs.pair_tasks("t1-shift6", 0, 2)[1][1]
    batch = collate([encode_example(tok, parse_line(o, f"b:{i}"), cfg.model.max_seq_len) for i, o in enumerate(objs)],
                    tok.pad_token_id)
    got = pairs.answer_routing(model, [batch])  # [L, E]
    experts = [layer[2] for layer in e1.capture_router(model, [batch])[0]]  # L x [B*S, k]
    sup = (torch.nn.functional.pad(batch["labels"][:, 1:], (0, 1), value=-100) != -100).reshape(-1)
    assert int(sup.sum()) == len(objs) * 7  # the last prompt token + 6 letters; the end token predicts nothing
    for li, idx in enumerate(experts):
        want = torch.bincount(idx[sup].reshape(-1), minlength=got.shape[1]).double()
        assert torch.allclose(got[li], want / want.sum())
        every = torch.bincount(idx.reshape(-1), minlength=got.shape[1]).double()  # prompt and padding too
        assert not torch.allclose(got[li], every / every.sum())


@pytest.mark.integration  # a tiny run of another pair: the overlap, its rows and its table
def test_a_pair_that_routes_apart_is_measured_run_and_tabulated(tmp_path, capsys):
    out, common = tmp_path / "out", ["--warmup-steps", "1", "--keys", "2", "--cache", str(tmp_path / "cache")]
    e1.main(["overlap", "--seeds", "0", "--out", str(out), *common])
    measured = [json.loads(x) for x in (out / "overlap.jsonl").read_text().splitlines()]
    assert [r["pair"] for r in measured][1:] == ["t1-t2", "t1-strings", "t1-shift6", "t1-arith"]
    e1.main(["run", "--pair", "t1-shift6", "--seeds", "0", "--steps-a", "1", "--a-round", "1", "--steps-b", "2",
             "--round", "1", "--arms", "none", "anchor-5", "--work", str(tmp_path / "work"), "--out", str(out),
             *common])
    rows = [json.loads(x) for x in (out / "rows.jsonl").read_text().splitlines()]
    assert {r["pair"] for r in rows} == {"t1-shift6"} and {("anchor-5", 2), ("none", 2)} <= {(r["arm"], r["step"])
                                                                                            for r in rows}
    timing = json.loads((out / "timing.jsonl").read_text())
    assert timing["seed"] == 0 and timing["finished"] and timing["wall_s"] > 0
    capsys.readouterr()
    e1.main(["table", "--out", str(out)])
    shown = capsys.readouterr().out
    assert "anchor-5" in shown and "JS distance" in shown and "Chosen by the pre-registered rule" in shown


LAYERS = 2
NARROW = {"model.layers": LAYERS, "model.hidden-size": 32, "model.moe-intermediate-size": 32, "model.heads": 2,
          "model.kv-heads": 1, "model.head-dim": 16}  # the tiny model's 8 experts per layer, at a fraction of its size


@functools.cache
def _b_setup():
    """Built once for every arm (each takes its own copy): the config, the narrow tiny model, its tokenizer, the
    encoded A and B examples and the A anchor of the model."""
    from distmoe.config import parse_run_config
    from distmoe.data.formats import parse_line
    from distmoe.data.synth import disjoint_lookup
    from distmoe.data.template import collate, encode_example
    from distmoe.model.build import build_model

    cfg = parse_run_config({"run.seed": 0, "train.threads": 1, "train.lr": 1e-2, "train.lr-experts": 1e-2,
                            "train.lr-router": 1e-2, **NARROW})
    model, tok = build_model(cfg.model)
    (a, _), (b, _) = disjoint_lookup(0, 2, 2)
    enc = {k: [encode_example(tok, parse_line(o, f"{k}:{i}"), 96) for i, o in enumerate(v)]
           for k, v in (("a", a), ("b", b))}
    anchor = _load("e1_arms").task_anchor(model, [collate(enc["a"], tok.pad_token_id)])
    return cfg, model, tok, enc, anchor


def _one_b_step(arm: str, regime: str):
    """The tiny model in ``regime``, one B step of ``arm`` from it as the bench takes it: (model, names of the
    tensors and expert slices that the step left exactly as they were, the arm's Branch)."""
    import copy
    import dataclasses

    import torch

    from distmoe.model.build import describe
    from distmoe.model.trainable import trainable_state
    from distmoe.train.sft import train_sft

    arms_mod = _load("e1_arms")
    cfg, base, tok, enc, anchor = _b_setup()
    model = arms_mod.regime_model(copy.deepcopy(base), cfg.model, regime)
    spec = describe(model)
    layers, experts = len(spec.moe_layers), spec.num_experts
    oracle = torch.zeros(layers, experts, dtype=torch.bool)
    oracle[:, :3] = True  # experts 0-2 of every layer: the expert oracle's set here
    pre = arms_mod.PreB(state=trainable_state(model), a_train=enc["a"], b_train=enc["b"], oracle_experts=oracle,
                        anchor=anchor.clone())
    br = arms_mod.branch(arm, model, pre, cfg.routing)
    grown = describe(model).num_experts
    train_sft(model, br.data, tok.pad_token_id, dataclasses.replace(cfg.train, local_steps=1), br.routing, grown,
              spec.top_k, br.anchor, 0, br.retention)
    after = dict(model.named_parameters())
    kept = set()
    for name, old in pre.state.items():
        new = after[name].detach()[: old.shape[0]] if ".experts." in name or name.endswith("gate.weight") else \
            after[name].detach()
        if new.dim() >= 2 and new.shape[0] == experts:  # an expert tensor [E, ...] or a router [E, H]: per expert
            kept |= {f"{name}[{e}]" for e in range(experts) if torch.equal(new[e], old[e])}
        elif torch.equal(new, old):
            kept.add(name)
    return model, kept, br, pre


def test_the_all_regime_trains_every_parameter_and_each_arm_freezes_only_what_it_names():
    """One B step per arm from the same state: in ``all`` the backbone moves; an arm keeps exactly what it names,
    plus only the expert slices that no token of the step was routed to (those ``none`` keeps too)."""
    model, idle, _, pre = _one_b_step("none", "all")
    assert "model.embed_tokens.weight" in pre.state and "model.layers.0.self_attn.q_proj.weight" in pre.state
    assert all("[" in n for n in idle)  # every tensor trained; at most a few experts' slices got no token
    routers = {f"model.layers.{i}.mlp.gate.weight" for i in range(LAYERS)}
    oracle = {f"model.layers.{i}.mlp.experts.{t}[{e}]" for i in range(LAYERS) for t in ("gate_up_proj", "down_proj")
              for e in range(3)}
    _, kept, br, _ = _one_b_step("router-frozen", "all")
    rows = {f"{r}[{e}]" for r in routers for e in range(8)}
    assert rows <= kept and all("[" in n for n in kept) and kept - rows <= idle
    for p in br.frozen:
        p.requires_grad_(True)  # (the bench's restore after the arm)
    _, kept, _, _ = _one_b_step("experts-frozen", "all")  # only experts 0-2's slices of the expert tensors
    assert oracle <= kept and kept - oracle <= idle
    _, kept, br, pre = _one_b_step("distill", "all")
    assert set(br.retention.ref_state) == set(pre.state) and kept <= idle  # the whole pre-B model is the reference
    model, kept, _, _ = _one_b_step("expand", "all")  # the 8 earlier experts and their router rows, nothing else
    assert {f"model.layers.{i}.mlp.{t}[{e}]" for i in range(LAYERS) for e in range(8)
            for t in ("experts.gate_up_proj", "experts.down_proj", "gate.weight")} <= kept
    assert all("[" in n for n in kept) and all(p.requires_grad for p in model.parameters())
    from distmoe.config import parse_run_config
    from distmoe.model.trainable import trainable_names

    primary = _load("e1_arms").regime_model(model, parse_run_config({"run.seed": 0, **NARROW}).model, "router+experts")
    assert "model.embed_tokens.weight" not in trainable_names(primary) and routers <= set(trainable_names(primary))
    with pytest.raises(ValueError, match="unknown regime"):
        _load("e1_arms").regime_model(model, None, "lora")


def test_rows_of_two_regimes_never_mix(tmp_path, capsys):
    tables = _load("e1_tables")
    primary = [{"seed": 0, "base": "b", "arm": "none"}]
    secondary = [{"seed": 0, "base": "b", "trainable": "all", "arm": "none"}]
    assert tables.regime(primary, "x") == "router+experts" and tables.regime(secondary, "x") == "all"
    with pytest.raises(SystemExit, match="several regimes"):
        tables.regime(primary + secondary, "x")
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "rows.jsonl").write_text(json.dumps(primary[0]) + "\n")
    with pytest.raises(SystemExit, match="several regimes"):  # refused before anything trains or is written
        e1.main(["run", "--trainable", "all", "--seeds", "0", "--out", str(tmp_path / "p"),
                 "--cache", str(tmp_path / "cache")])
    assert not (tmp_path / "cache").exists() and not (tmp_path / "p" / "args.json").exists()
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in primary + secondary))
    with pytest.raises(SystemExit, match="several regimes"):
        e1.main(["table", "--out", str(tmp_path / "m")])
    assert e1.same_regime(secondary, tmp_path / "s", tmp_path / "p") is None  # the primary's rows not read beside
    assert e1.same_regime(primary, tmp_path / "q", tmp_path / "p") == primary
    assert "Regime: model.trainable = 'all'" in capsys.readouterr().out


@pytest.mark.integration  # a tiny run of the secondary regime: its own pre-B file, tagged rows, its table
def test_a_tiny_run_of_the_all_regime_keeps_its_rows_apart(tmp_path, capsys):
    import torch

    out, work = tmp_path / "out", tmp_path / "work"
    e1.main(["run", "--trainable", "all", "--seeds", "0", "--warmup-steps", "1", "--keys", "2", "--steps-a", "1",
             "--a-round", "1", "--steps-b", "2", "--round", "1", "--arms", "none", "router-frozen", "distill",
             "--cache", str(tmp_path / "cache"), "--work", str(work), "--out", str(out)])
    rows = [json.loads(x) for x in (out / "rows.jsonl").read_text().splitlines()]
    assert {r["trainable"] for r in rows} == {"all"} and ("router-frozen+forced", 2) in {(r["arm"], r["step"])
                                                                                         for r in rows}
    assert "model.embed_tokens.weight" in torch.load(work / "s0-all" / "pre-b.pt") and not (work / "s0").exists()
    assert json.loads((out / "args.json").read_text())["trainable"] == "all"
    capsys.readouterr()
    e1.main(["table", "--out", str(out), "--stage0", str(tmp_path / "none")])
    shown = capsys.readouterr().out
    assert shown.startswith("Regime: model.trainable = 'all'") and "router-frozen+forced" in shown
