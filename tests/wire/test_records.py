"""The codec's array field kind (``distmoe.wire.records``): the bytes it writes are ``np.save``'s, and a large
vector read without a copy is a read-only view that still passes every strict check."""

from __future__ import annotations

import io

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord

from distmoe.wire.records import WireError, _array, _read_arrays, npy_bytes


@pytest.mark.parametrize("a", [
    np.zeros((3, 4), np.float32), np.arange(5, dtype=np.uint64), np.arange(7, dtype=np.uint32),
    np.zeros((0, 2)), np.ones((2, 3, 4), np.float16), np.array([True, False]), np.arange(6, dtype=">i4"),
    np.zeros(()), np.asfortranarray(np.arange(12, dtype=np.int64).reshape(3, 4)),
])
def test_npy_bytes_are_np_saves_bytes_and_the_array_equals_flowers(a):
    c = np.ascontiguousarray(a)
    buf = io.BytesIO()
    np.save(buf, c, allow_pickle=False)
    assert npy_bytes(c) == buf.getvalue()
    ours, flowers = _array(a), Array(c)
    assert (ours.data, ours.dtype, ours.shape, ours.stype) == (flowers.data, flowers.dtype, flowers.shape,
                                                                flowers.stype)
    assert np.array_equal(ours.numpy(), c)


def test_read_without_copy_is_a_read_only_view_and_with_copy_is_writeable():
    y = np.arange(1000, dtype=np.uint32)
    rec = ArrayRecord(array_dict={"y": _array(y)})
    view = _read_arrays(rec, "t", copy=False)["y"]
    assert np.array_equal(view, y) and not view.flags.writeable
    with pytest.raises(ValueError):
        view[0] = 1
    owned = _read_arrays(rec, "t")["y"]
    owned[0] = 7  # a copy: the record is unchanged
    assert _read_arrays(rec, "t", copy=False)["y"][0] == 0


def test_read_without_copy_still_rejects_trailing_bytes():
    arr = _array(np.arange(4, dtype=np.uint32))
    bad = Array(dtype=arr.dtype, shape=arr.shape, stype=arr.stype, data=arr.data + b"\0\0\0\0")
    with pytest.raises(WireError, match="t: array 'y'"):
        _read_arrays(ArrayRecord(array_dict={"y": bad}), "t", copy=False)
