"""The privacy math: DP mechanisms and integer encoding (``dp``), client-level update noise
(``update_noise``), the vector layouts of each release (``vectors``), privacy accounting
(``accountant``), the privacy plan (``plan``) and the secure-aggregation protocol (``secagg``).

Must not: import ``flwr``, talk to other processes, or read party data: the coordinator
(``distmoe.coordinator.secagg``) and the party (``distmoe.party.session``) drive it.
"""
