"""Local DPO at a party: the loss, the reference log-probs (trainer or inference engine, IcePop-masked) and
the loop of optimizer steps.

Paper: Rafailov et al. 2023, "Direct Preference Optimization: Your Language Model is Secretly a Reward
Model" (https://arxiv.org/abs/2305.18290), Eq. 7. With ``B`` pairs ``(x, y_w, y_l)`` of a step::

    s(y|x)   = sum over the completion tokens t of y: log pi(y_t | x, y_<t)          [B]  (sequence log-prob;
                                                                                             prompt tokens excluded)
    h        = beta * [(s_theta(y_w) - s_ref(y_w)) - (s_theta(y_l) - s_ref(y_l))]    [B]
    L_dpo    = (1 / B) * sum_i m_i * (-log sigmoid(h_i))                             []   (m_i = 1, or 0 for a pair
                                                                                             the IcePop mask drops)
    loss     = L_dpo + routing.aux-loss-coef * aux + routing.anchor-kl-coef * anchor KL   (as in SFT)

``s_ref`` is computed once per round, before the first step, with no gradient: by the trainer itself on the
reference weights (exact, the default), or by an inference engine (``distmoe.rl.engines``, ``dpo.reference-engine``).
The engine's reference is trusted only where it agrees with the trainer's: per token of both answers of a pair,
``k = pi_ref_train / pi_ref_engine`` (``distmoe.rl.losses.mismatch_weights``, IcePop's bounds), and a pair with any
token outside ``[rl.icepop-low, rl.icepop-high]`` gets ``m_i = 0``. Kept pairs are not reweighted by ``k``: the
pairs are fixed data, not samples from the engine, so there is no sampling distribution to correct; only the
reference is suspect. This is our adaptation of IcePop to DPO (``docs/algorithms.md``, DPO); the normaliser counts
every pair of the step, masked or not, as IcePop's counts every token.

Why not TRL's ``DPOTrainer``: it is a whole ``transformers.Trainer`` that owns the loop, the data collation, the
optimiser and the reference model, while here the party's loop must own them (gradient clipping, skipped non-finite
steps, the router aux and anchor terms, the update that is clipped, noised and masked for secure aggregation, the
party's ledgers); the loss itself is the few lines of ``dpo_loss`` (``trl`` is not a dependency either).

Must not: load data files, talk to the wire, or keep a second copy of the policy beyond the inference engine's
(the trainer reference is a set of log-probs computed before training, not a model).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from distmoe.config import DPOConfig, RoutingConfig, TrainConfig
from distmoe.data.template import batch_iterator, collate
from distmoe.model.device import autocast_for, base_dtype, device_of, to_device
from distmoe.model.router import forward_with_router
from distmoe.rl.engines import InferenceEngine
from distmoe.rl.losses import mismatch_weights
from distmoe.train.optim import build_optimizer
from distmoe.train.sft import micro_slices, router_terms, set_checkpointing
from distmoe.train.stability import NonFinite, guard_gradients

Encoded = tuple[list[int], list[int]]  # (input_ids, labels), labels -100 off the completion
Pair = tuple[Encoded, Encoded]  # (chosen, rejected)


def token_logps(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, S, V]`` logits, ``[B, S]`` labels (-100 = not scored) -> ``(logp [B, S], mask [B, S])``: position ``t``
    holds ``log p(labels[t + 1] | ...)``, 0 where not scored (the labels are shifted, as in ``causal_lm_loss``)."""
    nxt = F.pad(labels[:, 1:], (0, 1), value=-100)  # [B, S]
    mask = nxt != -100  # [B, S]
    nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), nxt.clamp(min=0).reshape(-1),
                          reduction="none").reshape(nxt.shape)  # [B, S]
    return torch.where(mask, -nll, torch.zeros_like(nll)), mask


def dpo_loss(pol_w: torch.Tensor, pol_l: torch.Tensor, ref_w: torch.Tensor, ref_l: torch.Tensor, beta: float,
             keep: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Rafailov et al. Eq. 7 on sequence log-probs, all ``[B]``: ``(loss [], stats)``. ``keep`` ``[B]`` (bool or 0/1):
    the pairs that count (the rest contribute 0; the mean is still over all ``B``). The reference is detached.

    stats: ``dpo_loss``; ``margin`` = mean ``h / beta`` (the policy's log-ratio margin over the reference);
    ``pref_acc`` = share of pairs with ``h > 0``; ``reward_chosen`` / ``reward_rejected`` = mean
    ``beta (s_theta - s_ref)`` of each answer (kept pairs only)."""
    if not (pol_w.shape == pol_l.shape == ref_w.shape == ref_l.shape) or pol_w.dim() != 1:
        shapes = [tuple(t.shape) for t in (pol_w, pol_l, ref_w, ref_l)]
        raise ValueError(f"dpo_loss: expected four [B] tensors, got {shapes}")
    if beta <= 0:
        raise ValueError(f"dpo_loss: beta must be > 0, got {beta}")
    rw = beta * (pol_w - ref_w.detach())  # [B] implicit reward of the chosen answer
    rl = beta * (pol_l - ref_l.detach())  # [B]
    h = rw - rl  # [B]
    m = torch.ones_like(h) if keep is None else keep.to(h.dtype)  # [B]
    loss = (m * -F.logsigmoid(h)).sum() / h.shape[0]  # []
    with torch.no_grad():
        n = float(m.sum())
        kept = m > 0
        stats = {"dpo_loss": float(loss), "kept_frac": n / h.shape[0],
                 "margin": float((h[kept] / beta).mean()) if n else math.nan,
                 "pref_acc": float((h[kept] > 0).float().mean()) if n else math.nan,
                 "reward_chosen": float(rw[kept].mean()) if n else math.nan,
                 "reward_rejected": float(rl[kept].mean()) if n else math.nan}
    return loss, stats


def _pair_batch(pairs: list[Pair], pad_id: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Chosen then rejected of every pair in one right-padded batch of ``2B`` rows."""
    return to_device(collate([p[0] for p in pairs] + [p[1] for p in pairs], pad_id), device)


@torch.no_grad()
def _seq_token_logps(model: nn.Module, pairs: list[Pair], pad_id: int, batch_size: int
                     ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per pair, on CPU: ``(logp_w [Tw], logp_l [Tl])`` of the completion tokens and the sums, in order."""
    dev = device_of(model)
    out = []
    for i in range(0, len(pairs), batch_size):
        chunk = pairs[i:i + batch_size]
        batch = _pair_batch(chunk, pad_id, dev)
        with autocast_for(model):
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
        lp, mask = token_logps(logits, batch["labels"])  # [2B, S]
        lp, mask = lp.float().cpu(), mask.cpu()
        b = len(chunk)
        for j in range(b):
            w, lo = lp[j][mask[j]], lp[b + j][mask[b + j]]  # [Tw], [Tl]
            out.append((w, lo, w.sum(), lo.sum()))
    return out


@dataclass
class Reference:
    """The reference of one round: sequence log-probs per pair and which pairs count."""

    chosen: torch.Tensor  # [N]
    rejected: torch.Tensor  # [N]
    keep: torch.Tensor  # [N] bool
    stats: dict[str, float] = field(default_factory=dict)


def pair_keep(train: list[tuple[torch.Tensor, torch.Tensor]], infer: list[tuple[torch.Tensor, torch.Tensor]],
              low: float, high: float) -> tuple[torch.Tensor, dict[str, float]]:
    """IcePop on pairs: per pair the completion-token log-probs ``(chosen [Tw], rejected [Tl])`` of the reference by
    the trainer and by the engine -> ``(keep [N] bool, stats)``; a pair is kept iff every token of both answers has
    ``low <= k <= high``, ``k = exp(clamp(logp_train - logp_engine, -20, 20))`` (``mismatch_weights``, mode mask)."""
    n = len(train)
    if len(infer) != n:
        raise ValueError(f"pair_keep: {n} trainer pairs but {len(infer)} engine pairs")
    if n == 0:
        return torch.zeros(0, dtype=torch.bool), {"ref_masked_frac": 0.0}
    seqs_t = [x for t in train for x in t]  # 2N sequences: chosen, rejected of each pair
    seqs_e = [x for t in infer for x in t]
    width = max(1, max(len(x) for x in seqs_t))
    lt = torch.zeros(2 * n, width)  # [2N, T]
    le = torch.zeros(2 * n, width)  # [2N, T]
    mask = torch.zeros(2 * n, width, dtype=torch.bool)  # [2N, T]
    for r, (a, b) in enumerate(zip(seqs_t, seqs_e, strict=True)):
        if len(a) != len(b):
            raise ValueError(f"pair_keep: sequence {r} has {len(a)} trainer and {len(b)} engine tokens")
        lt[r, :len(a)], le[r, :len(b)], mask[r, :len(a)] = a, b, True
    w, st = mismatch_weights(lt, le, mask, level="token", mode="mask", low=low, high=high)  # [2N, T]
    seq_ok = ((w > 0) | ~mask).all(dim=1)  # [2N]: no valid token masked
    keep = seq_ok[0::2] & seq_ok[1::2]  # [N]
    return keep, {"ref_masked_frac": 1.0 - float(keep.float().mean()),
                  "ref_logp_diff_mean": st["mismatch/logp_abs_diff_mean"],
                  "ref_logp_diff_max": st["mismatch/logp_abs_diff_max"], "ref_k3": st["mismatch/kl_k3"]}


def reference_logps(model: nn.Module, pairs: list[Pair], pad_id: int, batch_size: int, engine: str = "",
                    low: float = 0.5, high: float = 5.0, calibration_batches: int = 4) -> Reference:
    """The reference sequence log-probs of every pair under ``model``'s current weights (the reference).

    ``engine == ""``: the trainer's own (exact; every pair kept). Otherwise an inference engine of that profile
    (``distmoe.rl.engines.InferenceEngine``, a view over the policy's weights; ``prune-k`` measures expert usage
    on the first ``calibration_batches`` batches of pairs) computes them, and a pair is kept iff every completion
    token of both answers has ``low <= k <= high``, ``k = exp(logp_ref_train - logp_ref_engine)`` (the module
    docstring)."""
    model.eval()
    train = _seq_token_logps(model, pairs, pad_id, batch_size)
    n = len(pairs)
    if not engine:
        return Reference(torch.stack([t[2] for t in train]), torch.stack([t[3] for t in train]),
                         torch.ones(n, dtype=torch.bool), {"ref_masked_frac": 0.0})
    calib = [collate([p[0] for p in pairs[i:i + batch_size]], pad_id)
             for i in range(0, min(n, batch_size * calibration_batches), batch_size)]
    eng = InferenceEngine(model, engine, calibration=calib)
    infer = _seq_token_logps(eng.model, pairs, pad_id, batch_size)
    keep, stats = pair_keep([t[:2] for t in train], [t[:2] for t in infer], low, high)
    del eng
    return Reference(torch.stack([t[2] for t in infer]), torch.stack([t[3] for t in infer]), keep, stats)


def preference_margins(model: nn.Module, pairs: list[Pair], pad_id: int, batch_size: int) -> torch.Tensor:
    """``[N]`` ``s(y_w) - s(y_l)`` of each pair under ``model`` (> 0: the model prefers the chosen answer)."""
    model.eval()
    out = _seq_token_logps(model, pairs, pad_id, batch_size)
    return torch.stack([t[2] - t[3] for t in out]) if out else torch.zeros(0)


@dataclass
class DPOResult:
    steps: int
    skipped_steps: int
    num_pairs: int
    losses: list[float] = field(default_factory=list)  # total loss per applied step
    dpo_losses: list[float] = field(default_factory=list)
    aux_losses: list[float] = field(default_factory=list)
    anchor_kls: list[float] = field(default_factory=list)
    margins: list[float] = field(default_factory=list)  # mean h / beta per applied step
    accs: list[float] = field(default_factory=list)
    ref_stats: dict[str, float] = field(default_factory=dict)
    time_s: float = 0.0
    nonfinite: NonFinite = field(default_factory=NonFinite)  # what the skipped steps' gradients were

    def summary(self) -> dict[str, float]:
        """The SFT summary's keys (``task_loss`` = the DPO loss) plus the DPO figures, prefixed ``dpo_``."""
        mean = lambda xs: float(sum(xs) / len(xs)) if xs else float("nan")  # noqa: E731
        first = lambda xs: xs[0] if xs else float("nan")  # noqa: E731
        last = lambda xs: xs[-1] if xs else float("nan")  # noqa: E731
        return {"loss": mean(self.losses), "task_loss": mean(self.dpo_losses), "aux_loss": mean(self.aux_losses),
                "anchor_kl": mean(self.anchor_kls), "loss_first": first(self.dpo_losses),
                "loss_last": last(self.dpo_losses), "steps": self.steps, "skipped_steps": self.skipped_steps,
                "num_examples": self.num_pairs, "time_s": self.time_s,
                "dpo_margin_first": first(self.margins), "dpo_margin_last": last(self.margins),
                "dpo_acc_first": first(self.accs), "dpo_acc_last": last(self.accs),
                **{f"dpo_{k}": float(v) for k, v in self.ref_stats.items()}}


def train_dpo(model: nn.Module, pairs: list[Pair], ref: Reference, pad_id: int, train: TrainConfig, dpo: DPOConfig,
              routing: RoutingConfig, num_experts: int, top_k: int, anchor: torch.Tensor | None, seed: int
              ) -> DPOResult:
    """``dpo.steps`` optimizer steps of ``dpo.pairs-per-step`` pairs on ``pairs`` against ``ref``.

    Each step runs as micro-batches of ``train.micro-batch-size`` pairs (0 = all) with gradient accumulation, each
    weighted by its share of the step's pairs, so the DPO gradient equals the whole step's exactly; the aux loss
    and anchor KL are averaged with the same weights. Gradient-norm clipping at ``train.grad-clip``; a step whose
    loss or gradient is not finite is skipped and counted (as in SFT)."""
    if not pairs:
        raise ValueError("train_dpo: no preference pairs")
    if len(ref.chosen) != len(pairs):
        raise ValueError(f"train_dpo: {len(ref.chosen)} reference log-probs for {len(pairs)} pairs")
    torch.manual_seed(seed)
    device = device_of(model)
    set_checkpointing(model, train.gradient_checkpointing)
    model.train()
    opt, sched = build_optimizer(model, train)
    scaler = torch.amp.GradScaler(device.type, enabled=base_dtype(model) == torch.float16)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    anchor = anchor.to(device) if anchor is not None else None
    res = DPOResult(steps=0, skipped_steps=0, num_pairs=len(pairs), ref_stats=dict(ref.stats))
    t0 = time.perf_counter()
    for idx in batch_iterator(list(range(len(pairs))), dpo.pairs_per_step, dpo.steps, seed):
        opt.zero_grad(set_to_none=True)
        total, parts, finite = 0.0, {}, True
        for sl in micro_slices(len(idx), train.micro_batch_size):
            mb = idx[sl]
            weight = len(mb) / len(idx)
            batch = _pair_batch([pairs[j] for j in mb], pad_id, device)
            out = forward_with_router(model, batch["input_ids"], batch["attention_mask"])
            lp, _ = token_logps(out.logits, batch["labels"])  # [2b, S]
            seq = lp.sum(dim=1)  # [2b]
            b = len(mb)
            ids = torch.tensor(mb)
            loss, st = dpo_loss(seq[:b], seq[b:], ref.chosen[ids].to(device), ref.rejected[ids].to(device), dpo.beta,
                                ref.keep[ids].to(device))
            step_parts = {"dpo_loss": st["dpo_loss"], "margin": st["margin"], "pref_acc": st["pref_acc"]}
            loss = router_terms(loss, out.router_logits, batch["attention_mask"], routing, num_experts, top_k, anchor,
                                step_parts)
            if not math.isfinite(float(loss.detach())):
                finite = False
                break
            scaler.scale(loss * weight).backward()
            total += float(loss.detach()) * weight
            for k, v in step_parts.items():
                if math.isfinite(v):
                    parts[k] = parts.get(k, 0.0) + v * weight
        if not finite:
            res.skipped_steps += 1
            res.nonfinite.add(["<loss>"])
            opt.zero_grad(set_to_none=True)
            continue
        scaler.unscale_(opt)
        # the SFT loop's guard (train/stability.py): a NaN/Inf gradient skips the step, naming the tensors;
        # winsorisation (train.winsorize) and the norm clip otherwise
        _, bad = guard_gradients(named, train.grad_clip, train.winsorize)
        if bad is not None:
            res.skipped_steps += 1
            res.nonfinite.add(bad)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            continue
        scaler.step(opt)
        scaler.update()
        sched.step()
        res.steps += 1
        res.losses.append(total)
        res.dpo_losses.append(parts["dpo_loss"])
        if "margin" in parts:  # absent when every pair of the step was masked
            res.margins.append(parts["margin"])
            res.accs.append(parts["pref_acc"])
        if "aux_loss" in parts:
            res.aux_losses.append(parts["aux_loss"])
        if "anchor_kl" in parts:
            res.anchor_kls.append(parts["anchor_kl"])
    model.eval()
    res.time_s = time.perf_counter() - t0
    return res
