"""The coordinator's privacy plane for one run: its ledger, the run's allow-list, the server guard, and
the secure-aggregation setup; and the ``run-end`` entry that closes the ledger.

Owns: ``start`` (a new signed ledger ``ledger/coordinator.jsonl`` + ``.pub`` whose first entry is the
run's allow-list with the privacy settings and plan, sized for every expert count the run goes through; or, on
resume, the interrupted run's ledger continued with a ``run-resume`` entry), the check that router statistics of
this many parties cannot wrap Z_2^64 (before anything is sent), the ``ServerGuard`` attached to the transport,
and the choice of aggregator: ``SecureAggregator`` after a ``SecureRounds.setup`` in ``privacy.mode = "secagg"``,
``PlaintextAggregator`` in the benchmark baseline, chosen once here; ``start`` returns them as a ``Plane`` that the
round loop holds. ``close`` writes ``run-end`` with the epsilon spent.

Must not: import ``flwr``, write into the run's state, or send anything before the allow-list is signed.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass

from distmoe.config import PRIVACY_KEYS
from distmoe.coordinator import resume
from distmoe.coordinator.aggregator import Aggregator, PlaintextAggregator
from distmoe.coordinator.context import RunContext
from distmoe.coordinator.errors import RunFailed
from distmoe.coordinator.secagg import SecureRounds
from distmoe.coordinator.secure import SecureAggregator
from distmoe.io import write_text_atomic
from distmoe.ledger import Ledger, canonical_json, generate_signing_key, public_key_hex
from distmoe.model.expand import per_expert, stages
from distmoe.privacy.metric_noise import EvalSpec
from distmoe.privacy.plan import threshold_for
from distmoe.privacy.releases import stats as stats_release
from distmoe.privacy.ring import WrapError
from distmoe.privacy.train_metrics import release_layout
from distmoe.privacy.vectors import UpdateLayout
from distmoe.wire.at_rest import check_allow_list
from distmoe.wire.server_guard import GuardedTransport, ServerGuard, build_policy, policy_digest
from distmoe.wire.stages import merge_policies


@dataclass
class Plane:
    """The run's privacy plane: the signed ledger, the server guard (attached to the transport), the SecAgg driver
    (None in the plaintext baseline) and the aggregator every round sums through. ``start`` fills it part by part
    as each opens, so that ``close`` seals a ledger opened by a start that failed later (its setup, say)."""

    ledger: Ledger | None = None
    guard: ServerGuard | None = None
    secure: SecureRounds | None = None
    aggregator: Aggregator | None = None


def stage_shapes(co: RunContext) -> list[tuple[dict[str, tuple[int, ...]], int]]:
    """``(trainable shapes, experts)`` of every expert count the run goes through (one stage unless
    ``retention.expand-experts``: ``model/expand.stages``, counted from the model before any expansion)."""
    first = int(co.s.expansions[0]["from"]) if co.s.expansions else co.mspec.num_experts
    return [({k: ((e, *sh[1:]) if per_expert(k) else sh) for k, sh in co.tspec.shapes}, e)
            for e in stages(co.cfg, first)]


def layout_facts(co: RunContext, n: int, shapes=None, experts: int | None = None,
                 objective: str = "sft") -> dict[str, int]:
    """The public vector lengths of each release for ``n`` parties (they size the allow-list); ``shapes`` /
    ``experts``: of one stage (default: the model now); ``objective``: of the ``model-update`` release (``sft`` or
    ``dpo``: their training-metric slots differ, ``distmoe.privacy.train_metrics``)."""
    cfg, p = co.cfg, co.cfg.privacy
    L, E = co.mspec.num_moe_layers, experts or co.mspec.num_experts
    shapes = tuple(shapes.items()) if shapes is not None else co.tspec.shapes
    update = UpdateLayout.build(shapes, n, p.update_clip, private=co.plan.update_noise_multiplier > 0)

    def length(obj: str) -> int:
        return release_layout(update, obj, p.metric_loss_bound, p.update_metric_share)[0].length

    return dict(
        update_length=length(objective),
        rl_update_length=length("rl"),  # the update layout with the rl slots
        stats_length=L * E + p.noise_canaries, eval_length=EvalSpec.length_for(cfg.schedule.tasks))


def update_objectives(co: RunContext) -> list[str]:
    """The objectives of the schedule's ``model-update`` releases: ``sft`` and/or ``dpo`` (one allow-list stage
    each)."""
    kinds = {ph.kind for ph in co.cfg.schedule.phases}
    return [o for o in ("sft", "dpo") if o in kinds] or ["sft"]


def start(co: RunContext, transport: GuardedTransport, nodes: list[int], out: Plane | None = None) -> Plane:
    """Sign (or, on resume, check and continue) the allow-list, attach the guard to ``transport``, run the secure
    setup with ``nodes`` and choose the aggregator; returns ``out`` (a new ``Plane`` when None), filled."""
    out = Plane() if out is None else out
    cfg, p = co.cfg, co.cfg.privacy
    lpath = co.files.ledger
    # else the interrupted session never opened its ledger (no file, or its first append never completed)
    continuing = bool(cfg.run.resume) and resume.ledger_opened(lpath)
    entries: list[dict] = []
    if continuing:
        out.ledger, run_start, entries = resume.reopen_ledger(co, lpath)
    else:
        if lpath.exists() and not cfg.run.resume:  # before the key is replaced: the run there keeps its key
            raise RunFailed(f"{lpath} exists: a run directory is used by one run only")
        if lpath.exists():  # nothing was sent under it (the run-start entry is durable before any message)
            co.warn(f"{lpath}: no complete entry (the interrupted session died in its first append): replaced by a "
                    "new ledger under a new key")
            lpath.unlink()
        key = generate_signing_key(co.files.ledger_key, force=True)
        out.ledger = Ledger(lpath, key)
        write_text_atomic(co.files.ledger_pub, public_key_hex(key) + "\n")
    ledger, n = out.ledger, len(nodes)
    L = co.mspec.num_moe_layers
    # one stage per expert count the schedule reaches (retention.expand-experts) and model-update objective
    staged = [(sh, E) for sh, E in stage_shapes(co) for _ in update_objectives(co)]
    facts = [layout_facts(co, n, sh, E, obj) for sh, E in stage_shapes(co) for obj in update_objectives(co)]
    if p.secure and co.plan.stats_releases:  # fail before anything is sent, naming the bound
        try:
            stats_release.spec(p, co.plan.noise_multiplier, L, staged[-1][1], n,
                       threshold_for(n, p.min_parties, p.secagg_graph))
        except WrapError as exc:
            raise RunFailed(f"router statistics of {n} parties cannot be summed in Z_2^64: {exc}; lower "
                            "privacy.num-sequences-max or privacy.scale") from None
    policy = merge_policies([build_policy(secure=p.secure, n_parties=n, trainable=sh, layers=L, experts=E,
                                          tasks=cfg.schedule.tasks, probe_prompts=co.probe_prompts,
                                          probe_tokens=len(co.probe_prompts) * cfg.model.max_seq_len,
                                          settle=cfg.routing.balance_settle_steps > 0, **f)
                             for (sh, E), f in zip(staged, facts, strict=True)])
    problems = check_allow_list(policy)  # the pre-run privacy check of the allow-list (distmoe.wire.at_rest)
    if problems:
        raise RunFailed("privacy check before the run failed: " + "; ".join(problems))
    digest = policy_digest(policy)
    if continuing:
        resume.append_resume_entry(co, ledger, digest, policy, run_start, entries, n)
    else:
        blob = canonical_json(policy).encode("ascii")
        ledger.append(run=co.run_id, round=0, phase="run-start", direction="out", payload_type="policy", keys=[],
                         shapes={}, bytes=len(blob), sha256=digest, verdict="accepted", peer="all",
                         info={"policy": policy, "mode": p.mode, "session": co.session_id,  # this Flower run's id
                               "privacy": {k: v for k, v in cfg.as_flat().items() if k in PRIVACY_KEYS},
                               "plan": co.plan.as_dict(), "router_spec": co.mspec.router_spec()})
    out.guard = guard = ServerGuard(ledger, co.run_id, policy)
    transport.attach(guard)
    if not p.secure:
        out.aggregator = PlaintextAggregator(co, transport, guard)
        return out
    out.secure = secure = SecureRounds(cfg, co.plan, transport, co.run_dir, co.say, co.report_errors)
    if continuing:
        resume.restore_accountants(secure, co.say, entries)
    secure.setup(nodes, max(max(f.values()) for f in facts), first_round=co.s.round + 1, logical_run=co.run_id,
                 epoch=co.epoch)
    co.record.update(parties={**(co.record.get("parties") or {}),
                              **{guard.peer(nd): {"node": str(nd),
                                                  "ledger_public_key": guard.public_keys.get(guard.peer(nd), ""),
                                                  **({"epsilon_max": secure.caps[guard.peer(nd)]}
                                                     if guard.peer(nd) in secure.caps else {})}
                                 for nd in secure.roster}},
                     privacy={**co.record["privacy"], "threshold": secure.threshold,
                              "n_parties": len(secure.roster)})
    out.aggregator = SecureAggregator(co, transport, guard, secure)
    return out


def close(co: RunContext, plane: Plane | None, status: str, seal: str | None = None) -> None:
    """The ``run-end`` entry (``status``: completed, failed, interrupted) with the epsilon spent per party; never
    masks the run's own error. The audit requires it as the ledger's last entry (``distmoe.audit.ledgers``).
    ``seal``: refuse every later append in this process (a stop signal closing the run from another thread).
    A ledger that holds no entry yet (the run failed in ``start`` before its ``run-start`` entry, e.g. the pre-run
    privacy check) is left without one: nothing was sent under it, and a ``run-end`` as its first entry would make
    it a ledger that neither a resume nor the audit accepts."""
    if plane is None or plane.ledger is None or plane.ledger.head()[0] < 0:
        return
    try:
        eps = plane.secure.epsilon() if plane.secure is not None else {}
        append = plane.ledger.append if seal is None else functools.partial(plane.ledger.append_final, seal)
        append(run=co.run_id, round=co.s.round, phase="run-end", direction="out", payload_type="run-end",
                         keys=[], shapes={}, bytes=0, sha256=hashlib.sha256(b"").hexdigest(), verdict="accepted",
                         peer="all", info={"status": status, "epsilon": eps})
        if eps:
            co.record.update(privacy={**co.record["privacy"], "epsilon_spent": eps})
    except Exception as exc:  # never mask the run's own error
        co.say(f"could not close the ledger: {exc}")
