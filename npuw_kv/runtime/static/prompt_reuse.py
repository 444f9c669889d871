"""Which plan a prompt runs with: fresh, after the cached sequence it continues, or after a
prefix brought back from the host store — whichever runs the fewest chunks.

The slot arithmetic of each plan is :class:`~.plan.PromptPlan`'s; this module only compares
the candidates and checks that a continuation still finds its KV (sliding-window rings may have
overwritten it, :func:`~.rings.ring_keeps`).
"""

from __future__ import annotations

import numpy as np

from .plan import PromptPlan, Slots
from .prefix_store import HostPrefixCache
from .rings import ring_keeps


def shared_prefix(cached: list[int], ids: np.ndarray) -> int:
    """How many leading ``ids`` the cached tokens already hold, leaving at least one to run
    (the last prompt token's logits are needed)."""
    n = min(len(cached), ids.size - 1)
    if n <= 0:
        return 0
    differ = np.flatnonzero(np.asarray(cached[:n]) != ids[:n])
    return int(differ[0]) if differ.size else n


def choose_plan(
    ids: np.ndarray,
    chunk: int,
    max_prompt_len: int,
    cached: list[int],
    slots: Slots,
    rings: tuple[tuple[int, int], ...] = (),
    store: HostPrefixCache | None = None,
) -> tuple[PromptPlan, bool]:
    """The plan that runs the fewest chunks, and whether it restores from ``store``.

    ``cached``: the token ids whose KV sits in ``slots`` from ``slots.first`` on.  A
    continuation keeps those slots, so it must end inside the prompt part of the cache
    (``max_prompt_len``); a restore copies the store's longest prefix into slots placed so
    that the rest of the prompt ends on the chunk grid.  Ties go to the plan that copies least.
    """
    n = int(ids.size)
    best, restore = PromptPlan(n, chunk), False
    common = shared_prefix(cached, ids)
    if common:
        try:
            plan = PromptPlan(n, chunk, slots.first, common)
        except ValueError:  # its first chunk would start before slot 0
            plan = best
        if (
            plan.padded_len <= max_prompt_len
            and plan.num_chunks < best.num_chunks
            and _rings_keep(slots, rings, plan.pad, plan.start)
        ):
            best = plan
    hit = store.lookup(ids) if store is not None else 0
    if hit:
        chunks = -(-(n - hit) // chunk)
        plan = PromptPlan(n, chunk, max(0, chunks * chunk - n), hit)
        if plan.num_chunks < best.num_chunks:
            best, restore = plan, True
    return best, restore


def _rings_keep(
    slots: Slots, rings: tuple[tuple[int, int], ...], first_slot: int, resume: int
) -> bool:
    """Whether every ring still holds the window a prompt resuming at slot ``resume`` reads
    (later tokens of the cached sequence may have overwritten it)."""
    written = min(slots.next, slots.capacity)
    return all(ring_keeps(first_slot, resume, written, window, ring) for window, ring in rings)
