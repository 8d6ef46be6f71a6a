"""The two ways a coordinator run ends early.

Owns: ``RunFailed`` (the schedule cannot continue: too few parties, nothing usable, a refused resume)
and ``PrivacyStop`` (a release would exceed a party's budget, or secure aggregation cannot be set up:
the run stops before anything is unmasked).

Must not: import anything of distmoe.
"""

from __future__ import annotations


class RunFailed(RuntimeError):
    """The schedule cannot continue (no parties, nothing usable, a resume that is refused)."""


class PrivacyStop(RuntimeError):
    """The run must stop before a release (budget, or too few parties for the threshold)."""
