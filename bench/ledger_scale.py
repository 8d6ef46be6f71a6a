"""A party's per-message ledger cost against its ledger's length: what opening the ledger (``PartyService`` opens it
for every message) and refreshing the run receipt (``PartyService.after_reply``) cost, in thread CPU, once a party's
ledger holds N entries (1,000 secure rounds write about 6,000: an ``in`` and an ``out`` entry per message, three
messages per round).

    python bench/ledger_scale.py [--entries 100 1000 6000]

Per N: a fresh work directory whose ledger holds N entries of one run (``sft`` instruction in, masked input out with
DP facts, unmask request in, unmask response out, round after round), then per message as a party does it: open the
ledger (``distmoe.party.session.open_ledger``), append the message's two entries, write the receipt
(``distmoe.party.receipt.write_receipt``); the median of 5 such messages after a first one (the first after the file
was written by another process reads and checks everything once). It imports distmoe from ``PYTHONPATH``: point that
at the checkout to measure (two checkouts side by side for a paired comparison).

Must not: be imported by the library (bench only).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from distmoe.config import parse_node_config, parse_run_config
from distmoe.ledger import describe_payload
from distmoe.party.receipt import write_receipt
from distmoe.party.session import open_ledger

RUN = "scale-run"


def _entry(led, rnd: int, k: int, d: dict) -> None:
    kind = k % 4
    direction = "in" if kind in (0, 2) else "out"
    ptype = ("sft-instruction", "masked-input:update", "unmask-request", "unmask-response")[kind]
    extra = {"anchor": {"node": "coordinator", "seq": 4 * rnd + kind, "hash": "a" * 64}} if kind == 0 else {}
    if kind == 1:
        extra["dp"] = {"epsilon": 0.01 * rnd, "budget": 8.0}
    led.append(run=RUN, round=rnd, phase="sft", direction=direction, payload_type=ptype, keys=["w"],
               shapes={"w": [7_100_000]}, **d, verdict="accepted", **extra)


def measure(n: int) -> tuple[float, float]:
    cfg = parse_run_config({})
    with tempfile.TemporaryDirectory() as tmp:
        node = parse_node_config({"data-path": tmp, "party-name": "party-0", "work-dir": str(Path(tmp) / "w")},
                                 cfg.sim)
        d = describe_payload(b"x")
        led = open_ledger(node)
        with led.batch():
            for k in range(n):
                _entry(led, 1 + k // 4, k, d)
        del led
        opens, receipts = [], []
        for m in range(6):
            t0 = time.thread_time()
            led = open_ledger(node)
            t1 = time.thread_time()
            _entry(led, 1 + (n + 2 * m) // 4, n + 2 * m, d)
            _entry(led, 1 + (n + 2 * m + 1) // 4, n + 2 * m + 1, d)
            t2 = time.thread_time()
            write_receipt(cfg, node, RUN)
            t3 = time.thread_time()
            if m:
                opens.append(t1 - t0)
                receipts.append(t3 - t2)
        return statistics.median(opens), statistics.median(receipts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--entries", type=int, nargs="+", default=[100, 1000, 6000])
    args = ap.parse_args()
    for n in args.entries:
        o, r = measure(n)
        print(f"{n:6d} entries: ledger open {1000 * o:8.2f} ms, receipt {1000 * r:8.2f} ms thread CPU per message")


if __name__ == "__main__":
    main()
