"""The run report: the Markdown + PNG report (``report``) and the TensorBoard scalars (``tensorboard``) of a run.

Owns: what a run's records show, read through the one reader of a run directory (``distmoe.rundir``, which also
owns the metrics log's format).

Must not: import ``flwr`` or ``torch``, or read models, checkpoints or data. A report is built from
``metrics.jsonl``, ``run.json`` and the server's accountants only.
"""
