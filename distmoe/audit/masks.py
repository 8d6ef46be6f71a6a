"""The audit's ``mask-uniformity`` check: every masked input a party sent was masked.

Owns: ``check_masks(parties) -> (findings, notes)`` (``distmoe.audit.engine`` turns them into the
``mask-uniformity`` check). ``parties`` maps a party name to the entries of its verified ledger. Every
accepted ``out`` entry of a ``masked-input:<release>`` payload must carry the uniformity statistic its
outbound guard recorded (``info.mask_check``: the sign-run test of ``distmoe.privacy.secagg.selftest``) and
the verdict is recomputed from its counts (``words``, ``sign_run``), not read from the recorded p-value: a
masked input whose words look like fixed-point plaintext (a zero or broken PRG) fails, as does a masked
input with no statistic. The ``no-plaintext`` check looks at mode labels only; this one at what was sent.

What it cannot see: a PRG that is uniform-looking but predictable to the server (``docs/privacy.md``).

Must not: import ``flwr``, read anything but the ledger entries it is given, or write anything.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from distmoe.privacy.secagg.selftest import ALPHA_LOG2, mask_check_failure

CHECK = "mask-uniformity"
MASKED = "masked-input:"


def check_masks(parties: Mapping[str, Iterable[Mapping[str, Any]]]) -> tuple[list[str], list[str]]:
    findings: list[str] = []
    n_checked = 0
    for name, entries in sorted(parties.items()):
        for e in entries:
            pt = e.get("payload_type")
            if e.get("direction") != "out" or not isinstance(pt, str) or not pt.startswith(MASKED):
                continue
            if e.get("verdict") != "accepted":
                continue  # nothing left (the no-blocked check reports it)
            info = e.get("info") if isinstance(e.get("info"), dict) else {}
            where = f"{name}#{e.get('seq')} {pt}" + (f" (round {e['round']})" if e.get("round") is not None else "")
            why = mask_check_failure(info.get("mask_check"))
            n_checked += 1
            if why is not None:
                findings.append(f"{where}: {why}")
    notes = [f"{n_checked} masked inputs checked (sign-run test, false-alarm level 2^{ALPHA_LOG2} each)"]
    return findings, notes
