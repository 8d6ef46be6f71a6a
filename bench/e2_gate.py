"""The mismatch-correction gate: does GRPO under a numeric engine that routing replay cannot fix (4-bit experts)
end below GRPO under the exact engine, on a task whose answers are long enough for per-token errors to compound?

    python bench/e2_gate.py --seeds 0 1 2 --iters 400 --out bench/results/e2          # SFT, calibration, arms
    python bench/e2_gate.py --calibrate-only --seeds 0 --out bench/results/e2         # the calibration table
    python bench/e2_gate.py --table --seeds 0 1 2 --out bench/results/e2              # the pre-registered analysis
    python bench/e2_gate.py --seeds 0 1 2 3 4 --milestones 500 1000 1500 --out bench/results/e2-long   # 1,500 its
    python bench/e2_gate.py --table --iters 1500 --seeds 0 1 2 3 4 --out bench/results/e2-long  # at 500/1000/1500

Setup per seed (the small MoE of ``tests/rl/conftest.py``: 2 layers, 8 experts, top-2; in process, no Flower):
task ``shift6`` (``distmoe.data.synth``: a 6-letter word with every letter moved one on, answers of 6 letters +
end token, exact-match reward), 2,000 training prompts and 200 held-out prompts (distinct words, never trained on).
SFT in chunks of ``--sft-chunk`` steps until the held-out exact-match reward (exact engine, 2 samples per prompt,
temperature 1) reaches ``--sft-target`` (0.3), saved as ``sft-s<seed>.pt``: every arm of the seed starts from it.
Arms (``ARMS``; ``rl_long.py``'s loop: ``--iters / --chunk`` calls of ``distmoe.rl.grpo.run_grpo`` with a fresh
AdamW and engine each, seed ``seed * 1000 + chunk``, resumable):

    exact       rollouts from the exact engine (no mismatch), correction none
    none        rollouts from the deployed engine ``--engine``, correction none
    tis, icepop, replay, replay+icepop   the same engine with a correction (run only once the gate passes)

The deployed engine, ``int2g32-experts`` (2-bit symmetric fake quantisation of the experts, one scale per 32 input
columns of each output channel; router exact), was chosen on seed 0's SFT checkpoint before any RL run, as the
profile of ``CALIBRATE`` whose mean |Δlogp| falls in the target 0.05-0.3 with route disagreement below 3 %:
per-channel 4-bit experts give only 0.004 on this model (``calibration-s<seed>.json``).

Pre-registered analysis (fixed before the runs):
* Endpoint: head-to-head deployed win rate. After the runs, arm X's and arm Y's final policies, each behind its own
  engine of the deployed profile ``--engine``, answer every held-out prompt ``--win-samples`` times with the same
  sampling seeds; pair j of prompt i scores 1 if X's j-th answer is exact and Y's is not, 0 for the reverse, 0.5 for
  a tie. ``h(X, Y)`` is the mean over all pairs of all seeds (arms paired by seed: same SFT checkpoint, same
  prompts, same sampling seeds). Beside it, the difference of deployed held-out exact-match rewards, X - Y.
* Interval: 95 % percentile bootstrap clustered by prompt (2,000 resamples of the 200 held-out prompts with
  replacement; a resampled prompt brings all its pairs of every seed), seed 0.
* Gate: the uncorrected arm ``none`` against ``exact``. It passes iff ``h(none, exact) <= 0.45`` (the uncorrected
  arm at least 0.05 below parity) and the interval's upper end is below 0.5. Otherwise no correction can show
  anything in this regime, and that is the finding. Per-seed values are reported beside the pooled one.
* Correction arms (only if the gate passes): ``h(arm, none)`` with its interval, for each correction arm.

The design's full length (fixed before those runs, 2026-12-06, after the 400-iteration gate above had failed): the
same two arms continued to 1,500 iterations from fresh runs of the same seeds (``--milestones 500 1000 1500``; the
first 400 iterations repeat the first gate's exactly, a check of determinism), the same gate rule applied at each
of 500, 1,000 and 1,500 iterations (``--table --iters N``), the gate passing only if it passes at 1,500.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import statistics
import time
from pathlib import Path

import torch

from distmoe.config import RLConfig, parse_run_config
from distmoe.data.formats import Example, parse_line
from distmoe.data.synth import generate
from distmoe.data.template import encode_example, encode_prompt
from distmoe.model.build import build_model, describe
from distmoe.rl.engine_calibration import calibrate_profile, calibration_table
from distmoe.rl.grpo import build_engine, run_grpo
from distmoe.rl.rewards import compute_rewards
from distmoe.rl.rollout import generate_rollouts
from distmoe.train.sft import train_sft

TASK = "shift6"
N_TRAIN, N_HELDOUT = 2000, 200
SMALL = {"model.hidden-size": 128, "model.moe-intermediate-size": 128, "model.layers": 2, "model.heads": 2,
         "model.kv-heads": 1, "model.head-dim": 64, "train.batch-size": 16,
         "train.lr": 3e-3, "train.lr-experts": 3e-3, "train.lr-router": 3e-3, "train.warmup-steps": 5,
         "routing.anchor-kl-coef": 0.0}
ARMS: dict[str, dict[str, object]] = {
    "exact": {"correction": "none", "engine": "exact"},
    "none": {"correction": "none"},
    "tis": {"correction": "tis"},
    "icepop": {"correction": "icepop"},
    "replay": {"correction": "none", "routing_replay": True},
    "replay+icepop": {"correction": "icepop", "routing_replay": True},
}
CALIBRATE = ("exact", "bf16", "int8-weight-only", "int4-experts", "int4g32-experts", "int3-experts", "int3g16-experts",
             "int2g16-experts", "int2g32-experts", "int2-experts", "bf16+prune-1", "prune-2")
LOGGED = ("reward", "logp_diff_mean", "logp_diff_max", "k3", "masked_frac", "skipped_steps", "response_len",
          "time_s", "replay_override_frac", "logp_diff_mean_native")


def split(seed: int) -> tuple[list[Example], list[Example]]:
    """The training and held-out prompts (distinct words; the same for every seed: only the model varies)."""
    ex = [parse_line(o, f"synth:{i}") for i, o in enumerate(generate(TASK, 0, N_TRAIN + N_HELDOUT, 0))]
    return ex[:N_TRAIN], ex[N_TRAIN:]


def deployed_rewards(model, tok, prompts: list[Example], engine: str, samples: int, seed: int) -> torch.Tensor:
    """``[len(prompts), samples]`` exact-match rewards of ``model``'s samples through an engine of ``engine``."""
    model.eval()
    cfg = RLConfig(engine=engine, max_new_tokens=8, group_size=samples)
    eng = build_engine(model, tok, prompts, cfg)
    ids = [encode_prompt(tok, ex, 256) for ex in prompts]
    ro = generate_rollouts(eng, tok, ids, samples, 8, cfg.temperature, seed=seed)
    rows = ro.prompt_index.tolist()
    r = compute_rewards("task", ro.texts, [prompts[i].answer for i in rows], TASK,
                        [prompts[i].prompt_messages[-1]["content"] for i in rows])
    return torch.tensor(r, dtype=torch.float32).view(len(prompts), samples)  # prompt-major rows


def sft_start(seed: int, args, out: Path):
    """The seed's SFT checkpoint (built once, then loaded): model, tokenizer and its record."""
    torch.manual_seed(seed)
    cfg = parse_run_config({**SMALL, "train.local-steps": args.sft_chunk})
    model, tok = build_model(cfg.model)
    path, rec_path = out / f"sft-s{seed}.pt", out / f"sft-s{seed}.json"
    if path.exists() and rec_path.exists():
        model.load_state_dict(torch.load(path, weights_only=True))
        model.eval()
        return model, tok, json.loads(rec_path.read_text())
    ms = describe(model)
    train, held = split(seed)
    encoded = [encode_example(tok, ex, cfg.model.max_seq_len) for ex in train]
    curve, steps = [], 0
    while steps < args.sft_max:
        train_sft(model, encoded, tok.pad_token_id, cfg.train, cfg.routing, ms.num_experts, ms.top_k, None,
                  seed * 1000 + steps)
        steps += args.sft_chunk
        r = float(deployed_rewards(model, tok, held, "exact", 2, seed * 1000 + 7).mean())
        curve.append([steps, r])
        if r >= args.sft_target:
            break
    model.eval()
    rec = {"seed": seed, "sft_steps": steps, "heldout_reward_exact": curve[-1][1], "curve": curve}
    torch.save(model.state_dict(), path)
    rec_path.write_text(json.dumps(rec, indent=1))
    return model, tok, rec


def calibrate(model, tok, seed: int, args, out: Path) -> list[dict]:
    _, held = split(seed)
    rows = [calibrate_profile(model, tok, held[:64], p, samples=4, max_new_tokens=8, seed=seed) for p in CALIBRATE]
    recs = [{"seed": seed, **vars(c)} for c in rows]
    (out / f"calibration-s{seed}.json").write_text(json.dumps(recs, indent=1))
    print(calibration_table(rows), flush=True)
    return recs


def run_arm(model0, tok, args, arm: str, seed: int, out: Path) -> torch.nn.Module:
    """``args.iters`` GRPO iterations of ``arm`` from ``model0`` (not changed), resumable; the final policy."""
    train, _ = split(seed)
    spec = {"engine": args.engine, **ARMS[arm]}
    log, ckpt = out / f"{arm}-s{seed}.jsonl", out / f"{arm}-s{seed}.pt"
    model, done = copy.deepcopy(model0), 0
    if ckpt.exists():
        saved = torch.load(ckpt, weights_only=True)
        model.load_state_dict(saved["state"])
        done = saved["iters"]
        rows = [line for line in log.read_text().splitlines() if line.strip()][:done] if log.exists() else []
        log.write_text("".join(r + "\n" for r in rows))
    elif log.exists():
        log.unlink()
    while done < args.iters:
        steps = min(args.chunk, args.iters - done)
        cfg = RLConfig(prompts_per_step=args.prompts, group_size=args.group, max_new_tokens=8, lr=args.lr,
                       minibatches=1, reward="task", steps=steps, **spec)
        res = run_grpo(model, tok, train, TASK, cfg, seed=seed * 1000 + done // args.chunk, max_prompt_len=256)
        with log.open("a") as f:
            f.writelines(json.dumps({"iter": done + i, **{k: float(m[k]) for k in LOGGED if k in m}}) + "\n"
                         for i, m in enumerate(res.steps))
        done += steps
        torch.save({"iters": done, "state": model.state_dict()}, ckpt)
    return model


def deployed_path(out: Path, seed: int, iters: int) -> Path:
    """Where ``evaluate`` keeps seed's deployed rewards after ``iters`` iterations (400: the first gate's name)."""
    return out / (f"deployed-s{seed}.json" if iters == 400 else f"deployed-s{seed}-i{iters}.json")


def evaluate(seed: int, args, out: Path) -> None:
    """Deployed rewards ``[P, S]`` of every finished arm of ``seed`` (same sampling seed for all arms)."""
    model0, tok, _ = sft_start(seed, args, out)
    _, held = split(seed)
    rec = {"seed": seed, "engine": args.engine, "win_samples": args.win_samples,
           "sft": deployed_rewards(model0, tok, held, args.engine, args.win_samples, seed * 1000 + 999).tolist()}
    for arm in ARMS:
        ckpt = out / f"{arm}-s{seed}.pt"
        if not ckpt.exists() or torch.load(ckpt, weights_only=True)["iters"] < args.iters:
            continue
        m = copy.deepcopy(model0)
        m.load_state_dict(torch.load(ckpt, weights_only=True)["state"])
        rec[arm] = deployed_rewards(m, tok, held, args.engine, args.win_samples, seed * 1000 + 999).tolist()
    rec["iters"] = args.iters
    deployed_path(out, seed, args.iters).write_text(json.dumps(rec))


def head_to_head(recs: list[dict], x: str, y: str, boot: int = 2000) -> dict[str, float]:
    """``h(x, y)`` and the reward difference over seeds, with prompt-clustered bootstrap intervals."""
    recs = [r for r in recs if x in r and y in r]
    if not recs:
        return {}
    px = [torch.tensor(r[x], dtype=torch.float32) for r in recs]  # seeds x [P, S]
    py = [torch.tensor(r[y], dtype=torch.float32) for r in recs]
    win = torch.stack([(a > b).float() + 0.5 * (a == b).float() for a, b in zip(px, py, strict=True)])  # [K, P, S]
    diff = torch.stack([a - b for a, b in zip(px, py, strict=True)])  # [K, P, S]
    n_p = win.shape[1]
    rng = random.Random(0)
    hs, ds = [], []
    for _ in range(boot):
        idx = torch.tensor([rng.randrange(n_p) for _ in range(n_p)])
        hs.append(float(win[:, idx].mean()))
        ds.append(float(diff[:, idx].mean()))
    hs.sort()
    ds.sort()
    lo, hi = int(0.025 * boot), int(0.975 * boot) - 1
    return {"h": float(win.mean()), "h_lo": hs[lo], "h_hi": hs[hi], "d": float(diff.mean()), "d_lo": ds[lo],
            "d_hi": ds[hi], "seeds": [r["seed"] for r in recs], "h_per_seed": [float(w.mean()) for w in win],
            "reward_x": [float(a.mean()) for a in px], "reward_y": [float(b.mean()) for b in py]}


def table(args, out: Path) -> dict:
    recs = [json.loads(deployed_path(out, s, args.iters).read_text()) for s in args.seeds
            if deployed_path(out, s, args.iters).exists()]
    gate = head_to_head(recs, "none", "exact")
    res = {"gate": gate, "engine": args.engine}
    if gate:
        res["gate_passes"] = bool(gate["h"] <= 0.45 and gate["h_hi"] < 0.5)
        print(f"gate h(none, exact) = {gate['h']:.3f} [{gate['h_lo']:.3f}, {gate['h_hi']:.3f}] "
              f"(per seed {', '.join(f'{v:.3f}' for v in gate['h_per_seed'])}); deployed reward none - exact "
              f"{gate['d']:+.3f} [{gate['d_lo']:+.3f}, {gate['d_hi']:+.3f}]; passes: {res['gate_passes']}")
    for arm in ("tis", "icepop", "replay", "replay+icepop"):
        c = head_to_head(recs, arm, "none")
        if c:
            res[arm] = c
            print(f"h({arm}, none) = {c['h']:.3f} [{c['h_lo']:.3f}, {c['h_hi']:.3f}]; reward diff {c['d']:+.3f}")
    print("| seed | SFT steps | SFT held-out (exact) | deployed: SFT | " +
          " | ".join(a for a in ARMS if any(a in r for r in recs)) + " |")
    for r in recs:
        sft = json.loads((out / f"sft-s{r['seed']}.json").read_text())
        cells = [f"{torch.tensor(r[a], dtype=torch.float32).mean():.3f}" for a in ARMS if a in r]
        print(f"| {r['seed']} | {sft['sft_steps']} | {sft['heldout_reward_exact']:.3f} | "
              f"{torch.tensor(r['sft'], dtype=torch.float32).mean():.3f} | " + " | ".join(cells) + " |")
    for arm in ARMS:
        logs = [out / f"{arm}-s{s}.jsonl" for s in args.seeds if (out / f"{arm}-s{s}.jsonl").exists()]
        if logs:
            rows = [json.loads(x) for p in logs for x in p.read_text().splitlines()[:args.iters][-50:]]
            print(f"{arm}: last-50-iteration mean reward {statistics.mean(r['reward'] for r in rows):.3f}, "
                  f"mean |Δlogp| {statistics.mean(r['logp_diff_mean'] for r in rows):.4f}")
    (out / ("gate.json" if args.iters == 400 else f"gate-i{args.iters}.json")).write_text(json.dumps(res, indent=1))
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2])
    ap.add_argument("--arms", nargs="*", default=["exact", "none"], choices=list(ARMS))
    ap.add_argument("--engine", default="int2g32-experts", help="the deployed engine profile")
    ap.add_argument("--iters", type=int, default=400)
    ap.add_argument("--milestones", type=int, nargs="*", default=[],
                    help="run to each of these iteration counts in turn, evaluating at each (overrides --iters)")
    ap.add_argument("--chunk", type=int, default=50)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--sft-chunk", type=int, default=10)
    ap.add_argument("--sft-max", type=int, default=400)
    ap.add_argument("--sft-target", type=float, default=0.3)
    ap.add_argument("--win-samples", type=int, default=4)
    ap.add_argument("--out", default="bench/results/e2")
    ap.add_argument("--calibrate-only", action="store_true")
    ap.add_argument("--table", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.table:
        table(args, out)
        return
    for seed in args.seeds:
        t0 = time.time()
        model0, tok, rec = sft_start(seed, args, out)
        print(f"seed {seed}: SFT {rec['sft_steps']} steps, held-out reward {rec['heldout_reward_exact']:.3f}",
              flush=True)
        if not (out / f"calibration-s{seed}.json").exists():
            calibrate(model0, tok, seed, args, out)
        if args.calibrate_only:
            continue
        for iters in args.milestones or [args.iters]:
            args.iters = iters
            for arm in args.arms:
                t1 = time.time()
                run_arm(model0, tok, args, arm, seed, out)
                print(f"seed {seed} {arm}: {args.iters} iterations, {time.time() - t1:.0f} s", flush=True)
            evaluate(seed, args, out)
        print(f"seed {seed}: {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
