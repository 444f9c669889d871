"""The shared KV cache: one host buffer per layer for K and one for V.

Both the prefill and the generate request read and write these buffers through views along the
sequence axis (ROI tensors, ``ov.Tensor(parent, begin, end)``), so nothing is re-laid-out when
prefill ends.  The buffers are numpy arrays; the ``ov.Tensor`` wrappers share their memory.

A buffer is laid out as ``[1, heads, capacity, head_dim]``, or, with ``split_at=A``, as two
such segments back to back in the same allocation: slots ``[0, A)`` then ``[A, capacity)``.
The split makes the prefix ``[0, A)`` *contiguous* (in the plain layout it is a strided view,
since the sequence axis is not the outermost), so a request can read it without the device
staging a copy; a model whose past input is ``Concat(prefix, tail)`` then reads all slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import openvino as ov

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

    def __init__(
        self,
        specs: list[KVSpec],
        capacity: int,
        precision: str = "f32",
        split_at: int | None = None,
    ) -> None:
        if capacity <= 0:
            raise ValueError(f"KV capacity must be > 0 tokens, got {capacity}")
        if precision not in KV_STORAGE:
            raise ValueError(f"KV precision {precision!r} not in {sorted(KV_STORAGE)}")
        if split_at is not None and not 0 < split_at < capacity:
            raise ValueError(f"KV split at slot {split_at} must lie inside (0, {capacity})")
        self.capacity = capacity
        self.precision = precision
        self.dtype = np.dtype(KV_STORAGE[precision][0])  # host storage dtype
        self.element_type = KV_STORAGE[precision][1]
        self.specs = {s.name: s for s in specs}
        # slot ranges stored as separate [1, heads, rows, head_dim] blocks of one allocation
        self.bounds = [(0, capacity)] if split_at is None else [(0, split_at), (split_at, capacity)]
        self.buffers: dict[str, np.ndarray] = {}  # name -> the flat allocation
        self.segments: dict[str, list[np.ndarray]] = {}
        for spec in specs:
            flat = np.zeros(spec.num_heads * capacity * spec.head_dim, self.dtype)
            parts, offset = [], 0
            for start, stop in self.bounds:
                size = spec.num_heads * (stop - start) * spec.head_dim
                shape = (1, spec.num_heads, stop - start, spec.head_dim)
                parts.append(flat[offset : offset + size].reshape(shape))
                offset += size
            self.buffers[spec.name], self.segments[spec.name] = flat, parts
        self._parents = {
            name: [self.tensor(part) for part in parts] for name, parts in self.segments.items()
        }

    @property
    def split_at(self) -> int | None:
        return self.bounds[0][1] if len(self.bounds) > 1 else None

    def segment_of(self, start: int, stop: int) -> int | None:
        """Index of the segment holding slots ``[start, stop)``, or None when they straddle the
        split (no single view can cover them)."""
        return next(
            (i for i, (lo, hi) in enumerate(self.bounds) if lo <= start and stop <= hi), None
        )

    def _segment(self, start: int, stop: int) -> int:
        if not 0 <= start < stop <= self.capacity:
            raise IndexError(f"KV slots [{start}, {stop}) outside capacity {self.capacity}")
        i = self.segment_of(start, stop)
        if i is None:
            raise IndexError(
                f"KV slots [{start}, {stop}) straddle the split at slot {self.split_at}"
            )
        return i

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
        i = self._segment(start, stop)
        lo, hi = self.bounds[i]
        if (start, stop) == (lo, hi):
            return self._parents[name][i]  # a whole segment: contiguous, no ROI needed
        spec = self.specs[name]
        return ov.Tensor(
            self._parents[name][i],
            ov.Coordinate([0, 0, start - lo, 0]),
            ov.Coordinate([1, spec.num_heads, stop - lo, spec.head_dim]),
        )

    def rows(self, name: str, start: int, stop: int) -> np.ndarray:
        """numpy view of slots ``[start, stop)`` (strided, no copy)."""
        i = self._segment(start, stop)
        lo = self.bounds[i][0]
        return self.segments[name][i][:, :, start - lo : stop - lo, :]
