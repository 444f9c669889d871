"""Block pools with real storage: a primary (device-side) and a host part per window.

Each pool owns a numpy ``uint8`` array ``[num_slots, tokens_per_block, bytes_per_token]``; a
token row holds, for every layer of the window group in order, K then V
(``num_kv_heads * head_dim`` elements each). ``layer_view`` gives a typed view of one layer so
a runtime can write K/V directly. Offload and onboard copy real bytes between the two arrays
(``move_bytes``), so a test can check that contents survive primary -> host -> primary.

``np.zeros`` is used for the arrays: the OS hands out zero pages lazily, so a large budget costs
address space until blocks are actually written.

A runtime that keeps the bytes in its own tensors (the PagedAttention cache: the device writes
them) builds the pools without a store and gives a :data:`SlotCopier` instead; the manager then
only decides which slot holds what, and calls the copier wherever it would move bytes.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .block import KVBlock, PoolKind
from .eviction import EvictionQueue
from .planning import WindowGroup

SlotCopier = Callable[[PoolKind, int, PoolKind, int], None]
"""``copy(src_pool, src_slot, dst_pool, dst_slot)``: copy one block's bytes between slots."""


class BlockPool:
    """The slots of one pool part and the queue of its reclaimable blocks."""

    def __init__(
        self, kind: PoolKind, group: WindowGroup, num_slots: int, with_store: bool = True
    ) -> None:
        self.kind = kind
        self.group = group
        self.num_slots = num_slots
        width = group.bytes_per_token if with_store else 0  # 0: the runtime holds the bytes
        self.store = np.zeros((num_slots, group.tokens_per_block, width), dtype=np.uint8)
        self.queue = EvictionQueue()

    @property
    def nbytes(self) -> int:
        return int(self.store.nbytes)

    def free_count(self) -> int:
        """Blocks that can be handed out right now (refcount 0, queued)."""
        return len(self.queue)

    def layer_view(self, slot: int, layer: int) -> np.ndarray:
        """Typed view ``[tokens_per_block, 2 (K,V), num_kv_heads, head_dim]`` of one layer."""
        g = self.group
        try:
            pos = g.layers.index(layer)
        except ValueError:
            raise KeyError(
                f"layer {layer} is not in window group {g.window} ({g.layers})"
            ) from None
        if not self.store.shape[2]:
            raise LookupError("this pool keeps no bytes: the runtime that built it holds them")
        heads, dim = g.layer_shapes[pos]
        start = g.layer_offsets[pos]
        nbytes = 2 * heads * dim * g.itemsize
        raw = self.store[slot, :, start : start + nbytes]
        return raw.view(g.dtype).reshape(g.tokens_per_block, 2, heads, dim)


def numpy_copier(pools: dict[PoolKind, BlockPool]) -> SlotCopier:
    """The copier for pools that keep their bytes in their own numpy stores."""

    def copy(src_pool: PoolKind, src_slot: int, dst_pool: PoolKind, dst_slot: int) -> None:
        pools[dst_pool].store[dst_slot] = pools[src_pool].store[src_slot]

    return copy


def move_bytes(src: KVBlock, dst: KVBlock, copy: SlotCopier) -> None:
    """Copy ``src``'s bytes into ``dst``'s slot, then swap their locations.

    Afterwards ``src`` (the block with an identity worth keeping) lives where ``dst`` was and
    ``dst`` (an empty block) takes ``src``'s old slot. Used for offload (primary -> host) and
    onboard (host -> primary).
    """
    copy(src.pool, src.slot, dst.pool, dst.slot)
    src.pool, dst.pool = dst.pool, src.pool
    src.slot, dst.slot = dst.slot, src.slot


def copy_bytes(src: KVBlock, dst: KVBlock, copy: SlotCopier) -> None:
    """Copy ``src``'s bytes into ``dst``'s slot (both keep their locations)."""
    copy(src.pool, src.slot, dst.pool, dst.slot)
