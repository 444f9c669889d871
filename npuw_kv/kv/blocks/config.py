"""Configuration: layers grouped by attention window, pool sizing in bytes or in blocks.

Everything derived from the model layout and the pool sizes is computed and validated once here.

Design choices:

- ``tokens_per_block`` defaults to 32 (TensorRT-LLM's default; vLLM uses 16).
- A layer window of ``None`` or ``max_seq_len`` is full attention; a window above
  ``max_seq_len`` is an error (it would silently be full attention, almost always a typo).
  Windows are keyed by size, full attention by ``max_seq_len`` (``window_sizes``).
- Bytes per token of a group = sum over its layers of ``2 * num_kv_heads * head_dim *
  itemsize`` (K and V); layers may differ in heads/head_dim.
- Pools are sized one of two ways, never both. In bytes: ``kv_budget_bytes`` (and
  ``host_budget_bytes``) split by ``window_size_shares`` (equal when unset), each window's pool
  ``floor(budget * share / (bytes_per_token * tokens_per_block))`` blocks. In blocks:
  ``primary_blocks`` (and ``host_blocks``) per window, for a caller that already knows its
  block counts (a runtime whose cache tensors hold a fixed number of blocks).
- The manager never reads the environment. ``with_env_shares`` is for the settings layer: it
  applies ``NPUW_KV_WINDOW_SIZE_SHARES`` unless ``window_size_shares`` is set (code is more
  specific than the environment; a warning says the variable was ignored).
- ``max_tokens`` caps a single-window pool sized in bytes at ``ceil(max_tokens / tpb)`` blocks;
  with several windows it is ignored with a warning (shares and budget decide, as in
  TensorRT-LLM).
- ``max_tokens_per_call`` (default 512, vLLM's classic chunked-prefill size) bounds the tokens
  one call may add (``add_sequence`` counts the tokens after the prefix hit). A call holds all
  the blocks its tokens need until the next call (see ``sequence.py``), so the size check
  must know the largest call: with it, the check can promise that one sequence of
  ``max_seq_len`` tokens, added in calls of at most that many tokens, fits an empty manager.
  An SWA window then needs about ``(window + max_tokens_per_call) / tpb + 1`` blocks; lower the
  setting for smaller pools, raise it (up to ``max_seq_len``) to add whole prompts at once.
- A window whose pool cannot hold one such sequence is rejected at construction with the bytes
  (or blocks) needed.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from .block import DEFAULT_PRIORITY
from .errors import ConfigError, SharesError, WindowTooLargeError
from .eviction import check_priority

SHARES_ENV = "NPUW_KV_WINDOW_SIZE_SHARES"


@dataclass(frozen=True)
class LayerSpec:
    """KV shape of one attention layer; ``window=None`` means full attention."""

    window: int | None
    num_kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class BlockManagerConfig:
    """User-facing settings of the block manager.

    Size the pools either in bytes (``kv_budget_bytes``, ``host_budget_bytes``,
    ``window_size_shares``, ``max_tokens``) or in blocks per window (``primary_blocks``,
    ``host_blocks``, keyed like ``window_sizes``).
    """

    layers: Sequence[LayerSpec]
    max_seq_len: int
    kv_budget_bytes: int | None = None
    host_budget_bytes: int = 0
    tokens_per_block: int = 32
    dtype: str = "float16"
    window_size_shares: Sequence[float] | None = None
    max_tokens: int | None = None
    enable_reuse: bool = True
    default_priority: int = DEFAULT_PRIORITY
    #: victims with priority >= this are offloaded to the host pool when it has room
    offload_min_priority: int = DEFAULT_PRIORITY
    #: most tokens one call may add (the prefill chunk); the size check is sized for it
    max_tokens_per_call: int = 512
    #: primary blocks per window (instead of ``kv_budget_bytes``)
    primary_blocks: Mapping[int, int] | None = None
    #: host blocks per window (with ``primary_blocks``); a window left out gets none
    host_blocks: Mapping[int, int] | None = None

    @property
    def sized_in_blocks(self) -> bool:
        return self.primary_blocks is not None

    @property
    def pool_setting(self) -> str:
        """The setting that sizes the primary pools (named in errors that ask for more)."""
        return "primary_blocks" if self.sized_in_blocks else "kv_budget_bytes"


def uniform_layers(
    windows: Sequence[int | None], num_kv_heads: int, head_dim: int
) -> tuple[LayerSpec, ...]:
    """Layer specs with the same KV shape and the given windows, in layer order."""
    return tuple(LayerSpec(w, num_kv_heads, head_dim) for w in windows)


def window_sizes(cfg: BlockManagerConfig) -> list[int]:
    """The window groups' keys, ascending: each layer's window, ``max_seq_len`` for full."""
    return sorted(
        {cfg.max_seq_len if layer.window is None else layer.window for layer in cfg.layers}
    )


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
    windows: Sequence[int], setting: Sequence[float] | None, source: str = "window_size_shares"
) -> list[float]:
    """Normalised share per window (ascending window order); equal when ``setting`` is None."""
    if setting is None:
        return [1.0 / len(windows)] * len(windows)
    values = [float(v) for v in setting]
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


def with_env_shares(cfg: BlockManagerConfig, env: Mapping[str, str]) -> BlockManagerConfig:
    """``cfg`` with the shares ``NPUW_KV_WINDOW_SIZE_SHARES`` gives in ``env``, checked against
    the model's windows (errors name the variable).

    For the settings layer: the manager itself never reads the environment. A set
    ``window_size_shares`` wins, and pools sized in blocks take no shares; either way a warning
    says the variable was ignored.
    """
    text = env.get(SHARES_ENV, "").strip()
    if not text:
        return cfg
    if cfg.window_size_shares is not None or cfg.sized_in_blocks:
        why = (
            "pools are sized in blocks (primary_blocks)"
            if cfg.sized_in_blocks
            else f"window_size_shares={list(cfg.window_size_shares or ())} is set"
        )
        warnings.warn(f"{SHARES_ENV}={text!r} ignored: {why}", stacklevel=2)
        return cfg
    values = parse_shares(text, SHARES_ENV)
    resolve_shares(window_sizes(cfg), values, SHARES_ENV)
    return replace(cfg, window_size_shares=values)


def _validate(cfg: BlockManagerConfig) -> np.dtype:
    if not cfg.layers:
        raise ConfigError("layers is empty; give one LayerSpec per attention layer")
    if cfg.max_seq_len < 1:
        raise ConfigError(f"max_seq_len={cfg.max_seq_len} must be >= 1")
    if cfg.tokens_per_block < 1:
        raise ConfigError(f"tokens_per_block={cfg.tokens_per_block} must be >= 1")
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
    _validate_sizing(cfg)
    try:
        return np.dtype(cfg.dtype)
    except TypeError:
        raise ConfigError(f"dtype={cfg.dtype!r} is not a numpy dtype name") from None


def _validate_sizing(cfg: BlockManagerConfig) -> None:
    """Exactly one way of sizing the pools, and block counts for the model's windows."""
    if cfg.sized_in_blocks == (cfg.kv_budget_bytes is not None):
        raise ConfigError(
            "size the pools one way: kv_budget_bytes (bytes, split by window_size_shares) or "
            "primary_blocks (blocks per window size), not "
            + ("both" if cfg.sized_in_blocks else "neither")
        )
    if not cfg.sized_in_blocks:
        assert cfg.kv_budget_bytes is not None
        if cfg.kv_budget_bytes < 0 or cfg.host_budget_bytes < 0:
            raise ConfigError("kv_budget_bytes and host_budget_bytes must be >= 0")
        if cfg.host_blocks is not None:
            raise ConfigError(
                "host_blocks goes with primary_blocks; with kv_budget_bytes give host_budget_bytes"
            )
        return
    byte_settings = {
        "host_budget_bytes": cfg.host_budget_bytes != 0,
        "window_size_shares": cfg.window_size_shares is not None,
        "max_tokens": cfg.max_tokens is not None,
    }
    for name, given in byte_settings.items():
        if given:
            raise ConfigError(
                f"{name} sizes pools in bytes but primary_blocks sizes them in blocks; "
                "give host_blocks for the host pools and no shares or token cap"
            )
    windows = window_sizes(cfg)
    primary, host = dict(cfg.primary_blocks or {}), dict(cfg.host_blocks or {})
    for what, counts, ok in (
        ("primary_blocks", primary, sorted(primary) == windows),
        ("host_blocks", host, set(host) <= set(windows)),
    ):
        if not ok:
            raise ConfigError(
                f"{what} has window sizes {sorted(counts)} but the model's are {windows} (full "
                f"attention is max_seq_len={cfg.max_seq_len}); give one block count per window size"
            )
        for w, n in counts.items():
            if isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 0:
                raise ConfigError(f"{what}[{w}]={n!r} must be an integer >= 0")
