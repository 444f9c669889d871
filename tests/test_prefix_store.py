"""The static path's host prefix store on its own: byte-exact round trips, no needless copies."""

from __future__ import annotations

import numpy as np
import pytest

from npuw_kv.kv.cache import KVSpec, SharedKVCache
from npuw_kv.kv.copy import CopyCounter
from npuw_kv.model.layout import KVLayout, KVPort
from npuw_kv.runtime.static.prefix_store import HostPrefixCache

pytestmark = pytest.mark.unit  # builds no model (the quick tier)

HEADS, DIM, LAYERS, SLOTS = 2, 8, 3, 256


def _layout(precision: str) -> KVLayout:
    ports = tuple(
        KVPort(
            i,
            kind,
            f"past_key_values.{i}.{kind}",
            2 * i + (kind == "value"),
            HEADS,
            DIM,
            2,
            precision,
        )
        for i in range(LAYERS)
        for kind in ("key", "value")
    )
    return KVLayout(ports, 2 * LAYERS, (None,) * LAYERS)


def _store(precision: str, tokens: int) -> tuple[HostPrefixCache, SharedKVCache, CopyCounter]:
    layout = _layout(precision)
    specs = [KVSpec(p.input_name, p.num_heads, p.head_dim) for p in layout.ports]
    cache = SharedKVCache(specs, SLOTS, precision)
    rng = np.random.default_rng(0)
    for buf in cache.buffers.values():
        buf[...] = rng.integers(0, 2**14, buf.shape).astype(buf.dtype)
    counter = CopyCounter()
    return HostPrefixCache(cache, layout, tokens, counter), cache, counter


@pytest.mark.parametrize("precision", ["f32", "f16", "bf16"])
def test_restore_puts_back_the_saved_bytes_at_another_slot(precision):
    store, cache, _ = _store(precision, 128)
    tokens = list(range(100, 200))  # 3 whole blocks stored, 4 tokens left over
    saved = {n: b[0, :, 10:106].copy() for n, b in cache.buffers.items()}
    store.save(tokens, first_slot=10)
    for buf in cache.buffers.values():
        buf[...] = 0
    prompt = np.array([*tokens, 7, 8], np.int64)
    assert store.lookup(prompt) == 96
    store.restore(prompt, 96, first_slot=40)
    for name, buf in cache.buffers.items():
        np.testing.assert_array_equal(buf[0, :, 40:136], saved[name])
        assert not buf[0, :, :40].any() and not buf[0, :, 136:].any()
    store.blocks.check_invariants()


def test_saving_what_the_store_holds_copies_nothing_and_evicts_nothing():
    store, _, counter = _store("f32", 128)  # 4 blocks of room + 1 for restores
    a, b = list(range(1000, 1064)), list(range(2000, 2096))
    store.save(a, 0)
    store.save(b, 0)
    counter.reset()
    store.save(b, 0)
    assert counter.bytes == 0
    assert store.lookup(np.array([*a, 1], np.int64)) == 64
    assert store.lookup(np.array([*b, 1], np.int64)) == 96


def test_room_below_one_block_is_refused():
    with pytest.raises(ValueError, match="at least 32"):
        _store("f32", 31)


def test_save_and_restore_across_block_edges():
    """A cache held as blocks (the NPU path's, cut where its models' pasts end): the stored
    blocks of tokens cross the edges on the way out and on the way back, in pieces."""
    layout = _layout("f32")
    specs = [KVSpec(p.input_name, p.num_heads, p.head_dim) for p in layout.ports]
    cache = SharedKVCache(specs, SLOTS, "f32", edges=(50, 60))

    def tokens_of(name: str, start: int, stop: int) -> np.ndarray:
        return np.concatenate(
            [cache.token_rows(name, a, b) for a, b, _ in cache.pieces(name, start, stop)], axis=1
        )

    rng = np.random.default_rng(1)
    for name in cache.specs:
        for a, b, _ in cache.pieces(name, 0, SLOTS):
            rows = cache.token_rows(name, a, b)
            rows[...] = rng.standard_normal(rows.shape)
    saved = {name: tokens_of(name, 10, 106).copy() for name in cache.specs}
    store = HostPrefixCache(cache, layout, 128, CopyCounter())
    tokens = list(range(100, 200))
    store.save(tokens, first_slot=10)  # blocks of 32 at slots 10, 42 (across 50 and 60), 74
    for name in cache.specs:
        for a, b, _ in cache.pieces(name, 0, SLOTS):
            cache.token_rows(name, a, b)[...] = 0
    prompt = np.array([*tokens, 7, 8], np.int64)
    assert store.lookup(prompt) == 96
    store.restore(prompt, 96, first_slot=30)  # back at 30, 62, 94: the first across 50 and 60
    for name in cache.specs:
        np.testing.assert_array_equal(tokens_of(name, 30, 126), saved[name])
        assert not tokens_of(name, 0, 30).any() and not tokens_of(name, 126, SLOTS).any()
