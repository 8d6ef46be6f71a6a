"""The keys of the federation's run: sections ``schedule``, ``federation`` (parties, timeouts, robustness),
``privacy`` (secure aggregation, DP), ``checkpoint``, ``eval``, ``report`` and ``sim``.

Owns: these sections' declarations; every ``privacy.*`` key is privacy-relevant (the section's default).

Must not: import anything of distmoe outside this package, or check across sections (:mod:`distmoe.config.parse`).
"""

from __future__ import annotations

from distmoe.config.keys import ConfigError, Section, key, section
from distmoe.config.schedule import Phase, parse_schedule

PRIVACY_MODES = ("secagg", "plaintext")
SECAGG_GRAPHS = ("complete", "harary")  # == distmoe.privacy.secagg.GRAPHS (a test keeps them equal)
ROUND_FAILURE_POLICIES = ("skip", "stop")
_DAY = 86400.0


@section("schedule")
class ScheduleConfig(Section):
    phases: tuple[Phase, ...] = key("sft:lookup, eval, stats:lookup, sft:arith, eval", "the round schedule",
                                    kind=str, allowed="grammar below")  # parsed by check()
    sft_rounds: int = key(5, "rounds of an `sft`, `rl` or `dpo` phase without `*n`", lo=1, hi=100000)

    def check(self) -> None:
        if isinstance(self.phases, str):
            object.__setattr__(self, "phases", parse_schedule(self.phases, self.sft_rounds))

    @property
    def total_rounds(self) -> int:
        return sum(p.rounds for p in self.phases)

    @property
    def tasks(self) -> tuple[str, ...]:
        seen: list[str] = []
        for p in self.phases:
            if p.task and p.task not in seen:
                seen.append(p.task)
        return tuple(seen)


@section("federation")
class FederationConfig(Section):
    min_available: int = key(2, "parties that must be connected before the run starts and at every round; "
                             "simulate sets it to the number of parties", lo=1, resume=True)
    wait_timeout: float = key(180.0, "seconds the server waits for `federation.min-available` parties at start",
                              lo=1.0, resume=True)
    round_timeout: float = key(900.0, "seconds for the training stage of a round (instruction out, update, "
                               "statistics, eval or masked input back); late parties are left out of that round and "
                               "rejoin at the next", lo=1.0, hi=_DAY, resume=True)
    setup_timeout: float = key(300.0, "seconds for each of the two secure-aggregation setup exchanges (a deployed "
                               "ClientApp's first start, imports included, can take tens of seconds)", lo=1.0, hi=_DAY,
                               resume=True)
    unmask_timeout: float = key(120.0, "seconds for each of the consistency-check and unmask exchanges of a secure "
                                "round (no training in them)", lo=1.0, hi=_DAY, resume=True)
    on_round_failure: str = key("skip", "a round that releases nothing (fewer than the threshold survived, or the "
                                "server rejected the sum): `skip` leaves the model/anchor unchanged and goes on; "
                                "`stop` ends the run with a message naming the round", choices=ROUND_FAILURE_POLICIES,
                                resume=True)
    max_norm_ratio: float = key(10.0, "plaintext mode: an update whose L2 norm is above this many times the round's "
                                "median (3+ updates) is rejected and logged. Under secure aggregation the server "
                                "checks the decoded sum instead (total weight ≤ n, one per contributing party, "
                                "average norm ≤ `privacy.update-clip`, plus noise)", lo=1.0, hi=1e6, lo_open=True,
                                off=0.0)
    anomaly_z: float = key(4.0, "an aggregate training loss (or RL K3 / mean abs Δlogp) beyond this many rolling "
                           "standard deviations above its last 8 rounds, or non-finite, is flagged in `run.json` "
                           "(`anomalies`), `metrics.jsonl` and the report (plaintext mode: under secure "
                           "aggregation no training metric reaches the server); 0 turns the spike test off",
                           lo=0.0, hi=1000.0)
    divergence_max: float = key(0.0, "per-tensor divergence check of every applied aggregate update: a tensor whose "
                                "largest absolute change exceeds this is flagged as a warning in `run.json`, the "
                                "progress stream, `metrics.jsonl` (`anomaly`) and the report, naming the tensors "
                                "(`docs/operations.md`); 0 = off",
                                lo=0.0, hi=1e6, lo_open=True, off=0.0)


@section("privacy", privacy=True)
class PrivacyConfig(Section):
    mode: str = key("secagg", "`secagg`: every reply is a masked vector in secure aggregation, the server sees sums "
                    "only. `plaintext`: a benchmark baseline that sends plain arrays; it warns at start, is recorded "
                    "in the ledger and `distmoe audit` fails the run", choices=PRIVACY_MODES)
    epsilon: float = key(8.0, "per-party budget (at `privacy.delta`) over the run, unit one sequence (add/remove); "
                         "each party's budget is `min(privacy.epsilon, node epsilon-max)`", lo=0.0, hi=1000.0,
                         lo_open=True)
    delta: float = key(1e-6, "δ of the (ε, δ) guarantee", lo=0.0, hi=0.1, lo_open=True,
                       allowed="(0, 0.1], <= 1/`privacy.num-sequences-max`")
    noise_multiplier: float = key(0.0, "z of the router-statistics noise; `0` = derived from `privacy.epsilon` over "
                                  "the schedule's `stats` releases (`distmoe config show` prints z and the planned "
                                  "ε). A given z whose plan exceeds the budget is refused at config time",
                                  lo=0.0, hi=1e6)  # see distmoe.privacy.plan for the resolved value
    scale: float = key(64.0, "integer encoding scale s of router statistics: each sequence's per-layer routing row "
                       "is rounded onto the integer simplex of size s (mass-preserving, so every row sums to s)",
                       lo=32.0, hi=2.0**20, allowed="integer in [32, 2^20]")
    noise_canaries: int = key(2048, "K known-zero noise-canary coordinates per router-statistics release; the "
                              "audit's χ² test on them detects missing noise (at the audit's level 1e-4, K = 2048 "
                              "caught one of 6 parties skipping its share in 40 of 40 rounds, K = 256 in 1 of 40)",
                              lo=0, hi=1 << 20)
    min_parties: int = key(2, "fewest parties any release is aggregated over; floor of the SecAgg threshold "
                           "`t = max(min-parties, n//2 + 1)`; parties refuse an unmask that names fewer",
                           lo=2, hi=10000, allowed="2..10000, <= `federation.min-available` in `secagg` mode")
    secagg_graph: str = key("complete", "the SecAgg peer graph: `complete` (Bonawitz et al. 2017: every party masks "
                            "with and shares to all others) or `harary` (SecAgg+, Bell et al. 2020: a k-regular "
                            "Harary graph over a public permutation keyed by the run id, k from the bound in "
                            "`distmoe/privacy/secagg/graph.py`, threshold `t = max(min-parties, ⌊(k+1)/2⌋ + 1)` per "
                            "neighbourhood). With the default bound `harary` equals `complete` up to 25 parties; "
                            "above that it cuts each party's masks and shares from n to k + 1 (k = 22 at 50 "
                            "parties), at the price of a guarantee that holds with probability 1 − 2^-40 for up to "
                            "10 % colluding and 10 % dropped parties, and more DP noise per party (shares are "
                            "over-provisioned for n − t dropouts); see `docs/results.md`, \"How does the per-party "
                            "cost grow with the number of parties?\"",
                            choices=SECAGG_GRAPHS)
    num_sequences_max: int = key(10000, "public bound on a party's sequences per release (a party above it "
                                 "sends no rows, contributor bit 0: never cuts, never refuses; fixes the bit "
                                 "width, checked so the 64-bit sum cannot wrap)",
                                 lo=1, hi=10**9)
    update_clip: float = key(10.0, "L2 bound a model update is clipped to before masking (fixes the fixed-point "
                             "range)", lo=0.0, hi=1e6, lo_open=True)
    ring_bits: str = key("auto", "ring width of model-update sums: `auto` = 32-bit words when the public bound "
                         "(parties x `update-clip`, plus the update-noise tail) leaves at least 20 fractional bits "
                         "(quantisation step <= 2^-20, stochastic rounding, unbiased), else 64; `32` refuses a "
                         "release that does not fit; `64` always 64-bit words (router statistics and evaluation "
                         "sums are always 64-bit); see `docs/privacy.md` §3", choices=("auto", "32", "64"))
    secagg_premask: bool = key(True, "expand a model-update round's masks in a second thread while the party "
                               "trains (they do not depend on the update; one update-sized buffer more), then add "
                               "them in one pass; only where the process has more than one core")
    update_noise_multiplier: float = key(0.0, "> 0: client-level DP on model updates (distributed Skellam): noise "
                                         "`z_u * update-clip` in the sum, uniform weights, the training metrics "
                                         "noised inside the same sensitivity (`update-metric-share`), accounted "
                                         "per party", lo=0.0, hi=1e6)
    update_metric_share: float = key(0.25, "with update noise: the share rho of `update-clip`'s L2 norm given to "
                                     "the training-metric slots of the update sum (the delta is clipped to "
                                     "`update-clip * sqrt(1 - rho^2)`; the metrics get the update noise at the same "
                                     "sensitivity, so the accounting is unchanged); 0 = no training metrics under "
                                     "update noise; see `docs/privacy.md` §3", lo=0.0, hi=0.9)
    metric_noise_multiplier: float = key(3.0, "z_m of the distributed Skellam noise on every evaluation release "
                                         "under secure aggregation (per-example correct answers, clipped losses "
                                         "and counts per task, one held-out sequence = sensitivity sqrt(3) examples)"
                                         "; each eval round is one release in the per-sequence ledger. At 3 the "
                                         "default run's two eval rounds spend epsilon 2.28 on their own",
                                         lo=0.0, hi=1e6, lo_open=True)
    metric_loss_bound: float = key(16.0, "B: each held-out example's mean answer-token loss is clipped to [0, B] "
                                   "nats before it enters the noised evaluation sum (the released loss is a mean of "
                                   "clipped losses; its noise scales with B)", lo=0.0, hi=1e4, lo_open=True)

    @property
    def secure(self) -> bool:
        return self.mode == "secagg"

    def check(self) -> None:
        if self.scale != int(self.scale):
            raise ConfigError(f"config key 'privacy.scale': value {self.scale:g} must be an integer (router "
                              "statistics are rounded onto the integer simplex of that size)")
        if self.delta > 1.0 / self.num_sequences_max:
            raise ConfigError(f"config key 'privacy.delta': value {self.delta:g} must be <= 1/privacy.num-sequences-"
                              f"max = {1.0 / self.num_sequences_max:g} (delta must stay below 1/N for a meaningful "
                              "guarantee)")


@section("checkpoint")
class CheckpointConfig(Section):
    keep: int = key(2, "checkpoints kept (oldest pruned) besides the initial model and the model before each task, "
                    "which are always kept (`distmoe rollback`)", lo=1, resume=True)
    every: int = key(5, "write a checkpoint (a resume point) every this many rounds; the initial model, the last "
                     "round of every phase (so of the run) and every round that releases a DP-charged sum "
                     "(`stats`, `eval`, updates under `privacy.update-noise-multiplier`) are always written. A crash "
                     "repeats the rounds after the last one written (`docs/operations.md`, Resume); 1 = every round",
                     lo=1, hi=100000, resume=True, privacy=False)


@section("eval")
class EvalConfig(Section):
    max_new_tokens: int = key(10, "greedy generation length for accuracy", lo=1, hi=1024)
    batch_size: int = key(32, "evaluation and statistics batch size", lo=1, hi=4096)
    every: int = key(0, "also evaluate after every this many rounds of each `sft`, `rl` or `dpo` phase (an `eval` "
                     "round inserted in the schedule, charged by the privacy plan like any other); 0 = only where "
                     "the schedule says", lo=0, hi=100000)


@section("report")
class ReportConfig(Section):
    tensorboard: bool = key(False, "also write every aggregate metric of `metrics.jsonl` as TensorBoard scalars under "
                            "`RUN/tensorboard/` when the report is written (`distmoe simulate`; `distmoe report "
                            "--tensorboard` does it for any run); needs the extra `distmoe[tensorboard]`", resume=True)


@section("sim")
class SimConfig(Section):
    nodes_dir: str = key("", "internal: where `distmoe simulate` wrote each virtual SuperNode's node file "
                         "(`node-<partition-id>.toml`)", allowed="path", resume=True)

