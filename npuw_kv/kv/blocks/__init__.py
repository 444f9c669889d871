"""VSWA block KV cache manager: per-window pools, detach, reuse tree, eviction, offload.

Public API::

    cfg = BlockManagerConfig(layers=uniform_layers([512] * 5 + [None], 4, 256),
                             max_seq_len=32768, kv_budget_bytes=2 << 30,
                             host_budget_bytes=4 << 30,
                             max_tokens_per_call=512)        # largest prefill chunk
    # or in blocks per window (full attention keyed by max_seq_len):
    #   BlockManagerConfig(layers, max_seq_len=32768, primary_blocks={512: 40, 32768: 1024})
    mgr = KVBlockManager(cfg)
    hit = mgr.lookup(prompt_ids).hit_tokens          # then add at most 512 tokens a call:
    reused = mgr.add_sequence("req-1", prompt_ids[: hit + 512])  # == hit
    mgr.add_tokens("req-1", prompt_ids[hit + 512 : hit + 1024])  # ... chunk by chunk
    mgr.add_tokens("req-1", [next_id])
    mgr.block_table("req-1", 512)                    # primary slots, -1 = detached
    mgr.remove_sequence("req-1")
    mgr.stats(); mgr.drain_events(); mgr.check_invariants()

Nothing here imports OpenVINO or reads the environment (``with_env_shares`` applies
``NPUW_KV_WINDOW_SIZE_SHARES`` for a settings layer); storage is numpy.
"""

from .block import DEFAULT_PRIORITY, MAX_PRIORITY, MIN_PRIORITY, KVBlock, PoolKind
from .config import (
    SHARES_ENV,
    BlockManagerConfig,
    LayerSpec,
    parse_shares,
    resolve_shares,
    uniform_layers,
    window_sizes,
    with_env_shares,
)
from .errors import (
    BlockManagerError,
    BudgetTooSmallError,
    ChunkTooLargeError,
    ConfigError,
    InvalidTokensError,
    OutOfBlocksError,
    SequenceExistsError,
    SequenceTooLongError,
    SharesError,
    UnknownSequenceError,
    WindowTooLargeError,
)
from .eviction import PriorityRange
from .hybrid import HybridBlockManager
from .manager import KVBlockManager, PrefixHit
from .planning import WindowGroup, plan_windows
from .shares import Shares, assign_shares, format_shares, parse_window_shares, window_label
from .state_slots import StatePaging, StateSlots
from .stats import KVCacheEvent, ManagerStats, WindowCounters, WindowStats

__all__ = [
    "DEFAULT_PRIORITY",
    "MAX_PRIORITY",
    "MIN_PRIORITY",
    "SHARES_ENV",
    "BlockManagerConfig",
    "BlockManagerError",
    "BudgetTooSmallError",
    "ChunkTooLargeError",
    "ConfigError",
    "HybridBlockManager",
    "InvalidTokensError",
    "KVBlock",
    "KVBlockManager",
    "KVCacheEvent",
    "LayerSpec",
    "ManagerStats",
    "OutOfBlocksError",
    "PoolKind",
    "PrefixHit",
    "PriorityRange",
    "SequenceExistsError",
    "SequenceTooLongError",
    "Shares",
    "StatePaging",
    "StateSlots",
    "SharesError",
    "UnknownSequenceError",
    "WindowCounters",
    "WindowGroup",
    "WindowStats",
    "WindowTooLargeError",
    "assign_shares",
    "format_shares",
    "parse_shares",
    "parse_window_shares",
    "plan_windows",
    "resolve_shares",
    "uniform_layers",
    "window_label",
    "window_sizes",
    "with_env_shares",
]
