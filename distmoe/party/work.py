"""What a party does for each phase, as plain functions: instruction payload in, reply payload out.

The ClientApp handlers are thin wrappers around these. Each call takes the party's prepared base
(``model/base.py``: loaded once per process on the party's device and dtype, the tiny default
initialised identically from ``model.seed``, a checkpoint from the node's own path), checks its
fingerprint against the server's (``base_hash``), loads the global trainable weights, and reads only
this party's own data directory. Nothing but that cached base is kept in process memory between
calls (in deployment every message runs in a new process); what one message's carried probe left loaded is that
message's own note (``Loaded``), passed down, never module state.

An example whose answer does not fit ``model.max-seq-len`` is left out of every path here (training, router
statistics, evaluation; ``template.encode_fitting``), never refused: a refusal would let a coordinator that searches
over that setting learn the length of the party's longest answer. The count left out goes to the party's own log
only; with nothing left the party takes part as one without data for the task (weight 0, no error code).

Must not: import ``flwr``, read another party's directory, or return anything but wire payloads.
"""

from __future__ import annotations

import time
import zlib

import numpy as np
import torch

from distmoe.config import NodeConfig, RunConfig
from distmoe.data.party import PartyData, load_party
from distmoe.data.template import collate, encode_fitting
from distmoe.model.base import base_fingerprint, clear_cache, is_cached, prepared_model
from distmoe.model.build import ModelError, describe, param_count
from distmoe.model.device import Runtime, resolve_runtime
from distmoe.model.expand import KEY as EXPAND_KEY
from distmoe.model.expand import base_experts, experts_in, resize_to, stages
from distmoe.model.trainable import load_trainable, spec_of, trainable_state
from distmoe.party.retention import round_retention
from distmoe.routing.stats import per_sequence_stats
from distmoe.train.evaluate import evaluate_party, example_scores, routing_on, routing_set
from distmoe.train.public_balance import PublicBalance, PublicBalanceError, balance_prompts
from distmoe.train.sft import train_sft
from distmoe.wire.errors import ErrorCode
from distmoe.wire.schema import (
    RL_METRIC_KEYS,
    RL_SIM_METRIC_KEYS,
    TRAIN_METRIC_KEYS,
    EvalInstruction,
    EvalReply,
    ModelUpdate,
    RlInstruction,
    RouterStats,
    SftInstruction,
    StatsInstruction,
    eval_metric_keys,
)


class PartyError(RuntimeError):
    """The party cannot carry out an instruction. Its message is detail for the party's own log; only
    ``code`` (``distmoe.wire.errors.ErrorCode``: ``DATA`` unless said otherwise) leaves."""

    def __init__(self, detail: str, code: int = ErrorCode.DATA):
        super().__init__(detail)
        self.code = ErrorCode(code)


def _to_torch(weights: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(np.array(v, dtype=np.float32, copy=True)) for k, v in weights.items()}


def runtime(cfg: RunConfig, node: NodeConfig) -> Runtime:
    """This party's device and precision: the run's ``train.*`` with the owner's node-config settings."""
    return resolve_runtime(node.train(cfg.train), cfg.model.trainable)


class Loaded:
    """One message's note of what a read-only use (the carried probe) left loaded in the party's model: the next
    ``prepare_model`` call given the same note, with the very same weights object on the same model, skips the copy
    and its checks (done on these weights already). The service makes one per message and passes it down; nothing
    outlives the message (another message, or another run in this process, has its own or none), and the note holds
    the weights, so no identity is reused while it lives."""

    def __init__(self) -> None:
        self._last: tuple | None = None  # (model, weights) as the read-only use left them

    def keep(self, model, weights: dict[str, np.ndarray]) -> None:
        self._last = (model, weights)

    def take(self, model, weights: dict[str, np.ndarray]) -> bool:
        """Whether ``model`` holds exactly ``weights`` already; consumed either way (a skip at most once)."""
        last, self._last = self._last, None
        return last is not None and last[0] is model and last[1] is weights


def prepare_model(cfg: RunConfig, node: NodeConfig, weights: dict[str, np.ndarray], base_hash: str,
                  loaded: Loaded | None = None, read_only: bool = False):
    """The (per-process cached) base on this party's device, checked against the server's fingerprint, with
    the global trainable weights loaded. ``loaded``: this message's note (``Loaded``); ``read_only``: the caller only
    reads the model (a forward pass in eval mode, no optimizer), so the next call with the same note, when it passes
    this same ``weights`` object for the same model, finds them loaded already; any next call with the note consumes
    that, so a load is skipped at most once and never after a change."""
    rt = runtime(cfg, node)
    fingerprint = base_fingerprint(cfg.model, node.model_path)
    if base_hash and fingerprint != base_hash:
        raise PartyError(f"party {node.party}: the frozen base model differs from the server's "
                         f"(fingerprint {fingerprint[:12]} vs {base_hash[:12]}); every node must use the same "
                         "checkpoint (model.path / node model-path) and model settings", ErrorCode.MODEL)
    fresh = not is_cached(cfg.model, node.model_path, rt)
    t0 = time.perf_counter()
    model, tok = prepared_model(cfg.model, node.model_path, rt, node.base_cache)
    if fresh:  # the SuperNode's log: what this owner's hardware runs
        print(f"distmoe party {node.party}: base {model.config.model_type} ({param_count(model) / 1e6:.1f}M "
              f"parameters) on {rt.describe()}, loaded in {time.perf_counter() - t0:.1f} s", flush=True)
    if cfg.retention.expand_experts:  # the global weights' shapes declare the expert count (model/expand.py)
        model, tok = _fit_experts(cfg, node, rt, model, tok, weights)
    elif describe(model).num_experts != base_experts(model):  # grown by an earlier run in this process: rebuild
        clear_cache()
        model, tok = prepared_model(cfg.model, node.model_path, rt, node.base_cache)
    spec = spec_of(model, cfg.model.trainable, fingerprint)
    if loaded is None or not loaded.take(model, weights):
        load_trainable(model, _to_torch(weights), spec)
    if read_only and loaded is not None:
        loaded.keep(model, weights)
    return model, tok, spec


def _fit_experts(cfg: RunConfig, node: NodeConfig, rt, model, tok, weights: dict[str, np.ndarray]):
    """The (cached) base grown to the expert count of the received weights (``retention.expand-experts``), which
    must be one of the counts this run's schedule goes through (``model.expand.stages``): the surgery only sets the
    shape, the received expert and router tensors then replace every value. A cached base
    that has more experts (an earlier run in this process) is rebuilt first."""
    try:
        want = experts_in({k: v.shape for k, v in weights.items()})
        if want is None:
            raise ModelError(f"config key '{EXPAND_KEY}': no expert or router tensor travels "
                             f"(model.trainable = {cfg.model.trainable!r})")
        allowed = stages(cfg, base_experts(model))
        if want not in allowed:  # the count can only be one this run's schedule reaches
            raise ModelError(f"config key '{EXPAND_KEY}': the server's weights have {want} experts per MoE layer; "
                             f"this run's schedule grows the model through {allowed} only")
        if not resize_to(model, want):
            clear_cache()
            model, tok = prepared_model(cfg.model, node.model_path, rt, node.base_cache)
            resize_to(model, want)
    except ModelError as exc:
        raise PartyError(f"party {node.party}: {exc}", ErrorCode.MODEL) from None
    return model, tok


def party_seed(base: int, party: str) -> int:
    return (base * 1_000_003 + zlib.crc32(party.encode())) % (2**31 - 1)


def load_data(cfg: RunConfig, node: NodeConfig) -> PartyData:
    return load_party(node.data_path, cfg.data)


def anchor_of(instr: SftInstruction, ms) -> torch.Tensor | None:
    """The instruction's anchor ``[L, E]`` as a tensor, checked against the model's spec ``ms``; None without one."""
    if instr.anchor is None:
        return None
    anchor = torch.from_numpy(np.asarray(instr.anchor, dtype=np.float32))
    if tuple(anchor.shape) != (ms.num_moe_layers, ms.num_experts):
        raise PartyError(f"anchor shape {tuple(anchor.shape)} does not fit the model "
                         f"({ms.num_moe_layers} MoE layers x {ms.num_experts} experts)", ErrorCode.MODEL)
    return anchor


def run_sft(cfg: RunConfig, node: NodeConfig, instr: SftInstruction, loaded: Loaded | None = None) -> ModelUpdate:
    """An ``sft`` round (a ``dpo`` round, ``objective = "dpo"``, is ``dpo_work.run_dpo``: the service dispatches)."""
    torch.set_num_threads(cfg.train.threads)
    data = load_data(cfg, node)
    keys = TRAIN_METRIC_KEYS
    def zero_update() -> ModelUpdate:  # made only when returned (a whole model of zeros)
        return ModelUpdate(party=node.party, num_examples=0, metrics={k: float("nan") for k in keys},
                           delta={k: np.zeros_like(v, dtype=np.float32) for k, v in instr.weights.items()})
    if not data.has(instr.task):
        return zero_update()  # this party holds no data for the task: it contributes nothing (weight 0)
    model, tok, spec = prepare_model(cfg, node, instr.weights, instr.base_hash, loaded)
    ms = describe(model)
    _, encoded, left_out = encode_fitting(tok, data.train(instr.task), cfg.model.max_seq_len)
    if not encoded:
        left_out_note(node, instr, left_out)
        return zero_update()  # no answer fits model.max-seq-len: as a party without data (no size-telling error code)
    anchor = anchor_of(instr, ms)
    try:
        retention = round_retention(cfg, node.work_dir, instr, ms.num_moe_layers, ms.num_experts,
                                    base_experts=base_experts(model))
    except ValueError as exc:
        raise PartyError(f"party {node.party}: {exc}", ErrorCode.MODEL) from None
    public = None
    if cfg.routing.public_balance_coef > 0 or cfg.routing.balance_source == "public":
        try:
            public = PublicBalance(model, tok, balance_prompts(cfg.run.seed, cfg.routing.public_balance_path,
                                                             cfg.routing.public_balance_styles),
                                   cfg.routing.public_balance_coef, cfg.routing.public_balance_batch,
                                   cfg.model.max_seq_len)
        except PublicBalanceError as exc:
            raise PartyError(f"party {node.party}: {exc}", ErrorCode.MODEL) from None
    before = {k: torch.from_numpy(np.asarray(v, dtype=np.float32)) for k, v in instr.weights.items()}
    res = train_sft(model, encoded, tok.pad_token_id, node.train(cfg.train), cfg.routing, ms.num_experts, ms.top_k,
                    anchor, seed=party_seed(instr.seed, node.party), retention=retention, public=public)
    params = dict(model.named_parameters())  # the delta straight from the trained tensors (no copy of them first)
    delta = {k: (params[k].detach().to("cpu", torch.float32) - before[k]).numpy() for k in spec.keys}
    s = res.summary()
    metrics = {k: float(s.get(k, float("nan"))) for k in keys}  # the dpo_* keys: NaN in an sft round
    progress(node, f"round {instr.round} sft:{instr.task}: loss {metrics['loss_first']:.4f} -> "
             f"{metrics['loss_last']:.4f} over {int(metrics['steps'])} steps ({res.num_examples} examples)"
             + (f", anchor KL {metrics['anchor_kl']:.4f}" if anchor is not None else "")
             + "".join(f", {n}" for n in (retention.notes if retention is not None else []))
             + (f", {int(metrics['skipped_steps'])} skipped steps" if metrics['skipped_steps'] > 0 else ""))
    stability(node, instr, res.nonfinite)
    left_out_note(node, instr, left_out, keep=True)  # after ``stability``, which starts the round's notes afresh
    return ModelUpdate(party=node.party, delta=delta, num_examples=res.num_examples, metrics=metrics)


_NOTES: dict[str, dict] = {}  # party -> facts of its last local round for its own metrics log (``take_notes``)


def stability(node: NodeConfig, instr, nonfinite) -> None:
    """Name the parameters behind skipped NaN/Inf steps in the party's own log line and keep them for its
    metrics log (``take_notes``); the names never leave the party (the wire carries the skipped-step count)."""
    _NOTES.pop(node.party, None)
    if not nonfinite.skipped:
        return
    progress(node, f"round {instr.round}: non-finite gradients skipped {nonfinite.summary()}")
    _NOTES[node.party] = nonfinite.facts()


def take_notes(party: str) -> dict:
    """What the party's last ``run_sft`` / ``run_rl`` left for its own metrics log (the names of parameters
    with non-finite gradients, the count of examples left out as too long), once; empty when there is none."""
    return _NOTES.pop(party, {})


def left_out_note(node: NodeConfig, instr, n: int, what: str = "examples", keep: bool = False) -> None:
    """Say in the party's own log how many ``what`` were left out because an answer does not fit
    ``model.max-seq-len`` (``encode_fitting``); ``keep``: also in an update round's metrics log (``take_notes``).
    The count never goes into a reply."""
    if n:
        progress(node, f"round {instr.round}: {n} {what} left out: an answer does not fit model.max-seq-len")
        if keep:
            _NOTES.setdefault(node.party, {})["left_out"] = n


def progress(node: NodeConfig, text: str) -> None:
    """A line of this party's own training progress on its stdout, only where that is the owner's own log
    (``node.progress_stdout``: a deployed SuperNode); never in simulation, whose output is the coordinator's."""
    if node.progress_stdout:
        print(f"distmoe party {node.party}: {text}", flush=True)


def router_stats_per_sequence(cfg: RunConfig, node: NodeConfig, instr: StatsInstruction,
                              max_sequences: int | None = None, loaded: Loaded | None = None) -> np.ndarray:
    """``[N, L, E]`` per-sequence mean router distributions of the global model on every training example of the
    split (``PartyData.stats_train``: no cap, so one added or removed example changes exactly one row). A party with
    more than ``max_sequences`` (the public bound ``privacy.num-sequences-max``) is never cut to the first N (a cut
    lets one added example replace another, twice the sensitivity the release is charged at) and never refuses
    (whether it answers or refuses told a coordinator varying the bound over runs its exact size): it takes part
    with no rows, as a party without data for the task (contributor bit 0), and says so in its own log only."""
    torch.set_num_threads(cfg.train.threads)
    data = load_data(cfg, node)
    tasks = [instr.task] if instr.task else list(data.tasks)
    examples = [ex for t in tasks if data.has(t) for ex in data.stats_train(t)]
    model, tok, _ = prepare_model(cfg, node, instr.weights, instr.base_hash, loaded)
    ms = describe(model)
    if max_sequences is not None and len(examples) > max_sequences:
        progress(node, f"round {instr.round}: {len(examples)} training sequences for the router statistics, above "
                       f"privacy.num-sequences-max = {max_sequences}: this party sends no rows (ask the coordinator "
                       "to raise the bound above every party's size)")
        examples = []
    if not examples:
        return np.zeros((0, ms.num_moe_layers, ms.num_experts), dtype=np.float64)
    _, encoded, left_out = encode_fitting(tok, examples, cfg.model.max_seq_len)
    left_out_note(node, instr, left_out, "router-statistics sequences")
    if not encoded:
        return np.zeros((0, ms.num_moe_layers, ms.num_experts), dtype=np.float64)
    bs = cfg.eval.batch_size
    batches = (collate(encoded[i:i + bs], tok.pad_token_id) for i in range(0, len(encoded), bs))
    return per_sequence_stats(model, batches)


def run_stats(cfg: RunConfig, node: NodeConfig, instr: StatsInstruction, loaded: Loaded | None = None) -> RouterStats:
    """Plaintext mode only: the ``[L, E]`` sum in the clear."""
    return RouterStats(sums=router_stats_per_sequence(cfg, node, instr, loaded=loaded).sum(0))


def fitting_heldout(cfg: RunConfig, node: NodeConfig, instr: EvalInstruction, data: PartyData, tok
                    ) -> dict[str, list]:
    """The held-out examples of each task of ``instr`` whose answer fits ``model.max-seq-len`` (a task with none
    left is scored as one the party does not hold); the count left out goes to the party's own log only."""
    out, left_out = {}, 0
    for t in instr.tasks:
        out[t], _, n = encode_fitting(tok, data.heldout(t) if data.has(t) else [], cfg.model.max_seq_len)
        left_out += n
    left_out_note(node, instr, left_out, "held-out examples")
    return out


def run_eval(cfg: RunConfig, node: NodeConfig, instr: EvalInstruction, loaded: Loaded | None = None) -> EvalReply:
    torch.set_num_threads(cfg.train.threads)
    data = load_data(cfg, node)
    ref_valid = None
    # the reference's routing first: one model in memory, two weight sets
    first = instr.ref_weights if instr.ref_weights is not None else instr.weights
    model, tok, _ = prepare_model(cfg, node, first, instr.base_hash, loaded)
    heldout = fitting_heldout(cfg, node, instr, data, tok)
    if instr.ref_weights is not None:
        fixed = routing_set(heldout)
        if fixed:
            _, ref_valid = routing_on(model, tok, fixed, cfg.model.max_seq_len, cfg.eval.batch_size)
        model, tok, _ = prepare_model(cfg, node, instr.weights, instr.base_hash, loaded)
    ms = describe(model)
    anchor = torch.from_numpy(np.asarray(instr.anchor)) if instr.anchor is not None else None
    metrics = evaluate_party(model, tok, heldout, cfg.model.max_seq_len, cfg.eval, ms.num_experts,
                             anchor, ref_valid)
    keys = eval_metric_keys(instr.tasks)
    return EvalReply(party=node.party, metrics={k: float(metrics.get(k, float("nan"))) for k in keys})


def eval_scores(cfg: RunConfig, node: NodeConfig, instr: EvalInstruction, loaded: Loaded | None = None
                ) -> dict[str, list[tuple[bool, float]]]:
    """Secure mode: ``(answered correctly, mean answer loss)`` per held-out example of each task (at most
    ``data.max-eval-examples``, ``load_party``'s cap) whose answer fits ``model.max-seq-len``, for the noised
    per-example sum (``distmoe.privacy.metric_noise``). No routing metrics: they are not released under secure
    aggregation."""
    torch.set_num_threads(cfg.train.threads)
    data = load_data(cfg, node)
    if not any(data.has(t) and data.heldout(t) for t in instr.tasks):
        return {t: [] for t in instr.tasks}
    model, tok, _ = prepare_model(cfg, node, instr.weights, instr.base_hash, loaded)
    model.eval()
    heldout = fitting_heldout(cfg, node, instr, data, tok)
    return {t: (example_scores(model, tok, t, ex, cfg.model.max_seq_len, cfg.eval) if ex else [])
            for t, ex in heldout.items()}


def run_rl(cfg: RunConfig, node: NodeConfig, instr: RlInstruction, loaded: Loaded | None = None) -> ModelUpdate:
    """Local GRPO on this party's prompts of ``instr.task``; the update travels like an SFT update."""
    from distmoe.rl.grpo import run_grpo

    torch.set_num_threads(cfg.train.threads)
    data = load_data(cfg, node)
    if not data.has(instr.task):
        zero = {k: np.zeros_like(v, dtype=np.float32) for k, v in instr.weights.items()}
        return ModelUpdate(party=node.party, delta=zero, num_examples=0, kind="rl",
                           metrics={k: float("nan") for k in RL_METRIC_KEYS})
    model, tok, spec = prepare_model(cfg, node, instr.weights, instr.base_hash, loaded)
    prompts = data.train(instr.task)
    r = cfg.rl  # rl.prompts-per-step above the prompt count: drawn with replacement (a refusal would tell the count)
    before = {k: torch.from_numpy(np.asarray(v, dtype=np.float32)) for k, v in instr.weights.items()}
    res = run_grpo(model, tok, prompts, instr.task, r, seed=party_seed(instr.seed, node.party),
                   max_prompt_len=cfg.model.max_seq_len, grad_clip=cfg.train.grad_clip,
                   winsorize=cfg.train.winsorize)
    after = trainable_state(model)
    delta = {k: (after[k] - before[k]).numpy() for k in spec.keys}
    summary = res.summary()
    metrics = {k: float(summary.get(k, float("nan"))) for k in RL_METRIC_KEYS}
    metrics.update({k: float(v) for k, v in summary.items() if k.startswith("route_disagree_l")})
    if r.simulator:
        metrics.update({k: float(summary.get(k, float("nan"))) for k in RL_SIM_METRIC_KEYS})
    n = r.steps * r.prompts_per_step * r.group_size  # rollouts used: the FedAvg weight
    progress(node, f"round {instr.round} rl:{instr.task}: reward {metrics['reward_first']:.4f} -> "
             f"{metrics['reward_last']:.4f} over {int(metrics['steps'])} steps ({n} rollouts)"
             + (f", simulator trusted on {int(summary.get('sim_trusted_steps', 0))} of them" if r.simulator else ""))
    stability(node, instr, res.nonfinite)
    return ModelUpdate(party=node.party, delta=delta, num_examples=n, metrics=metrics, kind="rl")
