"""The continual-learning instrument, Stage 0: can routing stability (or expert protection) buy retention at all?
Centralised, deterministic (one thread, fixed seeds), no DP, on the tiny default model.

    python bench/retention_e1.py base --base-seed 0 --warmup-steps 3000           # build + gate the warm base
    python bench/retention_e1.py run --seeds 0 1 2 --out bench/results/e1-stage0  # rows (JSONL), as they come
    python bench/retention_e1.py table --out bench/results/e1-stage0             # the Stage 0 tables

Design. A warm base (``distmoe.train.warmup.build_base``, every parameter trained on the public mix of every
family), gated on >= 0.9 format-valid greedy answers on held-out public items of every family. Primary regime:
the backbone frozen after the base (``model.trainable = "router+experts"``). Tasks: two lookup tables with
disjoint keys and distinct codes (``distmoe.data.synth.disjoint_lookup``, 80 keys each: 480 training items and
480 held-out items, the same keys in 6 other phrasings), T1 = A then T2 = B, seeded by the seed. Per seed: A is
trained in rounds of ``--a-round`` steps until its held-out accuracy reaches ``--a-target`` (at most
``--steps-a``), the state after A is saved (``<work>/s<seed>/pre-b.pt``) and EVERY arm restores it
before B (exact pairing). B runs as rounds of ``--round`` steps of the party's own loop
(``distmoe.train.sft.train_sft``: a fresh AdamW per round, like the federated rounds), up to ``--steps-b``, and
A and B are evaluated after every round (the forgetting curve) from the model in memory, without noise.

Arms (all from the same pre-B state): ``none``; ``router-frozen`` (routing oracle: every router weight frozen
during B; read out twice: with its own routing, and ``router-frozen+forced`` with A's pre-B router outputs
(logits, top-k weights and experts) forced on A's evaluation); ``experts-frozen`` (expert oracle: per MoE layer
the smallest set of experts holding >= half of A's top-k assignments on A's training tokens before B, frozen
during B: ``retention.protected`` at scale 0); ``replay`` (positive control: B's batches drawn from B's and A's
training items, 1:1); ``distill`` (LwF on B's batches against the pre-B model, weight 1, tau 2).

Endpoints, per checkpoint, on the 480 held-out items of each task, teacher-forced (one forward, no sampling):
exact match = every answer token (and the end token) is the argmax given the gold prefix, which is exactly
greedy decoding's exact match of the answer's tokens; NLL = mean over items of the mean CE per answer token
(nats). Primary: A's accuracy after B and dNLL_A = NLL_A(after B) - NLL_A(before B); beside them B's accuracy
and NLL, A's kept fraction of accuracy (``e1_stats.kept_fraction``), the curve.

Analysis (fixed before the runs; ``bench/e1_stats.py``): B's length = the checkpoint whose none-arm mean kept
fraction is closest to 0.5 inside [0.2, 0.8]; at that length, per arm vs none: paired mean difference over
seeds with the 95 % t-interval and the Wilcoxon p, Holm-corrected over the arm-vs-none tests of the endpoint
(an effect claimed only where the Holm-adjusted interval excludes 0), at equal B steps and at equal B loss (the
largest B NLL of the seed's arms at that step; each curve starts at the shared pre-B state, step 0: the first
version of the table code left that point out, which favours arms that learn B slowly; fixed after seed 0's raw
rows had been looked at). The same tables at the last B checkpoint are reported as secondary. Stop rule: an
oracle that does not beat none by >= 0.10 in A's accuracy at equal B loss means that family of mechanisms cannot
buy retention in this regime.

Must not: change the library's training loop (it calls it), use DP or parties, or write outside ``--out`` and
``--work``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import e1_stats  # noqa: E402  (the bench's own analysis module, beside this file)

from distmoe.checkpoint import load_checkpoint  # noqa: E402
from distmoe.config import parse_run_config  # noqa: E402
from distmoe.data.formats import parse_line  # noqa: E402
from distmoe.data.synth import TASK_FAMILIES, disjoint_lookup, generate  # noqa: E402
from distmoe.data.template import collate, encode_example  # noqa: E402
from distmoe.model.build import build_model, describe, router_modules  # noqa: E402
from distmoe.model.trainable import apply_trainable, load_trainable, spec_of, trainable_state  # noqa: E402
from distmoe.train.evaluate import generate_answers, routing_on  # noqa: E402
from distmoe.train.retention import Retention  # noqa: E402
from distmoe.train.sft import train_sft  # noqa: E402
from distmoe.train.warmup import PUBLIC_SEED_OFFSET, build_base  # noqa: E402

ARMS = ("none", "router-frozen", "experts-frozen", "replay", "distill")
READOUTS = {"router-frozen+forced": "router-frozen"}  # a second readout of an arm's run
FORMAT = {"arith": re.compile(r"^-?\d+$"), "strings": re.compile(r"^[A-Za-z]+$"), "lookup": re.compile(r"^[A-Z]{3}$")}
GATE_ITEMS = 60  # per family
EVAL_BS = 96


def config(args, seed: int, trainable: str = "all"):
    return parse_run_config({"run.seed": seed, "model.trainable": trainable, "train.threads": 1,
                             "train.lr": args.lr, "train.lr-experts": args.lr, "train.lr-router": args.lr})


def load_base(args):
    """(model with the base's weights and the backbone frozen, tokenizer, cfg, the base's directory)."""
    cfg = config(args, args.base_seed)
    base = build_base(cfg, args.warmup_steps, Path(args.cache))
    model, tok = build_model(cfg.model)
    _, weights, _, _ = load_checkpoint(base)
    load_trainable(model, weights, spec_of(model, "all"))
    return model, tok, cfg, base


def format_gate(model, tok, cfg, base_seed: int) -> dict[str, float]:
    """Share of format-valid greedy answers per family on unseen public items (party window 5 of the warm-up seed)."""
    out = {}
    for fam in TASK_FAMILIES:
        exs = [parse_line(o, f"gate {fam}:{i}")
               for i, o in enumerate(generate(fam, 5, GATE_ITEMS, base_seed + PUBLIC_SEED_OFFSET + 7))]
        preds = generate_answers(model, tok, exs, cfg.model.max_seq_len, cfg.eval)
        out[fam] = sum(bool(FORMAT[fam].match(p.strip())) for p in preds) / len(preds)
    return out


def capture_router(model, batches) -> list[list[tuple]]:
    """Per batch, per MoE layer: the router's (logits, weights, experts) on that batch."""
    out = []
    for batch in batches:
        got: list[tuple] = []
        hooks = [m.register_forward_hook(lambda _m, _i, o, keep=got: keep.append(tuple(t.detach().clone() for t in o)))
                 for _, m in router_modules(model)]
        with torch.no_grad():
            model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False)
        for h in hooks:
            h.remove()
        out.append(got)
    return out


@torch.no_grad()
def evaluate(model, batches, forced: list[list[tuple]] | None = None) -> tuple[float, float]:
    """(exact-match accuracy, mean NLL per answer token) over the batches, teacher-forced; ``forced``: router
    outputs to substitute per batch and layer (``capture_router``)."""
    model.eval()
    ok, nll = [], []
    for bi, batch in enumerate(batches):
        hooks = []
        if forced is not None:
            for li, (_, m) in enumerate(router_modules(model)):
                hooks.append(m.register_forward_hook(lambda _m, _i, _o, fix=forced[bi][li]: fix))
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       use_cache=False).logits  # [B, S, V]
        for h in hooks:
            h.remove()
        labels = torch.nn.functional.pad(batch["labels"][:, 1:], (0, 1), value=-100)  # [B, S] next-token labels
        sup = labels != -100  # [B, S]
        ce = torch.nn.functional.cross_entropy(logits.float().transpose(1, 2), labels, ignore_index=-100,
                                               reduction="none")  # [B, S]
        hit = (logits.argmax(-1) == labels) | ~sup  # [B, S]
        ok.extend(hit.all(1).tolist())
        nll.extend((ce.sum(1) / sup.sum(1)).tolist())
    return sum(ok) / len(ok), sum(nll) / len(nll)


def a_experts(model, tok, examples, max_len: int, top_k: int) -> torch.Tensor:
    """``[L, E]`` bool: per MoE layer the fewest experts that take >= half of A's top-k assignments."""
    _, valid = routing_on(model, tok, examples, max_len, EVAL_BS)
    rows = []
    for v in valid:  # [N, E] per layer
        counts = torch.bincount(torch.topk(v, top_k, -1).indices.reshape(-1), minlength=v.shape[-1]).float()
        order = torch.argsort(counts, descending=True)
        share = torch.cumsum(counts[order], 0) / counts.sum()
        keep = torch.zeros(v.shape[-1], dtype=torch.bool)
        keep[order[: int((share < 0.5).sum()) + 1]] = True
        rows.append(keep)
    return torch.stack(rows)


def run_seed(args, seed: int, out: Path) -> None:
    model, tok, cfg, base = load_base(args)
    torch.manual_seed(seed)
    model = apply_trainable(model, dataclasses.replace(cfg.model, trainable="router+experts"))
    ms, max_len = describe(model), cfg.model.max_seq_len
    (a_train, a_held), (b_train, b_held) = disjoint_lookup(seed, 2, args.keys)
    ex = {k: [parse_line(o, f"{k}:{i}") for i, o in enumerate(v)]
          for k, v in {"a_train": a_train, "a_held": a_held, "b_train": b_train, "b_held": b_held}.items()}
    enc = {k: [encode_example(tok, e, max_len) for e in v] for k, v in ex.items()}
    held = {t: [collate(enc[f"{t}_held"][i:i + EVAL_BS], tok.pad_token_id)
                for i in range(0, len(enc[f"{t}_held"]), EVAL_BS)] for t in ("a", "b")}

    def write(row: dict) -> None:
        with (out / "rows.jsonl").open("a") as f:
            f.write(json.dumps({"seed": seed, "base": base.parent.name, **row}) + "\n")

    def point(arm: str, step: int, forced=None, b_from: dict | None = None) -> dict:
        acc_a, nll_a = evaluate(model, held["a"], forced)
        acc_b, nll_b = (b_from["acc_b"], b_from["nll_b"]) if b_from else evaluate(model, held["b"])
        return {"arm": arm, "step": step, "acc_a": acc_a, "nll_a": nll_a, "acc_b": acc_b, "nll_b": nll_b}

    def train(data, steps: int, rseed: int, retention: Retention | None = None) -> None:
        tr = dataclasses.replace(cfg.train, local_steps=steps)
        train_sft(model, data, tok.pad_token_id, tr, cfg.routing, ms.num_experts, ms.top_k, None, rseed, retention)

    write({**point("base", 0), "phase": "base"})
    done_a = 0
    while done_a < args.steps_a:  # A in rounds until its held-out accuracy reaches --a-target (or --steps-a)
        train(enc["a_train"], args.a_round, seed + 7919 * done_a)
        done_a += args.a_round
        if evaluate(model, held["a"])[0] >= args.a_target:
            break
    pre = trainable_state(model)
    work = Path(args.work) / f"s{seed}"
    work.mkdir(parents=True, exist_ok=True)
    torch.save(pre, work / "pre-b.pt")
    forced = capture_router(model, held["a"])
    protected = a_experts(model, tok, ex["a_train"], max_len, ms.top_k)
    write({**point("after-a", 0), "phase": "after-a", "steps_a": done_a, "protected": protected.int().tolist()})
    routers = [p for _, m in router_modules(model) for p in m.parameters()]
    for arm in args.arms:
        t0 = time.perf_counter()
        load_trainable(model, torch.load(work / "pre-b.pt"), spec_of(model, "router+experts"))
        data, ret = enc["b_train"], None
        if arm == "router-frozen":
            for p in routers:
                p.requires_grad_(False)
        elif arm == "experts-frozen":
            ret = Retention(protected=protected, protect_lr_scale=0.0)
        elif arm == "replay":
            data = enc["b_train"] + enc["a_train"]
        elif arm == "distill":
            ret = Retention(ref_state={k: v.clone() for k, v in pre.items()}, distill_weight=1.0,
                            distill_temperature=2.0)
        for r, step in enumerate(range(args.round, args.steps_b + 1, args.round)):
            train(data, args.round, seed * 1000 + r, ret)
            row = point(arm, step)
            write({**row, "phase": "b"})
            if arm == "router-frozen":
                write({**point("router-frozen+forced", step, forced, row), "phase": "b"})
        for p in routers:
            p.requires_grad_(True)
        print(f"s{seed} {arm}: {time.perf_counter() - t0:.0f} s", flush=True)


# ------------------------------------------------------------------------------------------------ tables
def load_rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines() if line.strip()]


def stage0(rows: list[dict]) -> str:
    """The Stage 0 tables (Markdown) from the kept rows, by the rules of ``bench/e1_stats.py``."""
    seeds = sorted({r["seed"] for r in rows if r["phase"] == "b" and r["arm"] == "none"})
    by = {(r["seed"], r["arm"], r["phase"], r["step"]): r for r in rows}
    arms = [a for a in (*ARMS, *READOUTS) if a != "none" and all(any(k[0] == s and k[1] == a for k in by)
                                                                  for s in seeds)]
    steps = sorted({r["step"] for r in rows if r["phase"] == "b" and r["arm"] == "none" and r["seed"] in seeds})
    steps = [st for st in steps if all((s, "none", "b", st) in by for s in seeds)]
    base = {s: by[(s, "base", "base", 0)] for s in seeds}
    after = {s: by[(s, "after-a", "after-a", 0)] for s in seeds}
    kept = {st: [e1_stats.kept_fraction(base[s]["acc_a"], after[s]["acc_a"], by[(s, "none", "b", st)]["acc_a"])
                 for s in seeds] for st in steps}
    lines = [f"Seeds: {seeds} (n = {len(seeds)}).", "",
             "| B step | none: A acc (mean, per seed) | kept fraction | B acc | B NLL |", "|---|---|---|---|---|"]
    for st in steps:
        r = [by[(s, "none", "b", st)] for s in seeds]
        per = ", ".join(f"{x['acc_a']:.3f}" for x in r)
        lines.append(f"| {st} | {_mean(x['acc_a'] for x in r):.3f} ({per}) | "
                     f"{_mean(kept[st]):.2f} | {_mean(x['acc_b'] for x in r):.3f} | "
                     f"{_mean(x['nll_b'] for x in r):.3f} |")
    lines += ["", "Forgetting curves, every arm (mean over seeds: A acc / A NLL / B NLL):", "",
              "| B step | " + " | ".join(("none", *arms)) + " |", "|---|" + "---|" * (len(arms) + 1)]
    for st in steps:
        cells = []
        for a in ("none", *arms):
            r = [by[(s, a, "b", st)] for s in seeds if (s, a, "b", st) in by]
            cells.append(f"{_mean(x['acc_a'] for x in r):.3f} / {_mean(x['nll_a'] for x in r):.2f} / "
                         f"{_mean(x['nll_b'] for x in r):.2f}" if r else "–")
        lines.append(f"| {st} | " + " | ".join(cells) + " |")
    length = e1_stats.choose_length(kept)
    lines += ["", f"Before B: A acc {_mean(after[s]['acc_a'] for s in seeds):.3f}, A NLL "
              f"{_mean(after[s]['nll_a'] for s in seeds):.3f}; base A acc "
              f"{_mean(base[s]['acc_a'] for s in seeds):.3f}, "
              f"A NLL {_mean(base[s]['nll_a'] for s in seeds):.3f}.",
              f"B's length by the rule (none keeps 20–80 %, closest to 50 %): {length}.", ""]
    if not arms:
        return "\n".join(lines)
    if length is None:
        lines.append("No checkpoint in the window: the gate is not met at these lengths.")
    else:
        lines += compare_at(by, seeds, arms, steps, length, after, "the rule's length")
    if steps and steps[-1] != length:
        lines += ["", *compare_at(by, seeds, arms, steps, steps[-1], after, "the end of B (secondary)")]
    return "\n".join(lines)


def compare_at(by: dict, seeds: list[int], arms: list[str], steps: list[int], length: int, after: dict,
               what: str) -> list[str]:
    """The paired arm-vs-none tables at B step ``length``: equal B steps, then equal B loss (each curve starts at
    the pre-B state, step 0)."""
    full = [s for s in seeds if all((s, a, "b", length) in by for a in arms)]
    if len(full) < 2:
        return [f"At B step {length} ({what}): fewer than 2 seeds with every arm."]
    lines = [f"At B step {length}, {what} (equal B steps), arm − none, paired over seeds {full}:", "",
             "| arm | A acc | NLL_A − none's (= ΔNLL_A − none's) | B acc | B NLL |", "|---|---|---|---|---|"]
    ends = {"A acc": "acc_a", "nll": "nll_a", "B acc": "acc_b", "B nll": "nll_b"}
    res = {k: e1_stats.compare_arms({a: [by[(s, a, "b", length)][f] - by[(s, "none", "b", length)][f] for s in full]
                                     for a in arms}) for k, f in ends.items()}
    for a in arms:
        lines.append(f"| {a} | " + " | ".join(e1_stats.fmt_test(res[k][a]) for k in ends) + " |")
    eq = {}
    for s in full:
        start = (after[s]["nll_b"], after[s]["acc_a"])  # step 0: the shared pre-B state
        curves = {a: [start] + [(by[(s, a, "b", st)]["nll_b"], by[(s, a, "b", st)]["acc_a"]) for st in steps
                                if (s, a, "b", st) in by and st <= length] for a in ("none", *arms)}
        target = max(c[-1][0] for c in curves.values())
        eq[s] = {a: e1_stats.at_equal_loss(c, target) for a, c in curves.items()}
    eq_res = e1_stats.compare_arms({a: [eq[s][a] - eq[s]["none"] for s in full] for a in arms})
    lines += ["", f"At equal B loss (the seed's largest B NLL at step {length}), A acc, arm − none:", "",
              "| arm | A acc at equal B loss | stop rule: mean gain ≥ +0.10 |", "|---|---|---|"]
    for a in arms:
        lines.append(f"| {a} | {e1_stats.fmt_test(eq_res[a])} | "
                     f"{'passes' if eq_res[a]['mean'] >= e1_stats.STOP_RULE_GAIN else 'fails'}"
                     f"{' (and claimed)' if eq_res[a]['claimed'] else ' (not claimed)'} |")
    per_seed = []
    for s in full:
        cells = [f"{a} {by[(s, a, 'b', length)]['acc_a']:.3f}/{_f(eq[s][a])}" for a in ("none", *arms)]
        per_seed.append(f"s{s}: " + ", ".join(cells))
    return lines + ["", "Per seed (A acc at that step / at equal B loss): " + "; ".join(per_seed)]


def _f(x: float | None) -> str:
    return "–" if x is None else f"{x:.3f}"


def _mean(xs) -> float:
    xs = [x for x in xs if math.isfinite(x)]
    return sum(xs) / len(xs) if xs else math.nan


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=("base", "run", "table"))
    ap.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2])
    ap.add_argument("--base-seed", type=int, default=0)
    ap.add_argument("--warmup-steps", type=int, default=3000)
    ap.add_argument("--arms", nargs="*", default=list(ARMS), choices=ARMS)
    ap.add_argument("--keys", type=int, default=80, help="keys per table (x6 held-out items)")
    ap.add_argument("--steps-a", type=int, default=600, help="at most this many A steps")
    ap.add_argument("--a-round", type=int, default=100, help="A steps per round (A's accuracy checked after each)")
    ap.add_argument("--a-target", type=float, default=0.8, help="A stops at this held-out accuracy")
    ap.add_argument("--steps-b", type=int, default=300)
    ap.add_argument("--round", type=int, default=25, help="B steps per round (one checkpoint each)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--cache", default="runs/e1/base-cache")
    ap.add_argument("--work", default="runs/e1/work")
    ap.add_argument("--out", default="bench/results/e1-stage0")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.what == "base":
        model, tok, cfg, base = load_base(args)
        gate = format_gate(model, tok, cfg, args.base_seed)
        row = {"base": base.parent.name, "base_seed": args.base_seed, "warmup_steps": args.warmup_steps,
               "format_valid": gate, "gate_passed": all(v >= 0.9 for v in gate.values())}
        with (out / "base.jsonl").open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps(row))
    elif args.what == "run":
        (out / "args.json").write_text(json.dumps(vars(args), indent=1))
        for seed in args.seeds:
            run_seed(args, seed, out)
    else:
        print(stage0(load_rows(out)))


if __name__ == "__main__":
    main()
