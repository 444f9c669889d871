"""The state tables of a hybrid model's paged linear-attention layers: slot-major tensors.

Each table input (``conv_state_table.3``, ``gated_delta_state_table.5``, ...) is one tensor
``[slots, *state]`` in the element type the device chose; slot ``i`` of every table is one
sequence's (or checkpoint's) state, which slot is whose being :class:`~.blocks.StateSlots`'.
The device reads and writes them in place, bound once; the host copies a slot only for a fork
in the middle of a checkpoint interval.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import openvino as ov

from .memory import ensure_fits


@dataclass(frozen=True)
class StateSpec:
    """One state table input as the device declared it: name, element type, one slot's
    shape."""

    name: str
    element_type: ov.Type
    slot_shape: tuple[int, ...]

    @property
    def slot_bytes(self) -> int:
        return math.prod(self.slot_shape) * self.element_type.size


class StatePool:
    """Zeroed tables of ``slots`` slots (the OS hands the pages out as they are written)."""

    def __init__(self, specs: Sequence[StateSpec], slots: int) -> None:
        if not specs or slots < 2:
            raise ValueError(f"need state tables and >= 2 slots (got {slots})")
        self.specs = list(specs)
        self.slots = slots
        ensure_fits(slots * self.slot_bytes, f"linear-attention state tables of {slots} slots")
        self.tensors = {
            s.name: ov.Tensor(
                np.zeros(slots * s.slot_bytes, np.uint8), [slots, *s.slot_shape], s.element_type
            )
            for s in specs
        }
        self.copied_bytes = 0  # by copy(), since the tables were made

    @property
    def slot_bytes(self) -> int:
        """One slot of every table: what one sequence's state takes."""
        return sum(s.slot_bytes for s in self.specs)

    @property
    def bytes_allocated(self) -> int:
        return sum(t.byte_size for t in self.tensors.values())

    def copy(self, src: int, dst: int) -> None:
        """Slot ``src``'s state into slot ``dst``, in every table."""
        for tensor in self.tensors.values():
            data = tensor.data
            data[dst] = data[src]
        self.copied_bytes += self.slot_bytes

    def grown(self, slots: int) -> StatePool:
        """Tables of ``slots`` slots holding these tables' slots where they were."""
        pool = StatePool(self.specs, slots)
        for name, tensor in self.tensors.items():
            pool.tensors[name].data[: self.slots] = tensor.data
        pool.copied_bytes = self.copied_bytes
        return pool
