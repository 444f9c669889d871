"""The shared buffers, their ROI views and the overlap-safe copy."""

from __future__ import annotations

import numpy as np
import pytest

from npuw_kv.kv.cache import KVSpec, SharedKVCache
from npuw_kv.kv.copy import CopyCounter, safe_copy


def make_cache(capacity=10):
    return SharedKVCache([KVSpec("k0", 3, 4), KVSpec("v0", 3, 4)], capacity, "f32")


def test_views_alias_the_buffer_and_are_strided():
    cache = make_cache()
    view = cache.view("k0", 2, 5)
    assert view.shape == [1, 3, 3, 4]
    assert not view.is_continuous()
    view.data[...] = 7.0
    grid = cache.buffers["k0"].reshape(1, 3, 10, 4)  # the plain layout: [1, heads, slots, dim]
    assert (grid[:, :, 2:5] == 7).all()
    assert (grid[:, :, :2] == 0).all() and (grid[:, :, 5:] == 0).all()
    assert np.shares_memory(cache.rows("k0", 2, 5), grid) and (cache.rows("k0", 2, 5) == 7).all()
    whole = cache.view("k0", 0, cache.capacity)
    assert whole.is_continuous() and np.shares_memory(whole.data, cache.buffers["k0"])
    assert cache.bytes_allocated == 2 * 3 * 10 * 4 * 4
    assert cache.bytes_per_token() == 2 * 3 * 4 * 4


def test_split_cache_keeps_two_contiguous_segments_in_one_allocation():
    cache = SharedKVCache([KVSpec("k0", 3, 4)], 10, "f32", split_at=6)
    head, tail = cache.view("k0", 0, 6), cache.view("k0", 6, 10)
    assert head.is_continuous() and tail.is_continuous()  # unlike [0, 6) of the plain layout
    assert head.shape == [1, 3, 6, 4] and tail.shape == [1, 3, 4, 4]
    flat = cache.buffers["k0"]
    assert head.data.ctypes.data == flat.ctypes.data
    assert tail.data.ctypes.data == flat.ctypes.data + 3 * 6 * 4 * 4  # right after the head
    assert cache.bytes_allocated == flat.nbytes == 3 * 10 * 4 * 4
    # a write through a slot view of either segment lands in that slot only
    cache.view("k0", 7, 8).data[...] = 5.0
    cache.view("k0", 2, 3).data[...] = 3.0
    assert (cache.rows("k0", 7, 8) == 5).all() and (cache.rows("k0", 2, 3) == 3).all()
    assert flat.sum() == 3 * 4 * (5 + 3)
    with pytest.raises(IndexError, match="straddle the split at slot 6"):
        cache.view("k0", 5, 7)
    for bad in (0, 10):
        with pytest.raises(ValueError, match="split at slot"):
            SharedKVCache([KVSpec("k0", 3, 4)], 10, "f32", split_at=bad)


@pytest.mark.parametrize(("start", "stop"), [(-1, 2), (3, 3), (0, 11)])
def test_view_bounds(start, stop):
    with pytest.raises(IndexError):
        make_cache().view("k0", start, stop)


def test_safe_copy_handles_aliasing_layouts():
    # V stored transposed on one side: dst is the transpose-view of the same memory as src
    base = np.arange(16, dtype=np.float32).reshape(4, 4)
    expected = base.T.copy()
    counter = CopyCounter()
    safe_copy(base, base.T, counter)
    np.testing.assert_array_equal(base, expected)
    assert counter.bytes == base.nbytes and counter.copies == 1
    # a naive in-place copy corrupts it (why safe_copy exists)
    naive = np.arange(16, dtype=np.float32).reshape(4, 4)
    for i in range(4):
        naive[i, :] = naive[:, i]
    assert not np.array_equal(naive, expected)


def test_safe_copy_shape_mismatch():
    with pytest.raises(ValueError, match="shape mismatch"):
        safe_copy(np.zeros((2, 2)), np.zeros((2, 3)))
