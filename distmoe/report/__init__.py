"""Run records and the run report.

Owns: the append-only, crash-safe metrics log (``metrics_log``) and the Markdown + PNG report built
from a run directory (``report``).

Must not: import ``flwr`` or ``torch``, or read models, checkpoints or data. A report is built from
``metrics.jsonl`` and ``run.json`` only.
"""
