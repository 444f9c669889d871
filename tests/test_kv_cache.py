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
    whole = cache.view("k0", 0, cache.capacity)  # what a device that stages strided inputs reads
    assert whole.is_continuous() and whole.data.ctypes.data == cache.buffers["k0"].ctypes.data
    assert cache.bytes_allocated == 2 * 3 * 10 * 4 * 4
    assert cache.bytes_per_token() == 2 * 3 * 4 * 4


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
