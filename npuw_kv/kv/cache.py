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
the methods take are the ring's own; :meth:`SharedKVCache.pieces` maps token slots onto them.

With ``edges`` a (non-ring) buffer is laid out as blocks one after the other in the same memory,
cut at those slots: slots ``[0, e1)`` as a dense ``[1, heads, e1, head_dim]``, then ``[e1, e2)``,
and so on.  The static models' pasts end on the edges, so each reads whole blocks, dense
tensors, not a strided view of one buffer (NPUW on the CPU copies a strided past before every
call); a model takes its past as one input per block (``transforms.split_past``).  A slot range
that crosses an edge has no single view: take it by :meth:`SharedKVCache.pieces`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import openvino as ov

from .copy import CopyCounter, relayout, safe_copy
from .memory import aligned_zeros, ensure_fits
from .slots import Piece, pieces

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

    def __init__(
        self,
        specs: list[KVSpec],
        capacity: int,
        precision: str = "f32",
        edges: Sequence[int] = (),
        *,
        allocate: Callable[[int, np.dtype], np.ndarray] = aligned_zeros,
        memory: Callable[[str, int, int], np.ndarray] | None = None,
    ) -> None:
        """``allocate(count, dtype)``: zeroed flat memory for the buffers and staging arrays
        (page-aligned host memory, or a device's own: runtime/npu_rules.DeviceMemory).
        ``memory(name, block, count)``: where buffer ``name``'s block number ``block`` lives
        instead (``count`` elements, flat): a sequence's region of a pool
        (:class:`~npuw_kv.kv.slot_pool.SlotPool`)."""
        if capacity <= 0:
            raise ValueError(f"KV capacity must be > 0 tokens, got {capacity}")
        if precision not in KV_STORAGE:
            raise ValueError(f"KV precision {precision!r} not in {sorted(KV_STORAGE)}")
        edges = tuple(edges)
        if list(edges) != sorted(set(edges)) or not all(0 < e < capacity for e in edges):
            raise ValueError(
                f"KV block edges {list(edges)} must ascend strictly within (0, {capacity})"
            )
        self.capacity = capacity
        self.precision = precision
        self.edges = edges  # where the blocks of a non-ring buffer meet
        self.dtype = np.dtype(KV_STORAGE[precision][0])  # host storage dtype
        self._allocate_flat = allocate
        self._memory = memory
        self.element_type = KV_STORAGE[precision][1]
        self.specs = {s.name: s for s in specs}
        self.slots = {s.name: s.ring or capacity for s in specs}  # each buffer's length
        if memory is None:
            need = self.nbytes_for(specs, capacity, precision)
            ensure_fits(need, f"a KV cache of {capacity} tokens")
        # per buffer its blocks, (first slot, array in the buffer's own layout), in slot order
        self.blocks = {s.name: self._allocate(s) for s in specs}
        # the layout each buffer's slots hold now (its own, unless a model of the other
        # layout wrote them: see relayout)
        self.content_axis = {s.name: s.seq_axis for s in specs}
        self._parents: dict[tuple[str, int, int], ov.Tensor] = {}

    def _allocate(self, spec: KVSpec) -> tuple[tuple[int, np.ndarray], ...]:
        rows = self.slots[spec.name]
        per_slot = spec.num_heads * spec.head_dim
        bounds = (0, rows) if spec.ring else (0, *self.edges, rows)
        if self._memory is not None:
            return tuple(
                (a, self._memory(spec.name, i, (b - a) * per_slot).reshape(spec.shape(b - a)))
                for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:], strict=True))
            )
        if spec.ring:  # a ring is read whole by every model: one block
            return ((0, self._new(spec.shape(rows))),)
        flat = self._allocate_flat(spec.num_heads * spec.head_dim * rows, self.dtype)
        return tuple(
            (a, flat[a * per_slot : b * per_slot].reshape(spec.shape(b - a)))
            for a, b in zip(bounds[:-1], bounds[1:], strict=True)
        )

    def pieces(self, name: str, start: int, stop: int) -> list[Piece]:
        """Token slots ``[start, stop)`` as the pieces of buffer ``name`` that hold them, each
        with a view of its own: cut at the block edges, or where a ring wraps
        (:func:`npuw_kv.kv.slots.pieces`)."""
        spec = self.specs[name]
        return pieces(start, stop, spec.ring, () if spec.ring else self.edges)

    def _block(self, name: str, start: int, stop: int) -> tuple[int, np.ndarray]:
        """The block holding slots ``[start, stop)``: its first slot and its array."""
        self._check(name, start, stop)
        first, block = next((f, b) for f, b in reversed(self.blocks[name]) if f <= start)
        rows = block.shape[self.specs[name].seq_axis]
        if stop > first + rows:
            raise ValueError(
                f"KV slots [{start}, {stop}) of {name} cross the edge of a block "
                f"({first + rows}): take them by pieces()"
            )
        return first, block

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

    def _in_axis(self, name: str, block: np.ndarray, axis: int) -> np.ndarray:
        """``block`` (a contiguous array in the buffer's own layout) laid out along ``axis``."""
        spec = self.specs[name]
        if axis == spec.seq_axis:
            return block
        return block.reshape(spec.shape(block.shape[spec.seq_axis], axis))

    def array(self, name: str, seq_axis: int | None = None) -> np.ndarray:
        """Buffer ``name`` as laid out along ``seq_axis`` (default: its own): the same memory.
        A buffer of several blocks has no single array (:meth:`rows` takes a block's slots)."""
        if len(self.blocks[name]) > 1:
            raise ValueError(f"{name} is held as blocks: read it through rows() or view()")
        return self._in_axis(name, self.blocks[name][0][1], self._axis(name, seq_axis))

    def zeros(self, name: str, rows: int, seq_axis: int | None = None) -> np.ndarray:
        """A zeroed host array laid out like ``rows`` slots of buffer ``name`` (staging etc.)."""
        return self._new(self.specs[name].shape(rows, self._axis(name, seq_axis)))

    def _new(self, shape: tuple[int, ...]) -> np.ndarray:
        return self._allocate_flat(int(np.prod(shape)), self.dtype).reshape(shape)

    def tensor(self, array: np.ndarray) -> ov.Tensor:
        """An ``ov.Tensor`` of the cache's element type sharing ``array``'s memory."""
        if array.dtype != self.dtype:
            raise TypeError(f"KV storage is {self.dtype}, got {array.dtype}")
        return ov.Tensor(array, list(array.shape), self.element_type)

    @property
    def buffers(self) -> dict[str, np.ndarray]:
        """Each buffer as one array, in its own layout (a cache without block edges)."""
        return {name: self.array(name) for name in self.blocks}

    @property
    def bytes_allocated(self) -> int:
        return sum(block.nbytes for blocks in self.blocks.values() for _, block in blocks)

    def bytes_per_token(self) -> int:
        """KV bytes one token takes in the layers that hold the whole past (a ring's slots are
        reused: they cost nothing per token)."""
        specs = [s for s in self.specs.values() if not s.ring]
        return self.nbytes_for(specs, 1, self.precision)

    def view(self, name: str, start: int, stop: int, seq_axis: int | None = None) -> ov.Tensor:
        """ROI tensor over token slots ``[start, stop)`` of one buffer (shares its memory),
        laid out along ``seq_axis`` (default: the buffer's own); within one block."""
        first, block = self._block(name, start, stop)
        axis = self._axis(name, seq_axis)
        if (name, axis, first) not in self._parents:
            self._parents[name, axis, first] = self.tensor(self._in_axis(name, block, axis))
        parent = self._parents[name, axis, first]
        start, stop = start - first, stop - first
        if (start, stop) == (0, block.shape[self.specs[name].seq_axis]):
            return parent  # a whole block: contiguous, no ROI needed
        begin = [0, 0, 0, 0]
        begin[axis] = start
        end = list(self.specs[name].shape(stop, axis))
        return ov.Tensor(parent, ov.Coordinate(begin), ov.Coordinate(end))

    def rows(self, name: str, start: int, stop: int, seq_axis: int | None = None) -> np.ndarray:
        """numpy view of slots ``[start, stop)`` along ``seq_axis`` (strided, no copy); within
        one block."""
        first, block = self._block(name, start, stop)
        axis = self._axis(name, seq_axis)
        return seq_slice(self._in_axis(name, block, axis), axis, start - first, stop - first)

    def write(
        self,
        name: str,
        start: int,
        stop: int,
        new: np.ndarray,
        seq_axis: int,
        counter: CopyCounter | None = None,
    ) -> None:
        """Copy ``new`` (the rows of token slots ``[start, stop)`` along ``seq_axis``) into
        their slots, piece by piece (block edges, ring wrap-around)."""
        for a, b, offset in self.pieces(name, start, stop):
            rows = seq_slice(new, seq_axis, offset, offset + b - a)
            safe_copy(self.rows(name, a, b, seq_axis), rows, counter)

    def mirror(
        self,
        name: str,
        start: int,
        stop: int,
        copy: np.ndarray,
        copy_first: int,
        seq_axis: int,
        counter: CopyCounter | None = None,
    ) -> None:
        """Bring token slots ``[start, stop)`` into ``copy``, a dense copy of this buffer's
        slots from ``copy_first`` on (a staged input), piece by piece."""
        for a, b, _ in self.pieces(name, start, stop):
            into = seq_slice(copy, seq_axis, a - copy_first, b - copy_first)
            safe_copy(into, self.rows(name, a, b, seq_axis), counter)

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
        moved = 0
        for a, b, _ in self.pieces(name, start, stop):
            dst = self.rows(name, a, b, seq_axis)
            relayout(dst, self.rows(name, a, b, src_axis), seq_axis, src_axis, counter)
            moved += dst.nbytes
        return moved
