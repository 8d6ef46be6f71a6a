"""Long GRPO runs (mismatch correction over long RL runs): >= 1000 GRPO iterations per arm of the party's own RL code
(``distmoe.rl.grpo.run_grpo``, the function a party's ``rl`` round calls), in process, no Flower, no coordinator.

    python bench/rl_long.py --engines prune-2 bf16 --arms none tis icepop simulator replay --seeds 0 1 2 \
        --iters 1000 --out runs/rl-long [--prompts 4 --group 4 --tokens 4 --minibatches 1 --lr 3e-4 --chunk 50]
    python bench/rl_long.py --check --engines exact --arms none --seeds 0 --iters 300   # does RL raise reward?
    python bench/rl_long.py --table --out runs/rl-long                                    # table + plots only

Setup per seed: the small MoE of ``tests/rl/conftest.py`` (2 layers, 8 experts), ``--sft-steps`` SFT steps on
synthetic ``lookup`` data to partial competence; the 240 distinct lookup prompts are split into 200 training
prompts (SFT and RL) and 40 held-out prompts that are never trained on (the win rate's). Every arm of a seed
starts from that same model.

One run (engine, arm, seed) is ``--iters`` GRPO iterations done as ``--iters / --chunk`` calls of ``run_grpo``
with ``rl.steps = --chunk``: exactly what a party does in consecutive ``rl`` rounds (a fresh AdamW, a fresh
engine and, for the simulator arm, a fresh simulator per call; seed ``seed * 1000 + chunk``). Every iteration's
metrics go to ``<out>/<engine>-<arm>-s<seed>.jsonl``; the model after each chunk to a ``.pt`` next to it, so an
interrupted run resumes at its last chunk and finished runs are reused. Between runs the driver waits while the
file ``--quiet-file`` exists.

Arms (``RLConfig`` fields): none (correction none), tis, icepop, simulator (icepop + simulator), replay (correction
none + routing replay). Collapse: any skipped (NaN/Inf) update or non-finite reward, or the reward's 50-iteration
moving average below ``COLLAPSE_FRAC`` of its running peak for ``COLLAPSE_LEN`` consecutive iterations; the first
such iteration is reported.

Deployed win rate (item 2): after the run, the final policy and the starting model, each behind its own inference
engine of the run's profile, answer every held-out prompt ``--win-samples`` times (same sampling seeds); pair j of
prompt i compares the task reward of the final policy's j-th sample with the start model's j-th: win 1, tie 0.5,
loss 0. The win rate is the mean over all pairs.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from distmoe.config import RLConfig, parse_run_config
from distmoe.data.formats import Example, parse_line
from distmoe.data.synth import generate
from distmoe.data.template import encode_example, encode_prompt
from distmoe.model.build import build_model, describe
from distmoe.rl.grpo import build_engine, run_grpo
from distmoe.rl.rewards import compute_rewards
from distmoe.rl.rollout import generate_rollouts
from distmoe.train.sft import train_sft

TASK = "lookup"
_RL = RLConfig()  # the defaults the runs use for the simulator's trigger thresholds
N_PROMPTS, N_HELDOUT = 240, 40  # 240 distinct lookup prompts (40 keys x 6 phrasings); the last 40 held out
SMALL = {"model.hidden-size": 128, "model.moe-intermediate-size": 128, "model.layers": 2, "model.heads": 2,
         "model.kv-heads": 1, "model.head-dim": 64, "train.batch-size": 16,
         "train.lr": 3e-3, "train.lr-experts": 3e-3, "train.lr-router": 3e-3, "train.warmup-steps": 5,
         "routing.anchor-kl-coef": 0.0}
ARMS: dict[str, dict[str, object]] = {
    "none": {"correction": "none"},
    "tis": {"correction": "tis"},
    "icepop": {"correction": "icepop"},
    "simulator": {"correction": "icepop", "simulator": True},
    "replay": {"correction": "none", "routing_replay": True},
}
LOGGED = ("reward", "logp_diff_mean", "logp_diff_max", "k3", "masked_frac", "weight_mean", "skipped_steps",
          "updates", "response_len", "time_s", "sim_trusted", "sim_r2", "sim_recal_triggered", "sim_route_shift",
          "sim_err_shift",
          "replay_override_frac", "logp_diff_mean_native")
COLLAPSE_WINDOW, COLLAPSE_FRAC, COLLAPSE_LEN = 50, 0.5, 100


@dataclass
class Start:
    """A seed's starting model and its data split."""

    model: torch.nn.Module
    tok: object
    train: list[Example]  # SFT and RL prompts
    heldout: list[Example]  # never trained on


def start_model(seed: int, sft_steps: int) -> Start:
    """The small MoE after ``sft_steps`` SFT steps on the training split of the lookup prompts (seed ``seed``)."""
    torch.manual_seed(seed)
    cfg = parse_run_config({**SMALL, "train.local-steps": max(1, sft_steps)})
    model, tok = build_model(cfg.model)
    ms = describe(model)
    examples = [parse_line(o, f"synth:{i}") for i, o in enumerate(generate(TASK, 0, N_PROMPTS, 0))]
    train, heldout = examples[:N_PROMPTS - N_HELDOUT], examples[N_PROMPTS - N_HELDOUT:]
    assert not {e.prompt_messages[-1]["content"] for e in train} & {e.prompt_messages[-1]["content"] for e in heldout}
    if sft_steps > 0:
        encoded = [encode_example(tok, ex, cfg.model.max_seq_len) for ex in train]
        train_sft(model, encoded, tok.pad_token_id, cfg.train, cfg.routing, ms.num_experts, ms.top_k, None, seed)
    model.eval()
    return Start(model=model, tok=tok, train=train, heldout=heldout)


def rl_config(args, engine: str, arm: str, steps: int) -> RLConfig:
    return RLConfig(prompts_per_step=args.prompts, group_size=args.group, max_new_tokens=args.tokens, lr=args.lr,
                    minibatches=args.minibatches, reward="task", steps=steps, engine=engine, **ARMS[arm])


def _row(it: int, m: dict[str, float]) -> dict[str, float]:
    return {"iter": it, **{k: float(m[k]) if k in m else math.nan for k in LOGGED}}


def _read_rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_arm(start: Start, args, engine: str, arm: str, seed: int, out: Path) -> list[dict]:
    """``args.iters`` GRPO iterations of one arm from ``start.model`` (not changed); resumes from ``out``.
    Returns the per-iteration rows (``LOGGED`` fields plus ``iter``) and leaves the final model's state in
    ``<out>.pt``."""
    ckpt = out.with_suffix(".pt")
    rows = [r for r in _read_rows(out) if "iter" in r]
    model = copy.deepcopy(start.model)
    done = len(rows)
    if done and ckpt.exists():
        saved = torch.load(ckpt, weights_only=True)
        if saved["iters"] == done:
            model.load_state_dict(saved["state"])
        else:  # the JSONL ran ahead of the checkpoint (killed in between): drop the rows after it
            rows, done = rows[:saved["iters"]], saved["iters"]
            model.load_state_dict(saved["state"])
            out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif done:
        rows, done = [], 0
        out.write_text("")
    while done < args.iters:
        steps = min(args.chunk, args.iters - done)
        chunk = done // args.chunk
        res = run_grpo(model, start.tok, start.train, TASK, rl_config(args, engine, arm, steps),
                       seed=seed * 1000 + chunk, max_prompt_len=256)
        new = [_row(done + i, m) for i, m in enumerate(res.steps)]
        with out.open("a") as f:
            f.writelines(json.dumps(r) + "\n" for r in new)
        rows += new
        done += steps
        torch.save({"iters": done, "state": model.state_dict()}, ckpt)
    return rows


def collapse_at(rows: list[dict]) -> int | None:
    """The first iteration of a collapse (module docstring), or ``None``."""
    rewards = [r["reward"] for r in rows]
    for r in rows:
        if r["skipped_steps"] > 0 or not math.isfinite(r["reward"]):
            return int(r["iter"])
    peak, below = -math.inf, 0
    for i in range(COLLAPSE_WINDOW - 1, len(rewards)):
        ma = sum(rewards[i - COLLAPSE_WINDOW + 1:i + 1]) / COLLAPSE_WINDOW
        peak = max(peak, ma)
        below = below + 1 if peak > 0 and ma < COLLAPSE_FRAC * peak else 0
        if below >= COLLAPSE_LEN:
            return int(rows[i - COLLAPSE_LEN + 1]["iter"])
    return None


def deployed_rewards(model, tok, prompts: list[Example], engine: str, samples: int, tokens: int,
                     seed: int) -> torch.Tensor:
    """``[len(prompts), samples]`` task rewards of ``model``'s samples drawn through an engine of ``engine``."""
    model.eval()
    cfg = RLConfig(engine=engine, max_new_tokens=tokens, group_size=samples)
    eng = build_engine(model, tok, prompts, cfg)
    ids = [encode_prompt(tok, ex, 256) for ex in prompts]
    ro = generate_rollouts(eng, tok, ids, samples, tokens, cfg.temperature, seed=seed)
    rows = ro.prompt_index.tolist()
    r = compute_rewards("task", ro.texts, [prompts[i].answer for i in rows], TASK,
                        [prompts[i].prompt_messages[-1]["content"] for i in rows])
    return torch.tensor(r, dtype=torch.float32).view(len(prompts), samples)  # prompt-major rows


def win_rate(final, start, tok, heldout: list[Example], engine: str, samples: int, tokens: int,
             seed: int) -> dict[str, float]:
    """Pairwise deployed win rate of ``final`` over ``start`` on ``heldout`` (module docstring)."""
    rf = deployed_rewards(final, tok, heldout, engine, samples, tokens, seed)  # [P, S]
    rs = deployed_rewards(start, tok, heldout, engine, samples, tokens, seed)  # [P, S]
    win = (rf > rs).float() + 0.5 * (rf == rs).float()  # [P, S]
    return {"win_rate": float(win.mean()), "heldout_reward_final": float(rf.mean()),
            "heldout_reward_start": float(rs.mean())}


def _share(rows: list[dict], key: str, threshold: float) -> float:
    """Share of the iterations whose ``key`` exceeded ``threshold`` (NaN when no row has the key)."""
    if not any(key in r for r in rows):
        return math.nan
    return sum(1 for r in rows if r.get(key, math.nan) > threshold) / len(rows)


def summarize(rows: list[dict], tail: int) -> dict[str, float]:
    """Per-run figures: early / late reward and mismatch, collapse, simulator trust."""
    def mean(key: str, part: list[dict]) -> float:
        v = [r[key] for r in part if math.isfinite(r[key])]
        return statistics.mean(v) if v else math.nan
    head, late = rows[:tail], rows[-tail:]
    c = collapse_at(rows)
    return {"reward_first": mean("reward", head), "reward_last": mean("reward", late),
            "reward_peak_ma": max(statistics.mean(r["reward"] for r in rows[i:i + COLLAPSE_WINDOW])
                                  for i in range(0, max(1, len(rows) - COLLAPSE_WINDOW + 1))),
            "dlogp_mean_first": mean("logp_diff_mean", head), "dlogp_mean_last": mean("logp_diff_mean", late),
            "dlogp_max_last": mean("logp_diff_max", late), "dlogp_max_all": max(r["logp_diff_max"] for r in rows),
            "k3_last": mean("k3", late), "masked_frac_last": mean("masked_frac", late),
            "skipped": sum(r["skipped_steps"] for r in rows),
            "collapse_iter": math.nan if c is None else float(c),
            "sim_trusted_frac": mean("sim_trusted", rows),
            "sim_triggered_frac": mean("sim_recal_triggered", rows),
            # which trigger saw a shift beyond the default thresholds (both may; NaN rows: scheduled fits)
            "sim_err_fired_frac": _share(rows, "sim_err_shift", _RL.simulator_error_shift),
            "sim_route_fired_frac": _share(rows, "sim_route_shift", _RL.simulator_route_shift),
            "iter_s": mean("time_s", rows)}


def run_one(start: Start, args, engine: str, arm: str, seed: int, outdir: Path) -> tuple[dict, list[dict]]:
    """One run (``run_arm``), its summary and deployed win rate, written to ``<name>.summary.json``."""
    name = f"{engine}-{arm}-s{seed}"
    path = outdir / f"{name}.jsonl"
    t_run = time.time()
    rows = run_arm(start, args, engine, arm, seed, path)
    s: dict = summarize(rows, max(1, args.iters // 10))
    final = copy.deepcopy(start.model)
    final.load_state_dict(torch.load(path.with_suffix(".pt"), weights_only=True)["state"])
    s.update(win_rate(final, start.model, start.tok, start.heldout, engine, args.win_samples, args.tokens,
                      seed=seed * 1000 + 999))
    s.update({"engine": engine, "arm": arm, "seed": seed, "iters": len(rows), "wall_s": time.time() - t_run,
              "settings": {k: getattr(args, k) for k in ("prompts", "group", "tokens", "lr", "sft_steps", "chunk",
                                                        "win_samples", "threads", "minibatches")}})
    (outdir / f"{name}.summary.json").write_text(json.dumps(s, indent=1))
    return s, rows


TABLE = (("reward (engine), first 100 iterations", "reward_first", "f"),
         ("reward (engine), last 100 iterations", "reward_last", "f"),
         ("reward (engine), peak 50-iteration mean", "reward_peak_ma", "f"),
         ("mean \\|Δlogp\\|, first 100 iterations", "dlogp_mean_first", "e"),
         ("mean \\|Δlogp\\|, last 100 iterations (late deviation)", "dlogp_mean_last", "e"),
         ("max \\|Δlogp\\|, mean over the last 100 iterations", "dlogp_max_last", "e"),
         ("max \\|Δlogp\\|, whole run", "dlogp_max_all", "e"),
         ("K3, last 100 iterations", "k3_last", "e"),
         ("masked share, last 100 iterations", "masked_frac_last", "f"),
         ("skipped updates", "skipped", "f"),
         ("collapse iteration (– none)", "collapse_iter", "f"),
         ("deployed win rate vs start (held-out)", "win_rate", "f"),
         ("held-out reward (engine), start model", "heldout_reward_start", "f"),
         ("held-out reward (engine), final policy", "heldout_reward_final", "f"),
         ("simulator trusted share of iterations", "sim_trusted_frac", "f"),
         ("simulator full fits triggered by a shift (share of iterations)", "sim_triggered_frac", "f"),
         (f"… held-out error shift beyond {_RL.simulator_error_shift:g} (share of iterations)", "sim_err_fired_frac",
          "f"),
         (f"… routing shift beyond {_RL.simulator_route_shift:g} (share of iterations)", "sim_route_fired_frac", "f"),
         ("seconds per iteration", "iter_s", "f"),
         ("wall time of the run, s", "wall_s", "f0"))


def _fmt(v: float, kind: str) -> str:
    if not math.isfinite(v):
        return "–"
    if kind == "f0":
        return f"{v:.0f}"
    if kind == "e" and v != 0 and abs(v) < 0.01:
        return f"{v:.1e}"
    return f"{v:.3f}"


def table(outdir: Path, engines: list[str], arms: list[str]) -> str:
    """Markdown tables (mean ± sample std over seeds, then each seed's value) of the finished runs."""
    out = []
    for engine in engines:
        runs = {a: sorted((json.loads(p.read_text()) for p in outdir.glob(f"{engine}-{a}-s*.summary.json")),
                          key=lambda r: r["seed"]) for a in arms}
        runs = {a: r for a, r in runs.items() if r}
        if not runs:
            continue
        out += [f"engine `{engine}`; per cell: mean ± sample std (seeds: values in seed order)", "",
                "| metric | " + " | ".join(f"{a} (seeds {', '.join(str(r['seed']) for r in rs)})"
                                          for a, rs in runs.items()) + " |",
                "|---|" + "---|" * len(runs)]
        for label, key, kind in TABLE:
            cells = []
            for rs in runs.values():
                vals = [float(r.get(key, math.nan)) for r in rs]  # a key added later: "–" in older summaries
                fin = [v for v in vals if math.isfinite(v)]
                if key == "collapse_iter":
                    cells.append(f"{len(fin)} of {len(vals)} collapsed ({', '.join(_fmt(v, kind) for v in vals)})")
                    continue
                if not fin:
                    cells.append("–")
                    continue
                sd = statistics.stdev(fin) if len(fin) > 1 else math.nan
                cells.append(f"{_fmt(statistics.mean(fin), kind)} ± {_fmt(sd, kind)} "
                             f"({', '.join(_fmt(v, kind) for v in vals)})")
            out.append(f"| {label} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def plots(outdir: Path, engines: list[str], arms: list[str], img_dir: Path) -> list[Path]:
    """Per engine, one PNG: reward, mean |Δlogp|, K3 and masked share against the iteration (50-iteration
    moving averages of the mean over seeds, one line per arm)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def moving(xs: list[float], w: int = COLLAPSE_WINDOW) -> list[float]:
        return [statistics.mean(xs[max(0, i - w + 1):i + 1]) for i in range(len(xs))]
    made = []
    img_dir.mkdir(parents=True, exist_ok=True)
    for engine in engines:
        fig, axes = plt.subplots(1, 4, figsize=(13, 3))
        any_run = False
        for arm in arms:
            runs = [_read_rows(p) for p in sorted(outdir.glob(f"{engine}-{arm}-s*.jsonl"))
                    if p.with_suffix("").with_suffix(".summary.json").exists()]
            if not runs:
                continue
            any_run = True
            n = min(len(r) for r in runs)
            for ax, key in zip(axes, ("reward", "logp_diff_mean", "k3", "masked_frac"), strict=True):
                mean = [statistics.mean(r[i][key] for r in runs) for i in range(n)]
                ax.plot(range(n), moving(mean), label=f"{arm} ({len(runs)} seeds)", lw=1)
                ax.set_title({"reward": "reward under the engine", "logp_diff_mean": "mean |Δlogp|",
                              "k3": "K3", "masked_frac": "masked share"}[key], fontsize=9)
                ax.set_xlabel("GRPO iteration", fontsize=8)
                ax.tick_params(labelsize=7)
        if not any_run:
            plt.close(fig)
            continue
        axes[0].legend(fontsize=7)
        fig.suptitle(f"engine {engine}: 50-iteration moving averages of the mean over seeds", fontsize=9)
        fig.tight_layout()
        path = img_dir / f"rl-long-{engine}.png"
        fig.savefig(path, dpi=70)
        plt.close(fig)
        made.append(path)
    return made


def _wait_quiet(path: str) -> None:
    while path and os.path.exists(path):
        time.sleep(15)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engines", nargs="*", default=["prune-2", "bf16"])
    ap.add_argument("--arms", nargs="*", default=list(ARMS), choices=list(ARMS))
    ap.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2])
    ap.add_argument("--iters", type=int, default=1000)
    ap.add_argument("--chunk", type=int, default=50, help="GRPO steps per run_grpo call (one party round)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--minibatches", type=int, default=1, help="rl.minibatches (1: no separate recompute)")
    ap.add_argument("--sft-steps", type=int, default=150)
    ap.add_argument("--win-samples", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="runs/rl-long")
    ap.add_argument("--quiet-file", default="", help="wait before each run while this file exists (none by default)")
    ap.add_argument("--check", action="store_true", help="print the reward curve in 50-iteration means")
    ap.add_argument("--table", action="store_true", help="only print the tables of finished runs and draw plots")
    ap.add_argument("--img-dir", default="docs/img")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    outdir = Path(args.out)
    if args.table:
        print(table(outdir, args.engines, args.arms))
        for p in plots(outdir, args.engines, args.arms, Path(args.img_dir)):
            print(f"wrote {p}")
        return
    outdir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    starts: dict[int, Start] = {}
    # engine-major (the first engine's table completes first); within an engine every seed of the cheap arms,
    # then the simulator arm (about three times the cost of an iteration)
    order = sorted(((e, a, s) for e in args.engines for s in args.seeds for a in args.arms),
                   key=lambda r: (args.engines.index(r[0]), r[1] == "simulator", r[2], args.arms.index(r[1])))
    for engine, arm, seed in order:
        name = f"{engine}-{arm}-s{seed}"
        if (outdir / f"{name}.summary.json").exists():
            continue
        _wait_quiet(args.quiet_file)
        if seed not in starts:
            starts[seed] = start_model(seed, args.sft_steps)
        s, rows = run_one(starts[seed], args, engine, arm, seed, outdir)
        print(f"{name}: " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                      for k, v in s.items()), flush=True)
        if args.check:
            for i in range(0, len(rows), 50):
                part = rows[i:i + 50]
                print(f"  iters {i}-{i + len(part) - 1}: reward "
                      f"{statistics.mean(r['reward'] for r in part):.3f}", flush=True)
    print(f"total wall {time.time() - t0:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
