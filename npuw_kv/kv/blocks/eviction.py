"""Eviction policy: priority levels, least-recently-released first inside a level.

Every block with refcount 0 sits in exactly one queue (its pool's). The victim is the least
recently released block of the lowest non-empty level. Worthless blocks (never cached, or cut
from the tree) sit at ``EMPTY_LEVEL`` so they go before any cached block.

Priorities come from the request: one integer, or token ranges (``PriorityRange``) so that a
system prompt can outlive the chat turns after it. A block takes the priority of the range that
holds its first token; when several sequences share a block, the last one to release it decides.
A priority may be any integer type (``int`` or a numpy integer, as a scheduler holding priorities
in an array would pass); ``bool``, floats and strings are rejected with a ``ConfigError``.
"""

from __future__ import annotations

import bisect
import operator
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import SupportsIndex

from .block import EMPTY_LEVEL, MAX_PRIORITY, MIN_PRIORITY, KVBlock
from .errors import ConfigError


@dataclass(frozen=True)
class PriorityRange:
    """Priority for the tokens ``[start, end)`` of a sequence (``end=None``: to the end)."""

    start: int
    end: int | None
    priority: int


class PrioritySpec:
    """Maps a block index to its retention priority for one sequence."""

    def __init__(
        self,
        priority: SupportsIndex | Sequence[PriorityRange] | None,
        default: int,
        tokens_per_block: int,
    ) -> None:
        self.default = default
        self.tpb = tokens_per_block
        self.ranges: tuple[PriorityRange, ...] = ()
        if priority is None:
            return
        if not isinstance(priority, Sequence) or isinstance(priority, str | bytes):
            self.default = check_priority(priority, "priority")
            return
        ranges = []
        for r in priority:
            if not isinstance(r, PriorityRange):
                raise ConfigError(
                    f"priority={priority!r}: {r!r} is not a PriorityRange; give an integer "
                    "priority, a sequence of PriorityRange, or None"
                )
            prio = check_priority(r.priority, "PriorityRange.priority")
            if r.start < 0 or (r.end is not None and r.end < r.start):
                raise ConfigError(
                    f"PriorityRange({r.start}, {r.end}) is not a token range; "
                    "use 0 <= start <= end (end=None means to the end)"
                )
            ranges.append(PriorityRange(r.start, r.end, prio))
        self.ranges = tuple(ranges)

    def for_block(self, index: int) -> int:
        """Priority of the block holding tokens ``[index*tpb, (index+1)*tpb)``."""
        first = index * self.tpb
        for r in self.ranges:
            if r.start <= first and (r.end is None or first < r.end):
                return r.priority
        return self.default


def held_above(blocks: Iterable[KVBlock], priority: int) -> int:
    """How many of ``blocks`` are in use or cached at a priority above ``priority``."""
    return sum(1 for b in blocks if b.priority > priority and b.queue_level != EMPTY_LEVEL)


def check_priority(value: SupportsIndex, what: str) -> int:
    """Return ``value`` as a plain ``int``; raise a ConfigError unless it is a valid priority.

    Any integer type is accepted (numpy integers included, via ``__index__``), so a priority
    read from an array works; ``bool`` is refused because ``True`` as "priority 1" is a bug.
    """
    try:
        if isinstance(value, bool):
            raise TypeError
        as_int = operator.index(value)
    except TypeError:
        raise ConfigError(
            f"{what}={value!r} is not an integer; priorities are integers in "
            f"[{MIN_PRIORITY}, {MAX_PRIORITY}]"
        ) from None
    if not MIN_PRIORITY <= as_int <= MAX_PRIORITY:
        raise ConfigError(f"{what}={as_int} is outside [{MIN_PRIORITY}, {MAX_PRIORITY}]")
    return as_int


class EvictionQueue:
    """Reclaimable blocks of one pool, ordered by (level, release time)."""

    def __init__(self) -> None:
        self._levels: dict[int, OrderedDict[int, KVBlock]] = {}
        self._sorted_levels: list[int] = []
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def __contains__(self, block: KVBlock) -> bool:
        level = block.queue_level
        return level is not None and block.block_id in self._levels.get(level, {})

    def push(self, block: KVBlock, level: int) -> None:
        """Make ``block`` reclaimable as the most recently released of ``level``."""
        if block.queue_level is not None or block.ref_count != 0:
            raise RuntimeError(f"cannot queue {block}: already queued or still referenced")
        queue = self._levels.get(level)
        if queue is None:
            queue = self._levels[level] = OrderedDict()
            bisect.insort(self._sorted_levels, level)
        queue[block.block_id] = block
        block.queue_level = level
        self._size += 1

    def remove(self, block: KVBlock) -> None:
        """Take ``block`` out of the queue (it is being claimed or moved)."""
        level = block.queue_level
        if level is None:
            raise RuntimeError(f"{block} is not queued")
        queue = self._levels[level]
        del queue[block.block_id]
        if not queue:
            del self._levels[level]
            self._sorted_levels.remove(level)
        block.queue_level = None
        self._size -= 1

    def requeue(self, block: KVBlock, level: int) -> None:
        """Move a queued block to ``level`` (as most recently released there)."""
        if block.queue_level != level:
            self.remove(block)
            self.push(block, level)

    def pop_victim(self) -> KVBlock:
        """Remove and return the block to reclaim next."""
        if not self._size:
            raise RuntimeError("eviction queue is empty (capacity was not checked)")
        level = self._sorted_levels[0]
        block = next(iter(self._levels[level].values()))
        self.remove(block)
        return block

    def peek_level(self) -> int | None:
        """Level of the next victim (``None`` when empty)."""
        return self._sorted_levels[0] if self._sorted_levels else None

    def blocks(self) -> Iterator[KVBlock]:
        """All queued blocks, victim order."""
        for level in self._sorted_levels:
            yield from self._levels[level].values()

    def count_at(self, level: int) -> int:
        return len(self._levels.get(level, ()))

    def __repr__(self) -> str:
        sizes = {lvl: len(self._levels[lvl]) for lvl in self._sorted_levels}
        return f"EvictionQueue({sizes})"


__all__ = [
    "EMPTY_LEVEL",
    "EvictionQueue",
    "PriorityRange",
    "PrioritySpec",
    "check_priority",
    "held_above",
]
