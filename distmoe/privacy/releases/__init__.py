"""One module per kind of release that leaves a party, each used by both sides: ``RELEASES`` maps the sum a
phase asks for (``update``, ``stats``, ``eval``) to its module.

Each release module holds its spec or layout (the public facts both sides derive the same vector from), the
party's encoding and noise (``encode``, and ``add_noise`` for the update's client-level DP), and the coordinator's
``prepare(facts, kind, release, instr)``: the vector's length and ring, the DP event at ``n_active`` survivors, and
``open(secure_sum)`` (decoding, bound check, the ledger entry's DP facts and info). The training metrics ride in
the update release (``update.py``, slots of ``distmoe.privacy.train_metrics``). The coordinator's secure aggregator
(``distmoe.coordinator.secure``) and the party's service (``distmoe.party.service``) dispatch through this table;
a phase that reuses one of these releases adds no privacy code.

Must not: import torch or ``flwr``, talk to a party, or hold a party's individual reply on the coordinator's side.
"""

from __future__ import annotations

from distmoe.privacy.releases import evaluate, stats, update

RELEASES = {"update": update, "stats": stats, "eval": evaluate}
