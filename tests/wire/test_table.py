"""Unit tests: the payload table drives the codec; the bytes on the wire are pinned."""

from __future__ import annotations

import dataclasses
import hashlib
import json

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord

from distmoe.privacy import secagg as sa
from distmoe.wire import codec
from distmoe.wire.codec import WireError
from distmoe.wire.schema import (
    BY_MESSAGE_TYPE,
    PAYLOADS,
    RL_METRIC_KEYS,
    TRAIN_METRIC_KEYS,
    ConsistencyRequestMsg,
    ConsistencyResponseMsg,
    DirectoryRequest,
    EvalInstruction,
    EvalReply,
    KeyAdvertReply,
    MaskedReply,
    ModelUpdate,
    RlInstruction,
    RouterStats,
    SecureInstruction,
    SetupRequest,
    SftInstruction,
    ShareKeysReply,
    StatsInstruction,
    UnmaskRequestMsg,
    UnmaskResponseMsg,
    eval_metric_keys,
)

W = {"model.layers.0.mlp.gate.weight": np.arange(8, dtype=np.float32).reshape(2, 4) / 7,
     "model.layers.0.mlp.experts.down_proj": np.linspace(-1, 1, 24, dtype=np.float32).reshape(2, 3, 4)}
ANCHOR = np.array([[0.7, 0.1, 0.1, 0.1], [0.25, 0.25, 0.25, 0.25]], dtype=np.float32)
METRICS = {k: float(i) + 0.5 for i, k in enumerate(TRAIN_METRIC_KEYS)}
METRICS["anchor_kl"] = float("nan")
tasks = ("arith", "strings")
B = lambda n, s=0: bytes((i + s) % 256 for i in range(n))
CT = sa.messages.SHARE_CIPHERTEXT_BYTES
env = lambda snd, rcp, r: sa.EncryptedShares(snd, rcp, r, B(12, snd), B(CT, rcp))
keys = sa.ShareKeys(5, 1, B(32, 1), B(32, 2), (env(5, 6, 1), env(5, 7, 1)))
keys0 = sa.ShareKeys(6, 2, B(32, 3), B(32, 4), ())
start = sa.RoundStart(1, 5, ((5, B(32, 5)), (6, B(32, 6))), (env(6, 5, 1),), 6)
CCT = sa.messages.COUNT_CIPHERTEXT_BYTES
cnt = lambda snd, rcp, r: sa.CountShare(snd, rcp, r, B(12, rcp), B(CCT, snd))
PAYLOADS_FIXED = [
    SftInstruction(3, "arith", W, "ab" * 32, 17, ANCHOR, 2),
    SftInstruction(1, "strings", W, "cd", 0, None, 0),
    StatsInstruction(4, "", W, "ef"),
    EvalInstruction(5, tasks, "strings", W, "01", {k: v + 1 for k, v in W.items()}, ANCHOR, 1),
    EvalInstruction(2, ("arith",), "", W, "01", None, None, 0),
    ModelUpdate("party-0", {k: v * -0.01 for k, v in W.items()}, 19, METRICS),
    RouterStats(np.array([[1.5, 0.5, 2.0, 1.0], [1.25, 1.75, 1.0, 1.0]])),
    EvalReply("hospital_B", {k: 0.25 for k in eval_metric_keys(tasks)} | {"load_cv": float("inf")}),
    RlInstruction(6, "arith", W, "ab", 5),
    ModelUpdate("party-1", W, 8, {**{k: 0.5 for k in RL_METRIC_KEYS}, "route_disagree_l0": 0.1}, "rl"),
    SetupRequest(B(16), 2, 10, 3, 1.5, 0.0, "20261201-141100-ab12", 2),
    SetupRequest(B(16, 9), 3, 100, 4, 2, 1, "", 0),
    KeyAdvertReply("party-0", B(32, 7), "ab" * 32, B(32, 8)),
    DirectoryRequest(sa.KeyDirectory(B(16), ((5, B(32, 1)), (6, B(32, 2)), (7, B(32, 3))),
                                     ((5, B(32, 11)), (6, B(32, 12)), (7, B(32, 13)))), 1,
                     ((7, "c"), (5, "a"), (6, "b"))),
    ShareKeysReply(keys),
    ShareKeysReply(keys0),
    SecureInstruction(StatsInstruction(1, "", W, "ef"), start, "router-stats"),
    SecureInstruction(SftInstruction(1, "arith", W, "h", 0, ANCHOR, 1), None, "model-update"),
    SecureInstruction(EvalInstruction(5, tasks, "strings", W, "01", W, None, 0), start, "eval"),
    MaskedReply("router-stats", sa.MaskedInput(5, 1, np.arange(6, dtype=np.uint64), keys,
                                               (cnt(5, 6, 1), cnt(5, 7, 1))), None),
    MaskedReply("model-update", sa.MaskedInput(5, 1, np.arange(3, dtype=np.uint64), None), None),
    MaskedReply("eval", None, keys0),
    UnmaskRequestMsg(sa.UnmaskRequest(1, (5, 6), (7,), ((5, B(66, 3), B(64, 4)), (6, B(66, 5), B(64, 6))))),
    UnmaskRequestMsg(sa.UnmaskRequest(2, (5,), ())),
    UnmaskResponseMsg(sa.UnmaskResponse(5, 1, ((5, B(66)), (6, B(66, 1))), ((7, B(66, 2)),))),
    ConsistencyRequestMsg(sa.ConsistencyRequest(1, 5, (5, 6, 7), (cnt(6, 5, 1), cnt(7, 5, 1)))),
    ConsistencyResponseMsg(sa.ConsistencyResponse(5, 1, B(66, 9), B(64, 10))),
    SftInstruction(2, "strings", W, "cd", 0, None, 3, task_anchors=np.stack([ANCHOR, ANCHOR[::-1]]), task_round=2,
                   ref_hash="ef" * 32),  # retention
]



# sha256 of the structural dump (records in order, keys in order, value types, array bytes) of each payload
# above, taken from the codec before it was driven by the table: the bytes on the wire must not change
# (re-pinned for the consistency check: the key advert and directory carry the signing keys, the masked input
# its contributor-bit shares, the unmask request the signatures; the two consistency messages are new; the
# round start of the two secure instructions carries its ring width `bits`)
PINNED = [
    "9f26bba42e4fd64119f24c395baf4b4be957b4f7aa3edebee57a6ac478686de9",
    "bcadd59e9f1157474d199c98697b17e3d1a8a2d28c55d739fd78e586f2d2b8eb",
    "20cd4ece194dc7156a14494b7fdc36fe9a5b163094b0d48994eb7a82708c191c",
    "488002e77136873bf21b275bd12aa49c61f0500d562dc27c63f99d8d21b4d367",
    "ea18730bd8560fb73bd1c0439f669eabebcd97281f13ba3df2e5b5beb613713c",
    "7ae1d60f282d1426742dacad060111cacd323c4b87eac43a2f9467a124c76d26",
    "ca7e4433073b61b2ba962d4319c315f19db9cf5d4fa4480f755cf8e1c2c5ae80",
    "9169602ce2efa6d201788d8d376083ac8e5e21e9499ce82ea52c156f763470dc",
    "edf18a3eb5cf3e470586413056d00e20a739e9fe66c9792662fcdf1a23ff364b",
    "25c7c7f2792d31c8e3078d4c17c2c34261b02475f3c39ec0cddc58e3ae5117db",
    "8902a0e4bcf99c029f8eab5a3f131483eedc56db0d28ec13c811dc6505b9e33f",
    "54342bfca4a365962bce71b9166f2b0ee1710748516994b86ac250490b2c40db",
    "e614bbf9d39da592be4ca3fd5be82e4d207258c75958c190aa85f1603295dd01",  # KeyAdvertReply: + epsilon_max (budget cap)
    "a597944c055819b0bbccc31b68e51fb56609a02562e910dddbeae3af32fe1ce3",
    "1fda911fef739a41dd00a68385dd863846d87758d462767f48b8494a7b4a601d",
    "a75d93ac19ea6889d99ce518de0896c8d50233ffae4ac940bd314cec6b061c67",
    "98cf1013d8b80bd402c2beecf7d58d79b4b393311e4ad06e5fe68d16374943b9",
    "d2612c0bf9fb893d5c8f4976b58a65687ebb0eeaf5337403304f0aad0d550d54",
    "ada9131c4333c139932cabd0b7c144515e11cd106c3afea6c135570e86a8ad3b",
    "a0affa7bcbbb3d793dea8d3f3985b765aa56f1126c2c5cc7448419ba9f1d8485",
    "3d5c1cc96d59d310a3bc753e61abd16e6f3984cc2e40ccfd3c8090d8538f4d2e",
    "9207289cc1c2225aa71a7f7e1c56d4cb4b5195391f4df1d745cdda413e3f77fa",
    "5877984ae1296e80d8813d6f88895e84081ccb59d9e2a682ebf64bb0fd10a7ff",
    "650edf066c17f69d1ff3f7a6e052d29153578a01e374ec33f8b2dccc728f5aaf",
    "0071e3d7d4ebe8ab04ea97d229248896aa6c6534308cf3dc744baf5a25e705c0",
    "9b49ec346af43f0091ee30f5ac8384eda761910abed1930dcd31ec856bf9e8bc",
    "098ed2744becf74459c58b290e6b8fe533cfb75ae96052ea4c8974027329e50b",
    "54c07a175466954e527f0b53e19136d07e9427b27029123b721fafb587bb2f6c",
]


def dump(rd):
    out = []
    for name, rec in rd.items():
        items = []
        for k, v in rec.items():
            if isinstance(rec, ArrayRecord):
                items.append([k, v.dtype, list(v.shape), v.stype, hashlib.sha256(v.data).hexdigest()])
            else:
                vv = v if not isinstance(v, bytes) else "b:" + v.hex()
                items.append([k, type(v).__name__, repr(vv)])
        out.append([name, type(rec).__name__, items])
    return out



def test_wire_bytes_are_pinned():
    got = [hashlib.sha256(json.dumps(dump(codec.encode(p))).encode()).hexdigest() for p in PAYLOADS_FIXED]
    assert got == PINNED


@pytest.mark.parametrize("i", range(len(PAYLOADS_FIXED)))
def test_pinned_payloads_round_trip(i):
    p = PAYLOADS_FIXED[i]
    back = codec.decode(codec.encode(p), type(p))
    assert type(back) is type(p)
    assert codec.encode(back).keys() == codec.encode(p).keys()
    assert json.dumps(dump(codec.encode(back))) == json.dumps(dump(codec.encode(p)))


def test_the_table_lists_every_field_of_every_payload_once():
    for pt in PAYLOADS:
        assert sorted(f.attr for f in pt.fields) == sorted(f.name for f in dataclasses.fields(pt.cls)), pt.cls
        assert set(pt.records) >= {f.record for f in pt.fields} - {"*"}, pt.cls
        assert all(f.kind.rstrip("?") in codec.KINDS for f in pt.fields), pt.cls
    assert {pt.cls for pt in PAYLOADS} >= {type(p) for p in PAYLOADS_FIXED}
    assert codec.MESSAGE_TYPE[SftInstruction] == "train.sft"
    assert BY_MESSAGE_TYPE["query.unmask"].reply is UnmaskResponseMsg
    assert {pt.release for pt in PAYLOADS if pt.release} == {"model-update", "rl-update", "router-stats", "eval"}


def test_string_fields_are_what_the_guards_allow():
    """The reply fields that may carry text or bytes, derived from the table: exactly the list the party
    and server guards kept by hand (``party_guard.REPLY_STRINGS``)."""
    assert codec.string_fields("reply") == {"meta": {"payload", "release", "party", "ledger_public_key", "kind",
                                                     "c_pk", "sig_pk"},
                                            "keys": {"s_pk", "b_commit"}, "next": {"s_pk", "b_commit"}}
    assert codec.string_fields("instruction")["meta"] >= {"payload", "task", "tasks", "names", "secagg_run"}


def test_decode_rejects_a_record_no_field_reads_and_a_wrong_kind_of_record():
    rd = codec.encode(PAYLOADS_FIXED[20])  # a masked input without share keys
    rd["next_shares"] = ArrayRecord({"x": Array(np.zeros(2, np.uint8))})
    with pytest.raises(WireError, match="unexpected"):
        codec.decode(rd, MaskedReply)
    rd = codec.encode(PAYLOADS_FIXED[21])  # late keys: a masked record does not belong
    rd["masked"] = ConfigRecord({"round": 1, "sender": 6})
    with pytest.raises(WireError, match="unexpected"):
        codec.decode(rd, MaskedReply)
    rd = codec.encode(PAYLOADS_FIXED[6])
    rd["stats"] = ConfigRecord({"sums": 1.0})
    with pytest.raises(WireError, match="not an ArrayRecord"):
        codec.decode(rd, RouterStats)


def test_secure_instruction_checks():
    rd = codec.encode(PAYLOADS_FIXED[16])
    assert isinstance(codec.decode(rd, SecureInstruction), SecureInstruction)
    assert isinstance(codec.decode(codec.encode(PAYLOADS_FIXED[2]), StatsInstruction), StatsInstruction)
    with pytest.raises(WireError, match="secure instruction"):
        codec.decode(codec.encode(PAYLOADS_FIXED[2]), SecureInstruction)  # no protocol part
    inner = codec.encode(PAYLOADS_FIXED[10])  # a setup request is not a phase instruction
    for k in ("sa", "sa_parts", "sa_shares"):
        inner[k] = rd[k]
    with pytest.raises(WireError, match="not a phase instruction"):
        codec.decode(inner, SecureInstruction)
    with pytest.raises(WireError, match="exactly one"):
        codec.encode(MaskedReply("eval", None, None))


@pytest.mark.parametrize("cap", [-1.0, float("nan"), float("inf"), True])
def test_a_key_advert_cap_must_be_a_finite_number_at_least_zero(cap):
    """A party's declared epsilon-max (0 = none) is a bounded number: anything else is refused both ways."""
    with pytest.raises(WireError, match="epsilon_max"):
        codec.encode(KeyAdvertReply("party-0", B(32, 7), "ab" * 32, B(32, 8), cap))
    rec = codec.encode(KeyAdvertReply("party-0", B(32, 7), "ab" * 32, B(32, 8), 4.0))
    rec["meta"]["epsilon_max"] = cap
    with pytest.raises(WireError, match="epsilon_max"):
        codec.decode(rec, KeyAdvertReply)
    assert codec.decode(codec.encode(KeyAdvertReply("p", B(32, 7), "ab" * 32, B(32, 8), 4.0)), KeyAdvertReply
                        ).epsilon_max == 4.0
