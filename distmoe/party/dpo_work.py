"""What a party does in a ``dpo`` round: local DPO on its preference pairs of the task; the update travels like an
SFT update (the same ``SftInstruction`` with ``objective = "dpo"``, the same ``model-update`` release, clipping,
DP noise and secure aggregation).

The reference is the instruction's ``ref_weights`` (the global model at the start of the ``dpo`` phase, with
``dpo.reference = phase``) or, when absent, the global weights as received. Its log-probs on every training pair are
computed once, before the first step (``distmoe.rl.dpo.reference_logps``: by the trainer, or by the inference
engine ``dpo.reference-engine`` with IcePop pair masking); the model then starts from the global weights. A pair
whose chosen or rejected answer does not fit ``model.max-seq-len`` is left out (``template.encode_fitting``; the
count goes to the party's own log); with no training pair left the party takes part with weight 0, as one without
data for the task.

The update's metric keys are the SFT ones (``task_loss`` = the DPO loss) with ``dpo_margin`` and ``dpo_acc``, the
round's mean log-ratio margin and preference accuracy (released as clipped training-metric slots of the secure sum,
``distmoe.privacy.train_metrics``). The other DPO figures (first/last margins, masked pairs, and the held-out pairs'
margin and preference accuracy before and after the round) are returned separately, for this party's own metrics
log only: nothing of them leaves.

Must not: import ``flwr``, read another party's directory, or put anything but the update and its metric keys
(``TRAIN_METRIC_KEYS``) into the wire payload.
"""

from __future__ import annotations

import numpy as np
import torch

from distmoe.config import NodeConfig, RunConfig
from distmoe.data.template import encode_example, encode_fitting
from distmoe.model.build import describe
from distmoe.model.trainable import trainable_state
from distmoe.party.work import (
    Loaded,
    PartyError,
    anchor_of,
    left_out_note,
    load_data,
    party_seed,
    prepare_model,
    progress,
    stability,
)
from distmoe.rl.dpo import preference_margins, reference_logps, train_dpo
from distmoe.wire.schema import TRAIN_METRIC_KEYS, ModelUpdate, SftInstruction


def _margin_stats(m: torch.Tensor, prefix: str) -> dict[str, float]:
    """Mean ``s(y_w) - s(y_l)`` and the share of pairs with it > 0, over ``m`` ``[N]``."""
    if m.numel() == 0:
        return {f"{prefix}_margin": float("nan"), f"{prefix}_acc": float("nan")}
    return {f"{prefix}_margin": float(m.mean()), f"{prefix}_acc": float((m > 0).float().mean())}


def _mean(xs: list[float]) -> float:
    """The mean of the finite values (NaN when there is none)."""
    xs = [x for x in xs if x == x]
    return float(sum(xs) / len(xs)) if xs else float("nan")


def run_dpo(cfg: RunConfig, node: NodeConfig, instr: SftInstruction, loaded: Loaded | None = None
            ) -> tuple[ModelUpdate, dict[str, float]]:
    """``(update, DPO figures for the party's own log)`` of one ``dpo`` round on ``instr.task``."""
    torch.set_num_threads(cfg.train.threads)
    data = load_data(cfg, node)
    zero_update = ModelUpdate(party=node.party, num_examples=0, metrics={k: float("nan") for k in TRAIN_METRIC_KEYS},
                              delta={k: np.zeros_like(v, dtype=np.float32) for k, v in instr.weights.items()})
    if not data.has(instr.task):  # no data for the task: contributes nothing (weight 0)
        return zero_update, {}
    if not data.is_preference(instr.task):
        raise PartyError(f"party {node.party}: task {instr.task!r} holds no preference pairs (a dpo phase needs "
                         "lines {\"prompt\", \"chosen\", \"rejected\"}; docs/operations.md, Data)")
    ref_w = instr.ref_weights if instr.ref_weights is not None else instr.weights
    model, tok, spec = prepare_model(cfg, node, ref_w, instr.base_hash, loaded)
    ms = describe(model)
    n_len, pad, bs = cfg.model.max_seq_len, tok.pad_token_id, cfg.dpo.pairs_per_step

    def pair(tok, ex, n):  # (chosen, rejected) as (input_ids, labels)
        return encode_example(tok, ex, n), encode_example(tok, ex.rejected_example(), n)

    _, pairs, left_train = encode_fitting(tok, data.train(instr.task), n_len, pair)  # a pair with an answer too
    _, held, left_held = encode_fitting(tok, data.heldout(instr.task), n_len, pair)  # long is left out, not refused
    left_out = left_train + left_held
    if not pairs:
        left_out_note(node, instr, left_out, "preference pairs")
        return zero_update, {}  # no pair fits model.max-seq-len: as a party without data (no size-telling code)
    ref = reference_logps(model, pairs, pad, bs, engine=cfg.dpo.reference_engine, low=cfg.rl.icepop_low,
                          high=cfg.rl.icepop_high)
    local = _margin_stats(preference_margins(model, held, pad, bs), "dpo_heldout_ref")
    if instr.ref_weights is not None:  # start from the global weights (the cached base: only the weights load)
        model, tok, spec = prepare_model(cfg, node, instr.weights, instr.base_hash, loaded)
    local.update(_margin_stats(preference_margins(model, held, pad, bs), "dpo_heldout_before"))
    anchor = anchor_of(instr, ms)
    before = {k: torch.from_numpy(np.asarray(v, dtype=np.float32)) for k, v in instr.weights.items()}
    res = train_dpo(model, pairs, ref, pad, node.train(cfg.train), cfg.dpo, cfg.routing, ms.num_experts, ms.top_k,
                    anchor, seed=party_seed(instr.seed, node.party))
    stability(node, instr, res.nonfinite)  # names of tensors with non-finite gradients: this party's log only
    left_out_note(node, instr, left_out, "preference pairs", keep=True)  # after stability: it starts the notes
    local.update(_margin_stats(preference_margins(model, held, pad, bs), "dpo_heldout_after"))
    after = trainable_state(model)
    delta = {k: (after[k] - before[k]).numpy() for k in spec.keys}
    s = res.summary()
    metrics = {k: float(s.get(k, float("nan"))) for k in TRAIN_METRIC_KEYS}
    metrics.update(dpo_margin=_mean(res.margins), dpo_acc=_mean(res.accs))  # the round's means: released figures
    local.update({k: float(v) for k, v in s.items() if k.startswith("dpo_")})
    progress(node, f"round {instr.round} dpo:{instr.task}: loss {metrics['loss_first']:.4f} -> "
             f"{metrics['loss_last']:.4f} over {int(metrics['steps'])} steps ({res.num_pairs} pairs), held-out "
             f"margin {local['dpo_heldout_before_margin']:.3f} -> {local['dpo_heldout_after_margin']:.3f}"
             + (f", {s['dpo_ref_masked_frac']:.3f} of pairs masked" if cfg.dpo.reference_engine else ""))
    return ModelUpdate(party=node.party, delta=delta, num_examples=res.num_pairs, metrics=metrics), local
