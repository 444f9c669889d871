"""The shared KV cache: one host buffer per layer for K and one for V.

Both the prefill and the generate request read and write these buffers in place, through views
along the sequence axis, so nothing is re-laid-out when prefill ends.  A buffer is a numpy
array ``[1, heads, capacity, head_dim]`` (sequence axis 2), or ``[1, heads, head_dim, capacity]``
(axis 3) for V stored transposed (``optimize_v_tensors``); the ``ov.Tensor`` wrappers share its
memory.  Every method takes slots along the buffer's own axis.

A slot range ``[a, b)`` is a strided view (ROI tensor, ``ov.Tensor(parent, begin, end)``): the
sequence axis is not the outermost.  Only the whole buffer is contiguous, which is what a device
that stages strided inputs through copies must be given to read it in place.  Along axis 3 (the
innermost) a slot range is strided even with one head: each of the ``head_dim`` rows is cut.

A model whose V layout differs from the buffer's (V transposed in the generate models only)
reads the same memory in its own layout: ``seq_axis=`` asks for that interpretation, and
:meth:`SharedKVCache.relayout` moves the slots between the two (through a temporary: the two
layouts overlap).  ``content_axis`` says which layout the slots hold now.

A sliding-window layer may keep its KV in a ring (``KVSpec.ring`` slots, see
:mod:`npuw_kv.model.ring`) instead of the whole capacity: its buffer is that long, and the slots
the methods take are the ring's own (:mod:`npuw_kv.runtime.rings` maps token slots onto them).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import openvino as ov

from .copy import CopyCounter, relayout
from .memory import ensure_fits

# precision -> (numpy storage dtype, OpenVINO element type). numpy has no bfloat16, so bf16
# rows are stored as uint16 bit patterns and typed bf16 only in the ov.Tensor wrappers.
KV_STORAGE: dict[str, tuple[type[np.generic], ov.Type]] = {
    "f32": (np.float32, ov.Type.f32),
    "f16": (np.float16, ov.Type.f16),
    "bf16": (np.uint16, ov.Type.bf16),
}
SEQ_AXIS = 2  # [1, heads, seq, head_dim]
SEQ_AXES = (2, 3)  # 3: [1, heads, head_dim, seq], V transposed


def seq_shape(heads: int, head_dim: int, rows: int, seq_axis: int) -> tuple[int, int, int, int]:
    """The shape of ``rows`` slots of a KV tensor whose sequence runs along ``seq_axis``."""
    if seq_axis not in SEQ_AXES:
        raise ValueError(f"KV sequence axis {seq_axis} not in {SEQ_AXES}")
    return (1, heads, rows, head_dim) if seq_axis == 2 else (1, heads, head_dim, rows)


def seq_slice(array: np.ndarray, seq_axis: int, start: int, stop: int) -> np.ndarray:
    """``array``'s slots ``[start, stop)`` along ``seq_axis`` (a view)."""
    index = [slice(None)] * 4
    index[seq_axis] = slice(start, stop)
    return array[tuple(index)]


def layout_name(seq_axis: int) -> str:
    """``"HSD"`` or ``"HDS"``: the order of a KV tensor's heads, sequence and head_dim axes."""
    return "HSD" if seq_axis == 2 else "HDS"


@dataclass(frozen=True)
class KVSpec:
    """One cache tensor (K or V of one layer) as the runtime sees it."""

    name: str
    num_heads: int
    head_dim: int
    seq_axis: int = SEQ_AXIS  # the buffer's layout (the generate models')
    ring: int = 0  # > 0: the layer keeps only this many slots, written circularly

    def shape(self, rows: int, seq_axis: int | None = None) -> tuple[int, int, int, int]:
        axis = self.seq_axis if seq_axis is None else seq_axis
        return seq_shape(self.num_heads, self.head_dim, rows, axis)


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
        self.slots = {s.name: s.ring or capacity for s in specs}  # each buffer's length
        ensure_fits(self.nbytes_for(specs, capacity, precision), f"a KV cache of {capacity} tokens")
        self.buffers = {s.name: np.zeros(s.shape(self.slots[s.name]), self.dtype) for s in specs}
        # the layout each buffer's slots hold now (its own, unless a model of the other
        # layout wrote them: see relayout)
        self.content_axis = {s.name: s.seq_axis for s in specs}
        self._parents = {
            (name, self.specs[name].seq_axis): self.tensor(buf)
            for name, buf in self.buffers.items()
        }

    @staticmethod
    def nbytes_for(specs: list[KVSpec], capacity: int, precision: str) -> int:
        """What the buffers of ``specs`` take for ``capacity`` slots, before allocating them."""
        itemsize = np.dtype(KV_STORAGE[precision][0]).itemsize
        return sum(s.num_heads * s.head_dim * (s.ring or capacity) for s in specs) * itemsize

    def _check(self, name: str, start: int, stop: int) -> None:
        if not 0 <= start < stop <= self.slots[name]:
            raise IndexError(f"KV slots [{start}, {stop}) outside {name}'s {self.slots[name]}")

    def _axis(self, name: str, seq_axis: int | None) -> int:
        return self.specs[name].seq_axis if seq_axis is None else seq_axis

    def array(self, name: str, seq_axis: int | None = None) -> np.ndarray:
        """Buffer ``name`` as laid out along ``seq_axis`` (default: its own): the same memory."""
        axis = self._axis(name, seq_axis)
        buffer = self.buffers[name]
        if axis == self.specs[name].seq_axis:
            return buffer
        return buffer.reshape(self.specs[name].shape(self.slots[name], axis))

    def zeros(self, name: str, rows: int, seq_axis: int | None = None) -> np.ndarray:
        """A zeroed host array laid out like ``rows`` slots of buffer ``name`` (staging etc.)."""
        return np.zeros(self.specs[name].shape(rows, self._axis(name, seq_axis)), self.dtype)

    def tensor(self, array: np.ndarray) -> ov.Tensor:
        """An ``ov.Tensor`` of the cache's element type sharing ``array``'s memory."""
        if array.dtype != self.dtype:
            raise TypeError(f"KV storage is {self.dtype}, got {array.dtype}")
        return ov.Tensor(array, list(array.shape), self.element_type)

    @property
    def bytes_allocated(self) -> int:
        return sum(buf.nbytes for buf in self.buffers.values())

    def bytes_per_token(self) -> int:
        """KV bytes one token takes in the layers that hold the whole past (a ring's slots are
        reused: they cost nothing per token)."""
        specs = [s for s in self.specs.values() if not s.ring]
        return self.nbytes_for(specs, 1, self.precision)

    def view(self, name: str, start: int, stop: int, seq_axis: int | None = None) -> ov.Tensor:
        """ROI tensor over token slots ``[start, stop)`` of one buffer (shares its memory),
        laid out along ``seq_axis`` (default: the buffer's own)."""
        self._check(name, start, stop)
        axis = self._axis(name, seq_axis)
        if (name, axis) not in self._parents:
            self._parents[name, axis] = self.tensor(self.array(name, axis))
        parent = self._parents[name, axis]
        if (start, stop) == (0, self.slots[name]):
            return parent  # the whole buffer: contiguous, no ROI needed
        begin = [0, 0, 0, 0]
        begin[axis] = start
        end = list(self.specs[name].shape(stop, axis))
        return ov.Tensor(parent, ov.Coordinate(begin), ov.Coordinate(end))

    def rows(self, name: str, start: int, stop: int, seq_axis: int | None = None) -> np.ndarray:
        """numpy view of slots ``[start, stop)`` along ``seq_axis`` (strided, no copy)."""
        self._check(name, start, stop)
        axis = self._axis(name, seq_axis)
        return seq_slice(self.array(name, axis), axis, start, stop)

    def token_rows(self, name: str, start: int, stop: int) -> np.ndarray:
        """Slots ``[start, stop)`` as ``[heads, tokens, head_dim]``, whatever the layout they
        are held in now (a numpy view: reading and assigning reach the buffer)."""
        axis = self.content_axis[name]
        rows = self.rows(name, start, stop, axis)[0]
        return rows if axis == 2 else rows.transpose(0, 2, 1)

    def relayout(
        self, name: str, start: int, stop: int, seq_axis: int, counter: CopyCounter | None = None
    ) -> int:
        """Re-lay slots ``[start, stop)`` of buffer ``name`` out along ``seq_axis`` in place
        (the two layouts share the memory: through a temporary); the bytes copied."""
        src_axis = self.content_axis[name]
        self.content_axis[name] = seq_axis
        if src_axis == seq_axis or start >= stop:
            return 0
        src = self.rows(name, start, stop, src_axis)
        dst = self.rows(name, start, stop, seq_axis)
        relayout(dst, src, seq_axis, src_axis, counter)
        return dst.nbytes
