"""The run report's Markdown tables of rounds and privacy: train rounds, statistics rounds, the privacy section
(mode, budget, epsilon spent per party, releases, refusals, skipped rounds) and the configuration.

Owns: those sections. The configuration section lists only the keys that differ from the defaults; every
resolved key is in the run's ``config.toml`` (the appendix: the audit admits only the report's own files
in ``report/``).

Must not: import ``flwr`` or ``torch``, or show free strings of ``privacy/ledger.json`` (numbers and the
closed-set labels ``RELEASE_KINDS`` / ``REFUSAL_REASONS`` only).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from distmoe.report.load import (
    _LABEL,
    AGG,
    PARTY_LOG,
    REFUSAL_REASONS,
    RELEASE_KINDS,
    _arrow,
    _count,
    _natural_key,
    _num,
    _party_of,
    _round_of,
    _Run,
    _slot,
    _table,
    fmt,
)


def _train_table(rows: list[dict[str, Any]], derived: bool, secure: bool = False) -> list[str]:
    out = ["## Train rounds (aggregate)", ""]
    if not rows:
        return out + ["No train rounds logged.", ""]
    if secure and not any(_num(r.get(k)) is not None for r in rows for k in ("loss", "loss_first", "loss_last")):
        # secure aggregation releases only the training-metric slots' means: no column of dashes
        body = [(r["round"], r.get("phase_label"), r.get("task"), _count(r.get("contributors", r.get("parties"))),
                 "skipped: nothing released" if r.get("skipped") else "applied") for r in rows]
        header: tuple[str, ...] = ("round", "phase", "task", "contributing parties†", "update")
        if any(_num(r.get("skipped_steps")) is not None for r in rows):  # the secure sum of NaN/Inf steps skipped
            body = [(*b, _count(r.get("skipped_steps"))) for b, r in zip(body, rows, strict=True)]
            header = (*header, "skipped NaN/Inf steps (sum)")
        body = [(*b, _slot(r, "task_loss")) for b, r in zip(body, rows, strict=True)]  # the released slot mean
        header = (*header, "mean task loss†")
        if any(_num(r.get("dpo_margin")) is not None for r in rows):  # dpo rounds: their two further slots
            body = [(*b, _slot(r, "dpo_margin"), _slot(r, "dpo_acc")) for b, r in zip(body, rows, strict=True)]
            header = (*header, "mean DPO margin†", "preference accuracy†")
        out += _table(header, body)
        if any(_num(r.get("task_loss_sd")) is not None for r in rows):
            out += ["", "With client-level DP on updates (`privacy.update-noise-multiplier`) the training figures "
                    "carry the update noise: `± x` is its standard deviation, `≈ 0 (within noise)` a figure within "
                    "one of 0 (docs/privacy.md §3, Training-metric slots)."]
    else:
        body = [
            (
                f"{r['round']}*" if r.get("_derived") else r["round"],
                r.get("phase_label"),
                r.get("task"),
                _arrow(r.get("loss_first"), r.get("loss_last")),
                _num(r.get("loss")),
                _num(r.get("aux_loss")),
                _num(r.get("anchor_kl")),
                _count(r.get("skipped_steps")),
                _count(r.get("num_examples", r.get("contributors"))),
            )
            for r in rows
        ]
        out += _table(
            (
                "round",
                "phase",
                "task",
                "loss first → last",
                "mean loss",
                "aux loss",
                "anchor KL",
                "skipped steps",
                "examples (parties†)",
            ),
            body,
        )
    if any("contributors" in r for r in rows):
        out += ["", "† secure aggregation: FedAvg weights are uniform, so the column counts the contributing parties "
                "(never examples); the mean task loss is over them, each party's clipped to "
                "`privacy.metric-loss-bound` (docs/privacy.md §3; per-party figures stay in each party's "
                f"{PARTY_LOG}), and "
                "the evaluation figures carry distributed DP noise (`privacy.metric-noise-multiplier`, "
                "docs/privacy.md §4.5)."]
    if derived:
        out += ["", "\\* no aggregate event logged for this round; weighted mean of the party events."]
    return out + [""]

def _stats_table(run: _Run, secure: bool = False) -> list[str]:
    agg = [e for e in run.stats if _party_of(e) == AGG]
    if not agg:
        return []
    rows = [(_round_of(e), e.get("task"), e.get("anchor_version"), _num(e.get("num_sequences"))) for e in agg]
    out = ["## Routing statistics rounds", "", *_table(("round", "task", "anchor version", "sequences"), rows), ""]
    if secure:
        out += ["Sequences: the number of sequences in the router statistics, summed over the parties with their DP "
                "noise (so not a whole number).", ""]
    return out

def _eps(v: Any) -> float | None:
    """epsilon of an accountant summary ``{"prv": x, "rdp": y}``: the max of the two, as the parties charge."""
    if isinstance(v, Mapping):
        vals = [x for x in (_num(v.get("prv")), _num(v.get("rdp"))) if x is not None]
        return max(vals) if vals else None
    return _num(v)

def _releases(state: Any) -> dict[str, int]:
    """Releases per kind in one party's accountant state (``privacy/ledger.json``): the sum of its events' steps by
    the closed set of labels ``RELEASE_KINDS`` (anything else counts as ``other``)."""
    out: dict[str, int] = {}
    events = state.get("events") if isinstance(state, Mapping) else None
    for ev in events if isinstance(events, list) else []:
        if not isinstance(ev, Mapping):
            continue
        label = str(ev.get("label") or "")
        kind = next((k for k in RELEASE_KINDS if label == k or label.startswith(k + " ")), "other")
        steps = ev.get("steps")
        out[kind] = out.get(kind, 0) + (steps if isinstance(steps, int) and not isinstance(steps, bool) else 1)
    return out

def _privacy(run: _Run) -> list[str]:
    """Mode, budget, epsilon spent per party, releases, refusals and skipped rounds."""
    out = ["## Privacy", ""]
    priv = run.record.get("privacy") if isinstance(run.record.get("privacy"), Mapping) else {}
    if not priv and not run.accounts:
        return out + ["No privacy record (`run.json` has no `privacy`).", ""]
    if priv.get("secure_aggregation") is False or priv.get("mode") == "plaintext":
        out += ["**Plaintext baseline**: no secure aggregation and no DP; every party's figures reach the server "
                "(the audit fails such a run).", ""]
    else:
        plan = priv.get("plan") if isinstance(priv.get("plan"), Mapping) else {}
        budget = _num(priv.get("epsilon_budget", run.accounts.get("epsilon_budget")))
        delta = _num(priv.get("delta", run.accounts.get("delta")))
        out.append(f"Secure aggregation of every reply (threshold t = {fmt(_count(priv.get('threshold')))} of "
                   f"{fmt(_count(priv.get('n_parties')))} parties); router statistics and evaluation figures with "
                   "distributed DP; model updates " + ("with client-level DP" if _num(
                       plan.get("update_noise_multiplier")) else "as a secure sum (no DP noise)") + ".")
        out.append(f"Budget ε = {fmt(budget)} at δ = {fmt(delta)} per party (unit: one sequence); planned "
                   f"ε {fmt(_num(plan.get('planned_epsilon')))} over {fmt(_count(plan.get('stats_releases')))} "
                   f"router-statistics, {fmt(_count(plan.get('update_releases')))} update and "
                   f"{fmt(_count(plan.get('eval_releases')))} evaluation release(s).")
        out.append("")
        spent = run.accounts.get("epsilon") if isinstance(run.accounts.get("epsilon"), Mapping) else None
        if spent is None:
            spent = priv.get("epsilon_spent") if isinstance(priv.get("epsilon_spent"), Mapping) else {}
        states = run.accounts.get("parties") if isinstance(run.accounts.get("parties"), Mapping) else {}
        names = sorted({str(p) for p in [*spent, *states] if _LABEL.match(str(p))}, key=_natural_key)
        kinds = [k for k in (*RELEASE_KINDS, "other") if any(_releases(states.get(p)).get(k) for p in names)]
        rows = []
        for p in names:
            eps, rel = _eps(spent.get(p)), _releases(states.get(p))
            share = f"{100 * eps / budget:.0f}%" if eps is not None and budget else None
            rows.append((p, eps, budget, share, *[rel.get(k, 0) for k in kinds]))
        if rows:
            out += _table(("party", "ε spent", "budget", "of budget", *[f"{k} releases" for k in kinds]), rows)
            out.append("")
        else:
            out += ["No epsilon spent recorded (no release was made).", ""]
    out += ["Refusals and skipped rounds:", ""]
    items = []
    for e in run.party_errors:
        code = e.get("code")
        if code == "budget":
            items.append(f"round {fmt(_round_of(e))}: party `{_party_of(e)}` refused the release: it would exceed "
                         "its privacy budget (nothing was sent)")
        elif isinstance(code, str) and _LABEL.match(code):
            items.append(f"round {fmt(_round_of(e))}: party `{_party_of(e)}` left out of "
                         f"`{e.get('phase_label') if _LABEL.match(str(e.get('phase_label'))) else '–'}`: {code}")
    refused = run.accounts.get("refused") if isinstance(run.accounts.get("refused"), list) else []
    for r in refused:
        if isinstance(r, Mapping):
            why = REFUSAL_REASONS.get(str(r.get("reason")), "refused")
            rel = r.get("release") if r.get("release") in RELEASE_KINDS else "release"
            items.append(f"round {fmt(_count(r.get('round')))}: {rel} not released: {why} "
                         f"({fmt(_count(r.get('contributors')))} contributed, min {fmt(_count(r.get('min_parties')))})")
    for e in run.train + run.rl:
        if e.get("skipped") is True and _party_of(e) == AGG:
            items.append(f"round {fmt(_round_of(e))}: {e.get('event')} round skipped: nothing released, model "
                         "unchanged")
    out += [f"- {i}" for i in items] if items else ["None."]
    return out + [""]

def _config(run: _Run) -> list[str]:
    """The keys that differ from the defaults; every resolved key is in the run's ``config.toml`` (appendix)."""
    cfg = run.record.get("config")
    if not isinstance(cfg, Mapping) or not cfg:
        return []
    from distmoe.config import DEFAULTS

    internal = ("run.dir", "run.name", "sim.", "run.resume")  # where this run lives, not how it was configured
    changed = [(str(k), json.dumps(v) if isinstance(v, (list, dict)) else v, DEFAULTS.get(k))
               for k, v in sorted(cfg.items()) if not str(k).startswith(internal) and DEFAULTS.get(k, object()) != v]
    out = ["## Config", "", f"Every resolved key ({len(cfg)}): the run's `config.toml` (appendix: `../config.toml` "
           "from this report); `distmoe config show` explains each.", ""]
    if changed:
        out += [f"{len(changed)} key(s) differ from the defaults:", "", *_table(("key", "value", "default"), changed)]
    else:
        out.append("Every key has its default value.")
    return out + [""]
