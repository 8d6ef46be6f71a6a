"""The party (a data owner's side of a run), independent of Flower: ``docs/architecture.md``.

Modules: ``service`` (``PartyService.answer``: every instruction a party is asked, dispatched to its own
work or secure-aggregation stage) and ``session`` (the party's secure-aggregation client, accountant and
ledger key, persisted in its work directory between messages).

Must not: import ``flwr`` (``clients/app.py`` adapts it to Flower's ClientApp).
"""
