"""The wire: the one narrow boundary every object leaving or entering a process passes through.

Modules: ``schema`` (the closed set of payload dataclasses and the reply string allow-list), ``codec``
(the only place Flower records are built and read), ``inspect`` (strict parsing of what arrived),
``party_guard`` (the outbound guard: ``serve`` runs every instruction at a party), ``server_guard``
(the run's allow-list, the inbound guard, the guarded exchange), ``errors`` (named error codes).

Must not: run a party's work, aggregate, or draw DP noise (``docs/architecture.md``, The wire rule).
"""
