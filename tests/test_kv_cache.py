"""The shared buffers, their ROI views and the overlap-safe copy."""

from __future__ import annotations

import numpy as np
import pytest

from npuw_kv.kv.cache import KVSpec, SharedKVCache
from npuw_kv.kv.copy import CopyCounter, relayout, safe_copy

pytestmark = pytest.mark.unit  # builds no model (the quick tier)


def make_cache(capacity=10):
    return SharedKVCache([KVSpec("k0", 3, 4), KVSpec("v0", 3, 4)], capacity, "f32")


def test_blocks_are_dense_and_ranges_across_edges_go_by_pieces():
    cache = SharedKVCache([KVSpec("k0", 3, 4), KVSpec("r", 3, 4, ring=4)], 10, "f32", (4, 6))
    assert cache.bytes_allocated == (3 * 4 * 10 + 3 * 4 * 4) * 4  # the same memory as one block
    blocks = [cache.view("k0", 0, 4), cache.view("k0", 4, 6), cache.view("k0", 6, 10)]
    assert [b.shape for b in blocks] == [[1, 3, 4, 4], [1, 3, 2, 4], [1, 3, 4, 4]]
    assert all(b.is_continuous() for b in blocks)  # a whole block: dense
    assert not cache.view("k0", 1, 3).is_continuous() and not cache.view("k0", 6, 8).is_continuous()
    # each block follows the one before in memory: one allocation
    for before, after in zip(blocks, blocks[1:], strict=False):
        assert after.data.ctypes.data == before.data.ctypes.data + before.data.nbytes
    # (first, stop, offset): the range's rows from offset on live in buffer slots [first, stop)
    assert cache.pieces("k0", 2, 9) == [(2, 4, 0), (4, 6, 2), (6, 9, 4)]
    assert cache.pieces("k0", 6, 9) == [(6, 9, 0)] and cache.pieces("k0", 0, 4) == [(0, 4, 0)]
    with pytest.raises(ValueError, match="edge of a block"):
        cache.view("k0", 3, 5)
    with pytest.raises(ValueError, match="held as blocks"):
        cache.array("k0")
    for a, b, _ in cache.pieces("k0", 3, 8):  # write token-wise, read back through the views
        cache.token_rows("k0", a, b)[...] = np.arange(a, b)[None, :, None]
    assert (cache.rows("k0", 3, 4)[0, :, :, 0] == [3]).all()
    assert (cache.rows("k0", 4, 6)[0, :, :, 0] == [4, 5]).all()
    assert (cache.view("k0", 6, 10).data[0, :, :2, 0] == [6, 7]).all()
    assert cache.pieces("r", 1, 4) == [(1, 4, 0)]  # a ring stays one block, not cut at edges
    # token slots on the ring: slot s lives at s mod 4, cut where the ring wraps
    assert cache.pieces("r", 6, 9) == [(2, 4, 0), (0, 1, 2)]
    with pytest.raises(ValueError, match="do not fit a ring"):
        cache.pieces("r", 0, 5)
    assert cache.view("r", 0, 4).is_continuous()
    for edges in ((10,), (0, 4), (6, 4), (4, 4)):
        with pytest.raises(ValueError, match="edges"):
            SharedKVCache([KVSpec("k0", 3, 4)], 10, "f32", edges)


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


def test_safe_copy_handles_aliasing_layouts(monkeypatch):
    """V stored transposed on one side: dst is the transpose-view of the same memory as src.
    numpy's own copy already detects the overlap, so the copy underneath is made an element by
    element one (what a device or a C++ copy does): only safe_copy's temporary keeps it right."""

    def element_by_element(dst: np.ndarray, src: np.ndarray) -> None:
        for index in np.ndindex(dst.shape):
            dst[index] = src[index]

    naive = np.arange(16, dtype=np.float32).reshape(4, 4)
    expected = naive.T.copy()
    element_by_element(naive, naive.T)
    assert not np.array_equal(naive, expected)  # an unguarded copy corrupts it
    monkeypatch.setattr(np, "copyto", element_by_element)
    base = np.arange(16, dtype=np.float32).reshape(4, 4)
    counter = CopyCounter()
    safe_copy(base, base.T, counter)
    np.testing.assert_array_equal(base, expected)
    assert counter.bytes == base.nbytes and counter.copies == 1


def test_safe_copy_shape_mismatch():
    with pytest.raises(ValueError, match="shape mismatch"):
        safe_copy(np.zeros((2, 2)), np.zeros((2, 3)))


def test_transposed_v_is_cut_along_its_innermost_axis():
    """V stored [1, H, D, S]: a slot range cuts axis 3, strided even with one head; the same
    memory read as [1, H, S, D] (a model that keeps V as it is) starts at the same address."""
    cache = SharedKVCache([KVSpec("v0", 1, 4, seq_axis=3), KVSpec("v1", 3, 4, seq_axis=3)], 10)
    assert cache.buffers["v0"].shape == (1, 1, 4, 10)
    for name, heads in (("v0", 1), ("v1", 3)):
        view = cache.view(name, 2, 5)
        assert list(view.shape) == [1, heads, 4, 3] and not view.is_continuous()
        view.data[...] = 7.0
        assert (cache.buffers[name][..., 2:5] == 7).all()
        assert not cache.buffers[name][..., :2].any() and not cache.buffers[name][..., 5:].any()
        assert cache.view(name, 0, 10).is_continuous()
        np.testing.assert_array_equal(cache.rows(name, 2, 5), view.data)
        assert cache.token_rows(name, 2, 5).shape == (heads, 3, 4)  # [heads, tokens, dim]
        other = cache.view(name, 0, 3, seq_axis=2)  # the other layout of the same memory
        assert list(other.shape) == [1, heads, 3, 4]
        assert other.data.ctypes.data == cache.buffers[name].ctypes.data
        assert cache.zeros(name, 2).shape == (1, heads, 4, 2)
        assert cache.zeros(name, 2, seq_axis=2).shape == (1, heads, 2, 4)
    assert cache.bytes_per_token() == (1 + 3) * 4 * 4


def test_relayout_of_overlapping_views_goes_through_a_temporary():
    # the first 6 slots of a [1, 2, 4, 8] V buffer written as [1, 2, 6, 4], then re-laid out
    # in place as [1, 2, 4, 6]: both views start at the buffer's first byte
    buffer = np.full((1, 2, 4, 8), np.nan, np.float32)
    hsd = buffer.reshape(1, 2, 8, 4)[:, :, :6]
    hds = buffer[..., :6]
    tokens = np.arange(48, dtype=np.float32).reshape(1, 2, 6, 4)
    hsd[...] = tokens
    counter = CopyCounter()
    relayout(hds, hsd, 3, 2, counter)
    np.testing.assert_array_equal(hds, tokens.transpose(0, 1, 3, 2))
    assert counter.bytes == hds.nbytes
    relayout(hsd, hds, 2, 3)  # and back
    np.testing.assert_array_equal(hsd, tokens)
