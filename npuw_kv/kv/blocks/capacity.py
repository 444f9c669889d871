"""Whether the pools can give what a call needs, and when not, an error that says how much fits.

The manager checks every call before it changes anything: a call that cannot get its blocks is
refused whole, naming the window short of blocks, what its live sequences hold, the largest call
that would fit now, and the setting that makes the pools larger.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping

from .errors import OutOfBlocksError
from .window_manager import WindowManager


def check_capacity(
    windows: Mapping[int, WindowManager],
    seq_id: Hashable,
    costs_for: Callable[[int], dict[int, int]],
    n_tokens: int,
    live: int,
    pool_setting: str,
) -> None:
    """Raise unless every window can give what a call adding ``n_tokens`` tokens needs.

    ``costs_for(c)`` is the per-window block cost of the same call adding ``c`` tokens
    (non-decreasing in ``c``); the error reports the largest ``c`` that fits right now.
    ``live``: the manager's live sequences; ``pool_setting``: what sizes the pools.
    """
    costs = costs_for(n_tokens)
    short = [w for w, cost in costs.items() if cost > windows[w].available()]
    if not short:
        return
    w = short[0]
    cost, avail = costs[w], windows[w].available()
    held = windows[w].primary.num_slots - avail
    lo, hi = 0, n_tokens - 1  # largest c in [0, n_tokens) that fits every window
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if all(c <= windows[v].available() for v, c in costs_for(mid).items()):
            lo = mid
        else:
            hi = mid - 1
    fits = (
        f"a call adding at most {lo} tokens fits now"
        if lo
        else "no call fits now, not even one token"
    )
    raise OutOfBlocksError(
        f"window {w} needs {cost} free primary blocks for {n_tokens} tokens of sequence "
        f"{seq_id!r} but only {avail} are reclaimable ({held} are held by "
        f"{live} live sequences); {fits}. Add fewer tokens per call, remove a "
        f"sequence, or raise {pool_setting}"
    )
