"""A runtime that keeps the blocks' bytes itself (the PagedAttention cache) and gives the
manager a slot copier: the manager allocates no store and moves bytes only through it."""

from __future__ import annotations

import numpy as np
import pytest

from npuw_kv.kv.blocks import BlockManagerConfig, KVBlockManager, LayerSpec, PoolKind

pytestmark = pytest.mark.unit  # builds no model (the quick tier)


class ExternalStore:
    """Blocks of one window as a runtime holds them: a row of 2 floats per token and slot."""

    def __init__(self, slots: int, host: int, tpb: int) -> None:
        self.arrays = {
            PoolKind.PRIMARY: np.zeros((slots, tpb)),
            PoolKind.HOST: np.zeros((host, tpb)),
        }
        self.calls: list[tuple[int, str, int, str, int]] = []

    def copy(self, window: int, sp: PoolKind, ss: int, dp: PoolKind, ds: int) -> None:
        self.calls.append((window, sp.value, ss, dp.value, ds))
        self.arrays[dp][ds] = self.arrays[sp][ss]


def _manager(store: ExternalStore, windows: list[int | None], **kw: object) -> KVBlockManager:
    settings: dict[str, object] = {"kv_budget_bytes": 4 * 2 * 4}  # 4 blocks: 2 tokens x 4 B
    cfg = BlockManagerConfig(
        layers=[LayerSpec(w, 1, 1) for w in windows],
        max_seq_len=8,
        tokens_per_block=2,
        **{**settings, **kw},  # type: ignore[arg-type]
    )
    return KVBlockManager(cfg, copy_slots=store.copy)


def test_offload_and_onboard_move_the_runtime_bytes() -> None:
    store = ExternalStore(4, 4, 2)
    mgr = _manager(store, [None], host_budget_bytes=4 * 2 * 4)
    assert mgr.storage(8).nbytes == 0 and mgr.storage(8, "host").nbytes == 0
    with pytest.raises(LookupError, match="keeps no bytes"):
        mgr.layer_view(8, 0, 0)
    a = [1, 2, 3, 4, 5]
    mgr.add_sequence("a", a)
    table = mgr.block_table("a", 8)
    for block, slot in enumerate(table[:2]):  # what the device wrote for a's two full blocks
        store.arrays[PoolKind.PRIMARY][slot] = [10 * block + 1, 10 * block + 2]
    mgr.remove_sequence("a")
    mgr.add_sequence("x", [9] * 7)  # takes every primary block: a's cached blocks go to host
    assert sum(1 for c in store.calls if c[1:4:2] == ("primary", "host")) == 2
    mgr.remove_sequence("x")
    assert mgr.add_sequence("b", a + [6]) == 4  # onboarded: back in primary slots
    slots = mgr.block_table("b", 8)[:2]
    assert store.arrays[PoolKind.PRIMARY][slots].tolist() == [[1, 2], [11, 12]]
    assert all(c[0] == 8 for c in store.calls)
    mgr.check_invariants()


def test_an_swa_hit_is_copied_through_the_runtime() -> None:
    """A live SWA block cannot be shared, so a hit on one is copied into a fresh block."""
    store = ExternalStore(8, 0, 2)
    mgr = _manager(store, [4], kv_budget_bytes=8 * 2 * 4, max_tokens_per_call=2)
    mgr.add_sequence("a", [1, 2])
    mgr.add_tokens("a", [3])
    slot = mgr.block_table("a", 4)[0]
    store.arrays[PoolKind.PRIMARY][slot] = [7, 8]
    mgr.remove_sequence("a")  # SWA: stored at the end
    assert mgr.add_sequence("b", [1, 2, 3]) == 2  # claims the cached block itself
    assert mgr.block_table("b", 4)[0] == slot and store.calls == []
    assert mgr.add_sequence("c", [1, 2, 3]) == 2  # b holds it live: c gets a copy
    fresh = mgr.block_table("c", 4)[0]
    assert fresh != slot and store.calls == [(4, "primary", slot, "primary", fresh)]
    assert store.arrays[PoolKind.PRIMARY][fresh].tolist() == [7, 8]
    mgr.check_invariants()
