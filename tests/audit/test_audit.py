"""The privacy audit (``distmoe audit``) on synthetic run directories written with the real signed ledger.

Each failure test breaks one thing in an otherwise honest run and asserts that exactly the check meant to
catch it fails. Run: ``python -m pytest tests/audit/test_audit.py -q``.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from types import SimpleNamespace

import numpy as np
import pytest

from distmoe.audit import CHECKS, audit_run
from distmoe.cli import main
from distmoe.deploy.receipt import sign_receipt
from distmoe.ledger import (
    SIG_DOMAIN,
    Ledger,
    canonical_json,
    describe_payload,
    entry_hash,
    generate_signing_key,
    load_signing_key,
    public_key_hex,
)
from distmoe.party.receipt import receipt_body
from distmoe.privacy.accountant import Accountant, PrivacyEvent, epsilon_from_events
from distmoe.privacy.dp import SkellamSpec, canary_positions, canary_seed, positions_digest
from distmoe.privacy.metric_noise import EvalSpec
from distmoe.privacy.releases.stats import event as stats_event
from distmoe.privacy.secagg.primitives import prg
from distmoe.privacy.secagg.selftest import mask_statistic
from distmoe.privacy.update_noise import update_dp_facts, update_event

PARTIES = ("party-0", "party-1", "party-2")
L, E, K = 4, 8, 256
Z, NMAX, DELTA, SCALE = 3.0, 10_000, 1e-6, 64
N_SEQ = 400  # sequences per party
N_CANARY_STRINGS = 2
RUN_ID = "audit-test"
VEC = [1, L * E + K]
POLICY = {
    "setup-request": {"keys": ["setup.round"], "shapes": {}, "max_bytes": 4096},
    "key-advert": {"keys": ["advert.ledger-key", "advert.pk1", "advert.pk2"],
                   "shapes": {"advert.pk1": [32], "advert.pk2": [32]}, "max_bytes": 4096},
    "stats-instruction": {"keys": ["plan.round", "weights.global"], "shapes": {}, "max_bytes": 1 << 24},
    "masked-input:router-stats": {"keys": ["masked.vector", "meta.num-examples"], "shapes": {"masked.vector": VEC},
                                  "max_bytes": 8 * VEC[1] + 4096},
}


def _spec() -> SkellamSpec:
    return SkellamSpec(L, E, Z, n_parties=len(PARTIES), num_sequences_max=NMAX, scale=SCALE, n_canaries=K,
                       max_dropouts=1)


def make_run(root, *, mode="secagg", epsilon=8.0, min_parties=2, canary_noise=1.0, responders=None, blocked=(),
             extra_key=None, row_bias=0.0, z_eff_factor=1.0, scan=True, sha_mismatch=None, policy=None, seed=0,
             update_z=0.0, forge=None, mask_check=None, row_noise=1.0, tail_canaries=False, party_seed=None,
             eval_z=0.0, eval_forge=None):
    """Write an honest run (setup key exchange + 2 router-stats rounds) under ``root/run``; knobs break it.

    ``responders``: {round: parties that reply}; ``blocked``: {(round, party)} replies the client guard
    blocked; ``extra_key``: (round, party[, keys...]) whose reply carries these keys (default: one outside the policy);
    ``sha_mismatch``: (round, party) whose reply the coordinator logs with another digest; ``update_z``:
    add a round-3 DP model-update release at that z_u (all parties); ``forge``: dp fields it claims instead;
    ``mask_check``: {(round, party): facts} recorded as that masked input's uniformity statistic (default: the
    statistic of a real ChaCha20 mask vector; ``None`` as a value records none); ``row_noise``: the share of the
    claimed noise std in the row sums (0: every row exactly N*s); ``tail_canaries``: the coordinator records the
    canaries as the last K coordinates instead of the seed's positions; ``party_seed``: {(round, party): hex}
    canary seed that party records instead of the round's; ``eval_z``: add a round-4
    evaluation release at that z_m (all parties), with ``eval_forge`` dp fields instead (``False``: dp null).
    """
    run = root / "run"
    rng = np.random.default_rng(seed)
    mask_rng = np.random.default_rng([seed, 1])  # mask keys: apart from rng, so the other draws stay as they were
    key_rng = np.random.default_rng([seed, 2])  # SecAgg round mask keys (U1), also apart
    secagg_run = b"secagg-" + RUN_ID.encode()
    spec = _spec()
    common = {"run": RUN_ID}

    coord = Ledger(run / "ledger" / "coordinator.jsonl", generate_signing_key(root / "keys" / "coordinator.pem"))
    (run / "ledger" / "coordinator.pub").write_text(coord.public_key_hex + "\n")
    led, canaries = {}, {}
    for i, p in enumerate(PARTIES):
        led[p] = Ledger(run / "work" / p / "ledger" / f"{p}.jsonl", generate_signing_key(root / "keys" / f"{p}.pem"))
        (run / "work" / p / "ledger" / f"{p}.pub").write_text(led[p].public_key_hex + "\n")
        data = root / "data" / p
        data.mkdir(parents=True)
        canaries[p] = [f"CANARY-{p}-{j}-{rng.integers(1 << 60):x}" for j in range(N_CANARY_STRINGS)]
        (data / "canaries.txt").write_text("\n".join(canaries[p]) + "\n")
        (run / "nodes").mkdir(exist_ok=True)
        (run / "nodes" / f"node-{100 + i}.toml").write_text(f'data-path = "{data}"\n')
    privacy = {"privacy.epsilon": epsilon, "privacy.delta": DELTA, "privacy.min-parties": min_parties,
               "privacy.num-sequences-max": NMAX, "privacy.mode": mode, "privacy.noise-multiplier": Z}

    policy = POLICY if policy is None else policy
    pol = canonical_json(policy).encode("ascii")
    coord.append(**common, round=None, phase="run-start", direction="out", payload_type="policy", keys=[],
                 shapes={}, **describe_payload(pol), verdict="accepted",
                 info={"policy": policy, "mode": mode, "privacy": privacy})

    def send(rnd, phase, p, ptype, keys):
        d = describe_payload(f"{ptype}/{rnd}/{p}".encode())
        ce = coord.append(**common, round=rnd, phase=phase, direction="out", peer=p, payload_type=ptype, keys=keys,
                          shapes={}, **d, verdict="accepted")
        led[p].append(**common, round=rnd, phase=phase, direction="in", peer="coordinator", payload_type=ptype,
                      keys=keys, shapes={}, **d, verdict="accepted",  # the coordinator head the instruction carried
                      anchor={"node": "coordinator", "seq": ce["seq"], "hash": ce["hash"]})

    def reply(rnd, phase, p, ptype, keys, shapes, dp=None, info=None):
        d = describe_payload(f"{ptype}/{rnd}/{p}/reply".encode())
        if extra_key is not None and (rnd, p) == tuple(extra_key[:2]):
            keys = [*keys, *(extra_key[2:] or ("stats.raw",))]
        rejected = (rnd, p) in blocked
        out_info = {"canary_scan": {"strings": N_CANARY_STRINGS, "hits": 0}} if scan else {}
        if ptype.startswith("masked-input:"):
            honest = mask_statistic(prg(bytes(mask_rng.integers(0, 256, 32, dtype=np.uint8)), VEC[1], 64))
            facts = (mask_check or {}).get((rnd, p), honest)
            if facts is not None:
                out_info["mask_check"] = facts
        pe = led[p].append(**common, round=rnd, phase=phase, direction="out", peer="coordinator", payload_type=ptype,
                           keys=keys, shapes=shapes, **d, dp=dp, info=out_info,
                           verdict="rejected: byte budget exceeded" if rejected else "accepted")
        if rejected:
            return False
        if (rnd, p) == sha_mismatch:
            d = describe_payload(b"something else")
        coord.append(**common, round=rnd, phase=phase, direction="in", peer=p, payload_type=ptype, keys=keys,
                     shapes=shapes, **d, verdict="accepted", info=info or {},
                     anchor={"node": p, "seq": pe["seq"], "hash": pe["hash"]})
        return True

    for p in PARTIES:  # setup: key adverts pin each party's ledger key
        send(0, "setup", p, "setup-request", ["setup.round"])
        reply(0, "setup", p, "key-advert", ["advert.ledger-key", "advert.pk1", "advert.pk2"],
              {"advert.pk1": [32], "advert.pk2": [32]}, info={"ledger_public_key": led[p].public_key_hex})

    events = {p: [] for p in PARTIES}
    for rnd in (1, 2):
        included = []
        for p in PARTIES:
            send(rnd, "stats", p, "stats-instruction", ["plan.round", "weights.global"])
        u1 = [(100 + i, bytes(key_rng.integers(0, 256, 32, dtype=np.uint8))) for i in range(len(PARTIES))]
        cseed = canary_seed(secagg_run, rnd, u1)
        for p in (responders or {}).get(rnd, PARTIES):
            own = (party_seed or {}).get((rnd, p), cseed.hex())
            if reply(rnd, "stats", p, "masked-input:router-stats", ["masked.vector", "meta.num-examples"],
                     {"masked.vector": VEC}, dp={**spec.dp_params(), "canary_seed": own}):
                included.append(p)
        n = len(included)
        dp = spec.dp_params(n)
        dp["z_eff"] *= z_eff_factor
        sigma = spec.aggregate_sigma(n)
        values = np.rint(rng.normal(0.0, sigma * canary_noise, K)).astype(int).tolist()
        rows = n * N_SEQ * SCALE + row_noise * rng.normal(0.0, math.sqrt(E) * sigma, L)
        pos = np.arange(L * E, L * E + K) if tail_canaries else canary_positions(cseed, L * E + K, K)
        canary = {"k": K, "values": values, "seed": cseed.hex(), "secagg_run": secagg_run.hex(),
                  "u1": [[c, k.hex()] for c, k in u1], "positions_sha256": positions_digest(pos)}
        rows[0] += row_bias * math.sqrt(E) * sigma
        coord.append(**common, round=rnd, phase="stats", direction="in", peer="all",
                     payload_type="release:router-stats", keys=[], shapes={"sum": [L * E + K]},
                     **describe_payload(f"sum/{rnd}".encode()), dp=dp, verdict="accepted",
                     info={"mode": mode, "release": "router-stats", "included": included,
                           "dropped": [p for p in PARTIES if p not in included], "responders": included,
                           "layers": L, "experts": E, "canary": canary,
                           "row_sums": np.rint(rows).astype(int).tolist()})
        for p in included:
            events[p].append(stats_event(spec, n, f"router-stats round {rnd}"))
    if update_z:  # what distmoe.privacy.releases.update opens for a DP update over all parties (t = n - d_max)
        t = len(PARTIES) - spec.max_dropouts
        dp = {**update_dp_facts(SimpleNamespace(clip=1.0, sensitivity=1.0), update_z, len(PARTIES), t,
                                len(PARTIES)), **(forge or {})}
        coord.append(**common, round=3, phase="sft", direction="in", peer="all", payload_type="release:model-update",
                     keys=[], shapes={"sum": [64]}, **describe_payload(b"update/3"), dp=dp, verdict="accepted",
                     info={"mode": mode, "release": "model-update", "included": list(PARTIES), "dropped": [],
                           "responders": list(PARTIES), "weight_sum": float(len(PARTIES))})
        for p in PARTIES:
            events[p].append(update_event(update_z, len(PARTIES), t, "model-update round 3"))
    if eval_z:  # what distmoe.privacy.releases.evaluate opens for an evaluation release over all parties
        es = EvalSpec(("arith",), eval_z, len(PARTIES), spec.max_dropouts, 48, 16.0)
        dp = None if eval_forge is False else {**es.dp_params(len(PARTIES)), **(eval_forge or {})}
        coord.append(**common, round=4, phase="eval", direction="in", peer="all", payload_type="release:eval",
                     keys=[], shapes={"sum": [3]}, **describe_payload(b"eval/4"), dp=dp, verdict="accepted",
                     info={"mode": mode, "release": "eval", "included": list(PARTIES), "dropped": [],
                           "responders": list(PARTIES), "tasks": ["arith"], "applied": True})
        for p in PARTIES:
            events[p].append(es.event(len(PARTIES), "eval round 4"))
    coord.append(**common, round=None, phase="run-end", direction="out", payload_type="run-end", keys=[], shapes={},
                 **describe_payload(b"done"), verdict="accepted", info={"status": "completed"})

    server = {}
    for p in PARTIES:
        acc = Accountant(DELTA, epsilon)
        acc.load_state_dict({**acc.state_dict(), "events": [e.to_dict() for e in events[p]]})
        server[p] = acc.state_dict()
    (run / "privacy").mkdir()
    (run / "privacy" / "ledger.json").write_text(json.dumps({"epsilon_budget": epsilon, "delta": DELTA,
                                                             "parties": server}))
    meta = {"run_id": RUN_ID, "status": "completed", "config": {**privacy, "data.canary-file": ""}, "privacy": {},
            "parties": {p: {"node": str(100 + i), "ledger_public_key": led[p].public_key_hex}
                        for i, p in enumerate(PARTIES)}}
    (run / "run.json").write_text(json.dumps(meta))
    (run / "metrics.jsonl").write_text('{"event": "stats", "round": 1}\n')
    for p in PARTIES:  # each party's signed run receipt, as distmoe.party.receipt writes it (outside the run dir)
        entries = [json.loads(x) for x in _ledger_path(run, p).read_text().splitlines()]
        body = receipt_body(entries, RUN_ID, p, DELTA, epsilon, None)
        (root / "receipts").mkdir(exist_ok=True)
        (root / "receipts" / f"{p}.json").write_text(json.dumps(sign_receipt(body, load_signing_key(
            root / "keys" / f"{p}.pem"))))
    return run, canaries


def _receipts(run, *parties):
    """The receipt files ``make_run`` wrote for ``parties`` (default: all)."""
    return [run.parent / "receipts" / f"{p}.json" for p in (parties or PARTIES)]


def _ledger_path(run, p):
    return run / "work" / p / "ledger" / f"{p}.jsonl"


def _rewrite(path, fn):
    """Apply ``fn(list of entry dicts)`` and write the lines back (canonical JSON, as the ledger does)."""
    entries = [json.loads(x) for x in path.read_text().splitlines()]
    entries = fn(entries)
    path.write_text("".join(canonical_json(e) + "\n" for e in entries))


def _failed(result):
    return sorted(result.failed)


# ------------------------------------------------------------------------------------------------ honest
def test_honest_run_passes_and_writes_report(tmp_path, capsys):
    run, canaries = make_run(tmp_path)
    assert main(["audit", str(run)]) == 0
    out = capsys.readouterr().out
    assert "PASS" in out and str(run / "audit" / "audit.md") in out
    report = json.loads((run / "audit" / "audit.json").read_text())
    assert report["verdict"] == "pass" and report["failed"] == []
    assert [c["name"] for c in report["checks"]] == list(CHECKS)
    assert report["verified"] and report["exit_status"] == 0 and report["unwitnessed"] == []
    assert all(c["status"] == "pass" for c in report["checks"] if c["name"] != "receipts"), report["checks"]
    assert report["checks"][-1]["status"] == "skipped"  # every party's ledger is here: no receipt needed
    assert set(report["ledgers"]) == {"coordinator", *PARTIES}
    for p in PARTIES:
        row = report["epsilon"][p]
        assert row["releases"] == 2 and 0 < row["epsilon"] <= 8.0
        assert row["epsilon"] == max(row["eps_prv"], row["eps_rdp"])
        assert row["server_epsilon"] == pytest.approx(row["epsilon"])
    assert [r["type"] for r in report["releases"]] == ["release:router-stats"] * 2
    assert all(0.9 < r["sigma_ratio"] < 1.1 for r in report["releases"])
    md = (run / "audit" / "audit.md").read_text()
    assert md.startswith("# Privacy audit") and "**Verdict: PASS**" in md.splitlines()[2]
    assert "| party |" in md and "| ledger-integrity | pass |" in md
    assert not list((run / "audit").glob(".*.tmp"))  # atomic writes leave no temp files
    text = md + json.dumps(report) + out
    assert not any(s in text for v in canaries.values() for s in v)


def test_json_output_and_library_api(tmp_path, capsys):
    run, _ = make_run(tmp_path)
    assert main(["audit", str(run), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["verdict"] == "pass"
    result = audit_run(run)
    assert result.passed and result.check("epsilon").status == "pass"


def test_one_run_id_the_flower_id_only_as_a_detail(tmp_path, capsys):
    run, _ = make_run(tmp_path)  # run.json has no run.name: the run's id is its directory's name
    assert main(["audit", str(run), "--json"]) == 0
    body = json.loads(capsys.readouterr().out)
    assert body["run_id"] == run.name and body["flower_run_id"] == RUN_ID
    md = (run / "audit" / "audit.md").read_text()
    assert md.splitlines()[0] == f"# Privacy audit: {run.name}" and "Flower's run id (a detail" in md
    meta = json.loads((run / "run.json").read_text())
    (run / "run.json").write_text(json.dumps({**meta, "name": "night-shift"}))
    assert audit_run(run).run_id == "night-shift"


def test_out_writes_a_data_owners_audit_apart_from_the_coordinators(tmp_path, capsys):
    """``distmoe audit --out DIR`` (docs/deploy.md §1.6): the report goes to DIR; RUN/audit is not touched."""
    run, _ = make_run(tmp_path)
    assert main(["audit", str(run)]) == 0
    before = (run / "audit" / "audit.json").read_bytes()
    mine = tmp_path / "owner-audit"
    own = ["audit", str(run), "--party-ledger", str(_ledger_path(run, PARTIES[0])), "--out", str(mine)]
    assert main(own) == 3  # the other owners witnessed nothing here: unverified
    capsys.readouterr()
    assert main([*own, *(a for f in _receipts(run, *PARTIES[1:]) for a in ("--receipt", str(f)))]) == 0
    assert str(mine / "audit.md") in capsys.readouterr().out
    assert json.loads((mine / "audit.json").read_text())["ledgers"].keys() == {"coordinator", PARTIES[0]}
    assert (run / "audit" / "audit.json").read_bytes() == before


def test_party_ledger_subset(tmp_path):
    run, _ = make_run(tmp_path)
    result = audit_run(run, party_ledgers=[_ledger_path(run, "party-0")])
    assert result.verdict == "unverified" and result.unwitnessed == ["party-1", "party-2"], result.to_dict()
    result = audit_run(run, party_ledgers=[_ledger_path(run, "party-0")], receipt_files=_receipts(run, "party-1",
                                                                                                   "party-2"))
    assert result.passed and result.witnessed == {"party-0": "ledger", "party-1": "receipt", "party-2": "receipt"}
    assert set(result.ledgers) == {"coordinator", "party-0"}
    assert any("party-1: ledger not available" in d for d in result.check("cross-check").details)


# -------------------------------------------------------------------------------------------- integrity
@pytest.mark.parametrize("rehash", [False, True])
def test_edited_party_entry_fails_integrity(tmp_path, rehash):
    run, _ = make_run(tmp_path)

    def edit(entries):
        entries[0]["bytes"] += 1  # an "in" entry nobody anchored: only the chain can catch it
        if rehash:
            entries[0]["hash"] = entry_hash(entries[0])
        return entries

    _rewrite(_ledger_path(run, "party-1"), edit)
    result = audit_run(run)
    assert _failed(result) == ["ledger-integrity"]
    assert any("party-1" in f for f in result.check("ledger-integrity").findings)


def test_truncated_party_ledger_fails(tmp_path):
    run, _ = make_run(tmp_path)
    _rewrite(_ledger_path(run, "party-2"), lambda entries: entries[:-1])
    result = audit_run(run)
    assert "ledger-integrity" in result.failed and "cross-check" in result.failed
    assert any("truncated" in f for f in result.check("ledger-integrity").findings)


def test_substituted_key_fails_pinning(tmp_path):
    """The whole party ledger re-signed with a new key (and a new .pub): it verifies, but the key is not the
    one the coordinator pinned at setup."""
    run, _ = make_run(tmp_path)
    new = generate_signing_key(tmp_path / "keys" / "forger.pem")

    def resign(entries):
        for e in entries:
            e["sig"] = new.sign(SIG_DOMAIN + e["hash"].encode("ascii")).hex()
        return entries

    path = _ledger_path(run, "party-1")
    _rewrite(path, resign)
    path.with_suffix(".pub").write_text(public_key_hex(new) + "\n")
    result = audit_run(run)
    assert _failed(result) == ["ledger-integrity"]
    assert any("not the key pinned" in f for f in result.check("ledger-integrity").findings)


def test_cross_check_catches_a_different_payload(tmp_path):
    run, _ = make_run(tmp_path, sha_mismatch=(1, "party-0"))
    result = audit_run(run)
    assert _failed(result) == ["cross-check"]
    assert "sha256" in result.check("cross-check").findings[0]


# ------------------------------------------------------------------------------------------ allow-list
def test_key_outside_policy_fails_allow_list(tmp_path):
    run, _ = make_run(tmp_path, extra_key=(2, "party-0"))
    result = audit_run(run)
    assert _failed(result) == ["allow-list"]
    assert all("stats.raw" in f for f in result.check("allow-list").findings)
    assert {f.split("#")[0] for f in result.check("allow-list").findings} == {"coordinator", "party-0"}


def test_a_carried_probe_is_a_declared_release_and_an_undeclared_clear_field_fails(tmp_path):
    """The routing probe carried beside a masked input (``probe.routing``, ``top1.top1``) is declared in the signed
    policy (optional keys, a fixed ``[L, E]`` shape): the audit accepts it. Anything else in the clear beside the
    masked input (here ``probe.hidden``) is undeclared and fails the allow-list, in both ledgers."""
    rule = POLICY["masked-input:router-stats"]
    declared = {**POLICY, "masked-input:router-stats": {**rule, "keys": [*rule["keys"], "probe.routing", "top1.top1"],
                                                        "required": rule["keys"]}}
    run, _ = make_run(tmp_path / "ok", policy=declared, extra_key=(2, "party-0", "probe.routing", "top1.top1"))
    assert _failed(audit_run(run)) == []
    run, _ = make_run(tmp_path / "bad", policy=declared, extra_key=(2, "party-0", "probe.routing", "probe.hidden"))
    result = audit_run(run)
    assert _failed(result) == ["allow-list"]
    assert {f.split("#")[0] for f in result.check("allow-list").findings} == {"coordinator", "party-0"}
    assert all("probe.hidden" in f for f in result.check("allow-list").findings)


@pytest.mark.parametrize("rule, ok", [
    ({"required": ["plan.round", "weights.global"], "keys": ["anchor.probs", "plan.round", "weights.global"]}, True),
    ({"required": ["anchor.probs", "plan.round", "weights.global"],
      "keys": ["anchor.probs", "plan.round", "weights.global"]}, False),
    ({"keys": ["plan.round"], "keys_pattern": "weights.*"}, True),
    ({"keys": ["plan.round"], "keys_pattern": "weight.*"}, False),
])
def test_policy_optional_and_pattern_keys(tmp_path, rule, ok):
    """``required`` (default: all keys) and ``keys_pattern`` as build_policy writes them."""
    policy = {**POLICY, "stats-instruction": {**POLICY["stats-instruction"], **rule}}
    run, _ = make_run(tmp_path, policy=policy)
    result = audit_run(run)
    assert _failed(result) == ([] if ok else ["allow-list"])
    if not ok:  # every stats instruction, in the coordinator's ledger and in each party's
        assert len(result.check("allow-list").findings) == 2 * 2 * len(PARTIES)


def test_rejected_verdict_fails_no_blocked(tmp_path):
    run, _ = make_run(tmp_path, blocked={(2, "party-2")})
    result = audit_run(run)
    assert _failed(result) == ["no-blocked"]
    (finding,) = result.check("no-blocked").findings
    assert finding.startswith("party-2#") and "byte budget exceeded" in finding


def test_plaintext_mode_fails(tmp_path):
    run, _ = make_run(tmp_path, mode="plaintext")
    result = audit_run(run)
    assert _failed(result) == ["no-plaintext"]
    assert sum("plaintext-mode release" in f for f in result.check("no-plaintext").findings) == 2


# ------------------------------------------------------------------------------------------------- DP
@pytest.mark.parametrize("noise", [0.0, 1 / 3])
def test_missing_noise_fails_noise_presence(tmp_path, noise):
    run, _ = make_run(tmp_path, canary_noise=noise)
    result = audit_run(run)
    assert _failed(result) == ["noise-presence"]
    assert len(result.check("noise-presence").findings) == 2


def test_inconsistent_row_sums_fail(tmp_path):
    run, _ = make_run(tmp_path, row_bias=12.0)
    result = audit_run(run)
    assert _failed(result) == ["row-sums"]


# ------------------------------------------------------------------------- row noise, canary positions (11.4)
def test_canary_only_noise_fails_row_noise(tmp_path, capsys):
    """Every party put its noise share on the canaries only: the canaries look right (noise-presence passes) and
    every row sum is exactly N*s. The row-noise test (the defence) fails both releases and the pool; without it
    this run passes."""
    run, _ = make_run(tmp_path, row_noise=0.0)
    result = audit_run(run)
    assert _failed(result) == ["row-noise"]
    findings = result.check("row-noise").findings
    assert sum("exactly equal" in f for f in findings) == 2 and any("pooled over 2 releases" in f for f in findings)
    assert main(["audit", str(run)]) == 1
    assert "row-noise" in capsys.readouterr().out


def test_honest_row_dispersion_passes_and_is_reported(tmp_path):
    result = audit_run(make_run(tmp_path)[0])
    assert result.check("row-noise").status == "pass"
    assert any("pooled over 2 releases" in d for d in result.check("row-noise").details)
    assert all(r["row_noise_p"] > 1e-3 for r in result.releases)


def test_canaries_off_the_recomputed_positions_fail(tmp_path):
    """The coordinator read its canaries from the old fixed tail, not where the round's seed puts them."""
    run, _ = make_run(tmp_path, tail_canaries=True)
    result = audit_run(run)
    assert _failed(result) == ["canary-positions"]
    assert all("not at the positions recomputed" in f for f in result.check("canary-positions").findings)


def test_party_built_with_another_canary_seed_fails(tmp_path):
    """A party's own signed entry records a seed that is not the round's (a split U1 view, or a party that
    chose its own layout)."""
    run, _ = make_run(tmp_path, party_seed={(2, "party-1"): "ab" * 32})
    result = audit_run(run)
    assert _failed(result) == ["canary-positions"]
    (finding,) = result.check("canary-positions").findings
    assert "party-1" in finding and "round 2" in finding
    assert audit_run(run, party_ledgers=[_ledger_path(run, "party-0")]).check("canary-positions").status == "pass"


def test_recorded_seed_that_is_not_the_hash_of_the_round_material_fails(tmp_path):
    run, _ = make_run(tmp_path)
    path = run / "ledger" / "coordinator.jsonl"

    def forge(entries):  # a chosen seed in the release entry (ledger-integrity fails too: it is not re-signed)
        for e in entries:
            if e["payload_type"] == "release:router-stats":
                e["info"]["canary"]["seed"] = "00" * 32
        return entries
    _rewrite(path, forge)
    result = audit_run(run)
    assert "canary-positions" in _failed(result)
    assert any("not the hash of the recorded round material" in f for f in result.check("canary-positions").findings)


def test_budget_too_small_fails_epsilon(tmp_path):
    run, _ = make_run(tmp_path, epsilon=1.0)
    result = audit_run(run)
    assert _failed(result) == ["epsilon"]
    assert all(r["status"] == "fail" and r["epsilon"] > 1.0 for r in result.epsilon.values())


def test_understated_noise_claim_fails_epsilon(tmp_path):
    """The release claims a larger z_eff than its survivors give: the recomputation disagrees."""
    run, _ = make_run(tmp_path, z_eff_factor=2.0)
    result = audit_run(run)
    assert _failed(result) == ["epsilon"]
    assert all("z_eff" in f for f in result.check("epsilon").findings)


def test_too_few_parties_fails_min_parties(tmp_path):
    run, _ = make_run(tmp_path, responders={2: ["party-0"]})
    result = audit_run(run)
    assert _failed(result) == ["min-parties"]
    assert "1 parties included < min-parties 2" in result.check("min-parties").findings[0]
    assert result.epsilon["party-0"]["releases"] == 2 and result.epsilon["party-1"]["releases"] == 1


# --------------------------------------------------------------------------------------------- canaries
def test_canary_in_server_file_fails_but_not_under_work(tmp_path, capsys):
    run, canaries = make_run(tmp_path)
    secret = canaries["party-1"][0]
    (run / "work" / "party-1" / "scratch.txt").write_text(f"local copy {secret}\n")
    assert audit_run(run).passed
    (run / "checkpoints").mkdir()
    (run / "checkpoints" / "notes.json").write_text(json.dumps({"sample": secret}))
    assert main(["audit", str(run)]) == 1
    out = capsys.readouterr().out
    result = audit_run(run)
    assert _failed(result) == ["canaries", "server-files"]  # a file the server never writes, with a canary
    (finding,) = result.check("canaries").findings
    assert finding.startswith("checkpoints/notes.json") and hashlib.sha256(secret.encode()).hexdigest()[:12] in finding
    report = (run / "audit" / "audit.md").read_text() + (run / "audit" / "audit.json").read_text() + out
    assert secret not in report and "canaries" in out


def test_canaries_from_explicit_file(tmp_path):
    run, _ = make_run(tmp_path)
    extra = tmp_path / "extra-canaries.txt"
    extra.write_text("\nSERVER-SIDE-CANARY-XYZ\n\n")
    (run / "metrics.jsonl").write_text('{"text": "SERVER-SIDE-CANARY-XYZ"}\n')
    result = audit_run(run, canaries=extra)
    assert _failed(result) == ["canaries", "server-files"]  # an unknown row, with a canary
    assert result.check("canaries").findings[0].startswith("metrics.jsonl")


def test_missing_canary_scan_fails(tmp_path):
    run, _ = make_run(tmp_path, scan=False)
    result = audit_run(run)
    assert _failed(result) == ["canaries"]
    assert all("no canary scan" in f for f in result.check("canaries").findings)


# ------------------------------------------------------------------------------------- masks
def test_zero_mask_input_fails_the_audit(tmp_path, capsys):
    """A party ledger recording the statistic of a masked input sent with zero masks (y = x, fixed-point
    plaintext): the audit recomputes the verdict from the counts and exits 1 naming ``mask-uniformity``
    (``no-plaintext`` passes: it reads mode labels only)."""
    from distmoe.privacy.ring import encode_fixed
    plain = mask_statistic(encode_fixed(np.random.default_rng(3).normal(size=VEC[1]), 2.0**40))  # y = x
    forged = {**plain, "log2_p": 0.0}  # a p-value claim that disagrees with the counts does not help
    run, _ = make_run(tmp_path, mask_check={(2, "party-1"): forged})
    result = audit_run(run)
    assert _failed(result) == ["mask-uniformity"]
    (finding,) = result.check("mask-uniformity").findings
    assert "party-1" in finding and "round 2" in finding and "not uniform" in finding
    assert result.check("no-plaintext").status == "pass"
    assert main(["audit", str(run)]) == 1
    assert "mask-uniformity" in capsys.readouterr().out


def test_masked_input_without_statistic_fails(tmp_path):
    run, _ = make_run(tmp_path, mask_check={(1, "party-0"): None})
    result = audit_run(run)
    assert _failed(result) == ["mask-uniformity"]
    assert "no mask statistic recorded" in result.check("mask-uniformity").findings[0]


# ------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("damage", ["no-coordinator-ledger", "no-run-json", "bad-run-json", "no-run-dir"])
def test_unusable_input_exits_2(tmp_path, capsys, damage):
    run, _ = make_run(tmp_path)
    if damage == "no-coordinator-ledger":
        os.remove(run / "ledger" / "coordinator.jsonl")
    elif damage == "no-run-json":
        os.remove(run / "run.json")
    elif damage == "bad-run-json":
        (run / "run.json").write_text("{not json")
    else:
        run = tmp_path / "nowhere"
    assert main(["audit", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ")
    assert not (run / "audit").exists()


# ----------------------------------------------------- server-side files (what the server wrote)
def _append(path, row):
    with path.open("a") as fh:
        fh.write(json.dumps(row) + "\n")


def _server_files(result):
    return result.check("server-files").findings


@pytest.mark.parametrize("row,needle", [
    ({"event": "train", "round": 1, "party": "party-1", "loss": 1.2}, "metrics.jsonl:2: key 'party'"),
    ({"party": "p0", "loss": 1.2}, "metrics.jsonl:2: key 'event'"),
    ({"event": "stats", "round": 1, "instruction": "What is 2+2?", "output": "4"},
     "metrics.jsonl:2: key 'instruction'"),
    ({"event": "eval", "round": 1, "party": "all", "acc/patient-4711": 1.0}, "metrics.jsonl:2: key 'acc/patient-4711'"),
    ({"event": "party_error", "round": 1, "phase_label": "setup", "node": "101", "party": "party-1", "code": "data",
      "reason": "data: arith.jsonl:5 has 4 prompts"}, "metrics.jsonl:2: key 'reason'"),
    ({"event": "run_end", "status": "completed: the answer was 42"}, "metrics.jsonl:2: key 'status'"),
])
def test_a_forged_metrics_row_fails_server_files(tmp_path, capsys, row, needle):
    run, _ = make_run(tmp_path)
    assert audit_run(run).passed
    _append(run / "metrics.jsonl", row)
    assert main(["audit", str(run)]) == 1
    result = audit_run(run)
    assert "server-files" in _failed(result) and set(_failed(result)) <= {"server-files", "release-records"}
    assert any(f.startswith(needle) for f in _server_files(result)), _server_files(result)
    assert "server-files" in capsys.readouterr().out


def test_run_json_and_stray_files_are_schema_checked(tmp_path):
    run, _ = make_run(tmp_path)
    meta = json.loads((run / "run.json").read_text())
    (run / "run.json").write_text(json.dumps({**meta, "parties": {**meta["parties"], "party-1": {
        **meta["parties"]["party-1"], "num_examples": 412}}, "samples": ["What is 2+2? 4"]}))
    (run / "examples.jsonl").write_text('{"instruction": "What is 2+2?", "output": "4"}\n')
    found = _server_files(audit_run(run))
    assert any(f.startswith("run.json: key 'parties.party-1'") for f in found), found
    assert any(f.startswith("run.json: key 'samples'") for f in found), found
    assert any(f.startswith("examples.jsonl: not a file the server writes") for f in found), found


# ------------------------------------------------------------------------------------ accounting
def test_update_release_is_charged_at_half_its_noise_multiplier(tmp_path):
    """One sequence moves a clipped update by 2 clips: the audit charges z_eff / 2 per sequence, as the
    parties and the coordinator do, not the party-level z_eff (the gap that reported 8 for RDP 11.65)."""
    spec = _spec()
    run, _ = make_run(tmp_path, update_z=4.0, epsilon=50.0)
    result = audit_run(run)
    assert _failed(result) == [], result.to_dict()
    ze = 4.0 * math.sqrt(3 / 2)  # all three of t = 2 present
    stats = [stats_event(spec, 3, "")] * 2
    want = epsilon_from_events([*stats, PrivacyEvent(ze / 2)], DELTA)
    party_level = epsilon_from_events([*stats, PrivacyEvent(ze)], DELTA)
    for row in result.epsilon.values():
        assert row["releases"] == 3
        assert (row["eps_prv"], row["eps_rdp"]) == pytest.approx(want)
        assert row["epsilon"] > max(party_level) + 0.5
        assert row["server_epsilon"] == pytest.approx(row["epsilon"])


def test_forged_sequence_level_claim_fails_epsilon(tmp_path):
    """A ledger that records the update at the party-level multiplier per sequence is caught."""
    run, _ = make_run(tmp_path, update_z=4.0, epsilon=50.0, forge={"z_sequence": 4.0 * math.sqrt(3 / 2)})
    result = audit_run(run)
    assert _failed(result) == ["epsilon"]
    assert any("z_sequence" in f for f in result.check("epsilon").findings)


def test_simulation_state_is_the_simulations_only_in_a_simulated_run(tmp_path):
    """`distmoe simulate` keeps Flower's state (the installed app bundle) and its overrides.toml in the run
    directory; outside a simulation (an in-process run) a file there is not one the server writes, and a file no
    distmoe writer makes (a harness's own log) is not one in either."""
    from distmoe.audit.schemas import _other_files

    (tmp_path / "flwr" / "apps" / "x").mkdir(parents=True)
    (tmp_path / "flwr" / "apps" / "x" / "app.py").write_text("print(1)\n")
    (tmp_path / "overrides.toml").write_text("")
    (tmp_path / "coordinator.log").write_text("round 1 ...\n")
    (tmp_path / "metrics.jsonl").write_text("")
    out: list[str] = []
    _other_files(tmp_path, out)
    assert out == [f"{f}: not a file the server writes" for f in ("coordinator.log", "flwr/apps/x/app.py",
                                                                  "overrides.toml")]
    (tmp_path / "simulate.json").write_text("{}")
    out = []
    _other_files(tmp_path, out)
    assert out == ["coordinator.log: not a file the server writes"]


# ------------------------------------------------------------- a cut or rewritten coordinator ledger
def _resign_coordinator(root, entries):
    """What a coordinator holding its key does after editing its ledger: renumber, re-chain, re-sign."""
    from distmoe.ledger import GENESIS, load_signing_key

    key, prev = load_signing_key(root / "keys" / "coordinator.pem"), GENESIS
    for seq, e in enumerate(entries):
        e.pop("sig", None)
        e["seq"], e["prev"] = seq, prev
        e["hash"] = prev = entry_hash(e)
        e["sig"] = key.sign(SIG_DOMAIN + e["hash"].encode("ascii")).hex()
    return entries


@pytest.mark.parametrize("attack, names", [
    ("cut-after-release", ["coordinator-heads", "release-records", "run-end"]),
    ("cut-run-end", ["run-end"]),
    ("delete-release-resigned", ["coordinator-heads", "release-coverage", "release-records"]),
    ("reorder-resigned", ["coordinator-heads"]),
])
def test_cut_or_rewritten_coordinator_ledger_fails(tmp_path, capsys, attack, names):
    """The fast form of ``tests/coordinator/test_ledger_cut.py``: ``head -n`` (no key), or an edit re-signed with
    the coordinator's key, passed with the old audit. Defence: the run-end entry and the coordinator heads the
    parties recorded (``distmoe.audit.ledgers``); without those checks every case here passes."""
    run, _ = make_run(tmp_path)
    path = run / "ledger" / "coordinator.jsonl"
    first = next(i for i, e in enumerate(map(json.loads, path.read_text().splitlines()))
                 if e["payload_type"] == "release:router-stats")

    def edit(entries):
        if attack == "cut-after-release":
            return entries[:first + 1]
        if attack == "cut-run-end":
            return entries[:-1]
        rel = entries.pop(first)
        if attack == "reorder-resigned":
            entries.insert(len(entries) - 1, rel)
        return _resign_coordinator(tmp_path, entries)

    _rewrite(path, edit)
    assert main(["audit", str(run)]) == 1
    out = capsys.readouterr().out
    result = audit_run(run)
    assert _failed(result) == names, result.to_dict()["checks"]
    assert all(n in out for n in names)
    if attack.endswith("resigned"):
        assert result.check("ledger-integrity").status == "pass"  # the forgery verifies


def test_eval_release_is_charged_in_the_audit_epsilon(tmp_path):
    """Evaluation figures carry Skellam noise and the audit charges each release (the
    sensitivities of one held-out sequence), recomputed independently of the ledger's own figures."""
    run, _ = make_run(tmp_path, eval_z=3.0)
    result = audit_run(run)
    assert _failed(result) == [], result.to_dict()
    es = EvalSpec(("arith",), 3.0, len(PARTIES), 1, 48, 16.0)
    want = epsilon_from_events([stats_event(_spec(), 3, "")] * 2 + [es.event(3, "")], DELTA)
    for row in result.epsilon.values():
        assert row["releases"] == 3 and (row["eps_prv"], row["eps_rdp"]) == pytest.approx(want)
        assert row["server_epsilon"] == pytest.approx(row["epsilon"])


@pytest.mark.parametrize("forge, needle", [(False, "without DP noise"), ({"delta2_int": 1.0}, "delta2_int"),
                                           ({"z_eff": 30.0}, "z_eff")])
def test_eval_release_without_noise_or_with_a_forged_calibration_fails_epsilon(tmp_path, forge, needle):
    """An evaluation release in secagg mode with no DP facts (exact counts and losses a straggle would
    difference out) or with a calibration that understates the charge fails the epsilon check."""
    run, _ = make_run(tmp_path, eval_z=3.0, eval_forge=forge)
    result = audit_run(run)  # without dp the release is also missing from the coordinator's accountant's story
    assert _failed(result) == (["epsilon", "release-records"] if forge is False else ["epsilon"])
    assert any(needle in f for f in result.check("epsilon").findings), result.check("epsilon").findings


# ------------------------------------------------------------------ TensorBoard event files
def _pb_varint(n):
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _pb(num, wt, val):
    """One protobuf field: varint (0), 64-bit (1), length-delimited (2) or 32-bit (5)."""
    key = _pb_varint(num << 3 | wt)
    if wt == 0:
        return key + _pb_varint(val)
    if wt == 2:
        return key + _pb_varint(len(val)) + val
    return key + val


def _tb_event(step=0, tag=None, value=None, extra=b"", version=False):
    """A ``tensorboard.Event`` as TensorBoard's writer encodes it: wall_time, step, file_version + source_metadata
    (the header) or summary { value { tag, simple_value } }; ``extra``: bytes appended to the value (a forgery)."""
    body = _pb(1, 1, struct.pack("<d", 1.7e9)) + (_pb(2, 0, step) if step else b"")
    if version:
        body += _pb(3, 2, b"brain.Event:2") + _pb(10, 2, _pb(1, 2, b"tensorboard.summary.writer.event_file_writer"))
    if tag is not None:
        val = _pb(1, 2, tag.encode()) + (_pb(2, 5, struct.pack("<f", value)) if value is not None else b"") + extra
        body += _pb(5, 2, _pb(1, 2, val))
    return body


def _tb_file(path, events):
    from distmoe.audit.tfevents import masked_crc32c

    path.parent.mkdir(parents=True, exist_ok=True)
    out = bytearray()
    for data in [_tb_event(version=True), *events]:
        head = struct.pack("<Q", len(data))
        out += head + struct.pack("<I", masked_crc32c(head)) + data + struct.pack("<I", masked_crc32c(data))
    path.write_bytes(bytes(out))
    return path


TB_NAME = "tensorboard/events.out.tfevents.1796203390.vm.23535.0"


def _tb_run(tmp_path):
    run, _ = make_run(tmp_path)
    _append(run / "metrics.jsonl", {"event": "stats", "round": 2, "party": "all", "num_sequences": 800.0})
    return run


def test_crc32c_is_castagnoli():
    from distmoe.audit.tfevents import crc32c

    assert crc32c(b"123456789") == 0xE3069283  # the standard check value of CRC-32C


def test_tensorboard_scalars_of_the_metrics_pass_server_files(tmp_path):
    run = _tb_run(tmp_path)
    _tb_file(run / TB_NAME, [_tb_event(2, "stats/num_sequences", 800.0)])
    result = audit_run(run)
    assert _failed(result) == [], _server_files(result)


@pytest.mark.parametrize("events,needle", [
    ([_tb_event(2, "stats/num_sequences", 800.0, extra=_pb(4, 2, b"\x89PNG"))], "summary value field 4"),
    ([_tb_event(2, "stats/instruction", 4.0)], "tag 'stats/instruction' at step 2: not a number key"),
    ([_tb_event(2, "eval/acc/patient-4711", 1.0)], "tag 'eval/acc/patient-4711'"),
    ([_tb_event(2, "stats/party", 1.0)], "tag 'stats/party'"),
    ([_tb_event(2, "stats/num_sequences", 4711.0)], "a value that metrics.jsonl does not hold"),
    ([_tb_event(1, "stats/num_sequences", 800.0)], "a value that metrics.jsonl does not hold"),
    ([_tb_event(2, "stats/num_sequences", 800.0) + _pb(6, 2, b"\x10\x01\x1a\x05hello")], "event field 6"),
])
def test_a_forged_tensorboard_file_fails_server_files(tmp_path, events, needle):
    """Defence: the ``tensorboard/`` check of ``distmoe.audit.schemas`` (strict event reader + tag schema + values
    cross-checked with metrics.jsonl). Without it, ``tensorboard/`` is skipped and every file here passes."""
    run = _tb_run(tmp_path)
    _tb_file(run / TB_NAME, events)
    result = audit_run(run)
    assert _failed(result) == ["server-files"]
    assert any(f.startswith(TB_NAME) and needle in f for f in _server_files(result)), _server_files(result)


def test_a_damaged_or_stray_tensorboard_file_fails_server_files(tmp_path):
    run = _tb_run(tmp_path)
    path = _tb_file(run / TB_NAME, [_tb_event(2, "stats/num_sequences", 800.0)])
    data = bytearray(path.read_bytes())
    data[-6] ^= 0x01  # one bit of the scalar's record
    path.write_bytes(bytes(data))
    (run / "tensorboard" / "notes.txt").write_text("What is 2+2? 4\n")
    found = _server_files(audit_run(run))
    assert any(f.startswith(TB_NAME) and "CRC does not match" in f for f in found), found
    assert any(f.startswith("tensorboard/notes.txt: not a file the TensorBoard writer makes") for f in found), found


def test_tensorboards_own_writer_passes_server_files(tmp_path):
    """The event file the ``tensorboard`` package writes (``distmoe report --tensorboard``) passes the check."""
    pytest.importorskip("tensorboard", reason="the optional extra distmoe[tensorboard] is not installed")
    from distmoe.report.tensorboard import write_tensorboard

    run = _tb_run(tmp_path)
    write_tensorboard(run)
    assert len(list((run / "tensorboard").iterdir())) == 1
    result = audit_run(run)
    assert _failed(result) == [], _server_files(result)


# ------------------------------------------------- verified only with every party's witness: ledgers or receipts
def _coordinator_only(run):
    """A deployment's run directory: the party ledgers stay with their owners."""
    import shutil

    shutil.rmtree(run / "work")
    return run


def _forge_cut(tmp_path, run):
    """Every coordinator entry of router-stats round 1 deleted, the chain re-signed, the records rewritten to match."""
    path = run / "ledger" / "coordinator.jsonl"
    _rewrite(path, lambda es: _resign_coordinator(tmp_path, [e for e in es if e.get("round") != 1]))
    led = json.loads((run / "privacy" / "ledger.json").read_text())
    for st in led["parties"].values():
        st["events"] = [e for e in st["events"] if e["label"] != "router-stats round 1"]
    (run / "privacy" / "ledger.json").write_text(json.dumps(led))
    (run / "metrics.jsonl").write_text("")


def test_a_coordinator_only_run_directory_is_unverified_never_pass(tmp_path, capsys):
    run, _ = make_run(tmp_path)
    _coordinator_only(run)
    result = audit_run(run)
    assert result.failed == [] and result.verdict == "unverified" and not result.passed
    assert result.unwitnessed == list(PARTIES) and result.witnessed == {}
    assert main(["audit", str(run)]) == 3
    assert "UNVERIFIED" in capsys.readouterr().out
    assert "**Verdict: UNVERIFIED**" in (run / "audit" / "audit.md").read_text()
    assert main(["audit", str(run), "--json"]) == 3
    assert json.loads(capsys.readouterr().out)["verdict"] == "unverified"
    assert audit_run(run, receipt_files=_receipts(run)).verdict == "pass"


def test_forged_cut_is_unverified_without_receipts_and_a_violation_with_them(tmp_path):
    """The forged cut (a whole round deleted, re-signed, the records rewritten): no check of the coordinator's own
    files can see it, so the verdict is UNVERIFIED; the receipts bind the chain up to each party's last instruction."""
    run, _ = make_run(tmp_path)
    _coordinator_only(run)
    _forge_cut(tmp_path, run)
    result = audit_run(run)
    assert result.verdict == "unverified" and result.failed == [], result.failed
    assert all(r["releases"] == 1 for r in result.epsilon.values())
    result = audit_run(run, receipt_files=_receipts(run))
    assert result.failed == ["receipts"]
    assert all(any(f.startswith(f"{p}.json:") and ("rewritten" in f or "was cut" in f)
                   for f in result.check("receipts").findings) for p in PARTIES), result.check("receipts").findings


@pytest.mark.parametrize("attack, needle", [
    ("other-key", "not this party's key in the key directory"),
    ("not-in-roster", "not in the run's key directory"),
    ("tampered", "signature does not verify"),
    ("stale", "beyond the receipt's final head"),
    ("other-run", "a receipt of run"),
    ("twice", "a second receipt"),
])
def test_a_receipt_that_does_not_match_is_a_violation(tmp_path, attack, needle):
    run, _ = make_run(tmp_path)
    _coordinator_only(run)
    files = _receipts(run)
    obj = json.loads(files[0].read_text())
    body = {k: v for k, v in obj["body"].items() if k != "public_key"}
    if attack == "other-key":  # signed by a key the coordinator made, not the owner's pinned one
        obj = sign_receipt(body, generate_signing_key(tmp_path / "other.pem"))
    elif attack == "not-in-roster":
        obj = sign_receipt({**body, "party": "party-9"}, generate_signing_key(tmp_path / "other.pem"))
    elif attack == "tampered":
        obj["body"]["epsilon"] = 0.5
    elif attack == "stale":  # a receipt from before the party's last reply
        obj = sign_receipt({**body, "ledger_head": {"seq": 1, "hash": "0" * 64}},
                           load_signing_key(tmp_path / "keys" / "party-0.pem"))
    elif attack == "other-run":
        obj = sign_receipt({**body, "run": "another-run"}, load_signing_key(tmp_path / "keys" / "party-0.pem"))
    files[0].write_text(json.dumps(obj))
    given = [*files, files[0]] if attack == "twice" else files
    result = audit_run(run, receipt_files=given)
    assert result.failed == ["receipts"], result.failed
    assert any(needle in f for f in result.check("receipts").findings), result.check("receipts").findings
    assert main(["audit", str(run), *(a for f in given for a in ("--receipt", str(f)))]) == 1


def test_a_receipts_charge_is_a_lower_bound_on_epsilon(tmp_path):
    """A party's receipt says its accountant charged more than the coordinator's releases account for: the audit's
    epsilon for that party is the receipt's, and over the budget it fails."""
    run, _ = make_run(tmp_path)
    _coordinator_only(run)
    files = _receipts(run)
    key = load_signing_key(tmp_path / "keys" / "party-0.pem")
    for eps, verdict in ((7.5, "pass"), (9.0, "fail")):
        body = {k: v for k, v in json.loads(files[0].read_text())["body"].items() if k != "public_key"}
        files[0].write_text(json.dumps(sign_receipt({**body, "epsilon": eps}, key)))
        result = audit_run(run, receipt_files=files)
        assert result.verdict == verdict and result.epsilon["party-0"]["epsilon"] == eps
    assert result.failed == ["epsilon"]


def test_an_unreadable_receipt_is_unusable_input(tmp_path, capsys):
    run, _ = make_run(tmp_path)
    (tmp_path / "bad.json").write_text("{not json")
    assert main(["audit", str(run), "--receipt", str(tmp_path / "bad.json")]) == 2
    assert "receipt is not valid JSON" in capsys.readouterr().err
