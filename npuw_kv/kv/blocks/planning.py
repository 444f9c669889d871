"""Planning the pools: from a validated configuration to one :class:`WindowGroup` per window,
with its block counts, bytes per block and the check that one full sequence fits.

See :mod:`.config` for the sizing rules (bytes and shares, or blocks per window).
"""

from __future__ import annotations

import math
import operator
import warnings
from dataclasses import dataclass, field

import numpy as np

from .config import BlockManagerConfig, _validate, resolve_shares
from .errors import BudgetTooSmallError
from .policy import Policy, policy_for
from .sequence import blocks_for, min_live_blocks


@dataclass(frozen=True)
class WindowGroup:
    """Layers sharing one attention window, and the pool sized for them."""

    window: int
    layers: tuple[int, ...]
    layer_shapes: tuple[tuple[int, int], ...]
    layer_offsets: tuple[int, ...]
    bytes_per_token: int
    dtype: np.dtype = field(repr=False)
    tokens_per_block: int
    is_swa: bool
    max_blocks_per_seq: int
    min_blocks_per_seq: int
    #: ``min(max_tokens_per_call, max_seq_len)``: the chunk ``min_blocks_per_seq`` is sized for
    max_tokens_per_call: int
    #: this window's part of the primary bytes (its budget share, or what its blocks come to)
    share: float
    primary_blocks: int
    host_blocks: int

    @property
    def policy(self) -> Policy:
        """What this group's attention type decides (full or sliding window)."""
        return policy_for(self.is_swa)

    @property
    def itemsize(self) -> int:
        return int(self.dtype.itemsize)

    @property
    def block_bytes(self) -> int:
        return self.bytes_per_token * self.tokens_per_block


def _pool_sizes(
    cfg: BlockManagerConfig, windows: list[int], block_bytes: dict[int, int]
) -> tuple[list[float], dict[int, int], dict[int, int]]:
    """Each window's share of the primary bytes and its primary and host block counts."""
    if cfg.sized_in_blocks:
        assert cfg.primary_blocks is not None
        primary = {w: operator.index(cfg.primary_blocks[w]) for w in windows}
        host = {w: operator.index((cfg.host_blocks or {}).get(w, 0)) for w in windows}
        total = sum(primary[w] * block_bytes[w] for w in windows)
        return (
            [primary[w] * block_bytes[w] / total if total else 0.0 for w in windows],
            primary,
            host,
        )
    assert cfg.kv_budget_bytes is not None
    shares = resolve_shares(windows, cfg.window_size_shares)
    cap = None
    if cfg.max_tokens is not None:
        if len(windows) > 1:
            warnings.warn(
                f"max_tokens={cfg.max_tokens} ignored: with {len(windows)} attention windows "
                "(VSWA) pool sizes follow window_size_shares and kv_budget_bytes",
                stacklevel=4,
            )
        else:
            cap = blocks_for(cfg.max_tokens, cfg.tokens_per_block)
    primary, host = {}, {}
    for w, share in zip(windows, shares, strict=True):
        primary[w] = int(cfg.kv_budget_bytes * share) // block_bytes[w]
        if cap is not None:
            primary[w] = min(primary[w], cap)
        host[w] = int(cfg.host_budget_bytes * share) // block_bytes[w]
    return shares, primary, host


def _too_small(
    cfg: BlockManagerConfig, w: int, have: int, needed: int, share: float, block_bytes: int
) -> BudgetTooSmallError:
    chunk = min(int(cfg.max_tokens_per_call), cfg.max_seq_len)
    one_sequence = (
        f"one sequence of max_seq_len {cfg.max_seq_len}, added {chunk} tokens a call at most "
        f"(max_tokens_per_call), needs {needed} blocks"
    )
    if cfg.sized_in_blocks:
        return BudgetTooSmallError(
            f"primary_blocks[{w}]={have} but {one_sequence}; raise primary_blocks[{w}], lower "
            "max_tokens_per_call, or lower max_seq_len"
        )
    total = math.ceil(needed * block_bytes / share) if share > 0 else None
    need_txt = f"{total} bytes of kv_budget_bytes" if total else "a share above 0"
    return BudgetTooSmallError(
        f"budget of {cfg.kv_budget_bytes} bytes (share {share:.3f}) holds {have} "
        f"blocks for window {w} but {one_sequence} of {block_bytes} bytes (needs {need_txt}); "
        "raise kv_budget_bytes, give this window a larger share, lower max_tokens_per_call, "
        "or lower max_seq_len"
    )


def plan_windows(cfg: BlockManagerConfig) -> list[WindowGroup]:
    """Group layers by window and size each window's pools; raise on pools too small."""
    dtype = _validate(cfg)
    tpb = cfg.tokens_per_block
    chunk = min(int(cfg.max_tokens_per_call), cfg.max_seq_len)
    by_window: dict[int, list[int]] = {}
    for i, layer in enumerate(cfg.layers):
        w = cfg.max_seq_len if layer.window is None else layer.window
        by_window.setdefault(w, []).append(i)
    windows = sorted(by_window)
    shapes, offsets, bytes_per_token = {}, {}, {}
    for w in windows:
        shapes[w] = tuple(
            (cfg.layers[i].num_kv_heads, cfg.layers[i].head_dim) for i in by_window[w]
        )
        offs, bpt = [], 0
        for heads, dim in shapes[w]:
            offs.append(bpt)
            bpt += 2 * heads * dim * dtype.itemsize
        offsets[w], bytes_per_token[w] = tuple(offs), bpt
    block_bytes = {w: bytes_per_token[w] * tpb for w in windows}
    shares, primary, host = _pool_sizes(cfg, windows, block_bytes)
    groups = []
    for w, share in zip(windows, shares, strict=True):
        is_swa = w < cfg.max_seq_len
        needed = min_live_blocks(cfg.max_seq_len, w, tpb, chunk)
        if primary[w] < needed:
            raise _too_small(cfg, w, primary[w], needed, share, block_bytes[w])
        groups.append(
            WindowGroup(
                window=w,
                layers=tuple(by_window[w]),
                layer_shapes=shapes[w],
                layer_offsets=offsets[w],
                bytes_per_token=bytes_per_token[w],
                dtype=dtype,
                tokens_per_block=tpb,
                is_swa=is_swa,
                max_blocks_per_seq=blocks_for(cfg.max_seq_len, tpb)
                + policy_for(is_swa).extra_blocks_per_seq,
                min_blocks_per_seq=needed,
                max_tokens_per_call=chunk,
                share=share,
                primary_blocks=primary[w],
                host_blocks=host[w],
            )
        )
    return groups
