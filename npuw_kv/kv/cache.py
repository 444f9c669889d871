"""The shared KV cache: one host buffer per layer for K and one for V.

Both the prefill and the generate request read and write these buffers in place, through views
along the sequence axis, so nothing is re-laid-out when prefill ends.  The buffers are numpy
arrays ``[1, heads, capacity, head_dim]``; the ``ov.Tensor`` wrappers share their memory.

A slot range ``[a, b)`` is a strided view (ROI tensor, ``ov.Tensor(parent, begin, end)``): the
sequence axis is not the outermost.  Only the whole buffer is contiguous, which is what a device
that stages strided inputs through copies must be given to read it in place.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import openvino as ov

from .memory import ensure_fits

# precision -> (numpy storage dtype, OpenVINO element type). numpy has no bfloat16, so bf16
# rows are stored as uint16 bit patterns and typed bf16 only in the ov.Tensor wrappers.
KV_STORAGE: dict[str, tuple[type[np.generic], ov.Type]] = {
    "f32": (np.float32, ov.Type.f32),
    "f16": (np.float16, ov.Type.f16),
    "bf16": (np.uint16, ov.Type.bf16),
}


@dataclass(frozen=True)
class KVSpec:
    """One cache tensor (K or V of one layer) as the runtime sees it."""

    name: str
    num_heads: int
    head_dim: int


class SharedKVCache:
    """Per-layer K/V buffers of a fixed token capacity, plus the views into them."""

    def __init__(self, specs: list[KVSpec], capacity: int, precision: str = "f32") -> None:
        if capacity <= 0:
            raise ValueError(f"KV capacity must be > 0 tokens, got {capacity}")
        if precision not in KV_STORAGE:
            raise ValueError(f"KV precision {precision!r} not in {sorted(KV_STORAGE)}")
        self.capacity = capacity
        self.precision = precision
        self.dtype = np.dtype(KV_STORAGE[precision][0])  # host storage dtype
        self.element_type = KV_STORAGE[precision][1]
        self.specs = {s.name: s for s in specs}
        ensure_fits(self.nbytes_for(specs, capacity, precision), f"a KV cache of {capacity} tokens")
        self.buffers = {
            s.name: np.zeros((1, s.num_heads, capacity, s.head_dim), self.dtype) for s in specs
        }
        self._parents = {name: self.tensor(buf) for name, buf in self.buffers.items()}

    @staticmethod
    def nbytes_for(specs: list[KVSpec], capacity: int, precision: str) -> int:
        """What the buffers of ``specs`` take for ``capacity`` slots, before allocating them."""
        itemsize = np.dtype(KV_STORAGE[precision][0]).itemsize
        return sum(s.num_heads * s.head_dim for s in specs) * capacity * itemsize

    def _check(self, start: int, stop: int) -> None:
        if not 0 <= start < stop <= self.capacity:
            raise IndexError(f"KV slots [{start}, {stop}) outside capacity {self.capacity}")

    def zeros(self, name: str, rows: int) -> np.ndarray:
        """A zeroed host array laid out like ``rows`` slots of buffer ``name`` (staging etc.)."""
        spec = self.specs[name]
        return np.zeros((1, spec.num_heads, rows, spec.head_dim), self.dtype)

    def tensor(self, array: np.ndarray) -> ov.Tensor:
        """An ``ov.Tensor`` of the cache's element type sharing ``array``'s memory."""
        if array.dtype != self.dtype:
            raise TypeError(f"KV storage is {self.dtype}, got {array.dtype}")
        return ov.Tensor(array, list(array.shape), self.element_type)

    @property
    def bytes_allocated(self) -> int:
        return sum(buf.nbytes for buf in self.buffers.values())

    def bytes_per_token(self) -> int:
        return self.bytes_allocated // self.capacity

    def view(self, name: str, start: int, stop: int) -> ov.Tensor:
        """ROI tensor over token slots ``[start, stop)`` of one buffer (shares its memory)."""
        self._check(start, stop)
        if (start, stop) == (0, self.capacity):
            return self._parents[name]  # the whole buffer: contiguous, no ROI needed
        spec = self.specs[name]
        return ov.Tensor(
            self._parents[name],
            ov.Coordinate([0, 0, start, 0]),
            ov.Coordinate([1, spec.num_heads, stop, spec.head_dim]),
        )

    def rows(self, name: str, start: int, stop: int) -> np.ndarray:
        """numpy view of slots ``[start, stop)`` (strided, no copy)."""
        self._check(start, stop)
        return self.buffers[name][:, :, start:stop, :]
