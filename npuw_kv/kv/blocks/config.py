"""Configuration: layers grouped by attention window, memory shares, pool sizing.

Everything derived from the model layout and the budget is computed and validated once here.

Choices where issue 4 is silent (a user of a real inference engine would expect these):

- ``tokens_per_block`` defaults to 32 (TensorRT-LLM's default; vLLM uses 16).
- A layer window of ``None`` or ``max_seq_len`` is full attention; a window above
  ``max_seq_len`` is an error (it would silently be full attention, almost always a typo).
- Bytes per token of a group = sum over its layers of ``2 * num_kv_heads * head_dim *
  itemsize`` (K and V); layers may differ in heads/head_dim.
- Shares: an explicit ``window_size_shares`` setting wins over ``NPUW_KV_WINDOW_SIZE_SHARES``
  (code is more specific than the environment); a warning says the env var was ignored. With
  neither, the budget is split equally. The host budget uses the same shares.
- Pool size = ``floor(budget * share / (bytes_per_token * tokens_per_block))`` blocks, per part.
- ``max_tokens`` caps a single-window pool at ``ceil(max_tokens / tpb)`` blocks; with several
  windows it is ignored with a warning (shares and budget decide, as in TensorRT-LLM).
- ``max_tokens_per_call`` (default 512, vLLM's classic chunked-prefill size) bounds the tokens
  one call may add (``add_sequence`` counts the tokens after the prefix hit). A call holds all
  the blocks its tokens need until the next call (see ``sequence.py``), so the budget check
  must know the largest call: with it, the check can promise that one sequence of
  ``max_seq_len`` tokens, added in calls of at most that many tokens, fits an empty manager.
  An SWA window then needs about ``(window + max_tokens_per_call) / tpb + 1`` blocks; lower the
  setting for a smaller budget, raise it (up to ``max_seq_len``) to add whole prompts at once.
- A window whose pool cannot hold one such sequence is rejected at construction with the bytes
  needed.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from .block import DEFAULT_PRIORITY
from .errors import BudgetTooSmallError, ConfigError, SharesError, WindowTooLargeError
from .eviction import check_priority
from .sequence import blocks_for, min_live_blocks

SHARES_ENV = "NPUW_KV_WINDOW_SIZE_SHARES"


@dataclass(frozen=True)
class LayerSpec:
    """KV shape of one attention layer; ``window=None`` means full attention."""

    window: int | None
    num_kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class BlockManagerConfig:
    """User-facing settings of the block manager."""

    layers: Sequence[LayerSpec]
    max_seq_len: int
    kv_budget_bytes: int
    host_budget_bytes: int = 0
    tokens_per_block: int = 32
    dtype: str = "float16"
    window_size_shares: Sequence[float] | None = None
    max_tokens: int | None = None
    enable_reuse: bool = True
    default_priority: int = DEFAULT_PRIORITY
    #: victims with priority >= this are offloaded to the host pool when it has room
    offload_min_priority: int = DEFAULT_PRIORITY
    #: most tokens one call may add (the prefill chunk); the budget check is sized for it
    max_tokens_per_call: int = 512


def uniform_layers(
    windows: Sequence[int | None], num_kv_heads: int, head_dim: int
) -> tuple[LayerSpec, ...]:
    """Layer specs with the same KV shape and the given windows, in layer order."""
    return tuple(LayerSpec(w, num_kv_heads, head_dim) for w in windows)


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
    share: float
    primary_blocks: int
    host_blocks: int

    @property
    def itemsize(self) -> int:
        return int(self.dtype.itemsize)

    @property
    def block_bytes(self) -> int:
        return self.bytes_per_token * self.tokens_per_block


def parse_shares(text: str, source: str = SHARES_ENV) -> list[float]:
    """Parse ``"0.4,0.6"`` into floats, naming ``source`` in errors."""
    parts = [p.strip() for p in text.split(",")]
    try:
        return [float(p) for p in parts]
    except ValueError:
        raise SharesError(
            f"{source}={text!r} is not a comma-separated list of numbers; "
            "write one share per window size in ascending window order, e.g. '0.4,0.6'"
        ) from None


def resolve_shares(
    windows: Sequence[int],
    setting: Sequence[float] | None,
    env: Mapping[str, str] | None = None,
) -> list[float]:
    """Normalised share per window (ascending window order)."""
    env = os.environ if env is None else env
    env_text = env.get(SHARES_ENV, "").strip()
    if setting is not None:
        values, source = [float(v) for v in setting], "window_size_shares"
        if env_text:
            warnings.warn(
                f"{SHARES_ENV}={env_text!r} ignored: window_size_shares={list(values)} is set",
                stacklevel=3,
            )
    elif env_text:
        values, source = parse_shares(env_text), SHARES_ENV
    else:
        return [1.0 / len(windows)] * len(windows)
    if len(values) != len(windows):
        raise SharesError(
            f"{source} has {len(values)} values but the model has {len(windows)} window sizes "
            f"{list(windows)}; give one share per window size, in that order"
        )
    for w, v in zip(windows, values, strict=True):
        if not (0.0 <= v <= 1.0) or math.isnan(v):
            raise SharesError(f"{source}: share {v} for window {w} is outside [0, 1]")
    total = sum(values)
    if total <= 0.0:
        raise SharesError(f"{source}: shares {values} sum to 0; give at least one positive share")
    return [v / total for v in values]


def _validate(cfg: BlockManagerConfig) -> np.dtype:
    if not cfg.layers:
        raise ConfigError("layers is empty; give one LayerSpec per attention layer")
    if cfg.max_seq_len < 1:
        raise ConfigError(f"max_seq_len={cfg.max_seq_len} must be >= 1")
    if cfg.tokens_per_block < 1:
        raise ConfigError(f"tokens_per_block={cfg.tokens_per_block} must be >= 1")
    if cfg.kv_budget_bytes < 0 or cfg.host_budget_bytes < 0:
        raise ConfigError("kv_budget_bytes and host_budget_bytes must be >= 0")
    mtpc = cfg.max_tokens_per_call
    if isinstance(mtpc, bool) or not isinstance(mtpc, int | np.integer) or mtpc < 1:
        raise ConfigError(
            f"max_tokens_per_call={mtpc!r} must be an integer >= 1 (the most tokens one "
            "add_sequence/add_tokens call adds; e.g. your prefill chunk size)"
        )
    if cfg.max_tokens is not None and cfg.max_tokens < 1:
        raise ConfigError(f"max_tokens={cfg.max_tokens} must be >= 1 (or None)")
    check_priority(cfg.default_priority, "default_priority")
    check_priority(cfg.offload_min_priority, "offload_min_priority")
    for i, layer in enumerate(cfg.layers):
        if layer.num_kv_heads < 1 or layer.head_dim < 1:
            raise ConfigError(f"layer {i}: num_kv_heads and head_dim must be >= 1, got {layer}")
        if layer.window is not None:
            if layer.window < 1:
                raise ConfigError(f"layer {i}: window={layer.window} must be >= 1 (None = full)")
            if layer.window > cfg.max_seq_len:
                raise WindowTooLargeError(
                    f"layer {i} has window {layer.window} > max_seq_len {cfg.max_seq_len}; "
                    "lower the window (a window equal to max_seq_len, or None, is full "
                    "attention) or raise max_seq_len"
                )
    try:
        return np.dtype(cfg.dtype)
    except TypeError:
        raise ConfigError(f"dtype={cfg.dtype!r} is not a numpy dtype name") from None


def plan_windows(
    cfg: BlockManagerConfig, env: Mapping[str, str] | None = None
) -> list[WindowGroup]:
    """Group layers by window and size each window's pools; raise on an unusable budget."""
    dtype = _validate(cfg)
    tpb = cfg.tokens_per_block
    chunk = min(int(cfg.max_tokens_per_call), cfg.max_seq_len)
    by_window: dict[int, list[int]] = {}
    for i, layer in enumerate(cfg.layers):
        w = cfg.max_seq_len if layer.window is None else layer.window
        by_window.setdefault(w, []).append(i)
    windows = sorted(by_window)
    shares = resolve_shares(windows, cfg.window_size_shares, env)
    cap = None
    if cfg.max_tokens is not None:
        if len(windows) > 1:
            warnings.warn(
                f"max_tokens={cfg.max_tokens} ignored: with {len(windows)} attention windows "
                "(VSWA) pool sizes follow window_size_shares and kv_budget_bytes",
                stacklevel=3,
            )
        else:
            cap = blocks_for(cfg.max_tokens, tpb)
    groups = []
    for w, share in zip(windows, shares, strict=True):
        layers = tuple(by_window[w])
        shapes = tuple((cfg.layers[i].num_kv_heads, cfg.layers[i].head_dim) for i in layers)
        offsets, bpt = [], 0
        for heads, dim in shapes:
            offsets.append(bpt)
            bpt += 2 * heads * dim * dtype.itemsize
        block_bytes = bpt * tpb
        primary = int(cfg.kv_budget_bytes * share) // block_bytes
        if cap is not None:
            primary = min(primary, cap)
        host = int(cfg.host_budget_bytes * share) // block_bytes
        is_swa = w < cfg.max_seq_len
        needed = min_live_blocks(cfg.max_seq_len, w, tpb, chunk)
        if primary < needed:
            total = math.ceil(needed * block_bytes / share) if share > 0 else None
            need_txt = f"{total} bytes of kv_budget_bytes" if total else "a share above 0"
            raise BudgetTooSmallError(
                f"budget of {cfg.kv_budget_bytes} bytes (share {share:.3f}) holds {primary} "
                f"blocks for window {w} but one sequence of max_seq_len {cfg.max_seq_len}, added "
                f"{chunk} tokens a call at most (max_tokens_per_call), needs {needed} blocks of "
                f"{block_bytes} bytes (needs {need_txt}); raise kv_budget_bytes, give this "
                "window a larger share, lower max_tokens_per_call, or lower max_seq_len"
            )
        groups.append(
            WindowGroup(
                window=w,
                layers=layers,
                layer_shapes=shapes,
                layer_offsets=tuple(offsets),
                bytes_per_token=bpt,
                dtype=dtype,
                tokens_per_block=tpb,
                is_swa=is_swa,
                max_blocks_per_seq=blocks_for(cfg.max_seq_len, tpb) + (1 if is_swa else 0),
                min_blocks_per_seq=needed,
                max_tokens_per_call=chunk,
                share=share,
                primary_blocks=primary,
                host_blocks=host,
            )
        )
    return groups
