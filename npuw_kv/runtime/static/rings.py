"""The masks that say what a sliding-window layer's ring holds (which ring slot holds which
token slot: :func:`npuw_kv.kv.slots.pieces`).

The static runner numbers KV slots per token as if every layer held the whole past
(:mod:`.plan`).  A layer kept as a ring of ``R`` slots (:mod:`npuw_kv.model.ring`) stores token
slot ``s`` in ring slot ``s mod R``; what a ring slot holds when a call writes from slot ``a``
is the latest token slot before ``a`` that maps there.  The ring is at least the window plus
the chunk being written, so the slots a call overwrites hold only tokens out of every one of
its queries' windows, and the mask below never lets a query read them.
"""

from __future__ import annotations

import numpy as np


def held_slots(write_start: int, ring: int) -> np.ndarray:
    """The token slot each ring slot holds just before a call writes from ``write_start``
    (negative: never written)."""
    j = np.arange(ring)
    return write_start - 1 - (write_start - 1 - j) % ring


def window_mask(
    write_start: int, tokens: int, first_slot: int, window: int, ring: int
) -> np.ndarray:
    """The additive f16 mask ``[1, 1, tokens, ring + tokens]`` of a windowed attention whose call
    writes token slots ``[write_start, write_start + tokens)``; slots before ``first_slot`` are
    padding.  Keys: the ring's slots, then the call's own tokens (the graph's Concat order).

    A query at slot q reads a key at slot k when ``first_slot <= k <= q`` and ``k > q - window``
    (transformers' sliding window).  A padding query reads itself, so no row is all -inf.
    """
    queries = write_start + np.arange(tokens)[:, None]
    held = held_slots(write_start, ring)[None, :]
    own = write_start + np.arange(tokens)[None, :]
    keys = np.concatenate([np.broadcast_to(held, (tokens, ring)), np.repeat(own, tokens, 0)], 1)
    allowed = (keys >= first_slot) & (keys <= queries) & (keys > queries - window)
    allowed[:, ring:] |= np.eye(tokens, dtype=bool)
    mask = np.where(allowed, np.float16(0), np.float16(-np.inf))  # the input is f16 (ring.py)
    return mask[None, None]


def ring_keeps(first_slot: int, resume: int, written_end: int, window: int, ring: int) -> bool:
    """Whether a ring that holds token slots up to ``written_end`` still has every slot a
    prompt resuming at slot ``resume`` reads: those in the window before it, from
    ``first_slot`` on (a continuation of the cached sequence)."""
    oldest = max(first_slot, resume - window + 1)
    return oldest >= written_end - ring
