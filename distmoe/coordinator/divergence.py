"""The per-tensor divergence check of an applied aggregate update (``federation.divergence-max``).

Owns: ``diverging`` (which tensors of an aggregate update move further than the threshold),
``divergence_warning`` (the one ASCII sentence) and ``check_update`` (recording it as a warning). For the
aggregate update ``Δ`` (the mean of the contributors' clipped deltas, noise included, exactly what is added
to the global weights) and each trainable tensor ``k``::

    m_k = max_i |Δ_k,i|                    []  over the tensor's elements
    flagged = {k : m_k > divergence_max}   sorted by m_k, largest first

A single element moving far in one round is the early sign of a diverging expert or router row that the
norm clip does not catch (the clip bounds the whole update, not one tensor of it). The check reads the
aggregate only, which the server holds anyway: it costs no privacy and changes nothing (a warning, the
update is still applied).

Must not: import ``flwr``, alter the update, or read anything a party sent except the aggregate.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from distmoe.coordinator.context import RunContext

NAMES_SHOWN = 5  # tensors named in one warning (the count is always given)
TEXT_MAX = 480  # below the audit's bound on the coordinator's sentences (distmoe.audit.schemas.TEXT_MAX)


def diverging(delta: Mapping[str, np.ndarray], limit: float) -> list[tuple[str, float]]:
    """``(tensor name, max |Δ|)`` of every tensor of ``delta`` whose largest absolute element exceeds ``limit``
    (a non-finite maximum counts as exceeding), largest first; nothing when ``limit <= 0`` (off)."""
    if limit <= 0:
        return []
    out = []
    for name, d in delta.items():
        a = np.abs(np.asarray(d, np.float64))
        m = float(a.max()) if a.size else 0.0
        if not m <= limit:  # NaN included
            out.append((name, m))
    return sorted(out, key=lambda x: (-x[1] if np.isfinite(x[1]) else -np.inf, x[0]))


def divergence_warning(flagged: list[tuple[str, float]], limit: float, n_tensors: int, event: str) -> str:
    """The recorded sentence (ASCII, at most a few hundred characters): how many tensors, the largest few."""
    shown = ", ".join(f"{name} {m:.4g}" for name, m in flagged[:NAMES_SHOWN])
    more = f", +{len(flagged) - NAMES_SHOWN} more" if len(flagged) > NAMES_SHOWN else ""
    return (f"{event} update diverges: max|delta| above federation.divergence-max = {limit:g} in "
            f"{len(flagged)} of {n_tensors} tensors: {shown}{more}")


def check_update(co: RunContext, event: str, delta: Mapping[str, np.ndarray]) -> str | None:
    """Run the check on an applied aggregate update of ``event`` (``train`` / ``rl``) and record a flag as a
    warning: the progress stream, ``run.json`` ``warnings`` (the report's Warnings) and ``metrics.jsonl``
    (``event: anomaly``). Returns the sentence, or None when nothing is flagged or the check is off."""
    limit = co.cfg.federation.divergence_max
    flagged = diverging(delta, limit)
    if not flagged:
        return None
    rnd = co.s.round
    text = divergence_warning(flagged, limit, len(delta), event)[:TEXT_MAX]
    co.say(f"round {rnd}: WARNING: {text}", wrapped=True)
    co.record.append("warnings", f"round {rnd}: {text}")
    co.metrics.append({"event": "anomaly", "round": rnd, "kind": event, "party": "all", "detail": text})
    return text
