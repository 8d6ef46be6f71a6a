"""Unit tests: the wire codec (round trips of every payload type and every rejection)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord

from distmoe.wire import codec
from distmoe.wire.codec import WireError, decode, encode
from distmoe.wire.schema import (
    PAYLOAD_TAGS,
    RL_METRIC_KEYS,
    TRAIN_METRIC_KEYS,
    EvalInstruction,
    EvalReply,
    ModelUpdate,
    ProbeInstruction,
    ProbeReply,
    RlInstruction,
    RouterStats,
    SettleInstruction,
    SettleReply,
    SftInstruction,
    StatsInstruction,
    eval_metric_keys,
)

W = {"model.layers.0.mlp.gate.weight": np.arange(8, dtype=np.float32).reshape(2, 4) / 7,
     "model.layers.0.mlp.experts.down_proj": np.linspace(-1, 1, 24, dtype=np.float32).reshape(2, 3, 4)}
ANCHOR = np.array([[0.7, 0.1, 0.1, 0.1], [0.25, 0.25, 0.25, 0.25]], dtype=np.float32)
METRICS = {k: float(i) + 0.5 for i, k in enumerate(TRAIN_METRIC_KEYS)}


def _payloads() -> list:
    tasks = ("arith", "strings")
    return [
        SftInstruction(round=3, task="arith", weights=W, base_hash="ab" * 32, seed=17, anchor=ANCHOR,
                       anchor_version=2),
        SftInstruction(round=1, task="strings", weights=W, base_hash="cd", seed=0, anchor=None,
                       anchor_version=0),
        StatsInstruction(round=4, task="", weights=W, base_hash="ef"),
        StatsInstruction(round=4, task="arith", weights=W, base_hash="ef"),
        EvalInstruction(round=5, tasks=tasks, new_task="strings", weights=W, base_hash="01",
                        ref_weights={k: v + 1 for k, v in W.items()}, anchor=ANCHOR, anchor_version=1),
        EvalInstruction(round=2, tasks=("arith",), new_task="", weights=W, base_hash="01",
                        ref_weights=None, anchor=None, anchor_version=0),
        ModelUpdate(party="party-0", delta={k: v * -0.01 for k, v in W.items()}, num_examples=19,
                    metrics=METRICS),
        RouterStats(sums=np.array([[1.5, 0.5, 2.0, 1.0], [1.25, 1.75, 1.0, 1.0]], dtype=np.float64)),
        EvalReply(party="hospital_B", metrics={k: 0.25 for k in eval_metric_keys(tasks)}),
        RlInstruction(round=6, task="arith", weights=W, base_hash="ab", seed=5),
        ModelUpdate(party="party-1", delta=W, num_examples=8, kind="rl",
                    metrics={**{k: 0.5 for k in RL_METRIC_KEYS}, "route_disagree_l0": 0.1, "route_disagree_l1": 0.0}),
        ProbeInstruction(round=7, base_hash="ab", prompts=("Compute\n1+2", "Look up k3"), weights=W),
        ProbeReply(party="party-2", routing=ANCHOR.astype(np.float64), top1=np.array([[0, 1, 3], [2, 2, 0]], np.int32)),
        SettleInstruction(round=8, base_hash="ab", weights=W),
        SettleReply(party="party-1", bias=ANCHOR.astype(np.float64) - 0.25),
        SftInstruction(round=7, task="pref", weights=W, base_hash="cd", seed=0, anchor=None, anchor_version=0,
                       objective="dpo", ref_weights={k: v + 1 for k, v in W.items()}),  # a dpo round's reference
    ]


def _assert_same(a, b):
    assert type(a) is type(b)
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, dict) and x and isinstance(next(iter(x.values())), np.ndarray):
            assert sorted(x) == sorted(y), f.name
            for k in x:
                assert y[k].dtype == x[k].dtype and np.array_equal(x[k], y[k]), (f.name, k)
        elif isinstance(x, np.ndarray):
            assert isinstance(y, np.ndarray) and y.dtype == x.dtype and np.array_equal(x, y), f.name
        else:
            assert x == y, (f.name, x, y)
            assert type(x) is type(y), (f.name, type(x), type(y))


def _secure_payloads() -> list:
    """Real protocol messages of a 3-party run (setup, a round start, a masked input, the consistency
    check, unmask)."""
    import os

    from distmoe.privacy import secagg as sa
    from distmoe.wire.schema import (
        ConsistencyRequestMsg,
        ConsistencyResponseMsg,
        DirectoryRequest,
        KeyAdvertReply,
        MaskedReply,
        SecureInstruction,
        SetupRequest,
        ShareKeysReply,
        UnmaskRequestMsg,
        UnmaskResponseMsg,
    )

    params = sa.SecAggParams(os.urandom(16), 2, 64, 10)
    fed = sa.LocalFederation(params, [5, 6, 7])
    adverts = [c.advertise() for c in fed.clients.values()]
    directory = fed.server.register(adverts)
    for c in fed.clients.values():
        c.receive_directory(directory)
    keys = [c.share_keys(1) for c in fed.clients.values()]
    fed.server.add_share_keys(keys)
    starts = fed.server.begin_round(1, 6)
    masked = {i: fed.clients[i].masked_input(starts[i], np.arange(6, dtype=np.uint64)) for i in (5, 6, 7)}
    checks = fed.server.receive_masked(1, masked.values())
    signed = fed.clients[5].consistency(checks[5])
    masked = masked[5]
    req = sa.UnmaskRequest(1, (5, 6), (7,), ((5, signed.share_sum, signed.signature),))
    resp = sa.UnmaskResponse(5, 1, ((5, bytes(66)), (6, bytes(range(66)))), ((7, bytes([1]) * 66),))
    return [
        SetupRequest(params.run_id, 2, 10, 3, 1.5, 0.0, "20261201-141100-ab12", 2),
        KeyAdvertReply("party-0", adverts[0].c_pk, "ab" * 32, adverts[0].sig_pk),
        DirectoryRequest(directory, 1, ((5, "a"), (6, "b"), (7, "c"))),
        ShareKeysReply(keys[0]),
        SecureInstruction(StatsInstruction(round=1, task="", weights=W, base_hash="ef"), starts[5], "router-stats"),
        SecureInstruction(SftInstruction(1, "arith", W, "h", 0, None, 0), None, "model-update"),
        MaskedReply("router-stats", masked, None),
        MaskedReply("eval", None, keys[1]),
        UnmaskRequestMsg(req),
        UnmaskResponseMsg(resp),
        ConsistencyRequestMsg(checks[5]),
        ConsistencyResponseMsg(signed),
    ]


def test_every_payload_type_is_covered():
    assert {type(p) for p in _payloads() + _secure_payloads()} - {_secure_payloads()[4].__class__} == \
        set(PAYLOAD_TAGS)


@pytest.mark.parametrize("i", range(12))
def test_secure_payload_roundtrip(i):
    from distmoe.wire.schema import MaskedReply, SecureInstruction

    payload = _secure_payloads()[i]
    back = decode(encode(payload), type(payload))
    if isinstance(payload, MaskedReply):
        assert back.release == payload.release and back.late_keys == payload.late_keys
        if payload.masked is not None:
            assert np.array_equal(back.masked.y, payload.masked.y) and back.masked.y.dtype == np.uint64
            assert back.masked.next_keys == payload.masked.next_keys and back.masked.sender == payload.masked.sender
            assert back.masked.count_shares == payload.masked.count_shares and len(back.masked.count_shares) == 2
    elif isinstance(payload, SecureInstruction):
        assert back.start == payload.start and back.release == payload.release
        _assert_same(payload.instruction, back.instruction)
    else:
        assert back == payload


def test_secure_decode_rejects_a_stray_field_and_trailing_bytes():
    from distmoe.wire.schema import MaskedReply

    p = _secure_payloads()[6]
    rd = encode(p)
    rd.config_records["masked"]["note"] = "hello"
    with pytest.raises(WireError, match="fields"):
        decode(rd, MaskedReply)
    rd = encode(p)
    a = rd.array_records["masked_y"]["y"]
    rd.array_records["masked_y"]["y"] = Array(dtype=a.dtype, shape=a.shape, stype=a.stype, data=a.data + b"\0" * 8)
    with pytest.raises(WireError, match="trailing|bytes"):
        decode(rd, MaskedReply)


@pytest.mark.parametrize("payload", _payloads(), ids=lambda p: type(p).__name__)
def test_roundtrip(payload):
    rd = encode(payload)
    back = decode(rd, type(payload))
    _assert_same(payload, back)
    assert decode(encode(payload)) is not None  # no expected type: the tag decides
    assert type(decode(encode(payload))) is type(payload)


def test_model_update_nan_metric_travels_as_nan():
    m = {**METRICS, "anchor_kl": float("nan"), "aux_loss": float("inf")}
    upd = ModelUpdate(party="p", delta=W, num_examples=0, metrics=m)
    back = decode(encode(upd), ModelUpdate)
    assert math.isnan(back.metrics["anchor_kl"]) and math.isnan(back.metrics["aux_loss"])
    assert back.metrics["loss"] == METRICS["loss"] and back.num_examples == 0


def _stats_rd():
    return encode(RouterStats(sums=np.ones((2, 4))))


def test_decode_rejects_unknown_tag_and_non_payloads():
    rd = _stats_rd()
    rd.config_records["meta"]["payload"] = "mystery"
    with pytest.raises(WireError, match="mystery"):
        decode(rd)
    rd = _stats_rd()
    del rd["meta"]
    with pytest.raises(WireError, match="meta"):
        decode(rd)
    with pytest.raises(WireError, match="not a wire payload"):
        encode({"weights": W})


def test_decode_rejects_wrong_expected_type():
    with pytest.raises(WireError) as ei:
        decode(_stats_rd(), SftInstruction)
    assert "sft-instruction" in str(ei.value) and "router-stats" in str(ei.value)


def test_decode_rejects_extra_record():
    rd = _stats_rd()
    rd["smuggled"] = MetricRecord({"secret": 1.0})
    with pytest.raises(WireError, match="smuggled"):
        decode(rd, RouterStats)
    rl = encode(RlInstruction(round=6, task="arith", weights=W, base_hash="ab", seed=5))
    rl["ref"] = ArrayRecord({"x": Array(np.zeros(2, np.float32))})  # optional only for eval and sft (dpo)
    with pytest.raises(WireError, match="ref"):
        decode(rl, RlInstruction)


def test_sft_objective_is_optional_and_closed():
    """``objective`` is absent for SFT (the bytes of an SFT instruction are unchanged) and one of OBJECTIVES else."""
    plain = encode(_payloads()[1])
    assert "objective" not in plain.config_records["meta"] and "ref" not in plain
    assert decode(plain, SftInstruction).objective is None
    dpo = encode(_payloads()[-1])
    assert dpo.config_records["meta"]["objective"] == "dpo" and "ref" in dpo
    dpo.config_records["meta"]["objective"] = "ppo"
    with pytest.raises(WireError, match="unknown objective 'ppo'"):
        decode(dpo, SftInstruction)


def test_decode_rejects_missing_record_and_field():
    rd = encode(_payloads()[0])
    del rd["arrays"]
    with pytest.raises(WireError, match="arrays"):
        decode(rd, SftInstruction)
    rd = encode(_payloads()[6])
    del rd["metrics"]
    with pytest.raises(WireError, match="metrics"):
        decode(rd, ModelUpdate)
    rd = encode(_payloads()[2])
    del rd.config_records["meta"]["round"]
    with pytest.raises(WireError, match="round"):
        decode(rd, StatsInstruction)


def test_decode_rejects_non_finite_arrays():
    for bad in (np.nan, np.inf):
        rd = encode(_payloads()[6])
        arr = np.zeros((2, 4), np.float32)
        arr[1, 2] = bad
        rd["arrays"] = ArrayRecord({"model.layers.0.mlp.gate.weight": Array(arr)})
        with pytest.raises(WireError, match="NaN or Inf") as ei:
            decode(rd, ModelUpdate)
        assert "model.layers.0.mlp.gate.weight" in str(ei.value)
    rd = _stats_rd()
    rd["stats"] = ArrayRecord({"sums": Array(np.array([[np.nan, 1.0]]))})
    with pytest.raises(WireError, match="NaN"):
        decode(rd, RouterStats)
    rd = encode(_payloads()[0])
    rd["anchor"] = ArrayRecord({"probs": Array(np.array([[np.inf, 0.0]], np.float32))})
    with pytest.raises(WireError, match="NaN or Inf"):
        decode(rd, SftInstruction)


def test_model_update_metric_keys_must_be_exact():
    extra = {**METRICS, "per_example_loss_0": 0.1}
    with pytest.raises(WireError, match="metrics"):
        encode(ModelUpdate(party="p", delta=W, num_examples=1, metrics=extra))
    missing = {k: v for k, v in METRICS.items() if k != "time_s"}
    with pytest.raises(WireError, match="metrics"):
        encode(ModelUpdate(party="p", delta=W, num_examples=1, metrics=missing))
    rd = encode(_payloads()[6])
    rd["metrics"] = MetricRecord({**METRICS, "leak": 3.0})
    with pytest.raises(WireError, match="leak"):
        decode(rd, ModelUpdate)
    rd = encode(_payloads()[6])
    rd["metrics"] = MetricRecord(missing)
    with pytest.raises(WireError, match="metric keys"):
        decode(rd, ModelUpdate)


def test_model_update_negative_examples_rejected():
    rd = encode(_payloads()[6])
    rd.config_records["meta"]["num_examples"] = -3
    with pytest.raises(WireError, match="negative"):
        decode(rd, ModelUpdate)


@pytest.mark.parametrize("name", ["a b", "x" * 100, "", "-lead", "semi;colon", "ünï"])
def test_invalid_party_names(name):
    with pytest.raises(WireError, match="party name"):
        encode(ModelUpdate(party=name, delta=W, num_examples=1, metrics=METRICS))
    with pytest.raises(WireError, match="party name"):
        encode(EvalReply(party=name, metrics={"load_cv": 0.1}))
    rd = encode(_payloads()[8])
    rd.config_records["meta"]["party"] = name
    with pytest.raises(WireError, match="party name"):
        decode(rd, EvalReply)


def test_router_stats_array_key_checked():
    rd = _stats_rd()
    rd["stats"] = ArrayRecord({"sums": Array(np.ones((2, 4))), "counts": Array(np.ones(2))})
    with pytest.raises(WireError, match="counts"):
        decode(rd, RouterStats)


def test_record_layout():
    rd = encode(_payloads()[0])
    assert set(rd.keys()) == {"meta", "arrays", "anchor"}
    assert isinstance(rd["meta"], ConfigRecord) and rd["meta"]["payload"] == "sft-instruction"
    assert sorted(rd.array_records["arrays"].keys()) == sorted(W)
    assert set(encode(_payloads()[1]).keys()) == {"meta", "arrays"}
    assert set(encode(_payloads()[6]).keys()) == {"meta", "arrays", "metrics"}
    assert set(encode(_payloads()[7]).keys()) == {"meta", "stats"}
    assert codec.MESSAGE_TYPE[SftInstruction] == "train.sft"
    assert codec.MESSAGE_TYPE[StatsInstruction] == "train.stats"
    assert codec.MESSAGE_TYPE[EvalInstruction] == "evaluate"
    with pytest.raises(WireError, match="not a server instruction"):
        codec.message_type_of(_payloads()[7])


def test_decode_rejects_extra_meta_fields():
    """The codec promises exact keys: a reply cannot carry extra scalar fields (e.g. free text)."""
    for payload, typ in ((_payloads()[6], ModelUpdate), (_payloads()[8], EvalReply),
                         (_payloads()[7], RouterStats)):
        rd = encode(payload)
        rd.config_records["meta"]["note"] = "free text that should not leave the party"
        with pytest.raises(WireError, match="note"):
            decode(rd, typ)


def test_decode_rejects_extra_arrays_in_anchor_record():
    rd = encode(_payloads()[0])
    rd["anchor"] = ArrayRecord({"probs": Array(ANCHOR), "extra": Array(np.ones(3, np.float32))})
    with pytest.raises(WireError, match="extra"):
        decode(rd, SftInstruction)


def test_decode_rejects_eval_reply_metrics_outside_schema():
    """EvalReply metrics are ``acc|loss|n/<task>`` plus the routing keys, never anything else."""
    rd = encode(EvalReply(party="p", metrics={"load_cv": 0.1}))
    rd["metrics"] = MetricRecord({"load_cv": 0.1, "per_example_loss_17": 2.5})
    with pytest.raises(WireError, match="per_example_loss_17"):
        decode(rd, EvalReply)


def test_rl_update_metric_keys_are_checked():
    good = {**{k: 0.5 for k in RL_METRIC_KEYS}, "route_disagree_l3": 0.2}
    assert decode(encode(ModelUpdate(party="p", delta=W, num_examples=2, metrics=good, kind="rl")),
                  ModelUpdate).metrics == good
    with pytest.raises(WireError, match="rl update metrics"):
        encode(ModelUpdate(party="p", delta=W, num_examples=2, metrics={**good, "sample_text_len": 3.0}, kind="rl"))
    with pytest.raises(WireError, match="rl update metrics"):
        encode(ModelUpdate(party="p", delta=W, num_examples=2, metrics=METRICS, kind="rl"))
    with pytest.raises(WireError, match="unknown update kind"):
        encode(ModelUpdate(party="p", delta=W, num_examples=2, metrics=METRICS, kind="dpo"))


def test_setup_request_declares_logical_run_and_epoch():
    """The resume fields travel exactly (a party keys its accountant by them) and are validated both ways."""
    from distmoe.wire.schema import SetupRequest

    req = SetupRequest(bytes(16), 2, 10, 3, 1.5, 0.0, "sec-1a2b.c:d", 3)
    back = decode(encode(req), SetupRequest)
    assert back == req and back.logical_run == "sec-1a2b.c:d" and back.epoch == 3
    for bad in (SetupRequest(bytes(16), 2, 10, 3, 1.5, 0.0, "a/../b", 0),
                SetupRequest(bytes(16), 2, 10, 3, 1.5, 0.0, "x" * 129, 0),
                SetupRequest(bytes(16), 2, 10, 3, 1.5, 0.0, "r", -1)):
        with pytest.raises(WireError, match="logical_run|epoch"):
            encode(bad)
    content = encode(req)
    content["meta"]["logical_run"] = "a b"  # a hostile sender: refused on decode too
    with pytest.raises(WireError, match="logical_run"):
        decode(content, SetupRequest)
    del content["meta"]["logical_run"]
    with pytest.raises(WireError, match="fields"):
        decode(content, SetupRequest)


def test_a_32_bit_round_travels_in_32_bit_words():
    """Ring width: the round start carries the release's ring width and the masked input is uint32 words (half
    the bytes of Z_2^64); a width other than 32 or 64 on the wire is refused."""
    import os

    from distmoe.privacy import secagg as sa
    from distmoe.wire.schema import MaskedReply, SecureInstruction, SftInstruction

    params = sa.SecAggParams(os.urandom(16), 2, 64, 10)
    fed = sa.LocalFederation(params, [5, 6, 7])
    fed.setup()
    starts = fed.server.begin_round(1, 6, 32)
    si = SecureInstruction(SftInstruction(1, "arith", W, "h", 0, None, 0), starts[5], "model-update")
    back = decode(encode(si), SecureInstruction)
    assert back.start.bits == 32 and back.start == starts[5]
    masked = fed.clients[5].masked_input(starts[5], np.arange(6, dtype=np.uint32))
    rd = encode(MaskedReply("model-update", masked, None))
    got = decode(rd, MaskedReply).masked.y
    assert got.dtype == np.uint32 and np.array_equal(got, masked.y)
    assert rd.array_records["masked_y"]["y"].numpy().nbytes == 6 * 4
    rd = encode(si)
    rd.config_records["sa"]["bits"] = 16
    with pytest.raises(WireError, match="ring width 16"):
        decode(rd, SecureInstruction)
