"""The shared KV cache: one ``[1, heads, capacity, head_dim]`` host buffer per layer for K and V.

Both the prefill and the generate request read and write these buffers through ROI views
(``ov.Tensor(parent, begin, end)``) along the sequence axis, so nothing is re-laid-out when
prefill ends.  The buffers are numpy arrays; the ``ov.Tensor`` wrappers share their memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import openvino as ov

SEQ_AXIS = 2


@dataclass(frozen=True)
class KVSpec:
    """One cache tensor (K or V of one layer) as the runtime sees it."""

    name: str
    num_heads: int
    head_dim: int


class SharedKVCache:
    """Per-layer K/V buffers of a fixed token capacity, plus the views into them."""

    def __init__(self, specs: list[KVSpec], capacity: int, dtype: np.dtype | str) -> None:
        if capacity <= 0:
            raise ValueError(f"KV capacity must be > 0 tokens, got {capacity}")
        self.capacity = capacity
        self.dtype = np.dtype(dtype)
        self.specs = {s.name: s for s in specs}
        self.buffers: dict[str, np.ndarray] = {
            s.name: np.zeros((1, s.num_heads, capacity, s.head_dim), self.dtype) for s in specs
        }
        self._parents = {
            name: ov.Tensor(buf, shared_memory=True) for name, buf in self.buffers.items()
        }

    @property
    def bytes_allocated(self) -> int:
        return sum(buf.nbytes for buf in self.buffers.values())

    def bytes_per_token(self) -> int:
        return self.bytes_allocated // self.capacity

    def view(self, name: str, start: int, stop: int) -> ov.Tensor:
        """ROI tensor over token slots ``[start, stop)`` of one buffer (shares its memory)."""
        if not 0 <= start < stop <= self.capacity:
            raise IndexError(f"KV slots [{start}, {stop}) outside capacity {self.capacity}")
        if start == 0 and stop == self.capacity:
            return self._parents[name]  # the whole buffer: contiguous, no ROI needed
        spec = self.specs[name]
        return ov.Tensor(
            self._parents[name],
            ov.Coordinate([0, 0, start, 0]),
            ov.Coordinate([1, spec.num_heads, stop, spec.head_dim]),
        )

    def rows(self, name: str, start: int, stop: int) -> np.ndarray:
        """numpy view of slots ``[start, stop)`` (strided, no copy)."""
        return self.buffers[name][:, :, start:stop, :]

    def clear(self) -> None:
        """Zero all slots.  Not needed for correctness (masks hide stale slots); for tests."""
        for buf in self.buffers.values():
            buf.fill(0)
