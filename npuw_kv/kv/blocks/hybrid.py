"""The block manager of a hybrid model: KV blocks and linear-attention state slots together.

Every call that changes a sequence's KV blocks changes its state slots too, so the runtime
and the scheduler drive one object as they drive :class:`KVBlockManager`: a prefix hit is cut
to the longest prefix whose state a checkpoint holds (a hit needs both), a fork shares or
copies the state, a removed (finished or preempted) sequence gives its slots back, and a
truncation (a speculative verify's rejected tokens) picks the state kept for that length.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from typing import Any, SupportsIndex

from .eviction import PriorityRange
from .manager import KVBlockManager
from .state_slots import StatePaging, StateSlots
from .window_manager import WindowMatch


class HybridBlockManager(KVBlockManager):
    """:class:`KVBlockManager` whose sequences also hold state slots (:class:`StateSlots`)."""

    def __init__(self, *args: Any, states: StateSlots, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.states = states

    def _match(self, tokens: Sequence[int], limit: int) -> tuple[int, dict[int, WindowMatch]]:
        """The KV hit (``lookup``'s and ``add_sequence``'s) cut to the longest prefix whose
        state is checkpointed: each cut matches the windows again, up to the checkpoint."""
        k, matches = super()._match(tokens, limit)
        while (cut := self.states.reusable(tokens, k * self.tpb)) != k * self.tpb:
            k, matches = super()._match(tokens, cut)
        return k, matches

    def add_sequence(
        self,
        seq_id: Hashable,
        tokens: Iterable[int],
        priority: SupportsIndex | Sequence[PriorityRange] | None = None,
        **reuse: Any,
    ) -> int:
        """:meth:`KVBlockManager.add_sequence`; the state starts at the reused prefix's
        checkpoint (``reuse``: its keywords)."""
        ids = list(tokens)
        reused = super().add_sequence(seq_id, ids, priority, **reuse)
        self.states.start(seq_id, ids, reused)
        return reused

    def fork(self, seq_id: Hashable, child_id: Hashable) -> None:
        super().fork(seq_id, child_id)
        self.states.fork(seq_id, child_id)

    def truncate(self, seq_id: Hashable, n_tokens: int) -> None:
        """As :meth:`KVBlockManager.truncate`, to a length whose state a speculative verify
        kept (``ValueError`` otherwise, nothing changed)."""
        why = self.states.rollback_error(seq_id, n_tokens)
        if why is not None:
            raise ValueError(f"cannot truncate sequence {seq_id!r} to {n_tokens}: {why}")
        super().truncate(seq_id, n_tokens)
        self.states.rollback(seq_id, n_tokens)

    def remove_sequence(self, seq_id: Hashable) -> None:
        super().remove_sequence(seq_id)
        self.states.end(seq_id)

    def state_paging(
        self, parts: Sequence[tuple[Hashable, int, int]], per_token: bool = False
    ) -> StatePaging:
        """The state slots of one call over ``parts`` (``(sequence, past, new tokens)``),
        whose tokens were added already."""
        return self.states.plan(
            [(seq, self._get(seq).tokens, past, new) for seq, past, new in parts], per_token
        )

    def check_invariants(self) -> None:
        super().check_invariants()
        self.states.check_invariants()
        if set(self.states.sequences) != set(self.sequence_ids):
            raise AssertionError("sequences with KV blocks and with state slots differ")
