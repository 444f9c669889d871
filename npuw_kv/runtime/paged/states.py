"""A hybrid model's linear-attention state tables on the paged path: bound, addressed, probed.

The tables (:class:`~npuw_kv.kv.state_pool.StatePool`) are bound to the request once and grown
in place of the old ones when the slots run out; which slot is whose is the block manager's
(:class:`~npuw_kv.kv.blocks.StateSlots`).  A state is checkpointed every ``interval`` tokens:
the prefill chunk rounded up to whole KV blocks, so a prompt's chunks end where checkpoints are
and a reused one is what a fresh run computes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import openvino as ov

from ...kv.blocks import StatePaging, StateSlots
from ...kv.state_pool import StatePool, StateSpec
from ...model.paged_rewrite import STATE_PAGING, state_inputs, state_paging_prefixes


class PagedStates:
    """The state tables of one PagedAttention request and the inputs that address them."""

    def __init__(self, request: ov.InferRequest, specs: list[StateSpec], interval: int) -> None:
        self.request = request
        self.interval = interval
        self.prefixes = state_paging_prefixes(request.get_compiled_model())
        if not self.prefixes:
            raise ValueError("the model has state tables but no inputs that address them")
        self.pool = StatePool(specs, 2)
        self._bind()

    @classmethod
    def of(cls, request: ov.InferRequest, interval: int) -> PagedStates | None:
        """The request's state tables (None: the model has no linear-attention layer)."""
        specs = [
            StateSpec(
                i.get_any_name(),
                i.get_element_type(),
                tuple(d.get_length() for d in list(i.get_partial_shape())[1:]),
            )
            for i in state_inputs(request.get_compiled_model())
        ]
        return cls(request, specs, interval) if specs else None

    def slots(self, max_checkpoints: int) -> StateSlots:
        """Slot bookkeeping over these tables for a new block manager, the tables sized for
        ``max_checkpoints`` and a sequence at first (they grow as sequences need more)."""
        if self.pool.slots < 2 + max_checkpoints:
            self._grow(2 + max_checkpoints)
        return StateSlots(
            self.pool.slots, self.interval, max_checkpoints, grow=self._grow, copy=self.pool.copy
        )

    def _grow(self, slots: int) -> None:
        self.pool = self.pool.grown(slots)
        self._bind()

    def _bind(self) -> None:
        for name, tensor in self.pool.tensors.items():
            self.request.set_tensor(name, tensor)

    def inputs(self, paging: StatePaging) -> dict[str, np.ndarray]:
        """One call's inputs addressing the tables, the same for every paging group."""
        values = (paging.slots, paging.begins, paging.past_lens, paging.intervals)
        return {
            prefix + name: value
            for prefix in self.prefixes
            for name, value in zip(STATE_PAGING, values, strict=True)
        }

    def unwritten(self, kv_inputs: Mapping[str, np.ndarray], kv: Sequence[ov.Tensor]) -> list[str]:
        """The tables the device does not write: one call of four tokens from the zero state
        into slot 1 (``kv_inputs``: the call's KV inputs, on the cache's first block), then
        the slot and the KV blocks it wrote (``kv``) zeroed again.  A plugin that computes a
        linear-attention op without storing its state would answer wrong silently."""
        tokens = 4
        # slot 0 (the zero state) read, slot 1 written; past 0, no checkpoints
        probe = StatePaging(*(np.array(v, np.int32) for v in ([0, 1], [0, 2], [0], [0])))
        inputs = {
            "input_ids": np.arange(1, tokens + 1, dtype=np.int64),
            "position_ids": np.arange(tokens, dtype=np.int64),
            "past_lens": np.zeros(1, np.int32),
            "subsequence_begins": np.array([0, tokens], np.int32),
            "block_indices_begins": np.array([0, 1], np.int32),
            "max_context_len": np.array(tokens, np.int32),
            **kv_inputs,
            **self.inputs(probe),
        }
        names = {i.get_any_name() for i in self.request.get_compiled_model().inputs}
        self.request.infer({k: v for k, v in inputs.items() if k in names})
        unwritten = [n for n, t in self.pool.tensors.items() if not t.data[1].any()]
        for tensor in (*self.pool.tensors.values(), *kv):
            tensor.data[:2] = 0
        return unwritten

    def stats(self, slots: StateSlots) -> dict[str, Any]:
        """The tables' slots, bytes and checkpoints."""
        return {
            "state_slots": self.pool.slots,
            "state_slots_used": slots.used,
            "state_checkpoints": slots.checkpoints,
            "state_checkpoint_interval": self.interval,
            "state_checkpoints_reused": slots.reused,
            "state_bytes_allocated": self.pool.bytes_allocated,
            "state_copied_bytes": self.pool.copied_bytes,
        }
