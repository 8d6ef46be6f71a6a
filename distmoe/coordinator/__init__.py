"""The coordinator (server side of a run), independent of Flower: ``docs/architecture.md``.

Modules, in reading order: ``loop`` (the round loop: ``Coordinator``, which owns the exchange), ``context``
(``RunContext``: what phases and setup steps see of a run), ``phases`` (one ``PhaseStep`` per phase kind:
``sft``, ``dpo``, ``rl``, ``stats``, ``evaluate``), ``aggregator`` (the ``Aggregator`` interface and the plaintext
baseline), ``secure`` (the secure aggregator) and ``secagg`` (the server's SecAgg driver), ``plane``
(ledger, allow-list, guard, setup), ``state`` (round state and checkpoints), ``resume``, ``start``, ``expand``,
``record`` (``run.json``, anomalies), ``errors``. The transport is ``distmoe.wire.server_guard.GuardedTransport``.

Must not: import ``flwr`` (``server/app.py`` adapts it to Flower's ``Grid``).
"""

from distmoe.coordinator.errors import PrivacyStop, RunFailed
from distmoe.coordinator.loop import PLAINTEXT_WARNING, Coordinator
from distmoe.coordinator.resume import RESUME_MAY_CHANGE, check_resumable, config_differences

__all__ = ["PLAINTEXT_WARNING", "RESUME_MAY_CHANGE", "Coordinator", "PrivacyStop", "RunFailed",
           "check_resumable", "config_differences"]
