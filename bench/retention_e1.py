"""The continual-learning instrument: can routing stability (or expert protection) buy retention at all? Stage 0
(the oracles and the gate) and Stage 1 (the product's mechanisms). Centralised, deterministic (one thread, fixed
seeds), no DP, on the tiny default model.

    python bench/retention_e1.py base --base-seed 0 --warmup-steps 3000           # build + gate the warm base
    python bench/retention_e1.py run --seeds 0 1 2 --out bench/results/e1-stage0  # rows (JSONL), as they come
    python bench/retention_e1.py table --out bench/results/e1-stage0             # the Stage 0 tables
    python bench/retention_e1.py table1 --out bench/results/e1-stage1            # the Stage 1 tables
    python bench/retention_e1.py overlap --out bench/results/e1-route-apart      # the routing overlap of the pairs
    python bench/retention_e1.py run --trainable all --out bench/results/e1-secondary  # everything trained

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

Arms (all from the same pre-B state; what each does: ``bench/e1_arms.py``): Stage 0's ``none``, the routing
oracle ``router-frozen`` (read out twice: with its own routing, and ``router-frozen+forced`` with A's pre-B router
outputs forced on A's evaluation), the expert oracle ``experts-frozen``, ``replay`` (reference: A's data) and
``distill`` (LwF, positive control); Stage 1 adds the product's mechanisms: the batch anchor at 3 coefficients
(``anchor-0.5``, ``anchor-5``, ``anchor-50``), the token anchor (``anchor-token``), expert protection at 3
strengths (``protect-0``, ``protect-0.1``, ``protect-0.3``) and expansion without and with the anchor
(``expand``, ``expand+anchor``).

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

Stage 1, pre-registered on 2026-12-06 before any Stage 1 run (a reduced design: the design asks >= 10 seeds on 5
bases, which one shared 2-core machine cannot run in the time it had). Base seed 0 (Stage 0's base, rebuilt by the
same command: its key is a hash of the config, so the same directory name), seeds 0, 1, 2, ... in order, one process
at a time, each seed running the product's arms in the order of ``e1_arms.STAGE1`` (none, the anchor x3, protection
x3, expansion +- anchor, distill, the token anchor: 11 arms), as many seeds as finish by the deadline; the oracles
and replay are not re-run (the machine's load left no time: amended before the first Stage 1 seed started): their
Stage 0 rows at B step 20 are from the same pre-B state wherever a seed's after-A row equals Stage 0's exactly, and
are quoted beside the table, outside its Holm family; a seed cut off before every arm ran is left out of the tables
(the table says which). B = 20 steps (one round of 20; the length Stage 0's rule chose, so the same comparison); the
100-step secondary is not run. Endpoints as above at B step 20: A's accuracy after B and A's NLL after B minus
none's (= dNLL_A minus none's, the pre-B state being shared), B's accuracy and NLL, and A's accuracy at equal B loss
(the largest B NLL of the seed's arms at step 20; each curve = the pre-B state and step 20). Per endpoint, every arm
against none: paired mean difference over seeds, 95 % t-interval, exact Wilcoxon p, Holm over all the arm-vs-none
tests of the table (10 when every arm ran); an effect is claimed only where the Holm-adjusted interval excludes 0.
Read-outs fixed in advance: a dose-response of the anchor = A's accuracy after B rising with the coefficient; a
mechanism "buys retention" only if it is claimed at equal B loss (at equal steps a part that learns B more slowly
keeps more of A for free); the oracles' +0.10-0.12 at equal B loss (Stage 0) is the scale expected of the routing-
and expert-side mechanisms, not of distillation and replay.

Stage 1's extension, fixed before any of its runs (2026-12-06, second session): the same command and arms for
seeds 5, 6, 7, 8, 9 on base 0 (continuing "as many seeds as finish"), then bases 1, 2, 3, 4 (``--base-seed``, their
own ``--work``), seeds 0 and 1 on each, in that order, as many as finish. The table pools every (base, seed) unit
that ran every arm (``e1_tables.units``: arms pair within a unit, never across bases); the same endpoints, tests
and Holm family as above. Base 0 alone (seeds 0-9) is reported beside the pooled table.

A pair whose tokens route apart, pre-registered on 2026-12-06 before any of its runs (``--pair``, ``e1_pairs``;
T1 -> T2 stays the default, so every command above reproduces its rows exactly). The pair is chosen by measurement
before any run (``overlap``, kept in ``<out>/overlap.jsonl``): on warm base 0 with seed 0's items, the mean over
MoE layers of the Jensen-Shannon distance between A's and B's answer-token routing (``e1_pairs``); run is the pair,
among the other-family ones whose B holds 480 held-out items apart from its 480 training items and which the base
does not already answer (held-out exact match < 0.5: a B the base knows barely moves the model), with the largest
distance. Run: base 0 (the cached Stage 0 base), seeds 0, 1, 2, ... one process each, one at a time, as many as
finish by 21:40 UTC (a seed cut off is left out, the table says which), the arms of
``e1_pairs.ROUTE_APART_ARMS`` in that order: none, router-frozen (read out also with A's routing forced),
experts-frozen, distill, replay, anchor-5, protect-0.1 (Stage 0's oracles and controls plus one strength of the
anchor and of protection, the strongest affordable ones; the other strengths, the token anchor and expansion are
left out so that a seed fits in ~15 min on the shared machine). A as in Stage 0 (the same T1, so the same pre-B
state), B to 100 steps in rounds of 20. Analysis exactly as Stage 0's ``table``: B's length by the rule from the none
arm; if no checkpoint lies in [0.2, 0.8] (a B that routes apart may leave A alone), that is the finding and the
comparison at step 100 (the end of B) is read, as a secondary; paired differences, 95 % t, Wilcoxon, Holm over the
arm-vs-none tests (forced routing counted as its own test, as in Stage 0), at equal B steps and at equal B loss;
an effect claimed only where the Holm interval excludes 0; the stop rule (+0.10 at equal B loss) for the oracles.
Also read (descriptive, not a test: B differs): how much of A none keeps here against T1 -> T2 at the same seeds.
Measured at 20:41 UTC, before any run (JS distance / intersection, mean of 4 layers): T1 train vs held 0.016 / 0.99
(noise floor), T1-T2 0.131 / 0.88, T1-strings 0.289 / 0.70 (base answers B: 0.91), T1-arith 0.290 / 0.70 (cannot
run; base 0.98), T1-shift6 0.359 / 0.63 (base 0.00): the run is ``--pair t1-shift6``.
Its replication on the other bases, declared on 2026-12-06 at 23:36 UTC before any of its runs: the same flags and
arms on bases 1, 2, 3, 4 with seed 0 (then seed 1 of each, in that order, as time allows until 01:45 UTC; a unit
cut off is left out), on the code of the base-0 rows (the commit before the parties' fused optimizer), out
``bench/results/e1-route-apart-bases`` (apart from base 0's rows, whose table stays as it is), analysed by the same
``table`` command over its units (B's length by the rule from its own none arm). The route-apart finding
"forced routing keeps A at equal B loss" replicates if its Holm interval there excludes 0 with a positive sign.

The oracles and replay on every unit, fixed before any of its runs (2026-12-06, third session): Stage 1 quotes the
oracles and replay from Stage 0 only (base 0, seeds 0-4). Arms ``none``, ``router-frozen`` (with its forced
readout), ``experts-frozen`` and ``replay``, B = 20 steps (one round, Stage 1's length), out
``bench/results/e1-oracles``; units in this order, one process at a time, as many as finish: bases 1, 2, 3, 4 with
seeds 0 and 1, then base 0 seeds 5-9, then base 0 seeds 0-4. Table: ``table --length 20`` (Stage 0's tables at
B's pre-registered length, units (base, seed), Holm over the 4 arm-vs-none tests of an endpoint; the stop rule's
+0.10 at equal B loss read as in Stage 0). Check: the ``none`` rows equal Stage 1's rows of the same unit.

Stage 1 at 100 B steps, fixed before any of its runs (2026-12-06, third session): the same units and flags as
Stage 1 but ``--steps-b 100`` (5 rounds of 20), arms ``none``, ``anchor-0.5``, ``anchor-50``, ``protect-0.1``,
``expand``, ``distill``, ``router-frozen`` (+ forced), ``experts-frozen``, ``replay``, out
``bench/results/e1-stage1-100``; units in this order, as many as finish: (1, 0), (2, 0), (3, 0), (4, 0), (0, 0),
(0, 1), (1, 1), (2, 1), (3, 1), (4, 1), then base 0 seeds 2-9. Table: ``table1 --length 100`` (Holm over the 9
arm-vs-none tests of an endpoint, the oracles included; claims only where the Holm interval excludes 0), with
``--length 20`` as the check that step 20 reproduces the Stage 1 and oracle rows. (This paragraph first named
``table``, which prints Stage 0's arms only; corrected to ``table1``, Stage 1's arms, the oracles included, before
any figure was written up; the analysis is unchanged.)

The pair lookup -> arith, pre-registered on 2026-12-06 at 23:31 UTC before any of its runs (``--pair t1-arith``; B =
``arith`` of party 0 from the smallest operand window that holds 480 training and 480 held-out items apart, 0..13,
``distmoe.data.synth.arith_window``). Measured before any run (``overlap``, ``bench/results/e1-lookup-arith``): JS
0.282 / intersection 0.71; the base answers 0.479 of B's held-out items (the one-digit facts; NLL 3.61). Run exactly
as the route-apart run: base 0 (the cached Stage 0 base), seeds 0, 1, 2, ... (at least 6 planned) one process each,
one at a time, as many as finish by 00:50 UTC (a seed cut off is left out, the table says which), the arms of
``e1_pairs.ROUTE_APART_ARMS`` in that order, ``--steps-a 300 --a-round 100 --a-target 0.8 --steps-b 100 --round
20``, out ``bench/results/e1-lookup-arith``. Analysis exactly as the route-apart run's ``table``: B's length by the
rule from the none arm (if no checkpoint lies in [0.2, 0.8], that is the finding and step 100 is read as a
secondary); paired differences, 95 % t, Wilcoxon, Holm over the arm-vs-none tests (forced routing its own test), at
equal B steps and at equal B loss; an effect claimed only where the Holm interval excludes 0; the stop rule (+0.10
at equal B loss) for the oracles. Descriptive only: none's A beside T1 -> T2 at the same seeds.
Its replication on the other bases, declared on 2026-12-07 at 02:35 UTC before any of its runs: the same flags and
arms (``--pair t1-arith``, ``e1_pairs.ROUTE_APART_ARMS``) on bases 1, 2, 3, 4 with seed 0, then seed 1 of each, in
that order, one process at a time at low priority, as many as finish by 04:20 UTC (a unit cut off is left out), on
the code of the commit that adds this paragraph, out ``bench/results/e1-lookup-arith-bases`` (apart from base 0's
rows), analysed by the same ``table`` over its units (B's length by the rule from its own none arm). Read-outs fixed
now: base 0's "the anchor at 5 keeps less of A than none at equal B loss" replicates if its Holm interval there
excludes 0 with a negative sign; the expert oracle's pass replicates if its mean at equal B loss is >= +0.10 and its
Holm interval excludes 0; distillation's gain if its Holm interval excludes 0 with a positive sign.
The secondary regime, everything trained (``--trainable all``: ``model.trainable = "all"`` during A and B; what
each arm means there: ``bench/e1_arms.py``), Stage 0, pre-registered on 2026-12-06 at 23:27 UTC before any of its
runs. Warm base 0 (the cached Stage 0 base, ``--cache`` the shared base cache, read only), pair ``t1-t2``, Stage 0's
flags exactly (``--steps-a 300 --a-round 100 --a-target 0.8 --steps-b 100 --round 20``, lr 1e-3 for every
parameter, the backbone's too), arms ``none router-frozen experts-frozen distill replay`` in that order in one
process per seed (Stage 0 ran distill in a second process: the same pre-B state, the re-run of A being exact),
``--work runs/e1/work-all``, out ``bench/results/e1-secondary`` (its rows carry ``"trainable": "all"``; the
tables refuse an out that mixes regimes). Seeds 0, 1, 2, ... in order, one process at a time at normal priority,
as many as finish by 00:50 UTC (at least 5 planned); a seed still running then is stopped and its rows are left
out of the kept rows (the notebook says which). Analysis exactly as Stage 0's: ``table --out
bench/results/e1-secondary``: B's length by the rule from the none arm (``e1_stats.choose_length``, the checkpoint
whose mean kept fraction is closest to 0.5 inside [0.2, 0.8]); at that length, each arm against none, A's accuracy
after B at equal B steps and at equal B loss, paired differences over seeds, 95 % t-interval, exact Wilcoxon,
Holm over the 5 arm-vs-none tests of an endpoint (the forced-routing readout its own test); an effect claimed only
where the Holm interval excludes 0; the stop rule: an oracle (routing: ``router-frozen+forced``; experts:
``experts-frozen``) that does not beat none by >= 0.10 in A's accuracy at equal B loss means that family cannot buy
retention in this regime. If no checkpoint lies in [0.2, 0.8], the gate is not met at these lengths: that is the
finding, and the comparisons at step 20 (the primary's length, ``table --length 20``) and step 100 (the end of B)
are read as secondary. Descriptive only (not a test: A trains other parameters): none's curve here beside the
primary's at the same seeds.

Must not: change the library's training loop (it calls it), use DP or parties, or write outside ``--out`` and
``--work``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import e1_arms  # noqa: E402  (the bench's own modules, beside this file)
import e1_eval  # noqa: E402
import e1_pairs  # noqa: E402
import e1_report  # noqa: E402
import e1_tables  # noqa: E402

from distmoe.checkpoint import load_checkpoint  # noqa: E402
from distmoe.config import parse_run_config  # noqa: E402
from distmoe.data.formats import DataError, parse_line  # noqa: E402
from distmoe.data.synth import generate  # noqa: E402
from distmoe.data.template import collate, encode_example  # noqa: E402
from distmoe.model.build import build_model, describe  # noqa: E402
from distmoe.model.trainable import load_trainable, spec_of, trainable_state  # noqa: E402
from distmoe.train.sft import train_sft  # noqa: E402
from distmoe.train.warmup import build_base  # noqa: E402

ARMS = e1_arms.ARMS
REGIMES = e1_arms.REGIMES
EVAL_BS = e1_eval.EVAL_BS
# the read-outs, in e1_eval (names kept here: the tests and the notebook's snippets call them from this module)
capture_router, evaluate, a_experts, format_gate = (e1_eval.capture_router, e1_eval.evaluate, e1_eval.a_experts,
                                                    e1_eval.format_gate)
same_regime = e1_report.same_regime  # (the table commands, in e1_report; the name kept here likewise)


class Timing:
    """Appends a seed's wall time and the machine's load (1-min load average, sampled every 30 s) to a JSONL file."""

    def __init__(self, path: Path, **what) -> None:
        self.path, self.what, self.loads, self.stop = path, what, [], threading.Event()

    def _sample(self) -> None:
        while not self.stop.wait(30.0):
            self.loads.append(os.getloadavg()[0])

    def __enter__(self) -> Timing:
        self.t0, self.start = time.perf_counter(), time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self.loads.append(os.getloadavg()[0])
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()
        with self.path.open("a") as f:
            f.write(json.dumps({**self.what, "start": self.start, "wall_s": round(time.perf_counter() - self.t0, 1),
                                "load_mean": round(sum(self.loads) / len(self.loads), 2),
                                "load_max": max(self.loads), "finished": exc[0] is None}) + "\n")


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


def run_seed(args, seed: int, out: Path) -> None:
    model, tok, cfg, base = load_base(args)
    torch.manual_seed(seed)
    model = e1_arms.regime_model(model, cfg.model, args.trainable)
    ms, max_len = describe(model), cfg.model.max_seq_len
    (a_train, a_held), (b_train, b_held) = e1_pairs.pair_tasks(args.pair, seed, args.keys)
    tag = {} if args.pair == e1_pairs.DEFAULT_PAIR else {"pair": args.pair}  # the default's rows stay as they were
    tag |= {} if args.trainable == REGIMES[0] else {"trainable": args.trainable}  # (e1_tables.regime reads it)
    ex = {k: [parse_line(o, f"{k}:{i}") for i, o in enumerate(v)]
          for k, v in {"a_train": a_train, "a_held": a_held, "b_train": b_train, "b_held": b_held}.items()}
    enc = {k: [encode_example(tok, e, max_len) for e in v] for k, v in ex.items()}
    held = {t: [collate(enc[f"{t}_held"][i:i + EVAL_BS], tok.pad_token_id)
                for i in range(0, len(enc[f"{t}_held"]), EVAL_BS)] for t in ("a", "b")}

    def write(row: dict) -> None:
        with (out / "rows.jsonl").open("a") as f:
            f.write(json.dumps({"seed": seed, "base": base.parent.name, **tag, **row}) + "\n")

    def point(arm: str, step: int, forced=None, b_from: dict | None = None) -> dict:
        acc_a, nll_a = evaluate(model, held["a"], forced)
        acc_b, nll_b = (b_from["acc_b"], b_from["nll_b"]) if b_from else evaluate(model, held["b"])
        return {"arm": arm, "step": step, "acc_a": acc_a, "nll_a": nll_a, "acc_b": acc_b, "nll_b": nll_b}

    def train(data, steps: int, rseed: int) -> None:
        tr = dataclasses.replace(cfg.train, local_steps=steps)
        train_sft(model, data, tok.pad_token_id, tr, cfg.routing, ms.num_experts, ms.top_k, None, rseed)

    write({**point("base", 0), "phase": "base"})
    done_a = 0
    while done_a < args.steps_a:  # A in rounds until its held-out accuracy reaches --a-target (or --steps-a)
        train(enc["a_train"], args.a_round, seed + 7919 * done_a)
        done_a += args.a_round
        if evaluate(model, held["a"])[0] >= args.a_target:
            break
    pre = trainable_state(model)
    work = Path(args.work) / (f"s{seed}" if args.trainable == REGIMES[0] else f"s{seed}-{args.trainable}")
    work.mkdir(parents=True, exist_ok=True)
    torch.save(pre, work / "pre-b.pt")
    forced = capture_router(model, held["a"])
    protected = a_experts(model, tok, ex["a_train"], max_len, ms.top_k)
    preb = e1_arms.PreB(state=pre, a_train=enc["a_train"], b_train=enc["b_train"], oracle_experts=protected,
                        anchor=e1_arms.task_anchor(model, [collate(enc["a_train"][i:i + EVAL_BS], tok.pad_token_id)
                                                           for i in range(0, len(enc["a_train"]), EVAL_BS)]))
    write({**point("after-a", 0), "phase": "after-a", "steps_a": done_a, "protected": protected.int().tolist(),
           "anchor": [[round(x, 4) for x in row] for row in preb.anchor.tolist()],
           "protect_count": e1_arms.protected_count(preb)})
    for arm in args.arms:
        t0 = time.perf_counter()
        if describe(model).num_experts != ms.num_experts:  # grown by an expansion arm: rebuild the model
            model = e1_arms.regime_model(load_base(args)[0], cfg.model, args.trainable)
        load_trainable(model, torch.load(work / "pre-b.pt"), spec_of(model, args.trainable))
        br = e1_arms.branch(arm, model, preb, cfg.routing)
        grown = describe(model).num_experts
        for r, step in enumerate(range(args.round, args.steps_b + 1, args.round)):
            tr = dataclasses.replace(cfg.train, local_steps=args.round)
            train_sft(model, br.data, tok.pad_token_id, tr, br.routing, grown, ms.top_k, br.anchor,
                      seed * 1000 + r, br.retention)
            row = point(arm, step)
            write({**row, "phase": "b"})
            if arm == "router-frozen":
                write({**point("router-frozen+forced", step, forced, row), "phase": "b"})
        for p in br.frozen:
            p.requires_grad_(True)
        print(f"s{seed} {arm}: {time.perf_counter() - t0:.0f} s", flush=True)


def measure_pairs(args, out: Path) -> None:
    """The routing overlap of A's and B's answer tokens for every pair on the warm base (``e1_pairs``), B's
    accuracy on the base, and the pre-registered choice, into ``<out>/overlap.jsonl`` and as a table."""
    model, tok, cfg, base = load_base(args)
    seed, max_len = args.seeds[0], cfg.model.max_seq_len

    def batches(objs: list[dict], name: str) -> list[dict]:
        enc = [encode_example(tok, parse_line(o, f"{name}:{i}"), max_len) for i, o in enumerate(objs)]
        return [collate(enc[i:i + EVAL_BS], tok.pad_token_id) for i in range(0, len(enc), EVAL_BS)]

    (a_train, a_held), _ = e1_pairs.pair_tasks(e1_pairs.DEFAULT_PAIR, seed, args.keys)
    ra = e1_pairs.answer_routing(model, batches(a_held, "A"))
    rows = [{"pair": "t1 training vs t1 held-out (the same task: noise floor)", "runnable": False,
             "base_acc_b": evaluate(model, batches(a_train, "A-train"))[0],
             **e1_pairs.overlap(ra, e1_pairs.answer_routing(model, batches(a_train, "A-train")))}]
    for pair in e1_pairs.PAIRS:
        try:
            b_held, runnable = e1_pairs.pair_tasks(pair, seed, args.keys)[1][1], True
        except DataError:  # too few distinct items to run; measured on the family's items, repeats and all
            b_held, runnable = generate(e1_pairs.FAMILY_OF_B[pair], 0, 6 * args.keys, seed), False
        bb = batches(b_held, pair)
        acc, nll = evaluate(model, bb)
        rows.append({"pair": pair, "runnable": runnable, "base_acc_b": acc, "base_nll_b": nll,
                     **e1_pairs.overlap(ra, e1_pairs.answer_routing(model, bb))})
    chosen = e1_pairs.choose(rows)
    with (out / "overlap.jsonl").open("w") as f:  # one measurement per out dir: the one that chose the pair
        for r in rows:
            f.write(json.dumps({"base": base.parent.name, "seed": seed, **r, "chosen": r["pair"] == chosen}) + "\n")
    print(e1_tables.overlap_table(rows, chosen))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=("base", "run", "table", "table1", "overlap"))
    ap.add_argument("--pair", default=e1_pairs.DEFAULT_PAIR, choices=e1_pairs.PAIRS, help="task A -> task B")
    ap.add_argument("--trainable", default=REGIMES[0], choices=REGIMES,
                    help="what trains during A and B (model.trainable): the primary regime or everything")
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
    ap.add_argument("--length", type=int, default=None,
                    help="B's pre-registered length in steps (table1: 20 when not given; table: Stage 0's rule)")
    ap.add_argument("--stage0", default="bench/results/e1-stage0", help="table1, table: Stage 0's rows")
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
        if (out / "rows.jsonl").exists():  # one regime per --out: never append rows of another
            e1_tables.regime(e1_tables.load_rows(out) + [{"trainable": args.trainable}], str(out))
        (out / "args.json").write_text(json.dumps(vars(args), indent=1))
        for seed in args.seeds:
            with Timing(out / "timing.jsonl", seed=seed, pair=args.pair, trainable=args.trainable, arms=args.arms):
                run_seed(args, seed, out)
    elif args.what == "overlap":
        measure_pairs(args, out)
    elif args.what == "table":
        e1_report.show_table(out, Path(args.stage0), args.length)
    else:
        e1_report.show_table1(out, Path(args.stage0), 20 if args.length is None else args.length)


if __name__ == "__main__":
    main()
