"""The KV memory of several sequences on the static-shape path, one region per sequence.

A packed generate model (:mod:`npuw_kv.model.packed`) reads K sequences' pasts as one tensor
``[1, K * H, rows, D]``: sequence k's heads ``[k H, (k + 1) H)``.  So each buffer block (a layer's
K or V, cut where the static models' pasts end: ``SharedKVCache.edges``) is one array
``[slots, H * rows * D]`` whose row k is sequence k's block: dense, and its first K rows are the
packed model's dense input.  Each sequence runs its prompt through a :class:`SharedKVCache`
over its own rows (``SharedKVCache(memory=pool.region(k))``), exactly as a lone sequence does.

The arrays are zeroed memory that is not touched until a sequence writes it, so slots no request
has used cost no resident memory.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .cache import KV_STORAGE, KVSpec
from .memory import aligned_zeros


class SlotPool:
    """Per buffer block an array of ``slots`` regions (module docstring)."""

    def __init__(
        self,
        precision: str,
        slots: int,
        *,
        allocate: Callable[[int, np.dtype], np.ndarray] = aligned_zeros,
    ) -> None:
        if slots < 1:
            raise ValueError(f"a slot pool holds at least one sequence, not {slots}")
        self.slots = slots
        self.dtype = np.dtype(KV_STORAGE[precision][0])
        self._allocate = allocate
        # (buffer name, block number) -> [slots, elements of the block]
        self.arrays: dict[tuple[str, int], np.ndarray] = {}

    def region(self, slot: int) -> Callable[[str, int, int], np.ndarray]:
        """Where sequence ``slot``'s blocks live: ``SharedKVCache``'s ``memory``."""
        if not 0 <= slot < self.slots:
            raise IndexError(f"slot {slot} outside the pool's {self.slots}")

        def memory(name: str, block: int, count: int) -> np.ndarray:
            key = (name, block)
            if key not in self.arrays:
                flat = self._allocate(self.slots * count, self.dtype)
                self.arrays[key] = flat.reshape(self.slots, count)
            array = self.arrays[key]
            if array.shape[1] != count:
                raise ValueError(f"{name} block {block}: {array.shape[1]} elements, not {count}")
            return array[slot]

        return memory

    def packed(self, spec: KVSpec, block: int, count: int) -> np.ndarray:
        """The first ``count`` regions of buffer ``spec``'s block as a packed model reads them,
        ``[1, count * H, rows, D]`` (a view: dense)."""
        array = self.arrays[spec.name, block]
        rows = array.shape[1] // (spec.num_heads * spec.head_dim)
        return array[:count].reshape(1, count * spec.num_heads, rows, spec.head_dim)

    @property
    def nbytes(self) -> int:
        """The pool's size: every slot's region (resident only where a sequence wrote it)."""
        return sum(a.nbytes for a in self.arrays.values())
