"""Packing at the Flower boundary: every payload round-trips bit-exact through Flower's own object transport
(deflate, inflate), a message shrinks to a few objects (a short one to three, its arrays inside the manifest), a
manifest that lies is refused naming the array, in both forms, and both guards still refuse what they refused, on
the unpacked records."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects
from flwr.supercore.inflatable.inflatable_utils import inflate_object_from_contents
from test_codec import _assert_same, _payloads, _secure_payloads

from distmoe.ledger import Ledger, generate_signing_key
from distmoe.wire import codec, inspect, packing
from distmoe.wire.codec import WireError
from distmoe.wire.errors import Refused
from distmoe.wire.packing import INLINE_MAX, MANIFEST, PACKED
from distmoe.wire.party_guard import serve
from distmoe.wire.schema import TRAIN_METRIC_KEYS, ModelUpdate, ProbeInstruction, ProbeReply
from distmoe.wire.server_guard import ServerGuard, build_policy

W = {"w": np.arange(6, dtype=np.float32).reshape(3, 2), "b": np.array([1.5, -2.0], np.float32),
     "i": np.array([[7]], np.int64), "e": np.zeros((0, 3), np.float32)}


@pytest.fixture(autouse=True)
def _run_id(monkeypatch):  # a ServerApp's messages take their run id from Flower's task identity
    from flwr.supercore.task_identity import TaskIdentity

    monkeypatch.setattr(TaskIdentity, "_run_id", 1, raising=False)
    monkeypatch.setattr(TaskIdentity, "_node_id", 0, raising=False)
    monkeypatch.setattr(TaskIdentity, "_task_id", 1, raising=False)


def _through_flower(content: RecordDict, node: int = 3) -> RecordDict:
    """What the receiver's ``msg.content`` is: the message built as distmoe builds it (packed), every object
    deflated to bytes as Flower sends it and inflated again from those bytes alone."""
    msg = codec.instruction_content(content, node, "query.probe")
    blobs = {oid: obj.deflate() for oid, obj in get_all_nested_objects(msg).items()}
    return inflate_object_from_contents(msg.object_id, blobs).content


def _same_records(a: RecordDict, b: RecordDict) -> None:
    assert list(a.keys()) == list(b.keys())
    for name, rec in a.items():
        assert type(b[name]) is type(rec) and list(b[name].keys()) == list(rec.keys()), name
        for key, v in rec.items():
            w = b[name][key]
            if isinstance(rec, ArrayRecord):
                assert (w.dtype, tuple(w.shape), w.stype, w.data) == (v.dtype, tuple(v.shape), v.stype, v.data)
            else:
                assert w == v and type(w) is type(v), (name, key)


@pytest.mark.parametrize("i", range(len(_payloads()) + len(_secure_payloads())))
def test_every_payload_round_trips_bit_exact_through_flowers_objects(i):
    payload = (_payloads() + _secure_payloads())[i]
    content = codec.with_ledger_head(codec.encode(payload), 4, "ab" * 32)
    got = _through_flower(content)
    size = sum(len(a.data) for r in content.values() if isinstance(r, ArrayRecord) for a in r.values())
    assert set(got.keys()) == ({PACKED, MANIFEST} if size > INLINE_MAX else {MANIFEST})  # the whole message
    if size <= INLINE_MAX:  # a short message is three Flower objects: the message, its record dict, the manifest
        assert packing.object_count(got) == 3, size
    back = packing.unpack(got)
    _same_records(content, back)  # names, order, dtypes, shapes, stypes, every byte
    assert inspect.digest(back) == inspect.digest(content)  # the ledgers' hash of the logical records
    decoded = codec.decode(back, type(payload))
    if dataclass_fields := getattr(payload, "__dataclass_fields__", None):
        if "instruction" not in dataclass_fields and "masked" not in dataclass_fields:
            _assert_same(payload, decoded)


def test_a_message_is_a_few_objects_and_shared_weights_stay_one_object():
    many = {f"model.layers.{i}.mlp.experts.{j}": np.full((4, 3), i + j / 10, np.float32)
            for i in range(2) for j in range(20)}
    content = codec.encode(ProbeInstruction(4, "h", ("p",), many))
    before, after = packing.object_count(content), packing.object_count(packing.pack(content, inline_max=0))
    assert before >= 2 + len(content) + 2 * len(many) and after == 2 + 2 + 2, (before, after)  # one array record
    assert packing.object_count(packing.pack(content)) == 3  # its 40 arrays (7 KB) inside the manifest
    assert packing.object_count(packing.pack(content, inline_max=1000)) == 6  # over the limit: as before
    # the same weights (over INLINE_MAX) to two nodes, each message with its own ledger head: one object
    big = codec.encode(ProbeInstruction(4, "h", ("p",), {"w": np.ones((INLINE_MAX // 4 + 1,), np.float32)}))
    a = codec.instruction_content(codec.with_ledger_head(codec.shared(big), 1, "a" * 64), 1, "query.probe")
    b = codec.instruction_content(codec.with_ledger_head(codec.shared(big), 2, "b" * 64), 2, "query.probe")
    assert a.content[PACKED]["arrays"].object_id == b.content[PACKED]["arrays"].object_id
    assert a.object_id != b.object_id


FORMS = {"packed record": 0, "inline": INLINE_MAX}  # pack's inline_max: W's arrays in PACKED, or in the manifest


def _packed(inline_max: int = 0) -> RecordDict:
    return packing.pack(codec.encode(ProbeInstruction(4, "h", ("p",), W)), inline_max=inline_max)


def _lie(field: str, fn, inline_max: int) -> RecordDict:
    rd = _packed(inline_max)
    man = {k: list(v) if isinstance(v, list) else v for k, v in rd[MANIFEST].items()}
    man[field] = fn(man[field])
    rd[MANIFEST] = ConfigRecord(man)
    return rd


def _set(i, v):
    return lambda xs: xs[:i] + [v] + xs[i + 1:]


# (how the manifest lies, what the refusal must say); the manifest order of W's keys is sorted: b, e, i, w
LIES = {
    "offset into the previous array": (lambda i: _lie("offsets", _set(1, 8), i), r"array arrays\.e: offset 8"),
    "a gap before an array": (lambda i: _lie("offsets", _set(3, _packed(i)[MANIFEST]["offsets"][3] + 1), i),
                              r"array arrays\.w: offset"),
    "a size past the end": (lambda i: _lie("sizes", _set(3, 10**6), i), r"array arrays\.w: bytes .* run past"),
    "a size one byte short": (lambda i: _lie("sizes", _set(0, _packed(i)[MANIFEST]["sizes"][0] - 1), i),
                              r"array arrays\.b: 1 bytes missing"),
    "a shape other than the bytes": (lambda i: _lie("dims", lambda d: [5] + d[1:], i),
                                     r"array arrays\.b: its bytes hold float32\[2\], the manifest says float32\[5\]"),
    "a dtype other than the bytes": (lambda i: _lie("dtypes", _set(2, "int32"), i),
                                     r"array arrays\.i: its bytes hold int64"),
    "an stype": (lambda i: _lie("stypes", _set(3, "torch.tensor"), i), r"array arrays\.w: stype"),
    "the same key twice": (lambda i: _lie("keys", _set(1, "b"), i), r"array arrays\.b is in the manifest twice"),
    "an array left out": (lambda i: _lie("keys", lambda k: k[:3], i), r"manifest lists differ in length"),
    "an array not listed": (lambda i: _lie("records", _set(3, "ref"), i), r"records \['ref'\] that are not packed"),
    "a negative offset": (lambda i: _lie("offsets", _set(0, -1), i), r"'offsets' holds a negative number"),
    "a text where numbers go": (lambda i: _lie("sizes", lambda s: [str(x) for x in s], i),
                                r"'sizes' is not a list of int"),
    "a record named twice": (lambda i: _lie("order", _set(1, "arrays"), i), r"a record named twice"),
    "an array record not packed": (lambda i: _lie("kinds", lambda k: ["array"] * len(k), i),
                                   r"array records \['arrays', 'meta'\]"),
    "a value of no record": (lambda i: _lie("value_records", _set(0, "ref"), i),
                             r"value ref\.\w+: no config or metric"),
    "a value twice": (lambda i: _lie("value_keys", lambda k: [k[1]] + k[1:], i),
                      r"value meta\.\w+ is in the manifest twice"),
    "a value not listed": (lambda i: _lie("value_keys", lambda k: k[:-1], i),
                           r"manifest fields: .*unexpected \['v\d+'\]"),
}


@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize("lie", sorted(LIES))
def test_a_manifest_that_lies_is_refused_naming_the_array(lie, form):
    make, match = LIES[lie]
    assert (PACKED in _packed(FORMS[form])) == (form == "packed record")
    with pytest.raises(WireError, match=match):
        packing.unpack(make(FORMS[form]))


def _inline_lie(fn) -> RecordDict:
    rd = _packed(INLINE_MAX)
    man = {k: list(v) if isinstance(v, list) else v for k, v in rd[MANIFEST].items()}
    fn(man, rd)
    rd[MANIFEST] = ConfigRecord(man)
    return rd


INLINE_LIES = {  # what only the inline form can say wrongly
    "inline bytes that are text": (lambda m, rd: m.update(a0="not bytes"), r"inline record's value \(a<j>\) is not"),
    "a record both inline and packed": (lambda m, rd: rd.__setitem__(PACKED, _packed(0)[PACKED]),
                                        r"array records \['arrays'\] != the packed \['arrays', 'arrays'\]"),
    "a record inline twice": (lambda m, rd: m.update(inline=m["inline"] * 2, a1=m["a0"]),
                              r"!= the packed \['arrays', 'arrays'\]"),
    "inline bytes with a tail": (lambda m, rd: m.update(a0=m["a0"] + b"tail"),
                                 r"do not cover the packed records: arrays \(\d+ of \d+ bytes\)"),
    "inline bytes cut short": (lambda m, rd: m.update(a0=m["a0"][:-4]), r"array arrays\.w: bytes .* run past"),
    "an inline record without its bytes": (lambda m, rd: m.pop("a0"), r"manifest fields: missing \['a0'\]"),
    "inline bytes of no record": (lambda m, rd: m.update(a1=b"x"), r"manifest fields: .*unexpected \['a1'\]"),
}


@pytest.mark.parametrize("lie", sorted(INLINE_LIES))
def test_an_inline_manifest_that_lies_is_refused(lie):
    fn, match = INLINE_LIES[lie]
    with pytest.raises(WireError, match=match):
        packing.unpack(_inline_lie(fn))


def test_bytes_after_the_last_array_and_loose_records_are_refused():
    rd = _packed()
    arr = rd[PACKED]["arrays"]
    rd[PACKED]["arrays"] = Array(np.frombuffer(inspect.check_array(arr, "x").tobytes() + b"tail", np.uint8).copy())
    with pytest.raises(WireError, match=r"do not cover the packed records: arrays \(\d+ of \d+ bytes\)"):
        packing.unpack(rd)
    rd = _packed()
    rd["hidden"] = ArrayRecord(array_dict={"x": Array(np.ones(3))})
    with pytest.raises(WireError, match=r"records \['hidden'\] travel outside the pack"):
        packing.unpack(rd)
    rd = _packed()
    del rd[MANIFEST]
    with pytest.raises(WireError, match="travels without its 'packed_manifest'"):
        packing.unpack(rd)
    rd = packing.pack(codec.encode(ModelUpdate("p0", W, 3, {k: 0.5 for k in TRAIN_METRIC_KEYS})))
    man = dict(rd[MANIFEST].items())
    i = next(j for j, r in enumerate(man["value_records"]) if r == "metrics")
    rd[MANIFEST] = ConfigRecord({**man, f"v{i}": "a line of private data"})
    with pytest.raises(WireError, match="a metric record holds a value that is not a number"):
        packing.unpack(rd)
    with pytest.raises(WireError, match="reserved for packing"):
        packing.pack(_packed())


def _policy():
    return build_policy(secure=True, n_parties=3, trainable={k: v.shape for k, v in W.items()}, layers=2, experts=4,
                        update_length=8, stats_length=8, rl_update_length=8, tasks=("t",), eval_length=8,
                        probe_prompts=("p",), probe_tokens=64)


def _poison(rd: RecordDict, record: str, key: str, value) -> RecordDict:
    """``rd`` (packed, either form) with the first value of ``record.key`` overwritten in the packed bytes: a
    well-formed pack."""
    man = rd[MANIFEST]
    i = next(j for j, (r, k) in enumerate(zip(man["records"], man["keys"], strict=True)) if (r, k) == (record, key))
    inline = record in man["inline"]
    blob = (np.frombuffer(man[f"a{man['inline'].index(record)}"], np.uint8) if inline
            else inspect.check_array(rd[PACKED][record], "x")).copy()
    dt = np.dtype(man["dtypes"][i])
    end = man["offsets"][i] + man["sizes"][i]
    start = end - int(np.prod(_shape(man, i))) * dt.itemsize  # the first value: a .npy's data ends its range
    blob[start:start + dt.itemsize] = np.frombuffer(np.array([value], dt).tobytes(), np.uint8)
    if inline:
        rd[MANIFEST] = ConfigRecord({**dict(man.items()), f"a{man['inline'].index(record)}": blob.tobytes()})
    else:
        rd[PACKED][record] = Array(blob)
    return rd


def _shape(man, i):
    before = sum(man["ndims"][:i])
    return man["dims"][before:before + man["ndims"][i]]


@pytest.mark.parametrize("form", sorted(FORMS))
def test_the_server_guard_refuses_a_nan_that_travels_packed_and_logs_it(tmp_path, form):
    pack = lambda rd: packing.pack(rd, inline_max=FORMS[form])  # noqa: E731
    guard = ServerGuard(Ledger(tmp_path / "c.jsonl", generate_signing_key(tmp_path / "c.key")), "run-1", _policy())
    rng = np.random.default_rng(0)
    reply = ProbeReply("party-0", rng.dirichlet(np.ones(4), 2), np.zeros((2, 5), np.int32))
    content = pack(codec.with_ledger_head(codec.encode(reply), 3, "ab" * 32))
    assert guard.inbound(0, content, ProbeReply, 4, "probe").party == "party-0"  # the well-formed pack passes
    bad = _poison(pack(codec.with_ledger_head(codec.encode(reply), 3, "ab" * 32)), "probe", "routing",
                  np.nan)
    with pytest.raises(WireError, match=r"rejected by the server guard: .*probe.*'routing'.*NaN"):
        guard.inbound(0, bad, ProbeReply, 4, "probe")
    liar = pack(codec.with_ledger_head(codec.encode(reply), 3, "ab" * 32))
    man = dict(liar[MANIFEST].items())
    man["offsets"][-1] += 8
    liar[MANIFEST] = ConfigRecord(man)
    with pytest.raises(WireError, match=r"rejected by the server guard: packing: array top1\.top1: offset"):
        guard.inbound(0, liar, ProbeReply, 4, "probe")
    ins = [json.loads(x) for x in (tmp_path / "c.jsonl").read_text().splitlines()][-3:]
    assert [e["verdict"][:8] for e in ins] == ["accepted", "rejected", "rejected"]
    assert ins[0]["keys"] == ["meta.party", "meta.payload", "probe.routing", "top1.top1"]  # the logical records
    assert ins[0]["sha256"] == inspect.digest(codec.encode(reply))


class _Party:
    name, canaries, secure = "party-0", [], True

    def __init__(self, ledger):
        self.ledger = ledger

    def answer(self, mtype, instruction):
        rng = np.random.default_rng(1)
        return ProbeReply("party-0", rng.dirichlet(np.ones(4), 2), np.zeros((2, 5), np.int32)), None


@pytest.mark.parametrize("form", sorted(FORMS))
def test_the_party_guard_refuses_a_packed_instruction_that_lies_or_carries_a_nan(tmp_path, form):
    pack = lambda rd: packing.pack(rd, inline_max=FORMS[form])  # noqa: E731
    guard = ServerGuard(Ledger(tmp_path / "c.jsonl", generate_signing_key(tmp_path / "c.key")), "run-1", _policy())
    party = _Party(Ledger(tmp_path / "p.jsonl", generate_signing_key(tmp_path / "p.key")))
    mtype, content = guard.outbound(0, ProbeInstruction(4, "h", ("p",), W), 4, "probe")
    reply = serve(mtype, pack(content), party, "run-1")  # a well-formed pack is answered
    assert guard.inbound(0, pack(reply), ProbeReply, 4, "probe").party == "party-0"
    party_in = [json.loads(x) for x in (tmp_path / "p.jsonl").read_text().splitlines()][-2]
    coord_out = [json.loads(x) for x in (tmp_path / "c.jsonl").read_text().splitlines()][-2]
    assert party_in["sha256"] == coord_out["sha256"] and party_in["verdict"] == "accepted"
    with pytest.raises(Refused):
        serve(mtype, _poison(pack(content), "arrays", "w", np.inf), party, "run-1")
    packed = pack(content)
    man = dict(packed[MANIFEST].items())
    man["sizes"][0] += 1
    packed[MANIFEST] = ConfigRecord(man)
    with pytest.raises(Refused):
        serve(mtype, packed, party, "run-1")
    verdicts = [json.loads(x)["verdict"] for x in (tmp_path / "p.jsonl").read_text().splitlines()
                if json.loads(x)["direction"] == "in"]
    assert "'w'" in verdicts[-2] and "NaN or Inf" in verdicts[-2], verdicts[-2]
    assert "packing: array arrays.b" in verdicts[-1], verdicts[-1]


def _round_starts(nodes=(5, 6, 7)) -> dict:
    import os

    from distmoe.privacy import secagg as sa

    fed = sa.LocalFederation(sa.SecAggParams(os.urandom(16), 2, 64, 10), list(nodes))
    directory = fed.server.register([c.advertise() for c in fed.clients.values()])
    for c in fed.clients.values():
        c.receive_directory(directory)
    fed.server.add_share_keys([c.share_keys(1) for c in fed.clients.values()])
    return fed.server.begin_round(1, 6)


def test_one_exchanges_secure_instructions_share_the_weights_and_log_the_same_digests():
    """Each party's secure instruction wraps the same phase instruction (the same weights) in its own round start:
    within one exchange (one ``ExchangeMemo`` for encoding, digests and packing) the weights are encoded, hashed and
    packed once, and every message's digest, records and decoded payload are exactly those made without sharing.
    A different instruction with the same record names in the same memo is not taken for the first one."""
    from distmoe.wire.schema import SecureInstruction, SftInstruction
    from distmoe.wire.server_guard import ExchangeMemo

    starts = _round_starts()
    first = SftInstruction(1, "arith", W, "h", 0, None, 0)
    other = SftInstruction(1, "arith", {k: v + 1 for k, v in W.items()}, "h", 0, None, 0)
    msgs = {n: SecureInstruction(first, starts[n], "model-update") for n in starts}
    msgs[99] = SecureInstruction(other, starts[5], "model-update")
    plain = {n: codec.encode(si) for n, si in msgs.items()}
    digests, memo = {}, ExchangeMemo()
    shared = {n: codec.encode(si, memo) for n, si in msgs.items()}
    for n, content in shared.items():
        digests[n] = inspect.digest(content, memo=memo)
        assert digests[n] == inspect.digest(plain[n])  # what the ledger records: unchanged by the sharing
        _same_records(packing.unpack(packing.pack(content, memo)), packing.unpack(packing.pack(plain[n])))
        got = codec.decode(content, SecureInstruction)
        assert got.start == msgs[n].start and got.instruction.round == 1
        _assert_same(got.instruction, msgs[n].instruction)
    assert shared[5]["arrays"] is shared[6]["arrays"] is shared[7]["arrays"]  # encoded once
    assert shared[99]["arrays"] is not shared[5]["arrays"] and digests[99] != digests[5]
    assert len({digests[n] for n in starts}) == 3  # each party's own round start is in its digest
    packs = [packing.pack(shared[n], memo, inline_max=0)[PACKED]["arrays"] for n in (5, 6, 99)]
    assert packs[0].data is packs[1].data and packs[2].data is not packs[0].data  # packed once; the other on its own
    assert codec.encode(msgs[5], ExchangeMemo())["arrays"] is not shared[5]["arrays"]  # a new exchange starts afresh
    assert codec.encode(msgs[5])["arrays"] is not codec.encode(msgs[6])["arrays"]  # no sharing without a memo


def test_a_partys_in_and_out_entries_of_one_message_are_one_group_commit(tmp_path, monkeypatch):
    """``serve`` logs the instruction (``in``) and the reply (``out``) in one ``Ledger.batch``: one fsync of the party
    ledger per message, done before the reply (or the error) leaves ``serve``; both entries are there and verify."""
    import distmoe.ledger.writer as ledger_writer
    from distmoe.ledger import public_key_hex, verify_ledger

    guard = ServerGuard(Ledger(tmp_path / "c.jsonl", generate_signing_key(tmp_path / "c.key")), "run-1", _policy())
    key = generate_signing_key(tmp_path / "p.key")
    party = _Party(Ledger(tmp_path / "p.jsonl", key))
    mtype, content = guard.outbound(0, ProbeInstruction(4, "h", ("p",), W), 4, "probe")
    serve(mtype, packing.pack(content), party, "run-1")  # creates the ledger file (and syncs its directory)
    synced, real = [], ledger_writer.os.fsync
    monkeypatch.setattr(ledger_writer.os, "fsync", lambda fd: synced.append(os.readlink(f"/proc/self/fd/{fd}"))
                        or real(fd))
    before = len((tmp_path / "p.jsonl").read_text().splitlines())
    reply = serve(mtype, packing.pack(content), party, "run-1")
    assert synced == [str(tmp_path / "p.jsonl")]  # one fsync for the two entries, before serve returned
    assert len((tmp_path / "p.jsonl").read_text().splitlines()) == before + 2
    assert guard.inbound(0, packing.pack(reply), ProbeReply, 4, "probe").party == "party-0"
    synced.clear()
    with pytest.raises(Refused):  # a refusal: its in entry and its error entry, one fsync, before the error leaves
        serve(mtype, _poison(packing.pack(content), "arrays", "w", np.inf), party, "run-1")
    assert synced == [str(tmp_path / "p.jsonl")]
    assert verify_ledger(tmp_path / "p.jsonl", public_key_hex(key)).ok
