"""The supported MoE families and the routing the rest of distmoe relies on: each family's router rule, the refused
families and why, the router module discovery, and the model's routing spec (``ModelSpec``).

Owns: the family tables (``FAMILIES``: each supported family's ``RouterRule``, how its router weighs its top-k;
``REFUSED_FAMILIES``: why each other MoE family transformers ships is refused; ``docs/checkpoints.md`` keeps the
same tables), ``router_modules`` / ``topk_weighting`` / ``num_experts`` on a built model, and ``describe``: the
spec that the wire schema and the anchor are versioned against.

Must not: build or load a model (``build.py`` does), or import anything of distmoe.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class RouterRule:
    """How a supported family's router turns its logits ``z`` ``[tokens, E]`` into its top-k. ``scores =
    "softmax"``: the experts are ``topk(softmax(z))`` (= ``topk(z)``), the weights ``softmax(z)[I]``.
    ``scores = "sigmoid"`` (DeepSeek-V3's router): the experts are the group-limited top-k of ``sigmoid(z)`` plus
    the checkpoint's ``e_score_correction_bias``, the weights ``sigmoid(z)[I]``. Either way the weights are
    renormalised over the ``k`` chosen experts when ``normalise`` (``None``: the config's ``norm_topk_prob``) and
    times ``config.<scale>`` when ``scale`` is set. ``router_rule.py`` applies the rule; routing replay and
    ``prune-k`` re-derive the weights with it."""

    normalise: bool | None
    scale: str | None = None
    config_checks: tuple[tuple[str, object], ...] = ()  # (config field, required value)
    scores: str = "softmax"  # "softmax" or "sigmoid" (group-limited, with the checkpoint's correction bias)


# family -> its router rule. A softmax router's routing distribution is softmax(z); a sigmoid router's is its
# normalised affinities sigmoid(z) / sum sigmoid(z) (router_rule.py), so the router statistics, the anchor KL,
# the aux loss and routing replay hold as written for both (docs/checkpoints.md).
FAMILIES: dict[str, RouterRule] = {
    "qwen3_moe": RouterRule(normalise=None),
    "qwen2_moe": RouterRule(normalise=None),  # plus a sigmoid-gated shared expert (not routed)
    "mixtral": RouterRule(normalise=True),
    "olmoe": RouterRule(normalise=None),
    "flex_olmo": RouterRule(normalise=None),  # OLMoE's router; FlexOlmo's experts can be trained apart
    # softmax over the top-k logits == softmax(z)[I] renormalised; the router has a bias (part of z)
    "gpt_oss": RouterRule(normalise=True),
    # greedy top-k of the softmax, times routed_scaling_factor; dense first layers, shared experts
    "deepseek_v2": RouterRule(normalise=False, scale="routed_scaling_factor",
                              config_checks=(("topk_method", "greedy"),)),
    # sigmoid affinities + e_score_correction_bias, group-limited top-k, times routed_scaling_factor; dense first
    # layers, shared experts; DeepSeek-V3 has multi-head latent attention, GLM-4.5 grouped-query attention
    "deepseek_v3": RouterRule(normalise=None, scale="routed_scaling_factor", scores="sigmoid"),
    "glm4_moe": RouterRule(normalise=None, scale="routed_scaling_factor", scores="sigmoid"),
}
SUPPORTED_FAMILIES = tuple(FAMILIES)

_SIGMOID_UNTESTED = ("its router is DeepSeek-V3's (sigmoid affinities plus the checkpoint's correction bias, "
                     "group-limited top-k; supported in deepseek_v3 and glm4_moe), but distmoe has not tested this "
                     "family (no fabricated checkpoint in the family tests or the Flower family matrix), so it is "
                     "refused until it is")
_SIGMOID = ("its router scores experts with independent sigmoids under a choice and weighting rule of its own, "
            "which distmoe has not implemented or tested (distmoe's sigmoid rule is DeepSeek-V3's router module: "
            "group-limited top-k with the correction bias)")
# MoE families transformers ships that distmoe refuses, and why (docs/checkpoints.md keeps the same table)
REFUSED_FAMILIES: dict[str, str] = {
    "deepseek_v32": _SIGMOID_UNTESTED + "; it also adds DeepSeek Sparse Attention (a lightning indexer that "
                                        "selects the attended tokens)",
    "glm4_moe_lite": _SIGMOID_UNTESTED,
    "dots1": _SIGMOID_UNTESTED,
    "longcat_flash": ("its router mixes zero-computation (identity) experts among the routed ones, so its E router "
                      "columns are not E experts with weights; distmoe's anchor, expert adapters and routing replay "
                      "assume they are"),
    "minimax_m2": _SIGMOID + " (with a bias-corrected choice)",
    "lfm2_moe": _SIGMOID + " (with an expert-bias-corrected choice)",
    "llama4": _SIGMOID + " (a sigmoid of the top-k logits); it is also a multimodal checkpoint",
    "ernie4_5_moe": ("it chooses experts by softmax plus a learned correction bias (moe_statics), so the "
                     "chosen experts are not the top-k of the routing distribution distmoe's statistics, "
                     "anchor and routing replay use"),
    "phimoe": ("its router uses SparseMixer (a sampled, masked two-stage top-2), so the chosen experts "
               "and weights are not the top-k of one softmax over the experts"),
    "dbrx": ("its router module (DbrxRouter) returns only logits and the top-k is taken inside the FFN, so "
             "distmoe cannot capture or replay the routing decisions at the router"),
    "jetmoe": ("its mixture-of-attention-heads layers route attention too, and its gate (JetMoeTopKGating) "
               "does not return (logits, weights, indices), so distmoe cannot capture or replay routing"),
    "hunyuan_v1_moe": ("its gate (HunYuanMoEV1Gate) is not a top-k router module distmoe discovers, and its "
                       "config allows a different expert count and top-k per layer; distmoe's anchor and wire "
                       "schema assume one E and one k for every MoE layer"),
    "jamba": ("a hybrid Mamba/attention model (its router is a softmax top-k); without the CUDA kernels "
              "its Mamba layers run a slow torch path, and distmoe's RL rollouts over its hybrid cache are "
              "untested, so it is refused until they are"),
    "qwen3_next": ("a hybrid linear-attention (Gated DeltaNet) model (its router is a softmax top-k); "
                   "without its CUDA kernels the linear attention runs a slow torch path, and distmoe's RL "
                   "rollouts over its hybrid cache are untested, so it is refused until they are"),
    "minimax": ("a hybrid lightning-attention (linear attention) model (its router is a softmax top-k); "
                "distmoe's RL rollouts over its hybrid cache are untested, so it is refused until they are"),
    "granitemoe": ("its fused experts (block_sparse_moe.input_linear / output_linear) are not where distmoe's "
                   "LoRA expert targets and parameter groups look (mlp.experts.*); untested, so refused"),
    "nllb_moe": "an encoder-decoder translation model, not a causal LM",
    "switch_transformers": "an encoder-decoder (T5) model, not a causal LM",
}


class ModelError(ValueError):
    """A checkpoint cannot be used (missing, unsupported family, incompatible architecture)."""


@dataclass(frozen=True)
class ModelSpec:
    """What the rest of the system needs to know about the model's routing."""

    family: str
    moe_layers: tuple[int, ...]  # decoder layer indices that hold a router
    num_experts: int
    top_k: int
    hidden_size: int
    vocab_size: int

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layers)

    def router_spec(self) -> dict:
        return {"family": self.family, "moe_layers": list(self.moe_layers),
                "num_experts": self.num_experts, "top_k": self.top_k}


def router_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The router module of every MoE layer, in layer order: [(qualified name, module)].

    A router is a module whose class name ends with ``TopKRouter`` (``TopkRouter`` in the DeepSeek-V2
    code) and that returns ``(logits, weights, indices)``."""
    found = [(n, m) for n, m in model.named_modules() if type(m).__name__.lower().endswith("topkrouter")]
    return found


def router_rule(model: nn.Module) -> RouterRule:
    """The supported family's ``RouterRule`` (``ModelError`` for any other family)."""
    family = model.config.model_type
    if family not in FAMILIES:
        raise ModelError(refusal(family))
    return FAMILIES[family]


def topk_weighting(model: nn.Module) -> tuple[bool, float]:
    """(renormalise over the k chosen experts, scale) of the model's router weights ``softmax(z)[I]``."""
    rule = router_rule(model)
    cfg = model.config
    norm = bool(getattr(cfg, "norm_topk_prob", False)) if rule.normalise is None else rule.normalise
    scale = float(getattr(cfg, rule.scale)) if rule.scale else 1.0
    return norm, scale


def refusal(family: str) -> str:
    """Why ``family`` cannot be used, naming it."""
    if family in REFUSED_FAMILIES:
        return f"the {family!r} family is not supported: {REFUSED_FAMILIES[family]}"
    return (f"architecture {family!r} is not a supported MoE family (supported: "
            f"{', '.join(SUPPORTED_FAMILIES)}; see docs/checkpoints.md)")


def check_family(cfg) -> None:
    """``ModelError`` unless the HF config ``cfg`` is a supported family in a supported configuration."""
    family = cfg.model_type
    if family not in FAMILIES:
        raise ModelError(refusal(family))
    for field, want in FAMILIES[family].config_checks:
        got = getattr(cfg, field, None)
        if got != want:
            raise ModelError(f"the {family!r} family is supported only with {field} = {want!r} (this "
                             f"checkpoint has {got!r}): other choices are not the top-k of the softmax "
                             "that distmoe's statistics, anchor and routing replay assume")


def _layer_index(name: str) -> int:
    parts = name.split(".")
    return int(parts[parts.index("layers") + 1])


def describe(model: nn.Module) -> ModelSpec:
    cfg = model.config
    if cfg.model_type not in FAMILIES:
        raise ModelError(refusal(cfg.model_type))
    routers = router_modules(model)
    if not routers:
        raise ModelError(f"model of type {cfg.model_type!r} has no top-k router modules; "
                         f"supported MoE families: {', '.join(SUPPORTED_FAMILIES)}")
    return ModelSpec(
        family=cfg.model_type,
        moe_layers=tuple(_layer_index(n) for n, _ in routers),
        num_experts=num_experts(model),
        top_k=int(cfg.num_experts_per_tok), hidden_size=int(cfg.hidden_size),
        vocab_size=int(cfg.vocab_size))


def num_experts(model: nn.Module) -> int:
    """Routed experts per MoE layer (the width of every router's logits)."""
    routers = router_modules(model)
    if routers and isinstance(getattr(routers[0][1], "num_experts", None), int):
        return int(routers[0][1].num_experts)
    cfg = model.config
    return int(getattr(cfg, "num_experts", None) or cfg.num_local_experts)
