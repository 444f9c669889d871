"""The KV cache of a PagedAttention model: one block-major tensor per layer for K and for V.

Each tensor is ``[blocks, heads, block_size, dims]`` in the element type the device chose (u8
rows carry their quantisation scales inside the block, so ``dims`` and the K block length may
exceed head_dim and block_size).  Which block holds which tokens is the block manager's
(``kv/blocks``, driven by ``runtime/paged_runner.py``): prefill chunks and generate steps read and
write these tensors in place, through the sequence's block table.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import openvino as ov

from .blocks.sequence import blocks_for, min_live_blocks
from .memory import ensure_fits


@dataclass(frozen=True)
class PagedSpec:
    """One cache input as the device declared it: name, element type, per-block shape."""

    name: str
    element_type: ov.Type
    block_shape: tuple[int, ...]  # [heads, rows, dims] of one block


class PagedKVCache:
    """Block-major K/V tensors holding ``capacity`` tokens in blocks of ``block_size``.

    ``blocks``: how many blocks a tensor gets, by name, where it is not ``capacity``'s worth: a
    sliding-window layer needs only those its window reads (the block manager's pool for it).
    """

    def __init__(
        self,
        specs: list[PagedSpec],
        capacity: int,
        block_size: int,
        blocks: Mapping[str, int] | None = None,
    ) -> None:
        if capacity <= 0:
            raise ValueError(f"KV capacity must be > 0 tokens, got {capacity}")
        if block_size <= 0 or not specs:
            raise ValueError(f"need cache inputs and a block size > 0 (got {block_size})")
        self.capacity = capacity
        self.block_size = block_size
        self.num_blocks = -(-capacity // block_size)
        types = {s.element_type.get_type_name() for s in specs}
        if len(types) != 1:
            raise ValueError(f"cache inputs of mixed element types {sorted(types)}")
        self.precision = types.pop()
        sizes = {s.name: self.num_blocks for s in specs} | dict(blocks or {})
        if min(sizes.values()) < 1:
            raise ValueError(f"every cache tensor needs >= 1 block, got {sizes}")
        nbytes = {
            s.name: sizes[s.name] * math.prod(s.block_shape) * s.element_type.size for s in specs
        }
        ensure_fits(sum(nbytes.values()), f"a paged KV cache of {capacity} tokens")
        # zeroed memory (the OS hands it out lazily, so unwritten blocks cost nothing): a slot
        # no sequence wrote yet is read as 0, never as garbage that could be NaN (PagedRunner
        # points a window's detached table entries at a held, maybe partly written, block)
        self.tensors = {
            s.name: ov.Tensor(
                np.zeros(nbytes[s.name], np.uint8),
                [sizes[s.name], *s.block_shape],
                s.element_type,
            )
            for s in specs
        }

    @property
    def bytes_allocated(self) -> int:
        return sum(t.byte_size for t in self.tensors.values())

    def bytes_per_token(self) -> int:
        """What one token's K and V take over all layers (whatever their block counts)."""
        per_block = sum(t.byte_size // t.get_shape()[0] for t in self.tensors.values())
        return per_block // self.block_size

    def blocks_for(self, tokens: int) -> int:
        """Blocks that ``tokens`` cached tokens occupy."""
        if not 0 <= tokens <= self.num_blocks * self.block_size:
            raise IndexError(f"{tokens} tokens outside the cache's {self.capacity}")
        return -(-tokens // self.block_size)


@dataclass(frozen=True)
class PoolPlan:
    """Blocks of each window's pools, keyed as the block manager keys windows (full attention:
    the capacity).  ``shares``: the part of the prefix-cache room (and of the host tier) each
    window got, in bytes; given, or by default each window the same tokens of room."""

    primary: dict[int, int]
    host: dict[int, int]
    shares: dict[int, float]
    given: bool  # shares came from the setting (or NPUW_KV_WINDOW_SIZE_SHARES)


def block_bytes(specs: Sequence[PagedSpec], names: Mapping[int, list[str]]) -> dict[int, int]:
    """Bytes of one block of every cache tensor of each window key's layers."""
    size = {s.name: math.prod(s.block_shape) * s.element_type.size for s in specs}
    return {key: sum(size[n] for n in tensors) for key, tensors in names.items()}


def sequence_blocks(
    keys: Sequence[int], capacity: int, tokens: int, block_size: int, chunk: int
) -> dict[int, int]:
    """Blocks one sequence of up to ``tokens`` tokens needs in each window's pool: all of them
    under full attention (key ``capacity``), its window and a chunk under a sliding window
    (``min_live_blocks``)."""
    return {
        k: blocks_for(tokens, block_size)
        if k == capacity
        else min_live_blocks(tokens, k, block_size, chunk)
        for k in keys
    }


def plan_pools(
    windows: Sequence[int | None],
    capacity: int,
    room_tokens: int,
    host_tokens: int,
    block_size: int,
    chunk: int,
    block_bytes: Mapping[int, int],
    shares: Mapping[int, float] | None = None,
) -> PoolPlan:
    """Primary and host blocks of each window's pool.

    Every window first gets what one sequence of ``capacity`` tokens needs: full attention all
    of it, a sliding window its window plus a chunk (``min_live_blocks``).  The prefix-cache
    room (``room_tokens`` beyond one sequence) and the host tier (``host_tokens``) come on top:
    by default the same tokens in every window (a window's pool never above the full one's);
    with ``shares``, their bytes over all layers split between the windows' pools.
    """
    keys = sorted({capacity if w is None else w for w in windows})
    need = sequence_blocks(keys, capacity, capacity, block_size, chunk)
    room, host = blocks_for(room_tokens, block_size), blocks_for(host_tokens, block_size)
    if shares is None:
        full = blocks_for(capacity + room_tokens, block_size)
        primary = {k: full if k == capacity else min(full, need[k] + room) for k in keys}
        total = sum(block_bytes[k] for k in keys)
        given = {k: block_bytes[k] / total for k in keys}
        return PoolPlan(primary, {k: host for k in keys}, given, False)
    per_block = sum(block_bytes[k] for k in keys)  # one block of every layer
    return PoolPlan(
        {k: need[k] + int(room * per_block * shares[k]) // block_bytes[k] for k in keys},
        {k: int(host * per_block * shares[k]) // block_bytes[k] for k in keys},
        dict(shares),
        True,
    )


class HostTier:
    """Host copies of the cache tensors' blocks, for blocks the manager evicts from the pools.

    ``blocks``: host blocks per window key; ``names``: the cache tensors of each key's layers.
    The arrays are zeros, which the OS hands out lazily: only blocks written cost memory.
    """

    def __init__(
        self,
        cache: PagedKVCache,
        names: Mapping[int, list[str]],
        blocks: Mapping[int, int],
        tokens: int = 0,
    ) -> None:
        self.block_bytes = {
            key: sum(cache.tensors[n].data[0].nbytes for n in tensors)
            for key, tensors in names.items()
        }
        nbytes = sum(blocks.get(k, 0) * b for k, b in self.block_bytes.items())
        ensure_fits(nbytes, f"a host tier of {tokens} tokens (prefix_cache_host_tokens)")
        self.arrays: dict[str, np.ndarray] = {}
        for key, tensors in names.items():
            for name in tensors:
                data = cache.tensors[name].data
                self.arrays[name] = np.zeros((blocks.get(key, 0), *data.shape[1:]), data.dtype)

        # running totals since the pools were sized
        self.offloaded_bytes = self.restored_bytes = 0

    def copy(
        self, cache: PagedKVCache, names: list[str], src: int, dst: int, hosted: tuple[bool, bool]
    ) -> int:
        """Copy block ``src`` to ``dst`` in every tensor of ``names``; ``hosted``: whether the
        source and the destination are host slots.  Returns the bytes copied."""
        moved = 0
        for name in names:
            device = cache.tensors[name].data
            source = self.arrays[name] if hosted[0] else device
            (self.arrays[name] if hosted[1] else device)[dst] = source[src]
            moved += source[src].nbytes
        if hosted[1]:
            self.offloaded_bytes += moved
        elif hosted[0]:
            self.restored_bytes += moved
        return moved

    @property
    def bytes_allocated(self) -> int:
        """Bytes the host arrays span (touched or not)."""
        return sum(a.nbytes for a in self.arrays.values())
