"""Benchmark: ``distmoe plan`` against measured peaks. One checkpoint of ``bench/real_model.py``'s scaled shapes
(random init, float32, saved and loaded as a party loads it) and one subprocess per round, each the peak RSS
(``VmHWM``) of a party process, next to what ``distmoe.model.memory_plan.predict`` says for the same shape and
settings (on the CPU the plan counts the imports and the checkpoint's mapped pages too):

    python bench/plan_check.py [--sizes 0.1b 1b] [--family qwen3_moe] [--rounds sft rl-exact rl-bf16 stats sft-nf4
                               load load-nf4-after load-nf4] [--batch-size 4] [--seq-len 64] [--rl-prompts 2]
                               [--rl-group 2] [--threads 2] [--ckpt-dir DIR] [--out f.json]

Rounds:

- ``sft`` / ``sft-nf4``: ``real_model.py``'s party role (load, ``apply_trainable``, one ``train_sft`` step of
  ``batch x seq``), with ``model.quantize-experts`` ``none`` / ``nf4``;
- ``rl-<engine>``: ``real_model.py``'s RL party role (one GRPO step, the engine a view over the policy's weights);
- ``stats``: load, ``apply_trainable``, ``routing.stats.per_sequence_stats`` over one ``batch x seq`` batch (what a
  ``stats`` round computes);
- ``load`` / ``load-nf4-after`` / ``load-nf4``: load and ``apply_trainable`` only: the load's peak RSS and its
  peak anonymous memory (``RssAnon`` read every millisecond by a thread while loading: the tensors the process
  owns, without the checkpoint's file pages, which the kernel may drop); full precision, full precision then
  quantised (the former 4-bit path), and the experts loaded straight into 4 bits.

``--ckpt-dir`` keeps the checkpoints there (reused when present). Peaks are not disturbed by load; times are.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import real_model as rm  # noqa: E402  (the shapes, the checkpoint writer, the batch, the roles and RSS readers)

MB = 1e6
# real_model.py's shapes and a small one for the test suite (tests/bench/test_plan_check.py): 0.03B, 100 MB of experts
SHAPES = {**rm.SHAPES, ("qwen3_moe", "small"): dict(hidden_size=256, moe_intermediate_size=256, num_hidden_layers=2,
                                                      num_attention_heads=4, num_key_value_heads=1, num_experts=64,
                                                      vocab_size=8192)}
ROUNDS = ("sft", "rl-exact", "rl-bf16", "stats", "sft-nf4", "load", "load-nf4-after", "load-nf4")


def _rss_anon_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024 / MB
    return 0.0


class AnonPeak:
    """The highest ``RssAnon`` seen by a thread polling every ``every`` seconds while the block runs."""

    def __init__(self, every: float = 0.001):
        self.every, self.peak, self._stop = every, 0.0, threading.Event()

    def __enter__(self):
        def poll():
            while not self._stop.is_set():
                self.peak = max(self.peak, _rss_anon_mb())
                time.sleep(self.every)

        self._thread = threading.Thread(target=poll, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_anon_mb())


def _role_main(args) -> None:
    """Subprocess body of ``load``, ``load-nf4`` and ``stats``: one JSON line."""
    torch.set_num_threads(args.threads)
    from distmoe.model.build import build_model
    from distmoe.model.trainable import apply_trainable
    from distmoe.routing.stats import per_sequence_stats

    quant = "nf4" if args.role.startswith("load-nf4") else "none"
    cfg = rm.run_config(args.ckpt, **{"model.quantize-experts": quant})
    loading = rm.run_config(args.ckpt) if args.role == "load-nf4-after" else cfg  # full precision, then quantised
    t = time.perf_counter()
    with AnonPeak() as anon:
        model = apply_trainable(build_model(loading.model)[0], cfg.model)
    out = {"role": args.role, "load_s": time.perf_counter() - t, "load_anon_peak_mb": anon.peak,
           "after_load": rm._rss_split_mb(), "load_peak_rss_mb": rm._peak_rss_mb()}
    if args.role == "stats":
        batch = rm.make_batch(args.batch_size, args.seq_len, model.config.vocab_size)
        rows = per_sequence_stats(model, [{"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}])
        out["rows"] = int(rows.shape[0])
    out["peak_rss_mb"] = rm._peak_rss_mb()
    print(json.dumps(out), flush=True)


def measure(round_: str, ckpt: Path, args) -> dict:
    """One round's subprocess -> its figures (``peak_rss_mb`` always)."""
    if round_.startswith("load") or round_ == "stats":
        cmd = [sys.executable, __file__, "--role", round_, "--ckpt", str(ckpt), "--threads", str(args.threads),
               "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len)]
        p = subprocess.run(cmd, capture_output=True, text=True, env={**rm.os.environ, "PYTHONPATH": rm._pythonpath()})
        if p.returncode != 0:
            raise RuntimeError(f"{round_} subprocess failed:\n{p.stderr[-3000:]}")
        return json.loads(p.stdout.strip().splitlines()[-1])
    role_args = argparse.Namespace(threads=args.threads, batch_size=args.batch_size, seq_len=args.seq_len, steps=0,
                                   warmup=0, plain_arm="routed", rl_prompts=args.rl_prompts, rl_group=args.rl_group,
                                   quantize_experts="nf4" if round_ == "sft-nf4" else "none")
    if round_.startswith("rl-"):
        return rm.run_role("party-rl", str(ckpt), role_args, "--engine", round_.removeprefix("rl-"))
    return rm.run_role("party", str(ckpt), role_args)


def predicted(round_: str, ckpt: Path, args) -> float | None:
    """The plan's party peak for the round on the CPU, in MB (None for the load rounds: the plan has no load
    round of its own; its ``sft`` figure contains the load)."""
    from distmoe.config import parse_run_config
    from distmoe.model.memory_plan import Settings, architecture, predict

    if round_.startswith("load"):
        return None
    rl = parse_run_config({}).rl
    rollouts = args.rl_prompts * args.rl_group
    s = Settings(batch=args.batch_size, seq=args.seq_len, dtype_bytes=4, cpu=True, rollouts=rollouts,
                 minibatches=min(rl.minibatches, rollouts), rl_len=args.seq_len,
                 engine=round_.removeprefix("rl-") if round_.startswith("rl-") else rl.engine,
                 nf4_experts=round_.endswith("nf4"))
    p = predict(architecture(str(ckpt)), s)
    key = "rl" if round_.startswith("rl-") else "stats" if round_ == "stats" else "sft"
    return p[key] / MB


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", nargs="+", default=["0.1b"], choices=["small", "0.1b", "0.5b", "1b"])
    ap.add_argument("--family", default="qwen3_moe", choices=["olmoe", "qwen3_moe"])
    ap.add_argument("--rounds", nargs="+", default=list(ROUNDS),
                    help=f"any of {', '.join(ROUNDS)} or rl-<engine profile>")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--rl-prompts", type=int, default=2)
    ap.add_argument("--rl-group", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ckpt-dir", default="", help="keep (and reuse) the checkpoints here")
    ap.add_argument("--out", default="")
    ap.add_argument("--role", choices=["load", "load-nf4-after", "load-nf4", "stats"], help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role:
        _role_main(args)
        return
    base = rm.baseline_rss(args)
    rows = []
    with tempfile.TemporaryDirectory(prefix="distmoe-plan-") as tmp:
        root = Path(args.ckpt_dir or tmp)
        for size in args.sizes:
            ckpt = root / f"{args.family}-{size}"
            if not (ckpt / "config.json").exists():
                rm.say(f"{args.family} {size}: building and saving the checkpoint")
                rm.save_checkpoint(args.family, SHAPES[(args.family, size)], ckpt)
            for round_ in args.rounds:
                rm.say(f"{args.family} {size}: {round_}")
                res = measure(round_, ckpt, args)
                pred = predicted(round_, ckpt, args)
                rows.append({"size": size, "round": round_, "predicted_mb": pred, **res})
                note = f", plan {pred:.0f} MB ({pred / res['peak_rss_mb']:.3f})" if pred else ""
                if "load_anon_peak_mb" in res:
                    note += f", anonymous peak while loading {res['load_anon_peak_mb']:.0f} MB"
                rm.say(f"  peak RSS {res['peak_rss_mb']:.0f} MB{note}")
    print(f"\nbatch {args.batch_size} x {args.seq_len}, RL {args.rl_prompts} x {args.rl_group} rollouts of "
          f"{args.seq_len} tokens; the imports alone: {base:.0f} MB\n")
    print("| size | round | measured peak RSS | plan | plan / measured | anonymous peak while loading |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        pred, peak = r["predicted_mb"], r["peak_rss_mb"]
        plan = f"{pred:.0f} MB | {pred / peak:.3f}" if pred else "- | -"
        anon = f"{r['load_anon_peak_mb']:.0f} MB" if "load_anon_peak_mb" in r else "-"
        print(f"| {r['size']} | {r['round']} | {peak:.0f} MB | {plan} | {anon} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "baseline_rss_mb": base, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
