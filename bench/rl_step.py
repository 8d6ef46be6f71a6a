"""Benchmark: RL iteration time with IcePop (the recompute of ``log pi_train(theta_old)`` with no grad, the
mismatch weights, then the weighted update) against plain GRPO (``logp_old := logp_infer``, weights 1) on the
same fixed rollouts, measured in one run, interleaved so that machine noise hits every arm alike.

    python bench/rl_step.py [--iters 20] [--warmup 3] [--threads 2] [--engine prune-2]
                            [--prompts 8] [--group 4] [--tokens 8] [--simulator] [--replay]

Setup: the default tiny model, briefly SFT-trained on synthetic lookup data, an ``InferenceEngine`` of profile
``--engine`` and one batch of rollouts generated once from it and reused by every arm. Before each timed update
the model and optimizer state are restored from a snapshot (outside the timed region), so every arm updates the
same theta. One update = forward with grad, ``grpo`` loss, backward, gradient clipping, AdamW step (as in
``run_grpo`` with one minibatch). The arm "reused logp_old" is ``rl.reuse-logprobs`` with one epoch and one
minibatch: no separate recompute, ``logp_old`` = the update forward's detached log-probs, the weights from them.
The rollout generation is timed too (interleaved, same seed), so the reader sees the share of an iteration.
Prints medians and the ratios vs plain GRPO. ``--replay`` adds routing replay
(``distmoe.rl.replay``): generation with the engine's routes recorded, and IcePop with the recompute and the update
replaying them.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable

import torch

from distmoe.config import RLConfig, parse_run_config, replace
from distmoe.data.formats import parse_line
from distmoe.data.synth import generate
from distmoe.data.template import encode_example, encode_prompt
from distmoe.model.build import build_model, describe
from distmoe.rl.advantages import group_advantages
from distmoe.rl.grpo import build_engine, optimizer_config
from distmoe.rl.losses import get_policy_loss, mismatch_weights
from distmoe.rl.rewards import compute_rewards
from distmoe.rl.rollout import generate_rollouts, train_logprobs
from distmoe.train.optim import build_optimizer
from distmoe.train.sft import train_sft

TASK = "lookup"


def simulator_arm(model, engine, ro) -> tuple[Callable[[], object] | None, str]:
    """A timed ``predict`` of the inference simulator (``distmoe.rl.simulator``), calibrated on these rollouts."""
    from distmoe.rl.simulator import InferenceSimulator

    sim = InferenceSimulator.for_model(model)
    t = time.perf_counter()
    metrics = sim.calibrate(model, engine, ro)
    note = (f"calibration {1000 * (time.perf_counter() - t):.0f} ms, held-out R2 {metrics.get('r2', float('nan')):.2f}"
            f", AUROC {metrics.get('auroc', float('nan')):.2f}")
    return (lambda: sim.predict(model, ro)), note


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--engine", default="prune-2")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--sft-steps", type=int, default=100)
    ap.add_argument("--simulator", action="store_true", help="also time the inference simulator's predict")
    ap.add_argument("--replay", action="store_true", help="also time routing replay (recording + replayed passes)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    # --- setup: tiny model, brief SFT ---------------------------------------------------------------------
    cfg = parse_run_config({})
    model, tok = build_model(cfg.model)
    ms = describe(model)
    examples = [parse_line(r, f"bench:{i}") for i, r in enumerate(generate(TASK, 0, 256, 0))]
    encoded = [encode_example(tok, ex, cfg.model.max_seq_len) for ex in examples]
    sft = train_sft(model, encoded, tok.pad_token_id, replace(cfg.train, local_steps=args.sft_steps),
                    cfg.routing, ms.num_experts, ms.top_k, None, seed=0)
    s = sft.summary()
    print(f"SFT: {sft.steps} steps in {sft.time_s:.2f} s (task loss {s['loss_first']:.3f} -> {s['loss_last']:.3f})")

    # --- engine and one fixed batch of rollouts --------------------------------------------------------------
    gcfg = RLConfig(prompts_per_step=args.prompts, group_size=args.group, max_new_tokens=args.tokens,
                    engine=args.engine, minibatches=1)
    prompts = examples[:args.prompts]
    model.eval()
    t = time.perf_counter()
    engine = build_engine(model, tok, examples, gcfg)
    t_engine = time.perf_counter() - t
    prompt_ids = [encode_prompt(tok, ex, 256) for ex in prompts]
    prompt_texts = [ex.prompt_messages[-1]["content"] if ex.prompt_messages else "" for ex in prompts]

    def rollout(record: bool = False):
        return generate_rollouts(engine, tok, prompt_ids, args.group, args.tokens, gcfg.temperature, seed=0,
                                 record_routes=record)

    ro = rollout(record=args.replay)  # recording changes no sample or log-prob; it only adds engine_routes
    rows = ro.prompt_index.tolist()
    rewards = torch.tensor(compute_rewards(gcfg.reward, ro.texts, [prompts[i].answer for i in rows], TASK,
                                           [prompt_texts[i] for i in rows]), dtype=torch.float32)  # [N]
    adv = group_advantages(rewards, args.group)  # [N]
    mask = ro.response_mask  # [N, T]
    ones = mask.to(torch.float32)  # [N, T] plain GRPO: w = 1 on valid tokens

    # --- the update, snapshot / restore -----------------------------------------------------------------------
    loss_fn = get_policy_loss(gcfg.policy_loss)
    params = [p for p in model.parameters() if p.requires_grad]
    opt, _ = build_optimizer(model, optimizer_config(gcfg, cfg.train.grad_clip))

    def update(logp_old: torch.Tensor, weights: torch.Tensor, replay: bool = False) -> float:
        model.train()
        logp_new = train_logprobs(model, ro, grad=True, replay=replay)  # [N, T]
        loss, _ = loss_fn(logp_new, logp_old, adv, mask, weights, clip_eps=gcfg.clip_eps)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.train.grad_clip)
        opt.step()
        model.eval()
        return float(loss.detach())

    def recompute(replay: bool = False) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
        model.eval()
        logp_old = train_logprobs(model, ro, grad=False, replay=replay)  # [N, T]
        w, st = mismatch_weights(logp_old, ro.logp_infer, mask, gcfg.correction_level, "mask", gcfg.icepop_low,
                                 gcfg.icepop_high)
        return logp_old, w, st

    snap_model = copy.deepcopy(model.state_dict())  # theta_old: the weights the engine was synced to
    update(ro.logp_infer, ones)  # one throwaway update so that the AdamW snapshot holds its moment state
    snap_opt = copy.deepcopy(opt.state_dict())

    def restore() -> None:
        model.load_state_dict(copy.deepcopy(snap_model))
        opt.load_state_dict(copy.deepcopy(snap_opt))

    restore()
    _, _, mstats = recompute()

    def plain() -> None:
        update(ro.logp_infer, ones)

    def icepop() -> None:
        logp_old, w, _ = recompute()
        update(logp_old, w)

    def icepop_reuse() -> None:  # on-policy reuse (rl.reuse-logprobs): the update forward is the recompute
        model.train()
        logp_new = train_logprobs(model, ro, grad=True)  # [N, T] at theta_old
        logp_old = logp_new.detach()
        w, _ = mismatch_weights(logp_old, ro.logp_infer, mask, gcfg.correction_level, "mask", gcfg.icepop_low,
                                gcfg.icepop_high)
        loss, _ = loss_fn(logp_new, logp_old, adv, mask, w, clip_eps=gcfg.clip_eps)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.train.grad_clip)
        opt.step()
        model.eval()

    def recompute_only() -> None:
        recompute()

    arms: dict[str, Callable[[], object]] = {"plain GRPO": plain, "GRPO + IcePop": icepop,
                                             "GRPO + IcePop, reused logp_old": icepop_reuse,
                                             "  recompute + weights only": recompute_only,
                                             "rollout generation": rollout}
    if args.replay:
        def icepop_replay() -> None:
            logp_old, w, _ = recompute(replay=True)
            update(logp_old, w, replay=True)

        arms["GRPO + IcePop + replay"] = icepop_replay
        arms["rollout generation, routes recorded"] = lambda: rollout(record=True)
        restore()
        _, _, rstats = recompute(replay=True)
    sim_note = ""
    if args.simulator:
        restore()
        fn, sim_note = simulator_arm(model, engine, ro)
        if fn is not None:
            arms["  simulator predict"] = fn
    times: dict[str, list[float]] = {k: [] for k in arms}
    for i in range(args.warmup + args.iters):
        for name, fn in arms.items():  # interleaved
            restore()  # outside the timed region; every arm starts from the same theta
            t = time.perf_counter()
            fn()
            if i >= args.warmup:
                times[name].append(time.perf_counter() - t)
    restore()

    # --- report -----------------------------------------------------------------------------------------------
    med = {k: statistics.median(v) for k, v in times.items()}
    base = med["plain GRPO"]
    n_tok = int(mask.sum())
    print(f"model {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params, engine {args.engine} "
          f"(built in {t_engine * 1000:.0f} ms), rollouts {args.prompts} prompts x {args.group} samples x "
          f"{args.tokens} tokens ({ro.num_rollouts} x {ro.sequences.shape[1]} seq, {n_tok} valid response tokens), "
          f"{args.threads} threads, {args.iters} iters (+{args.warmup} warmup)")
    print(f"IcePop masked share {mstats['icepop/masked_frac']:.3f}, mean |dlogp| "
          f"{mstats['mismatch/logp_abs_diff_mean']:.4f}, reward mean {float(rewards.mean()):.3f}")
    print(f"{'arm':30s} {'median ms':>10s} {'ratio vs plain':>15s}")
    for name in arms:
        print(f"{name:30s} {med[name] * 1000:10.2f} {med[name] / base:15.3f}")
    rec = med["  recompute + weights only"]
    gen = med["rollout generation"]
    it_plain, it_ice = gen + base, gen + med["GRPO + IcePop"]
    it_reuse = gen + med["GRPO + IcePop, reused logp_old"]
    print(f"iteration (rollout + update): plain {it_plain * 1000:.2f} ms, IcePop {it_ice * 1000:.2f} ms, "
          f"ratio {it_ice / it_plain:.3f}; IcePop with reused logp_old {it_reuse * 1000:.2f} ms, "
          f"ratio {it_reuse / it_plain:.3f}")
    print(f"recompute share: {rec / med['GRPO + IcePop']:.1%} of the IcePop update, {rec / it_ice:.1%} of an IcePop "
          f"iteration; rollout share {gen / it_ice:.1%} of an IcePop iteration")
    if "  simulator predict" in med:
        sp = med["  simulator predict"]
        print(f"simulator ({sim_note}): predict {sp * 1000:.2f} ms per batch vs recompute {rec * 1000:.2f} ms "
              f"(ratio {sp / rec:.3f})")
    elif args.simulator:
        print(f"simulator arm skipped: {sim_note}")
    if args.replay:
        print(f"routing replay: mean |dlogp| {mstats['mismatch/logp_abs_diff_mean']:.4f} -> "
              f"{rstats['mismatch/logp_abs_diff_mean']:.4f}, IcePop masked share {mstats['icepop/masked_frac']:.3f} "
              f"-> {rstats['icepop/masked_frac']:.3f}; update ratio vs IcePop "
              f"{med['GRPO + IcePop + replay'] / med['GRPO + IcePop']:.3f}, generation ratio with recording "
              f"{med['rollout generation, routes recorded'] / med['rollout generation']:.3f}")
    else:
        print("simulator arm skipped (pass --simulator to try distmoe.rl.simulator)")


if __name__ == "__main__":
    main()
