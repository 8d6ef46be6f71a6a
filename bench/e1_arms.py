"""The arms of the continual-learning instrument (``bench/retention_e1.py``): how each arm sets up task B from the
shared pre-B state, with the library's own retention code (the same calls a party makes, ``party/work.py`` and
``party/retention.py``), so what is measured is the product's mechanism, not a bench re-implementation.

A's anchor ``a: [L, E]`` is what the coordinator builds from task A's ``stats:`` phase, without the DP noise
(this instrument is centralised): the sum over A's training sequences of each sequence's mean routing
(``routing.stats.router_stats``), row-normalised (``routing.anchor.build_anchor``). Then, per arm:

* ``none``: plain SFT on B.
* ``anchor-<c>``: the anchor KL of ``routing/losses.py`` against ``a``, ``routing.anchor-granularity = "batch"``
  (the default), ``routing.anchor-kl-coef = c`` for c in 0.5 (the default), 5, 50 (the dose-response);
  ``anchor-token``: the same at ``"token"`` granularity, c = 0.5.
* ``protect-<s>``: expert protection (``routing.retention.protected_experts``: the experts with more than
  ``retention.protect-mass = 0.2`` of A's anchor mass in a layer, the threshold the federated bench uses, above the
  uniform 1/8) with ``retention.protect-lr-scale = s`` for s in 0 (frozen), 0.1, 0.3 (``train/retention.py``).
* ``expand`` / ``expand+anchor``: dynamic expert expansion (``model/expand.py``, ``retention.expand-experts = 2``):
  every MoE layer grows 8 -> 10 experts, copies of the two with the most mass in ``a``, and the 8 earlier experts
  and their router rows are frozen during B; ``+anchor`` adds the batch anchor at 0.5 (``a`` zero-padded to 10).
* ``distill``: LwF on B's batches against the pre-B model, weight 1, tau 2 (``retention.distill-*``).
* Stage 0's arms: ``router-frozen`` (every router weight frozen; read out also with A's pre-B routing forced),
  ``experts-frozen`` (the expert oracle: per layer the fewest experts holding >= half of A's top-k assignments,
  protection at scale 0), ``replay`` (B's batches drawn from B's and A's training items, 1:1).

Regimes (``--trainable``, ``REGIMES``): what trains during A and B. ``router+experts`` (primary, the default: the
backbone frozen after the warm base, so forgetting must go through routers and experts; every arm above as
written) and ``all`` (secondary: every parameter trains during A and B, ``model.trainable = "all"``). In ``all``
each arm freezes or constrains only what it names, and everything else, the backbone (embeddings, attention,
norms, the head) included, trains:

* ``none``, ``replay``: plain SFT of every parameter (replay on B's and A's items, 1:1).
* ``router-frozen``: only the routers' weights frozen. Their inputs (the hidden states) still move with the
  backbone, so A's routing is not kept by this arm alone; ``router-frozen+forced`` replaces every router's output
  (logits, weights, chosen experts) on A's evaluation with the pre-B model's: A's routing exactly as before B,
  whatever the backbone did (the routing oracle); the experts' inputs and the experts themselves still change.
* ``experts-frozen``: only the oracle's experts' slices of the expert tensors frozen (protection at scale 0);
  their inputs move with the backbone, so this bounds what keeping A's experts' weights can buy, not A's
  expert outputs.
* ``anchor-*``, ``anchor-token``: the anchor KL added to the loss; nothing frozen.
* ``protect-*``: the update of A's protected experts' slices scaled by ``s``; nothing else constrained.
* ``expand``, ``expand+anchor``: the 8 earlier experts and their router rows frozen; the 2 new experts, the new
  router rows and the backbone train.
* ``distill``: the reference is the whole pre-B model (in this regime the pre-B state holds every parameter).

Must not: train, evaluate or write rows (the bench does), or change the library.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from distmoe.config.routing_keys import RoutingConfig
from distmoe.model.build import describe, router_modules
from distmoe.model.expand import default_sources, expand_experts, frozen_set, pad_anchor
from distmoe.model.trainable import apply_trainable
from distmoe.routing.anchor import AnchorVersion, build_anchor
from distmoe.routing.retention import protected_experts
from distmoe.routing.stats import router_stats
from distmoe.train.retention import Retention

REGIMES = ("router+experts", "all")  # model.trainable during A and B; the first is the default (rows untagged)
STAGE0 = ("none", "router-frozen", "experts-frozen", "replay", "distill")
ANCHOR_COEFS = {"anchor-0.5": 0.5, "anchor-5": 5.0, "anchor-50": 50.0}
TOKEN_COEF = 0.5
PROTECT_SCALES = {"protect-0": 0.0, "protect-0.1": 0.1, "protect-0.3": 0.3}
PROTECT_MASS = 0.2
EXPAND_K = 2
DISTILL = {"distill_weight": 1.0, "distill_temperature": 2.0}
# Stage 1, in the pre-registered priority order (the order a seed runs them in); the oracles and replay last, for a
# run that can afford them (the pre-registered reduced run did not: their Stage 0 rows are quoted beside)
STAGE1 = ("none", *ANCHOR_COEFS, *PROTECT_SCALES, "expand", "expand+anchor", "distill", "anchor-token",
          "router-frozen", "experts-frozen", "replay")
ARMS = tuple(dict.fromkeys(STAGE0 + STAGE1))


@dataclass
class PreB:
    """What the arms read of the shared pre-B state."""

    state: dict[str, torch.Tensor]  # the trainable tensors after A
    a_train: list  # encoded A training items
    b_train: list  # encoded B training items
    oracle_experts: torch.Tensor  # [L, E] bool: the expert oracle's set
    anchor: torch.Tensor  # [L, E]: A's anchor


@dataclass
class Branch:
    """How one arm trains B: its data, routing config, anchor and retention context."""

    data: list
    routing: RoutingConfig
    anchor: torch.Tensor | None = None
    retention: Retention | None = None
    frozen: list[torch.nn.Parameter] = field(default_factory=list)  # parameters frozen for this arm only


def task_anchor(model: torch.nn.Module, batches: list[dict[str, torch.Tensor]]) -> torch.Tensor:
    """``[L, E]``: the row-normalised sum of per-sequence mean routing over ``batches`` (a task's anchor, no noise)."""
    spec = describe(model)
    summed, n = router_stats(model, batches)  # [L, E] float64, sequences
    meta = AnchorVersion(version=1, round=0, source_checkpoint="", task="A", num_sequences=float(n),
                         router_spec={"moe_layers": list(spec.moe_layers), "num_experts": spec.num_experts})
    return torch.from_numpy(build_anchor(summed, meta).probs)


def protected_count(pre: PreB) -> int:
    """How many experts (over all MoE layers) the ``protect-*`` arms protect."""
    return int(protected_experts(pre.anchor[None], PROTECT_MASS).sum())


def regime_model(model: torch.nn.Module, model_cfg, regime: str) -> torch.nn.Module:
    """``model`` with ``model.trainable = regime`` applied (``distmoe.model.trainable.apply_trainable``); ``ValueError``
    naming an unknown regime."""
    if regime not in REGIMES:
        raise ValueError(f"unknown regime (--trainable) {regime!r}; known: {', '.join(REGIMES)}")
    return apply_trainable(model, dataclasses.replace(model_cfg, trainable=regime))


def branch(arm: str, model: torch.nn.Module, pre: PreB, routing: RoutingConfig) -> Branch:
    """Set ``model`` (already holding the pre-B state) up for ``arm``; ``expand*`` grows it in place (the caller
    rebuilds it before the next arm). ``ValueError`` naming an unknown arm."""
    if arm not in ARMS:
        raise ValueError(f"unknown arm {arm!r}; known: {', '.join(ARMS)}")
    out = Branch(data=pre.b_train, routing=routing)
    if arm in ANCHOR_COEFS or arm == "anchor-token":
        coef, gran = (ANCHOR_COEFS[arm], "batch") if arm in ANCHOR_COEFS else (TOKEN_COEF, "token")
        out.routing = dataclasses.replace(routing, anchor_kl_coef=coef, anchor_granularity=gran)
        out.anchor = pre.anchor.clone()
    elif arm in PROTECT_SCALES:
        out.retention = Retention(protected=protected_experts(pre.anchor[None], PROTECT_MASS),
                                  protect_lr_scale=PROTECT_SCALES[arm])
    elif arm in ("expand", "expand+anchor"):
        spec = describe(model)
        layers, experts = len(spec.moe_layers), spec.num_experts
        grown = expand_experts(model, default_sources(pre.anchor.numpy(), layers, experts, EXPAND_K))
        out.retention = Retention(frozen=frozen_set(layers, grown, EXPAND_K))  # [L, E + k]
        if arm == "expand+anchor":
            out.routing = dataclasses.replace(routing, anchor_kl_coef=ANCHOR_COEFS["anchor-0.5"],
                                              anchor_granularity="batch")
            out.anchor = torch.from_numpy(pad_anchor(pre.anchor.numpy(), grown))
    elif arm == "distill":
        out.retention = Retention(ref_state={k: v.clone() for k, v in pre.state.items()}, **DISTILL)
    elif arm == "router-frozen":
        out.frozen = [p for _, m in router_modules(model) for p in m.parameters() if p.requires_grad]
    elif arm == "experts-frozen":
        out.retention = Retention(protected=pre.oracle_experts.clone(), protect_lr_scale=0.0)
    elif arm == "replay":
        out.data = pre.b_train + pre.a_train
    for p in out.frozen:
        p.requires_grad_(False)
    return out
