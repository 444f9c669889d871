"""Memory shares between window pools, as a pipeline setting or ``NPUW_KV_WINDOW_SIZE_SHARES``.

Two spellings: positional, one share per window size in ascending order with full attention
last (``"0.25,0.75"``, the manager's ``parse_shares`` form), or keyed by window
(``"8:0.25,full:0.75"``; a window left out gets 0).  Shares must sum to 1 (within 1e-3): a
typo should not silently rescale the others.  The syntax and the sum are checked when the
setting is read (:func:`parse_window_shares`); the windows once the model is known
(:func:`assign_shares`).  Every error is a :class:`SharesError` (a ``ValueError``) naming the
setting.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from .config import SHARES_ENV
from .errors import SharesError

FULL = "full"
SUM_TOLERANCE = 1e-3

#: parsed shares: (window key or None when positional, share); a key is a window size or FULL
Shares = tuple[tuple[int | str | None, float], ...]


def _key(text: str, source: str) -> int | str:
    word = text.strip().lower()
    if word in (FULL, "none"):
        return FULL
    try:
        window = int(word)
    except ValueError:
        raise SharesError(
            f"{source}: window {text.strip()!r} is neither a window size nor 'full'"
        ) from None
    if window < 1:
        raise SharesError(f"{source}: window {window} must be >= 1 (or 'full')")
    return window


def _share(value: Any, source: str) -> float:
    try:
        share = float(value)
    except (TypeError, ValueError):
        raise SharesError(
            f"{source}={value!r} is not a number; write shares as '0.25,0.75' (ascending "
            "window order, full attention last) or '8:0.25,full:0.75'"
        ) from None
    if math.isnan(share) or not 0.0 <= share <= 1.0:
        raise SharesError(f"{source}: share {value!r} is outside [0, 1]")
    return share


def parse_window_shares(value: Any, source: str) -> Shares:
    """``value`` (text, a sequence of numbers, or a mapping window -> share) as parsed shares;
    raises unless every share is in [0, 1] and they sum to 1."""
    pairs: list[tuple[int | str | None, float]] = []
    if isinstance(value, Mapping):
        for k, v in value.items():
            pairs.append((FULL if k is None else _key(str(k), source), _share(v, source)))
    elif isinstance(value, str):
        parts = [p for p in value.split(",") if p.strip()]
        if not parts:
            raise SharesError(f"{source}={value!r} is empty; give one share per window size")
        for part in parts:
            if ":" in part:
                k, v = part.split(":", 1)
                pairs.append((_key(k, source), _share(v.strip(), source)))
            else:
                pairs.append((None, _share(part.strip(), source)))
    elif isinstance(value, Sequence):
        pairs = [(None, _share(v, source)) for v in value]
    else:
        raise SharesError(f"{source}={value!r}: expected text such as '0.25,0.75' or a mapping")
    keyed = {k is not None for k, _ in pairs}
    if len(keyed) != 1:
        raise SharesError(f"{source}={value!r} mixes keyed and positional shares; use one form")
    keys = [k for k, _ in pairs if k is not None]
    if len(set(keys)) != len(keys):
        raise SharesError(f"{source}={value!r} names a window twice")
    total = sum(s for _, s in pairs)
    if abs(total - 1.0) > SUM_TOLERANCE:
        raise SharesError(f"{source}={value!r}: shares sum to {total:g}, not 1")
    return tuple(pairs)


def format_shares(shares: Shares) -> str:
    """The canonical text of parsed shares (what the pipeline's config keeps)."""
    return ",".join(f"{s:g}" if k is None else f"{k}:{s:g}" for k, s in shares)


def window_label(window: int, full_key: int) -> str:
    """How messages and ``kv_stats()`` name a window: its size, or 'full'."""
    return FULL if window == full_key else str(window)


def assign_shares(
    shares: Shares, windows: Sequence[int], full_key: int, source: str
) -> dict[int, float]:
    """Share per window key (ascending ``windows``; full attention keyed by ``full_key``)."""
    labels = [window_label(w, full_key) for w in windows]
    if shares and shares[0][0] is None:
        if len(shares) != len(windows):
            raise SharesError(
                f"{source} has {len(shares)} shares but the model has {len(windows)} window "
                f"sizes ({', '.join(labels)}); give one share per window size, in that order"
            )
        return {w: s for w, (_, s) in zip(windows, shares, strict=True)}
    by_label = {window_label(w, full_key): w for w in windows}
    unknown = [str(k) for k, _ in shares if str(k) not in by_label]
    if unknown:
        raise SharesError(
            f"{source} names window {', '.join(unknown)} but the model's windows are "
            f"{', '.join(labels)}"
        )
    given = {by_label[str(k)]: s for k, s in shares}
    return {w: given.get(w, 0.0) for w in windows}


def shares_setting(
    setting: str | None, env: Mapping[str, str], name: str
) -> tuple[Shares | None, str]:
    """The shares to apply and the name errors give them: the setting ``name``, else
    ``NPUW_KV_WINDOW_SIZE_SHARES`` from ``env`` (a setting in code wins, with a warning)."""
    text = env.get(SHARES_ENV, "").strip()
    if setting is not None:
        if text and text != setting:
            warnings.warn(f"{SHARES_ENV}={text!r} ignored: {name} is set", stacklevel=3)
        return parse_window_shares(setting, name), name
    if text:
        return parse_window_shares(text, SHARES_ENV), SHARES_ENV
    return None, name
