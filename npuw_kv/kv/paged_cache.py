"""The KV cache of a PagedAttention model: one block-major tensor per layer for K and for V.

Each tensor is ``[blocks, heads, block_size, dims]`` in the element type the device chose (u8
rows carry their quantisation scales inside the block, so ``dims`` and the K block length may
exceed head_dim and block_size).  Which block holds which tokens is the block manager's
(``kv/blocks``, driven by ``runtime/paged_runner.py``): prefill chunks and generate steps read and
write these tensors in place, through the sequence's block table.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import openvino as ov

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
        nbytes = sum(sizes[s.name] * math.prod(s.block_shape) * s.element_type.size for s in specs)
        ensure_fits(nbytes, f"a paged KV cache of {capacity} tokens")
        self.tensors = {
            s.name: ov.Tensor(s.element_type, [sizes[s.name], *s.block_shape]) for s in specs
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
