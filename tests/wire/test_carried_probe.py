"""The routing probe carried on a phase instruction and its reply: the request (the public prompts) and the answer
(``ProbePart``: ``[L, E]`` routing, ``[L, N]`` top-1) round-trip through the codec; the codec refuses values a probe
cannot produce; the party's outbound guard and the coordinator's inbound guard each refuse a probe part that was not
asked for, that is missing, that has other shapes than the bounds, or that smuggles an extra array; and the run's
allow-list declares the probe's records only when the run probes."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, RecordDict

from distmoe.ledger import Ledger, generate_signing_key
from distmoe.privacy import secagg as sa
from distmoe.wire import codec, inspect
from distmoe.wire.allow_list import ProbeBounds, check_probe_part
from distmoe.wire.codec import WireError
from distmoe.wire.errors import Blocked
from distmoe.wire.party_guard import serve
from distmoe.wire.schema import (
    TRAIN_METRIC_KEYS,
    EvalReply,
    MaskedReply,
    ModelUpdate,
    ProbePart,
    RouterStats,
    SecureInstruction,
    SftInstruction,
    StatsInstruction,
)
from distmoe.wire.server_guard import ServerGuard, build_policy, check_against_policy

L, E, N = 2, 4, 30
TRAINABLE = {"w": (3, 2)}
W = {"w": np.zeros(TRAINABLE["w"], np.float32)}
PROMPTS = ("Compute\n1+2", "Look up k3")
MAX_LEN = 64
BOUNDS = ProbeBounds(L, E, len(PROMPTS) * MAX_LEN)


def _policy(secure: bool, prompts=PROMPTS) -> dict:
    return build_policy(secure=secure, n_parties=3, trainable=TRAINABLE, layers=L, experts=E, update_length=8,
                        stats_length=8, rl_update_length=8, tasks=("t",), eval_length=8, probe_prompts=prompts,
                        probe_tokens=len(prompts) * MAX_LEN)


def _part(n: int = N, rows: int = L, experts: int = E) -> ProbePart:
    rng = np.random.default_rng(0)
    return ProbePart(rng.dirichlet(np.ones(experts), rows), rng.integers(0, experts, (rows, n)).astype(np.int32))


def _update(part: ProbePart | None) -> ModelUpdate:
    return ModelUpdate("party-0", dict(W), 1, {k: 0.0 for k in TRAIN_METRIC_KEYS}, probe=part)


def _sft(probe=PROMPTS) -> SftInstruction:
    return SftInstruction(4, "t", W, "h", 0, None, 0, probe=probe)


def test_the_request_and_the_answer_round_trip_and_are_absent_when_unused():
    back = codec.decode(codec.encode(_sft()), SftInstruction)
    assert back.probe == PROMPTS and codec.message_type_of(back) == "train.sft"
    assert codec.decode(codec.encode(_sft(None)), SftInstruction).probe is None
    assert "probe_prompts" not in codec.encode(_sft(None))["meta"]
    part = _part()
    for reply in (_update(part), RouterStats(np.zeros((L, E)), part), EvalReply("party-0", {}, part),
                  MaskedReply("model-update", None, sa.ShareKeys(0, 5, bytes(32), bytes(32), ()), part)):
        got = codec.decode(codec.encode(reply)).probe
        np.testing.assert_array_equal(got.routing, part.routing)
        np.testing.assert_array_equal(got.top1, part.top1)
        assert got.top1.dtype == np.int32
    plain = codec.encode(_update(None))
    assert "probe" not in plain and "top1" not in plain and codec.decode(plain).probe is None


def _bad_parts():
    good = _part()
    over = good.routing.copy()
    over[0] *= 2  # a row that is no distribution: any float could be hidden in it
    neg = good.routing.copy()
    neg[0, 0], neg[0, 1] = -0.5, neg[0, 1] + neg[0, 0] + 0.5
    hi = good.top1.copy()
    hi[1, 3] = E  # not an expert
    return {"row-sum": ProbePart(over, good.top1), "negative": ProbePart(neg, good.top1),
            "top1-out-of-range": ProbePart(good.routing, hi),
            "top1-negative": ProbePart(good.routing, -good.top1 - 1),
            "top1-rows": ProbePart(good.routing, good.top1[:1]),
            "top1-float": ProbePart(good.routing, good.top1.astype(np.float64)),
            "routing-3d": ProbePart(good.routing[None], good.top1)}


@pytest.mark.parametrize("name", sorted(_bad_parts()))
def test_the_codec_refuses_what_a_probe_cannot_produce(name):
    bad = _bad_parts()[name]
    with pytest.raises(WireError, match="probe"):
        codec.encode(_update(bad))
    content = codec.encode(_update(_part()))  # the same values written past the encoder: refused on decode
    content["probe"] = ArrayRecord(array_dict={"routing": Array(np.asarray(bad.routing))})
    content["top1"] = ArrayRecord(array_dict={"top1": Array(np.asarray(bad.top1))})
    with pytest.raises(WireError, match="probe"):
        codec.decode(content, ModelUpdate)


def _smuggled() -> dict[str, RecordDict]:
    """Replies that carry more than the probe in the probe's slot."""
    rd = codec.encode(_update(_part()))
    extra_array = RecordDict(dict(rd.items()))
    extra_array["probe"] = ArrayRecord(array_dict={"routing": Array(_part().routing), "hidden": Array(np.ones(3))})
    half = RecordDict({k: v for k, v in rd.items() if k != "probe"})  # top1 without its routing
    extra_record = RecordDict({**dict(rd.items()), "probe_extra": ArrayRecord(array_dict={"x": Array(np.ones(2))})})
    return {"extra-array": extra_array, "top1-alone": half, "extra-record": extra_record}


@pytest.mark.parametrize("name", sorted(_smuggled()))
def test_extra_data_in_the_probe_slot_is_refused_by_the_codec_and_the_coordinator(tmp_path, name):
    content = _smuggled()[name]
    with pytest.raises(WireError):
        codec.decode(content, ModelUpdate)
    guard = _guard(tmp_path, secure=False)
    with pytest.raises(WireError, match="rejected by the server guard"):
        guard.inbound(0, codec.with_ledger_head(content, 1, "0" * 64), ModelUpdate, 4, "sft", probe=BOUNDS)


@dataclass
class _Party:
    """A party whose answer is given: the reply it would send, and the bounds its own model names."""

    name: str
    ledger: Ledger
    reply: object
    bounds: ProbeBounds | None = BOUNDS
    canaries: list[bytes] = field(default_factory=list)
    secure: bool = False

    def answer(self, mtype, instruction):
        return self.reply, None

    def take_probe_bounds(self):
        return self.bounds


def _entries(ledger: Ledger) -> list[dict]:
    return [json.loads(x) for x in Path(ledger.path).read_text().splitlines() if x]


def _guard(tmp_path, secure: bool = False, prompts=PROMPTS) -> ServerGuard:
    return ServerGuard(Ledger(tmp_path / "c.jsonl", generate_signing_key(tmp_path / "c.key")), "run-1",
                       _policy(secure, prompts))


def _party(tmp_path, reply, bounds=BOUNDS) -> _Party:
    return _Party("party-0", Ledger(tmp_path / "p.jsonl", generate_signing_key(tmp_path / "p.key")), reply, bounds)


def test_a_carried_probe_through_both_guards(tmp_path):
    guard = _guard(tmp_path)
    mtype, content = guard.outbound(0, _sft(), 4, "sft")
    reply = serve(mtype, content, _party(tmp_path, _update(_part())), "run-1")
    back = guard.inbound(0, reply, ModelUpdate, 4, "sft", probe=BOUNDS)
    np.testing.assert_array_equal(back.probe.top1, _part().top1)


@pytest.mark.parametrize("case", ["not-asked", "missing", "no-bounds", "more-layers", "more-experts",
                                  "more-tokens"])
def test_the_party_guard_refuses_a_probe_part_that_is_not_what_was_asked(tmp_path, case):
    """Nothing leaves the party: its own outbound guard replaces the reply by an error."""
    guard = _guard(tmp_path)
    instr = _sft(None) if case == "not-asked" else _sft()
    part = {"missing": None, "more-layers": _part(rows=L + 1), "more-experts": _part(experts=E + 1),
            "more-tokens": _part(n=BOUNDS.max_tokens + 1)}.get(case, _part())
    party = _party(tmp_path, _update(part), None if case == "no-bounds" else BOUNDS)
    mtype, content = guard.outbound(0, instr, 4, "sft")
    with pytest.raises(Blocked):
        serve(mtype, content, party, "run-1")
    out = [e for e in _entries(party.ledger) if e["direction"] == "out"]
    assert out[0]["verdict"].startswith("rejected") and out[-1]["payload_type"] == "error"


@pytest.mark.parametrize("case", ["not-asked", "missing", "more-layers", "more-experts", "more-tokens",
                                  "run-without-probe"])
def test_the_coordinator_guard_refuses_a_probe_part_that_is_not_what_was_asked(tmp_path, case):
    """A party that skipped its own guard (or a hostile one): the coordinator refuses the whole reply."""
    guard = _guard(tmp_path, prompts=() if case == "run-without-probe" else PROMPTS)
    part = {"missing": None, "more-layers": _part(rows=L + 1), "more-experts": _part(experts=E + 1),
            "more-tokens": _part(n=BOUNDS.max_tokens + 1)}.get(case, _part())
    asked = None if case in ("not-asked", "run-without-probe") else BOUNDS
    content = codec.with_ledger_head(codec.encode(_update(part)), 1, "0" * 64)
    with pytest.raises(WireError, match="rejected by the server guard"):
        guard.inbound(0, content, ModelUpdate, 4, "sft", probe=asked)
    (entry,) = [e for e in _entries(guard.ledger) if e["direction"] == "in"]
    assert entry["verdict"].startswith("rejected")


def test_check_probe_part_bounds():
    assert check_probe_part(None, None) is None and check_probe_part(_part(), BOUNDS) is None
    assert check_probe_part(_part(n=BOUNDS.max_tokens), BOUNDS) is None
    assert "did not ask" in check_probe_part(_part(), None)
    assert "asked for one" in check_probe_part(None, BOUNDS)


@pytest.mark.parametrize("secure", [True, False])
def test_the_allow_list_declares_the_carried_probe_only_when_the_run_probes(secure):
    pol, off = _policy(secure), _policy(secure, prompts=())
    instr_tag = "stats-instruction"
    asked = StatsInstruction(4, "t", W, "h", probe=PROMPTS)
    if secure:
        start = sa.RoundStart(4, 0, tuple((i, bytes(32)) for i in range(3)), (), 8)
        asked = SecureInstruction(asked, start, "router-stats")
        keys = sa.ShareKeys(0, 5, bytes(32), bytes(32), ())
        reply = MaskedReply("router-stats", sa.MaskedInput(0, 4, np.zeros(8, np.uint64), keys, ()), None, _part())
        reply_tag = "masked-input:router-stats"
        late = codec.encode(MaskedReply("router-stats", None, keys, _part()))
        assert check_against_policy(pol, "late-keys:router-stats", inspect.describe(late)) is None
    else:
        reply, reply_tag = RouterStats(np.zeros((L, E)), _part()), "router-stats"
    d_instr, d_reply = inspect.describe(codec.encode(asked)), inspect.describe(codec.encode(reply))
    assert "meta.probe_prompts" in d_instr["keys"] and {"probe.routing", "top1.top1"} <= set(d_reply["keys"])
    assert check_against_policy(pol, instr_tag, d_instr) is None
    assert check_against_policy(pol, reply_tag, d_reply) is None
    assert "probe.routing" not in pol[reply_tag]["required"] and pol[reply_tag]["shapes"]["probe.routing"] == [L, E]
    assert "outside the allow-list" in check_against_policy(off, instr_tag, d_instr)
    assert "outside the allow-list" in check_against_policy(off, reply_tag, d_reply)
