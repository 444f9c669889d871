"""Which slot of the state tables holds each sequence's linear-attention state.

A hybrid model (LFM2's short convolutions, Qwen3.5's gated DeltaNet, Mamba) keeps, beside the
attention layers' KV, a fixed-size state per layer that every token rewrites.  The paged
rewrite gives each such layer a state *table*: slots of one state each, addressed per
sequence by ``[read slot, write slot for each interval the call touches]`` with a checkpoint
interval ``I``: the state at the end of every interval of ``I`` tokens the call completes goes
to that interval's slot, the state after the call's last token to the last slot.

Here a slot is one of: slot 0, the zero state a prompt starts from (never written); a
sequence's *own* slot, where the state of its unfinished interval lives (no one else reads
it); a *checkpoint*, the state after the first ``b`` tokens of some token list (``b`` a
multiple of ``I``), kept for prefix reuse: a prompt whose first ``b`` tokens are cached in the
KV blocks starts from it.  Checkpoints are cache: evicted least recently used when their
number passes ``max_checkpoints`` or a slot is needed, never while a sequence reads from one.
Nothing is copied except when a sequence is forked in the middle of an interval (its own slot
is copied for the child).  ``per_token`` calls (a speculative verify) write the state after
every token into slots of their own, so a rollback picks the one it keeps.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np

ZERO = 0  # the slot of the zero state


@dataclass
class _State:
    latest: int  # the slot holding the state after `tokens` tokens
    tokens: int
    own: int | None = None  # the private slot of its unfinished interval
    undo: dict[int, int] = field(default_factory=dict)  # after a per_token call: tokens -> slot


@dataclass(frozen=True)
class StatePaging:
    """One call's state-table inputs (the same for every table): each sequence's slots
    ``[read, writes...]`` concatenated, where each sequence's begin, its past and interval."""

    slots: np.ndarray
    begins: np.ndarray
    past_lens: np.ndarray
    intervals: np.ndarray


class StateSlots:
    """Slot bookkeeping of the state tables, for the sequences of one block manager.

    ``grow(slots)`` enlarges the tables to ``slots`` (their bytes kept); ``copy(src, dst)``
    copies one slot's state in every table.  Both are the runtime's: here are only numbers.
    """

    def __init__(
        self,
        slots: int,
        interval: int,
        max_checkpoints: int,
        *,
        grow: Callable[[int], None],
        copy: Callable[[int, int], None],
    ) -> None:
        if slots < 2 or interval < 1 or max_checkpoints < 0:
            raise ValueError(f"state slots {slots} (>= 2), interval {interval} (>= 1)")
        self.interval, self.max_checkpoints = interval, max_checkpoints
        self.slots = slots
        self._grow, self._copy = grow, copy
        self._free = list(range(slots - 1, ZERO, -1))  # pop() hands out the lowest first
        self._refs: dict[int, int] = {}
        self._checkpoints: OrderedDict[bytes, int] = OrderedDict()  # oldest use first
        self._states: dict[Hashable, _State] = {}
        # slots the call being planned reads or writes: none is handed out again in it (one
        # released meanwhile goes back to the free list when the plan is done)
        self._pinned: set[int] = set()
        self._released: list[int] = []
        self._planning = False
        self.copies = 0  # slots copied for forks
        self.reused = 0  # checkpoints a sequence started from

    # -- prefix reuse --------------------------------------------------------------------------
    def reusable(self, tokens: Sequence[int], hit: int) -> int:
        """The longest prefix of at most ``hit`` tokens whose state a checkpoint holds."""
        for end in range(hit - hit % self.interval, 0, -self.interval):
            if _key(tokens, end) in self._checkpoints:
                return end
        return 0

    # -- sequences -----------------------------------------------------------------------------
    def start(self, seq: Hashable, tokens: Sequence[int], reused: int) -> None:
        """``seq`` starts after its first ``reused`` tokens (0, or a checkpoint's length)."""
        if seq in self._states:
            raise AssertionError(f"sequence {seq!r} already has a state")
        slot = ZERO
        if reused:
            key = _key(tokens, reused)
            if key not in self._checkpoints:
                raise AssertionError(f"no state checkpoint after {reused} tokens")
            slot = self._checkpoints[key]
            self._checkpoints.move_to_end(key)
            self.reused += 1
        self._ref(slot)
        self._states[seq] = _State(slot, reused)

    def fork(self, seq: Hashable, child: Hashable) -> None:
        """``child`` continues from ``seq``'s state: a slot no call writes again is shared,
        the own slot (written by the next call) copied."""
        state = self._states[seq]
        slot = state.latest
        if slot == state.own:
            slot = self._acquire()
            self._copy(state.latest, slot)
            self.copies += 1
            self._states[child] = _State(slot, state.tokens, own=slot)
            self._ref(slot)  # as latest and as own
        else:
            self._ref(slot)
            self._states[child] = _State(slot, state.tokens)

    def end(self, seq: Hashable) -> None:
        """``seq`` ended: its slots go back (checkpoints it wrote stay cached)."""
        state = self._states.pop(seq)
        self._drop_undo(state)
        self._unref(state.latest)
        if state.own is not None:
            self._unref(state.own)

    def rollback_error(self, seq: Hashable, tokens: int) -> str | None:
        """Why :meth:`rollback` to ``tokens`` cannot be done, or None."""
        state = self._states[seq]
        if tokens == state.tokens or tokens in state.undo:
            return None
        return (
            f"the linear-attention state after {tokens} tokens is not kept (the sequence holds "
            f"{state.tokens}); only a speculative verify's tokens can be dropped"
        )

    def rollback(self, seq: Hashable, tokens: int) -> None:
        """Keep the state after ``seq``'s first ``tokens`` tokens: one a ``per_token`` call
        wrote (a speculative verify's accepted candidates)."""
        why = self.rollback_error(seq, tokens)
        if why is not None:
            raise ValueError(why)
        state = self._states[seq]
        if tokens != state.tokens:
            self._set_latest(state, state.undo[tokens], tokens)
        self._drop_undo(state)

    @property
    def sequences(self) -> list[Hashable]:
        return list(self._states)

    def tokens(self, seq: Hashable) -> int:
        return self._states[seq].tokens

    # -- calls ---------------------------------------------------------------------------------
    def plan(
        self, parts: Sequence[tuple[Hashable, Sequence[int], int, int]], per_token: bool = False
    ) -> StatePaging:
        """The slots of one call over ``parts``: ``(sequence, its tokens so far, past, new)``.
        Each sequence's state then covers ``past + new`` tokens; completed intervals are
        checkpointed where a slot is free.  ``per_token``: every token's state kept apart
        (interval 1), for :meth:`rollback`."""
        self._planning = True
        slots: list[int] = []
        begins, pasts, intervals = [0], [], []
        for seq, tokens, past, new in parts:
            state = self._states[seq]
            if state.tokens != past:
                raise AssertionError(
                    f"sequence {seq!r}: its state covers {state.tokens} tokens, the call says "
                    f"{past} are cached"
                )
            self._drop_undo(state)
            self._pinned.add(state.latest)
            writes = self._per_token(state, new) if per_token else self._writes(state, tokens, new)
            slots += [state.latest, *writes]
            begins.append(len(slots))
            pasts.append(past)
            intervals.append(1 if per_token else self.interval)
            self._set_latest(state, writes[-1], past + new)
        self._planning = False
        self._pinned.clear()
        self._free += self._released
        self._released.clear()
        return StatePaging(
            np.array(slots, np.int32),
            np.array(begins, np.int32),
            np.array(pasts, np.int32),
            np.array(intervals, np.int32),
        )

    def _writes(self, state: _State, tokens: Sequence[int], new: int) -> list[int]:
        """A slot per interval the call touches: a new checkpoint for each it completes (own
        when there is no room, or the prefix has one already), own for the unfinished one."""
        size, past = self.interval, state.tokens
        writes = []
        for k in range(past // size, (past + new - 1) // size + 1):
            end = (k + 1) * size
            slot = None
            if end <= past + new:
                slot = self._checkpoint(_key(tokens, end))
            writes.append(self._own(state) if slot is None else slot)
        return writes

    def _per_token(self, state: _State, new: int) -> list[int]:
        """A slot for each token's state; the one before the call kept too (:meth:`rollback`)."""
        writes = [self._acquire() for _ in range(new)]  # each referenced by its undo entry
        self._ref(state.latest)
        state.undo = {state.tokens: state.latest}
        state.undo.update((state.tokens + i + 1, s) for i, s in enumerate(writes))
        return writes

    def _set_latest(self, state: _State, slot: int, tokens: int) -> None:
        self._ref(slot)
        self._unref(state.latest)
        state.latest, state.tokens = slot, tokens

    def _drop_undo(self, state: _State) -> None:
        for slot in state.undo.values():
            self._unref(slot)
        state.undo.clear()

    # -- slots ---------------------------------------------------------------------------------
    def _own(self, state: _State) -> int:
        if state.own is None:
            state.own = self._acquire()  # the reference of `own`
        return state.own

    def _checkpoint(self, key: bytes) -> int | None:
        """A new checkpoint's slot for ``key``, registered; None if none is free or ``key``
        has one (which this call must not overwrite: others may read it)."""
        if key in self._checkpoints or not self.max_checkpoints:
            return None
        while len(self._checkpoints) >= self.max_checkpoints:
            if not self._evict():
                return None
        slot = self._take()  # the registry's reference
        if slot is not None:
            self._checkpoints[key] = slot
        return slot

    def _acquire(self) -> int:
        """A free slot, referenced once: an unread checkpoint is evicted for it, else the
        tables grow by a quarter."""
        slot = self._take()
        if slot is None:
            more = max(4, self.slots // 4)
            self._grow(self.slots + more)
            self._free = list(range(self.slots + more - 1, self.slots - 1, -1))
            self.slots += more
            slot = self._take()
            assert slot is not None
        return slot

    def _take(self) -> int | None:
        """A free slot (evicting an unread checkpoint if none is), referenced once; None if
        there is none."""
        if not self._free and not self._evict():
            return None
        slot = self._free.pop()
        self._refs[slot] = 1
        if self._planning:
            self._pinned.add(slot)
        return slot

    def _evict(self) -> bool:
        """Drop the least recently used checkpoint no sequence reads; False if none."""
        for key, slot in self._checkpoints.items():
            if self._refs.get(slot) == 1 and slot not in self._pinned:
                del self._checkpoints[key]
                self._unref(slot)
                return True
        return False

    def _ref(self, slot: int) -> None:
        if slot != ZERO:
            self._refs[slot] += 1

    def _unref(self, slot: int) -> None:
        if slot == ZERO:
            return
        self._refs[slot] -= 1
        if not self._refs[slot]:
            del self._refs[slot]
            (self._released if slot in self._pinned else self._free).append(slot)

    # -- accounting ----------------------------------------------------------------------------
    @property
    def checkpoints(self) -> int:
        return len(self._checkpoints)

    @property
    def used(self) -> int:
        """Slots holding a state someone may read (the zero slot not counted)."""
        return len(self._refs)

    def check_invariants(self) -> None:
        """Every slot is free or referenced, never both; references add up."""
        held = list(self._checkpoints.values())
        for state in self._states.values():
            held += [state.latest, *state.undo.values()]
            held += [] if state.own is None else [state.own]
        counted: dict[int, int] = {}
        for slot in held:
            if slot != ZERO:
                counted[slot] = counted.get(slot, 0) + 1
        if counted != self._refs:
            raise AssertionError(f"state slot references {self._refs}, counted {counted}")
        if set(self._free) & set(self._refs) or ZERO in self._free:
            raise AssertionError("a state slot is both free and held")
        if len(self._free) + len(self._refs) != self.slots - 1:
            raise AssertionError("state slots lost")


def _key(tokens: Sequence[int], end: int) -> bytes:
    """The exact identity of a prefix (the bytes, not a hash: no collision can alias one)."""
    return np.asarray(tokens[:end], np.int64).tobytes()
