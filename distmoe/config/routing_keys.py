"""The keys of expert routing and retention: sections ``routing`` (load balancing, the anchor, the probe) and
``retention`` (per-task anchors, expert protection, distillation, expert expansion).

Owns: these sections' declarations and their modes; :class:`Balance`, the load-balancing mode as an enum whose
parts (``aux``, ``bias``) are asked by name, never by substring.

Must not: import anything of distmoe outside this package.
"""

from __future__ import annotations

from enum import StrEnum

from distmoe.config.keys import Section, key, section


class Balance(StrEnum):
    """``routing.balance``: the aux loss, the routing bias, or both."""

    AUX = "aux"
    BIAS = "bias"
    AUX_BIAS = "aux+bias"

    def __repr__(self) -> str:  # as the value it was given: messages and records read 'bias', not the member
        return repr(self.value)

    @property
    def aux(self) -> bool:
        """The aux load-balance loss is on."""
        return self in (Balance.AUX, Balance.AUX_BIAS)

    @property
    def bias(self) -> bool:
        """The model has a per-expert routing bias (it is part of the model and travels)."""
        return self in (Balance.BIAS, Balance.AUX_BIAS)


BALANCE_MODES = tuple(m.value for m in Balance)
GRANULARITIES = ("batch", "token")
AUX_SCOPES = ("layer", "pooled")  # routing.aux-loss-scope (distmoe.routing.losses)
BALANCE_COUNTS = ("topk", "first")  # routing.balance-count: what the bias update counts
BALANCE_SOURCES = ("party", "public")  # routing.balance-source: whose tokens the bias update counts
SETTLE_SCHEDULES = ("constant", "linear")  # routing.balance-settle-schedule: the settle's u per update
TASK_ANCHOR_MODES = ("off", "sum", "mean")


@section("routing")
class RoutingConfig(Section):
    aux_loss_coef: float = key(0.01, "aux load-balance loss weight (`routing.balance` `aux` or `aux+bias`)",
                               lo=0.0, hi=100.0)
    aux_loss_scope: str = key("layer", "where the aux loss is taken: `layer` one Switch loss per MoE layer, "
                              "averaged (the paper's), `pooled` transformers' `load_balancing_loss_func`, whose "
                              "expert counts are summed over layers first (`docs/algorithms.md`, Load balancing)",
                              choices=AUX_SCOPES)
    balance: Balance = key("aux", "expert load balancing: `aux` the aux loss (Switch Transformer), `bias` a per-expert "
                       "routing bias for the top-k choice only, updated after each local step, no aux loss "
                       "(auxiliary-loss-free balancing, Wang et al. 2024), `aux+bias` both; the bias travels and "
                       "aggregates like the weights (`docs/algorithms.md`); not with `model.trainable = \"lora\"`",
                       choices=BALANCE_MODES, kind=str)
    balance_rate: float = key(0.05, "u: the routing bias moves by u * sign(mean load - expert load) per local step",
                              lo=0.0, hi=1.0)
    balance_count: str = key("topk", "what the routing bias balances: `topk` every chosen expert of each token (the "
                             "paper's load), `first` each token's first choice only (the expert it weighs most: the "
                             "top-1 load the probe's load CV measures)", choices=BALANCE_COUNTS)
    balance_source: str = key("party", "whose tokens the routing bias counts: `party` the party's training batch, "
                              "`public` the public balance batch of each step (`routing.public-balance-*`; the bias "
                              "then balances the public mixture, `docs/algorithms.md`, Public balance)",
                              choices=BALANCE_SOURCES)
    balance_settle_steps: int = key(0, "after each aggregated update, every party makes this many bias-only "
                                    "updates of the new global model's routing bias on public balance batches, "
                                    "weights held still, and the coordinator keeps the median (`docs/algorithms.md`, "
                                    "Settling the bias); needs `routing.balance-source = \"public\"`; 0 = off",
                                    lo=0, hi=10000, experimental=True)
    balance_settle_rate: float = key(0.02, "u of the first settle update (smaller than `routing.balance-rate`: the "
                                     "sign update's jitter is u per update); a settle moves each bias entry by at "
                                     "most the sum of its K rates, and the coordinator refuses a reply beyond that",
                                     lo=0.0, hi=1.0, experimental=True)
    balance_settle_schedule: str = key("linear", "u of the i-th of K settle updates: `linear` rate x (1 - i/K), "
                                       "decaying to rate/K at the last (the sign update's jitter shrinks as the bias "
                                       "nears its fixed point; measured lower load CV than `constant`, "
                                       "`docs/results.md`), `constant` the rate at each", choices=SETTLE_SCHEDULES,
                                       experimental=True)
    public_balance_coef: float = key(0.0, "public balance: each local step adds this times the gradient of the "
                                     "first-choice Switch load-balance loss on a batch of public prompts, to the "
                                     "router weights only (`docs/algorithms.md`, Public balance); 0 = off",
                                     lo=0.0, hi=100.0, experimental=True)
    public_balance_batch: int = key(16, "public prompts per local step of the public balance", lo=1, hi=256,
                                    experimental=True)
    public_balance_path: str = key("", "a JSONL file of public prompts (`{\"prompt\": \"...\"}` per line), at "
                                   "this path at every party, for the public balance; `\"\"` = 96 public "
                                   "synthetic prompts per style (`routing.public-balance-styles`) drawn apart "
                                   "from the probe's", experimental=True)
    public_balance_styles: int = key(12, "the default public balance set spans this many generator indices (styles) "
                                     "of the public synthetic families, 96 prompts each: the generators vary "
                                     "operations, number ranges and key windows with the index, with period 12, so "
                                     "12 covers every variant; 1 = the one style used before 2026-12-04 "
                                     "(`docs/algorithms.md`, Public balance)", lo=1, hi=64, experimental=True)
    anchor_kl_coef: float = key(0.5, "anchor-KL weight; 0 turns the anchor off", lo=0.0, hi=1000.0)
    anchor_granularity: str = key("batch", "where the anchor KL is taken; see `docs/algorithms.md`",
                                  choices=GRANULARITIES)
    probe_every: int = key(1, "routing metrics on the public probe set every this many rounds (the round's global "
                           "model, at every party, no privacy cost: `docs/operations.md`, Routing probe); 0 = off",
                           lo=0, hi=100000)
    probe_prompts: int = key(16, "size of the default probe set (public prompts of the synthetic task families, "
                             "drawn from `run.seed`)", lo=1, hi=256)
    probe_path: str = key("", "a JSONL file of public probe prompts, one `{\"prompt\": \"...\"}` per line, read by "
                          "the coordinator and sent to the parties; `\"\"` = the default probe set")
    load_cv_warn: float = key(1.0, "warn when the probe's top-1 load CV exceeds this (1.0: about half the experts "
                              "idle; healthy < 0.2); 0 = off", lo=0.0, hi=100.0)
    kl_rise_rounds: int = key(3, "warn when the probe's routing KL to the anchor rises this many rounds in a row "
                              "to above its level at the anchor's first probe; 0 = off", lo=0, hi=100000)

    def check(self) -> None:
        object.__setattr__(self, "balance", Balance(self.balance))  # a mode, asked by its parts (Balance.aux)


@section("retention")
class RetentionConfig(Section):
    task_anchors: str = key("off", "per-task anchors: the anchor KL is taken against each earlier task's own anchor "
                            "(from its `stats:<task>` phase) and the per-task KLs are summed (`sum`) or averaged "
                            "(`mean`), times `routing.anchor-kl-coef`; `off` = the latest anchor only",
                            choices=TASK_ANCHOR_MODES, experimental=True)
    protect_mass: float = key(0.0, "expert protection: an expert whose routing mass in some earlier task's anchor "
                              "exceeds this is protected while a new task trains (its update scaled by "
                              "`retention.protect-lr-scale`); 0 = off", lo=0.0, hi=1.0, lo_open=True, off=0.0,
                              experimental=True)
    protect_lr_scale: float = key(0.0, "learning-rate scale of a protected expert's tensors (0 = frozen)",
                                  lo=0.0, hi=1.0, experimental=True)
    distill_weight: float = key(1.0, "output distillation (Learning without Forgetting) weight: KL from the pre-task "
                                "model's to the current model's token distribution on the new task's data, from the "
                                "second task on; 0 = off. On by default: of the rehearsal-free mechanisms measured, "
                                "the one that kept the most of an earlier task, at a cost on the new one "
                                "(`docs/results.md`)", lo=0.0, hi=1000.0)
    distill_temperature: float = key(2.0, "temperature of the output distillation", lo=0.0, hi=100.0, lo_open=True,
                                     experimental=True)
    expand_experts: int = key(0, "dynamic expert expansion (Lifelong-MoE): experts (and router rows) added to every "
                              "MoE layer at each new `sft` task after the first, copies of the experts with the most "
                              "routing mass in the latest anchor; every earlier expert and its router row is frozen "
                              "while the new task trains. Needs `model.trainable` = `all` or `router+experts` and "
                              "a family with fused experts and a bias-free router (qwen3_moe, qwen2_moe, olmoe, "
                              "flex_olmo, mixtral); 0 = off", lo=0, hi=256, experimental=True)

    @property
    def protect(self) -> bool:
        return self.protect_mass > 0

