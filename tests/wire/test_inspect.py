"""Byte-level inspection of inbound Flower records (distmoe/wire/inspect.py)."""

from __future__ import annotations

import re
import struct

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from distmoe.wire.inspect import (
    InspectError,
    check_array,
    check_layout,
    check_strings,
    describe,
    digest,
    parse_npy,
    record_bytes,
)


def _raw(data: bytes, dtype: str, shape: tuple[int, ...]) -> Array:
    return Array(dtype=dtype, shape=shape, stype="numpy.ndarray", data=data)


def _npy(descr: object, shape: tuple, payload: bytes, fortran: bool = False, version: int = 1) -> bytes:
    header = f"{{'descr': {descr!r}, 'fortran_order': {fortran}, 'shape': {shape}, }}".encode() + b"\n"
    field = struct.pack("<H" if version == 1 else "<I", len(header))
    return b"\x93NUMPY" + bytes([version, 0]) + field + header + payload


A = np.arange(12, dtype=np.float32).reshape(3, 4)


def test_valid_array_accepted_values_equal_and_read_only():
    out = check_array(Array(A), "arrays.w", dtype="float32", shape=(3, 4))
    np.testing.assert_array_equal(out, A)
    assert out.dtype == np.float32 and not out.flags.writeable
    u = np.array([1, 2**63], dtype=np.uint64)
    np.testing.assert_array_equal(check_array(Array(u), "x", dtype=np.dtype("uint64")), u)
    assert check_array(Array(np.zeros((2, 0))), "x").shape == (2, 0)
    for version in (2, 3):  # the other header-length layouts parse too
        data = _npy("<f4", (2,), np.array([1, 2], "<f4").tobytes(), version=version)
        np.testing.assert_array_equal(check_array(_raw(data, "float32", (2,)), "x"), [1, 2])


@pytest.mark.parametrize("extra", [1, 600])
def test_trailing_bytes_rejected(extra):
    a = Array(A)
    assert _raw(a.data + b"x" * extra, a.dtype, a.shape).numpy().shape == (3, 4)  # Flower accepts them
    with pytest.raises(InspectError, match=f"arrays.w: {extra} trailing bytes"):
        check_array(_raw(a.data + b"x" * extra, a.dtype, a.shape), "arrays.w")


def test_truncated_data_rejected():
    a = Array(A)
    with pytest.raises(InspectError, match="4 bytes missing"):
        check_array(_raw(a.data[:-4], a.dtype, a.shape), "arrays.w")
    with pytest.raises(InspectError, match="truncated .npy header"):
        parse_npy(a.data[:20], "arrays.w")
    with pytest.raises(InspectError, match="bad magic"):
        parse_npy(b"\x00" * len(a.data), "arrays.w")


def test_header_metadata_mismatch_rejected():
    a = Array(A)
    with pytest.raises(InspectError, match=r"header says float32\[3, 4\] but metadata says float32\[4, 3\]"):
        check_array(_raw(a.data, "float32", (4, 3)), "arrays.w")
    with pytest.raises(InspectError, match="metadata says float64"):
        check_array(_raw(a.data, "float64", (3, 4)), "arrays.w")
    with pytest.raises(InspectError, match="stype"):
        check_array(Array(dtype=a.dtype, shape=a.shape, stype="torch.Tensor", data=a.data), "arrays.w")


def test_wrong_dtype_and_shape_rejected():
    with pytest.raises(InspectError, match="arrays.w: dtype float32, expected float64"):
        check_array(Array(A), "arrays.w", dtype="float64")
    with pytest.raises(InspectError, match=r"arrays.w: shape \[3, 4\], expected \[12\]"):
        check_array(Array(A), "arrays.w", shape=(12,))


def test_nan_and_inf_rejected_unless_allowed():
    for bad in (np.nan, np.inf):
        x = A.copy()
        x[1, 2] = bad
        with pytest.raises(InspectError, match="NaN or Inf"):
            check_array(Array(x), "arrays.w")
        assert not np.isfinite(check_array(Array(x), "arrays.w", finite=False)).all()


def test_fortran_object_structured_and_big_endian_rejected():
    data = _npy("<f4", (2, 2), b"\x00" * 16, fortran=True)
    with pytest.raises(InspectError, match="fortran_order"):
        check_array(_raw(data, "float32", (2, 2)), "arrays.w")
    with pytest.raises(InspectError, match=re.escape("dtype '|O' not allowed")):
        check_array(_raw(_npy("|O", (1,), b"\x00" * 8), "object", (1,)), "arrays.w")
    with pytest.raises(InspectError, match="descr"):
        parse_npy(_npy([("a", "<f4")], (1,), b"\x00" * 4), "x")
    with pytest.raises(InspectError, match="not allowed"):
        parse_npy(_npy("|V4", (1,), b"\x00" * 4), "x")
    with pytest.raises(InspectError, match="big-endian|native"):
        parse_npy(_npy(">f4", (1,), b"\x00" * 4), "x")
    with pytest.raises(InspectError, match="not allowed"):
        parse_npy(_npy("<U1", (1,), b"\x00" * 4), "x")
    with pytest.raises(InspectError, match="negative"):
        parse_npy(_npy("<f4", (-1,), b""), "x")
    bad_keys = _npy("<f4", (1,), b"\x00" * 4).replace(b"'shape'", b"'shapf'")
    with pytest.raises(InspectError, match="header keys"):
        parse_npy(bad_keys, "x")


def _content(order: int = 1, w: np.ndarray = A, key: str = "w") -> RecordDict:
    recs = {
        "arrays": ArrayRecord({key: Array(w), "b": Array(np.ones(2, np.float32))}),
        "meta": ConfigRecord({"payload": "update", "round": 3, "party": "p1", "tags": ["a", "b"]}),
        "metrics": MetricRecord({"loss": 0.5, "n": 7}),
    }
    return RecordDict(dict(list(recs.items())[::order]))


def test_digest_stable_across_insertion_order_and_sensitive_to_changes():
    base = digest(_content())
    assert digest(_content(order=-1)) == base
    rev = RecordDict({"arrays": ArrayRecord({"b": Array(np.ones(2, np.float32)), "w": Array(A)}),
                      "metrics": MetricRecord({"n": 7, "loss": 0.5}),
                      "meta": ConfigRecord({"tags": ["a", "b"], "party": "p1", "round": 3, "payload": "update"})})
    assert digest(rev) == base
    flipped = bytearray(Array(A).data)
    flipped[-1] ^= 1
    changed = _content()
    changed["arrays"]["w"] = _raw(bytes(flipped), "float32", (3, 4))
    assert digest(changed) != base
    assert digest(_content(key="w2")) != base
    assert digest(_content(w=A.astype(np.float64))) != base
    assert digest(_content(w=A.reshape(4, 3))) != base
    for dtype, shape in (("float64", (3, 4)), ("float32", (4, 3))):  # metadata alone changes it too
        meta_only = _content()
        meta_only["arrays"]["w"] = _raw(Array(A).data, dtype, shape)
        assert digest(meta_only) != base
    meta_changed = _content()
    meta_changed["meta"]["round"] = 4
    assert digest(meta_changed) != base
    assert digest(meta_changed, exclude={"meta"}) == digest(_content(), exclude=("meta",)) != base
    assert len(base) == 64 and int(base, 16) >= 0


def test_describe_keys_shapes_bytes():
    d = describe(_content())
    assert d["keys"] == ["arrays.b", "arrays.w", "meta.party", "meta.payload", "meta.round", "meta.tags",
                         "metrics.loss", "metrics.n"]
    assert d["shapes"] == {"arrays.w": [3, 4], "arrays.b": [2]}
    assert d["sha256"] == digest(_content())
    assert d["bytes"] == record_bytes(_content())


def test_record_bytes_counts_data_values_and_keys():
    a = Array(A)
    rd = RecordDict({"a": ArrayRecord({"w": a}), "c": ConfigRecord({"s": "héllo", "y": b"123", "l": [1, 2]}),
                     "m": MetricRecord({"x": 1.5})})
    names_keys = 3 + 5
    assert record_bytes(rd) == names_keys + len(a.data) + 6 + 3 + 16 + 8


def test_check_strings_allow_list():
    content = _content()
    check_strings(content, {"meta": {"payload", "party", "tags"}})
    with pytest.raises(InspectError, match="meta.tags"):
        check_strings(content, {"meta": {"payload", "party"}})
    with pytest.raises(InspectError, match="meta.payload"):
        check_strings(content, {"other": {"payload", "party", "tags"}})
    with pytest.raises(InspectError, match="cfg.blob"):
        check_strings(RecordDict({"cfg": ConfigRecord({"blob": [b"x"]})}), {})
    check_strings(RecordDict({"cfg": ConfigRecord({"n": [1, 2], "f": True})}), {})


def _layout():
    return {"arrays": ("array", {"w": ("float32", (3, 4)), "b": ("float32", (2,))}),
            "meta": ("config", {"payload", "round", "party", "tags"}),
            "metrics": ("metric", None)}


def test_layout_accepts_and_returns_arrays():
    out = check_layout(_content(), _layout())
    np.testing.assert_array_equal(out["arrays"]["w"], A)
    assert set(out) == {"arrays"}


def test_layout_rejects_extra_missing_records_keys_and_kinds():
    extra = _content()
    extra["smuggled"] = ConfigRecord({"x": 1})
    with pytest.raises(InspectError, match=r"unexpected \['smuggled'\]"):
        check_layout(extra, _layout())
    missing = _content()
    del missing["metrics"]
    with pytest.raises(InspectError, match=r"missing \['metrics'\]"):
        check_layout(missing, _layout())
    extra_key = _content()
    extra_key["arrays"]["z"] = Array(np.zeros(1, np.float32))
    with pytest.raises(InspectError, match=r"arrays: keys missing \[\], unexpected \['z'\]"):
        check_layout(extra_key, _layout())
    wrong_kind = {**_layout(), "metrics": ("config", None)}
    with pytest.raises(InspectError, match="metrics: metric record, expected config record"):
        check_layout(_content(), wrong_kind)
    wrong_shape = {**_layout(), "arrays": ("array", {"w": ("float32", (12,)), "b": ("float32", (2,))})}
    with pytest.raises(InspectError, match="arrays.w: shape"):
        check_layout(_content(), wrong_shape)
    trailing = _content()
    trailing["arrays"]["b"] = _raw(Array(np.ones(2, np.float32)).data + b"\x00", "float32", (2,))
    with pytest.raises(InspectError, match="arrays.b: 1 trailing bytes"):
        check_layout(trailing, {**_layout(), "arrays": ("array", None)})


def test_the_memoised_header_parse_decides_each_payload_by_its_own_header():
    """The headers' literal parse is memoised by their text: a header seen before gives the same verdict, a bad one
    is refused every time (an exception is never cached), and each payload is judged by its own header and size."""
    good = _npy("<f4", (2,), np.array([1, 2], "<f4").tobytes())
    other = _npy("<f4", (3,), np.array([1, 2, 3], "<f4").tobytes())
    bad = _npy("<f4", (2,), b"\0" * 8).replace(b"(2,)", b"(2*)")
    for _ in range(3):
        assert parse_npy(good, "x") == (np.dtype("<f4"), (2,))
        assert parse_npy(other, "x") == (np.dtype("<f4"), (3,))
        with pytest.raises(InspectError, match="not a literal"):
            parse_npy(bad, "x")
        with pytest.raises(InspectError, match="4 bytes missing"):
            parse_npy(good[:-4], "x")  # the header seen before, the payload short
        with pytest.raises(InspectError, match="keys"):
            parse_npy(_npy("<f4", (2,), b"\0" * 8).replace(b"'shape'", b"'shapE'"), "x")
