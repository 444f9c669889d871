"""The public block manager: one ``WindowManager`` per attention window behind one API.

A sequence lives in every window group at once. ``add_sequence`` looks the prompt up in every
group's reuse tree, takes the longest hit every group can serve, checks that every group has
the blocks it needs, and only then changes state; so an error leaves the manager untouched.

Its choices (the hit every window can serve, ``max_hit_tokens``, sequence serials, how the
runtime writes rows, what ``OutOfBlocksError`` says) are in docs/design.md, "Choices across
window groups".
"""

from __future__ import annotations

import functools
import operator
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import SupportsIndex

import numpy as np

from .block import EMPTY_LEVEL, PoolKind
from .capacity import check_capacity
from .config import BlockManagerConfig
from .errors import (
    ChunkTooLargeError,
    ConfigError,
    InvalidTokensError,
    SequenceExistsError,
    SequenceTooLongError,
    UnknownSequenceError,
)
from .eviction import PriorityRange, PrioritySpec, held_above
from .invariants import check_manager
from .planning import WindowGroup, plan_windows
from .stats import KVCacheEvent, ManagerStats, WindowCounters, WindowStats
from .window_manager import WindowManager, WindowMatch

_REMEMBER_REMOVED = 4096


@dataclass(frozen=True)
class PrefixHit:
    """Result of a prefix lookup, in tokens."""

    hit_tokens: int
    per_window: dict[int, int]


@dataclass
class _Sequence:
    seq_id: Hashable
    serial: int
    tokens: list[int]
    priorities: PrioritySpec


class KVBlockManager:
    """KV cache block manager for variable sliding-window attention (VSWA)."""

    def __init__(
        self,
        config: BlockManagerConfig,
        *,
        max_events: int = 10_000,
        copy_slots: Callable[[int, PoolKind, int, PoolKind, int], None] | None = None,
    ) -> None:
        """``copy_slots(window, src_pool, src_slot, dst_pool, dst_slot)``: for a runtime that
        keeps the blocks' bytes itself (e.g. a PagedAttention cache the device writes).  The
        pools then allocate no numpy store, and the manager calls it wherever bytes move (an
        SWA prefix hit copied into fresh blocks, offload, onboard)."""
        self.config = config
        self.groups: dict[int, WindowGroup] = {g.window: g for g in plan_windows(config)}
        self._events: deque[KVCacheEvent] = deque(maxlen=max_events)
        self._events_dropped = 0
        self.windows: dict[int, WindowManager] = {
            w: WindowManager(
                g,
                enable_reuse=config.enable_reuse,
                default_priority=config.default_priority,
                offload_min_priority=config.offload_min_priority,
                sink=self._on_event,
                copier=None if copy_slots is None else functools.partial(copy_slots, w),
            )
            for w, g in self.groups.items()
        }
        self.tpb = config.tokens_per_block
        self.max_call = min(int(config.max_tokens_per_call), config.max_seq_len)
        self._seqs: dict[Hashable, _Sequence] = {}
        self._removed: OrderedDict[Hashable, None] = OrderedDict()
        self._next_serial = 0
        self.sequences_added = 0
        self.sequences_removed = 0
        self.prompt_tokens = 0
        self.hit_tokens = 0
        self.lookups = 0

    # ---- lookups -------------------------------------------------------------------------
    def lookup(self, tokens: Iterable[int], *, max_hit_tokens: int | None = None) -> PrefixHit:
        """How much of ``tokens`` ``add_sequence`` would take from the cache (no state change).

        ``max_hit_tokens``: the longest hit wanted (default ``len(tokens) - 1``: one token left
        to compute), at most ``len(tokens)``.
        """
        ids = _as_tokens(tokens)
        limit = _hit_limit(ids, max_hit_tokens)
        self.lookups += 1
        k, matches = self._match(ids, limit)
        per_window = {w: m.best() * self.tpb for w, m in matches.items()}
        return PrefixHit(k * self.tpb, per_window)

    def _match(self, tokens: Sequence[int], limit: int) -> tuple[int, dict[int, WindowMatch]]:
        """Longest hit of at most ``limit`` tokens every window serves, in blocks."""
        max_blocks = limit // self.tpb
        matches = {w: wm.match(tokens, max_blocks) for w, wm in self.windows.items()}
        depth = min(len(m.valid) - 1 for m in matches.values())
        k = max(i for i in range(depth + 1) if all(m.valid[i] for m in matches.values()))
        return k, matches

    # ---- sequence lifecycle --------------------------------------------------------------
    def add_sequence(
        self,
        seq_id: Hashable,
        tokens: Iterable[int],
        priority: SupportsIndex | Sequence[PriorityRange] | None = None,
        *,
        reuse: bool = True,
        max_hit_tokens: int | None = None,
    ) -> int:
        """Start a sequence with its prompt; return the number of prompt tokens reused.

        ``reuse=False`` computes the whole prompt (e.g. a timed cold run) even where the cache
        holds a prefix; its full blocks are still stored for later sequences.
        ``max_hit_tokens`` as in ``lookup``.
        """
        if seq_id in self._seqs:
            raise SequenceExistsError(
                f"sequence {seq_id!r} is already live; remove it first or use another id"
            )
        ids = _as_tokens(tokens)
        self._check_length(seq_id, 0, len(ids))
        prio = PrioritySpec(priority, self.config.default_priority, self.tpb)
        limit = _hit_limit(ids, max_hit_tokens) if reuse else 0
        k, matches = self._match(ids, limit)
        hit = k * self.tpb
        if len(ids) - hit > self.max_call:
            raise ChunkTooLargeError(
                f"add_sequence({seq_id!r}) would add {len(ids) - hit} tokens after a {hit}-token "
                f"prefix hit but max_tokens_per_call is {self.max_call}; add "
                f"prompt[:{hit + self.max_call}] first and the rest with add_tokens in chunks of "
                "at most max_tokens_per_call, or raise max_tokens_per_call (pools must then be "
                "larger)"
            )
        self._check_capacity(
            seq_id,
            lambda c: {w: wm.cost_of_add(matches[w], k, hit + c) for w, wm in self.windows.items()},
            len(ids) - hit,
        )
        serial = self._next_serial
        self._next_serial += 1
        for w, wm in self.windows.items():
            wm.add(serial, ids, matches[w], k, prio)
        self._seqs[seq_id] = _Sequence(seq_id, serial, ids, prio)
        self._removed.pop(seq_id, None)
        self.sequences_added += 1
        self.prompt_tokens += len(ids)
        self.hit_tokens += k * self.tpb
        return k * self.tpb

    def add_tokens(self, seq_id: Hashable, tokens: Iterable[int], *, store: bool = True) -> None:
        """Append generated (or further prompt) tokens to a live sequence.

        ``store=False``: these tokens' blocks, and every later one of the sequence, stay out of
        the reuse tree (the blocks complete before the call are still stored, by SWA groups
        when the sequence ends); for a runtime whose blocks would differ from a fresh
        prefill's (u8 KV blocks written one token at a time get other quantisation scales).
        """
        seq = self._get(seq_id)
        new = _as_tokens(tokens)
        n_old = len(seq.tokens)
        self._check_length(seq_id, n_old, n_old + len(new))
        if len(new) > self.max_call:
            raise ChunkTooLargeError(
                f"add_tokens({seq_id!r}) adds {len(new)} tokens but max_tokens_per_call is "
                f"{self.max_call}; split the call into chunks of at most that many tokens, or "
                "raise max_tokens_per_call (pools must then be larger)"
            )
        self._check_capacity(
            seq_id,
            lambda c: {
                w: wm.cost_of_extend(seq.serial, n_old, n_old + c) for w, wm in self.windows.items()
            },
            len(new),
        )
        seq.tokens.extend(new)
        for wm in self.windows.values():
            wm.extend(seq.serial, seq.tokens, n_old, store)

    def detach_unseen(self, seq_id: Hashable) -> None:
        """Detach now, in every sliding-window group, the blocks the sequence's next token
        cannot see.  Its next call would; a batch that leaves a sequence waiting between calls
        (its prompt half read) calls this so that it does not hold its last call's blocks
        meanwhile.  A later ``truncate`` cannot go back before them."""
        seq = self._get(seq_id)
        for wm in self.windows.values():
            wm.detach_unseen(seq.serial, len(seq.tokens))

    def add_token(self, seq_id: Hashable, token: int, *, store: bool = True) -> None:
        self.add_tokens(seq_id, (token,), store=store)

    def truncate(self, seq_id: Hashable, n_tokens: int) -> None:
        """Keep only the first ``n_tokens`` tokens of a live sequence (rejected speculative
        tokens).  The blocks past the new end are released and no longer-full block stays in
        the reuse tree, so none is reused with rows that are overwritten next.  Only the
        sequence's own live blocks can be cut (``ValueError`` otherwise, state untouched)."""
        seq = self._get(seq_id)
        if not 0 < n_tokens <= len(seq.tokens):
            raise ValueError(f"cannot truncate {len(seq.tokens)} tokens to {n_tokens}")
        for wm in self.windows.values():
            why = wm.truncate_error(seq.serial, n_tokens)
            if why is not None:
                raise ValueError(f"cannot truncate sequence {seq_id!r} to {n_tokens}: {why}")
        for wm in self.windows.values():
            wm.truncate(seq.serial, n_tokens)
        del seq.tokens[n_tokens:]

    def fork(self, seq_id: Hashable, child_id: Hashable) -> None:
        """Start ``child_id`` as a copy of live ``seq_id`` (a beam that parts from another):
        full blocks shared where the window shares blocks (full attention, by reference
        count), every other live block copied into a block of its own, so each writes its
        next tokens into its own last block.  Nothing changes if a window lacks the blocks."""
        if child_id in self._seqs:
            raise SequenceExistsError(f"sequence {child_id!r} is already live")
        seq = self._get(seq_id)
        n = len(seq.tokens)
        self._check_capacity(
            child_id,
            lambda _: {w: wm.cost_of_fork(seq.serial, n) for w, wm in self.windows.items()},
            n,
        )
        serial = self._next_serial
        self._next_serial += 1
        for wm in self.windows.values():
            wm.fork(seq.serial, serial, n)
        self._seqs[child_id] = _Sequence(child_id, serial, list(seq.tokens), seq.priorities)
        self._removed.pop(child_id, None)
        self.sequences_added += 1

    def grow_primary(self, window: int, blocks: int) -> None:
        """Window ``window``'s primary pool grows to ``blocks`` slots (the runtime grew its
        tensors keeping their bytes): new empty blocks; live sequences and the cache stay."""
        wm = self._window(window)
        wm.grow_primary(blocks)
        self.groups[wm.group.window] = wm.group

    def remove_sequence(self, seq_id: Hashable) -> None:
        """End a sequence: SWA groups store its blocks for reuse, all blocks are released."""
        seq = self._get(seq_id)
        for wm in self.windows.values():
            wm.remove(seq.serial, seq.tokens)
        del self._seqs[seq_id]
        self._removed[seq_id] = None
        if len(self._removed) > _REMEMBER_REMOVED:
            self._removed.popitem(last=False)
        self.sequences_removed += 1

    # ---- data access ---------------------------------------------------------------------
    def block_table(self, seq_id: Hashable, window: int) -> list[int]:
        """Primary slots of the sequence's blocks in ``window``; -1 marks detached slots."""
        return self._window(window).block_table(self._get(seq_id).serial)

    def storage(self, window: int, pool: str = "primary") -> np.ndarray:
        """The numpy store ``[slots, tokens_per_block, bytes_per_token]`` of one pool part."""
        return self._window(window).pools[PoolKind(pool)].store

    def layer_view(self, window: int, slot: int, layer: int) -> np.ndarray:
        """Typed K/V view ``[tpb, 2, kv_heads, head_dim]`` of ``layer`` in a primary slot."""
        return self._window(window).primary.layer_view(slot, layer)

    def num_tokens(self, seq_id: Hashable) -> int:
        return len(self._get(seq_id).tokens)

    @property
    def sequence_ids(self) -> list[Hashable]:
        return list(self._seqs)

    # ---- stats, events, invariants -------------------------------------------------------
    def stats(self) -> ManagerStats:
        windows = {}
        for w, wm in self.windows.items():
            g = wm.group
            windows[w] = WindowStats(
                window_size=w,
                is_swa=g.is_swa,
                num_layers=len(g.layers),
                bytes_per_token=g.bytes_per_token,
                tokens_per_block=g.tokens_per_block,
                primary_total=wm.primary.num_slots,
                primary_free=wm.primary.free_count(),
                host_total=wm.host.num_slots,
                host_free=wm.host.free_count(),
                cached_blocks=wm.tree.cached_blocks if wm.tree is not None else 0,
                primary_bytes=wm.primary.nbytes,
                host_bytes=wm.host.nbytes,
                counters=_copy_counters(wm),
                host_held=wm.host.num_slots - wm.host.queue.count_at(EMPTY_LEVEL),
                priority_blocks=held_above(wm.blocks, self.config.default_priority),
            )
        return ManagerStats(
            windows=windows,
            live_sequences=len(self._seqs),
            sequences_added=self.sequences_added,
            sequences_removed=self.sequences_removed,
            prompt_tokens=self.prompt_tokens,
            hit_tokens=self.hit_tokens,
            miss_tokens=self.prompt_tokens - self.hit_tokens,
            lookups=self.lookups,
            events_dropped=self._events_dropped,
        )

    def drain_events(self) -> list[KVCacheEvent]:
        """Return and forget the buffered stored/removed events (oldest first)."""
        out = list(self._events)
        self._events.clear()
        return out

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` naming the first broken invariant."""
        check_manager(self.windows, self.live_serials(), len(self._seqs), self.stats())

    def live_serials(self) -> dict[int, int]:
        """serial -> token count of every live sequence (for invariant checks)."""
        return {s.serial: len(s.tokens) for s in self._seqs.values()}

    # ---- helpers -------------------------------------------------------------------------
    def _on_event(self, event: KVCacheEvent) -> None:
        if len(self._events) == self._events.maxlen:
            self._events_dropped += 1
        self._events.append(event)

    def _get(self, seq_id: Hashable) -> _Sequence:
        seq = self._seqs.get(seq_id)
        if seq is None:
            if seq_id in self._removed:
                raise UnknownSequenceError(
                    f"sequence {seq_id!r} was removed; add it again with add_sequence"
                )
            raise UnknownSequenceError(f"unknown sequence {seq_id!r}; call add_sequence first")
        return seq

    def _window(self, window: int) -> WindowManager:
        wm = self.windows.get(window)
        if wm is None:
            raise KeyError(f"no window group {window}; window sizes are {sorted(self.windows)}")
        return wm

    def _check_length(self, seq_id: Hashable, n_old: int, n_new: int) -> None:
        limit = self.config.max_seq_len
        if n_new > limit:
            raise SequenceTooLongError(
                f"sequence {seq_id!r} would hold {n_new} tokens (has {n_old}) but max_seq_len "
                f"is {limit}; shorten the input or raise max_seq_len"
            )

    def _check_capacity(
        self, seq_id: Hashable, costs_for: Callable[[int], dict[int, int]], n_tokens: int
    ) -> None:
        check_capacity(
            self.windows, seq_id, costs_for, n_tokens, len(self._seqs), self.config.pool_setting
        )


def _copy_counters(wm: WindowManager) -> WindowCounters:
    return replace(wm.counters)


def _as_tokens(tokens: Iterable[int]) -> list[int]:
    try:
        return [operator.index(t) for t in tokens]
    except TypeError:
        raise InvalidTokensError("token ids must be integers (int or numpy integer)") from None


def _hit_limit(tokens: Sequence[int], max_hit_tokens: int | None) -> int:
    """The most tokens a hit on ``tokens`` may cover."""
    if max_hit_tokens is None:
        return max(0, len(tokens) - 1)
    m = max_hit_tokens
    if isinstance(m, bool) or not isinstance(m, int | np.integer) or m < 0:
        raise ConfigError(
            f"max_hit_tokens={m!r} must be an integer >= 0 (or None: all but the last token)"
        )
    return min(int(m), len(tokens))
