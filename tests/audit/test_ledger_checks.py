"""The checks that the coordinator's ledger is whole (``distmoe.audit.ledgers``), on hand-built entries.

Whole-run attacks (a cut, a deleted release re-signed with the run's key, a reordering) are in
``tests/coordinator/test_ledger_cut.py``; the party side of the heads in ``tests/wire/test_coordinator_heads.py``.
"""

from __future__ import annotations

import hashlib

import pytest

from distmoe.audit.ledgers import check_coverage, check_heads, check_run_end, fold_party_charges, party_charges


def _h(*parts) -> str:
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def _coord_run(rounds=(1, 2), release_rounds=(1, 2), z=3.0):
    """A coordinator ledger: per round one instruction, a masked input, an unmask request and reply per
    party (2 parties), then the release; and the two parties' ledgers with the heads they recorded."""
    coord, parties = [], {"p0": [], "p1": []}

    def c(**e):
        e = {"seq": len(coord), **e}
        e["hash"] = _h("c", e["seq"], e.get("payload_type"), e.get("sha256"))
        coord.append(e)
        return e

    def p(name, **e):
        e = {"seq": len(parties[name]), **e}
        e["hash"] = _h(name, e["seq"])
        parties[name].append(e)
        return e

    c(round=0, direction="out", payload_type="policy", sha256=_h("policy"))
    for r in rounds:
        for step, (ptype, reply) in enumerate(
            (("stats-instruction", "masked-input:router-stats"), ("unmask-request", "unmask-response"))
        ):
            for name in parties:
                sha = _h(ptype, r, name)
                ce = c(round=r, direction="out", payload_type=ptype, sha256=sha, peer=name, verdict="accepted")
                p(
                    name,
                    round=r,
                    direction="in",
                    payload_type=ptype,
                    sha256=sha,
                    verdict="accepted",
                    anchor={"node": "coordinator", "seq": ce["seq"], "hash": ce["hash"]},
                )
                dp = {"noise_multiplier": z, "epsilon": 2.0 * r} if step == 0 else None
                pe = p(
                    name,
                    round=r,
                    direction="out",
                    payload_type=reply,
                    sha256=_h(reply, r, name),
                    dp=dp,
                    verdict="accepted",
                )
                c(
                    round=r,
                    direction="in",
                    payload_type=reply,
                    sha256=pe["sha256"],
                    peer=name,
                    verdict="accepted",
                    anchor={"node": name, "seq": pe["seq"], "hash": pe["hash"]},
                )
        if r in release_rounds:
            c(
                round=r,
                direction="in",
                payload_type="release:router-stats",
                peer="all",
                verdict="accepted",
                dp={"noise_multiplier": z},
                info={"included": list(parties)},
            )
    c(round=max(rounds), direction="out", payload_type="run-end", info={"status": "completed"})
    return coord, parties


def test_honest_ledgers_pass_every_check():
    coord, parties = _coord_run()
    assert check_run_end(coord)[0] == []
    assert check_heads(coord, parties)[0] == []
    assert check_coverage(coord, parties)[0] == []


# ------------------------------------------------------------------------------------------------ run-end
@pytest.mark.parametrize(
    "damage, needle",
    [
        ("cut", "has no run-end entry"),
        ("after", "follow the last run-end"),
        ("status", "is not one of"),
        ("empty", "is empty"),
    ],
)
def test_an_unclosed_ledger_fails_run_end(damage, needle):
    coord, _ = _coord_run()
    if damage == "cut":
        coord = coord[:-3]
    elif damage == "after":
        coord = [*coord, {**coord[1], "seq": len(coord)}]
    elif damage == "status":
        coord[-1]["info"] = {"status": "fine"}
    else:
        coord = []
    (finding,) = check_run_end(coord)[0]
    assert needle in finding


def test_an_interrupted_run_is_closed_and_says_so():
    coord, _ = _coord_run()
    coord[-1]["info"] = {"status": "interrupted"}
    findings, notes = check_run_end(coord)
    assert findings == [] and any("ended interrupted" in n for n in notes)


# ------------------------------------------------------------------------------------------------- heads
def test_a_cut_coordinator_ledger_misses_the_heads_the_parties_recorded():
    coord, parties = _coord_run()
    findings, _ = check_heads(coord[:9], parties)
    assert findings and all("was cut" in f for f in findings)
    assert {f.split("#")[0] for f in findings} == {"p0", "p1"}


@pytest.mark.parametrize(
    "edit, needle",
    [
        ("hash", "was rewritten"),
        ("sha", "is not the instruction"),
        ("order", "were reordered"),
        ("missing", "records no coordinator ledger head"),
    ],
)
def test_rewritten_or_reordered_heads_fail(edit, needle):
    coord, parties = _coord_run()
    inbound = [e for e in parties["p1"] if e["direction"] == "in"]
    if edit == "hash":  # a re-signed chain has other hashes from the first change on
        coord[inbound[1]["anchor"]["seq"]]["hash"] = _h("forged")
    elif edit == "sha":
        coord[inbound[1]["anchor"]["seq"]]["sha256"] = _h("another instruction")
    elif edit == "order":
        inbound[1]["anchor"], inbound[2]["anchor"] = inbound[2]["anchor"], inbound[1]["anchor"]
    else:
        del inbound[0]["anchor"]
    findings, _ = check_heads(coord, parties)
    assert any(needle in f for f in findings) and all(f.startswith("p1#") for f in findings), findings


# ------------------------------------------------------------------------------------------------- coverage
def test_unmask_replies_without_a_release_fail_coverage_with_and_without_party_ledgers():
    coord, parties = _coord_run(release_rounds=(1,))
    for given in (parties, {}):
        findings, _ = check_coverage(coord, given)
        assert any(f.startswith("round 2: ") and "no release entry" in f for f in findings), findings
    coord_only = [e for e in coord if not (e["round"] == 2 and e["payload_type"] == "unmask-response")]
    findings, _ = check_coverage(coord_only, parties)  # the party ledgers still hold their unmask replies
    assert any(f.startswith("round 2: 2 unmask replies (p0#") for f in findings), findings
    assert check_coverage(coord_only, {})[0] == []  # nothing to witness it without them


def test_a_received_dp_input_left_out_of_its_release_fails_coverage():
    coord, parties = _coord_run()
    rel = [e for e in coord if e["payload_type"] == "release:router-stats"][1]
    rel["info"] = {"included": ["p0"]}
    (finding,) = check_coverage(coord, parties)[0]
    assert finding.startswith("p1#") and "naming p1" in finding


def test_a_release_claiming_another_noise_multiplier_fails_coverage():
    coord, parties = _coord_run()
    [e for e in coord if e["payload_type"] == "release:router-stats"][0]["dp"] = {"noise_multiplier": 6.0}
    findings, _ = check_coverage(coord, parties)
    assert len(findings) == 2 and all("noise multiplier 3.0" in f for f in findings)


def test_a_stragglers_input_the_coordinator_never_logged_needs_no_release():
    coord, parties = _coord_run()
    late = next(e for e in parties["p1"] if e.get("dp") and e["round"] == 2)
    coord = [e for e in coord if (e.get("anchor") or {}).get("seq") != late["seq"] or e.get("peer") != "p1"]
    rel = [e for e in coord if e["payload_type"] == "release:router-stats"][1]
    rel["info"] = {"included": ["p0"]}
    assert check_coverage(coord, parties)[0] == []


# -------------------------------------------------------------------------------------------- party charges
def test_epsilon_is_the_larger_of_the_coordinators_figure_and_the_partys_signed_charges():
    _, parties = _coord_run()
    charges = party_charges(parties)
    assert charges["p0"][0] == 4.0 and charges["p0"][1].startswith("p0#")
    table = {"p0": {"epsilon": 0.0, "status": "pass"}, "p1": {"epsilon": 5.0, "status": "pass"}}
    findings, notes = fold_party_charges(table, charges, 8.0)
    assert findings == [] and table["p0"]["epsilon"] == 4.0 and table["p1"]["epsilon"] == 5.0
    assert table["p0"]["coordinator_epsilon"] == 0.0 and table["p0"]["party_epsilon"] == 4.0
    assert len(notes) == 1 and notes[0].startswith("p0:")
    table = {"p0": {"epsilon": 0.0, "status": "pass"}}
    (finding,) = fold_party_charges(table, charges, 3.0)[0]
    assert table["p0"]["status"] == "fail" and "over the budget 3" in finding
