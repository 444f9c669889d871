"""Where KV slots live: one owner for cutting a token-slot range ``[start, stop)`` into the
pieces of buffer that hold it.

A layer's buffer is either whole (one row per token slot, possibly laid out as blocks one after
another, cut where the static models' pasts end) or a sliding-window *ring* of ``R`` slots,
where token slot ``s`` lives in ring slot ``s mod R``.  Every binding and copy asks
:func:`pieces` (through :meth:`npuw_kv.kv.cache.SharedKVCache.pieces`) instead of handling
block edges and ring wrap-around itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple


class Piece(NamedTuple):
    """Buffer slots ``[first, stop)`` hold the range's rows from ``offset`` on."""

    first: int
    stop: int
    offset: int


def pieces(start: int, stop: int, ring: int = 0, edges: Sequence[int] = ()) -> list[Piece]:
    """Token slots ``[start, stop)`` as the pieces of buffer holding them: on a ring of
    ``ring`` slots, cut where it wraps (at most ``ring`` slots); else cut at the block
    ``edges``, each piece in a block of its own."""
    if ring:
        return [Piece(*p) for p in ring_segments(start, stop, ring)]
    bounds = [start, *(e for e in edges if start < e < stop), stop]
    return [Piece(a, b, a - start) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def ring_slots(window: int, chunk: int) -> int:
    """Slots of a window-``window`` ring: the window before a chunk plus the chunk, in whole
    chunks (a chunk of a fresh prompt then never wraps)."""
    return -(-(window + chunk - 1) // chunk) * chunk


def plan_rings(
    windows: Sequence[int | None], chunk: int, capacity: int
) -> tuple[tuple[int, int], ...]:
    """``(window, slots)`` of each distinct window whose ring is smaller than the whole
    ``capacity`` (a window as long as the cache gains nothing from a ring)."""
    rings = {w: ring_slots(w, chunk) for w in windows if w is not None}
    return tuple(sorted((w, r) for w, r in rings.items() if r < capacity))


def ring_segments(start: int, stop: int, ring: int) -> list[tuple[int, int, int]]:
    """Token slots ``[start, stop)`` (at most ``ring`` of them) as ``(ring_start, ring_stop,
    offset)`` pieces: ring slots ``[ring_start, ring_stop)`` hold the rows from ``offset`` on."""
    if stop - start > ring:
        raise ValueError(f"{stop - start} slots do not fit a ring of {ring}")
    out, offset = [], 0
    while start < stop:
        first = start % ring
        n = min(stop - start, ring - first)
        out.append((first, first + n, offset))
        start, offset = start + n, offset + n
    return out
