"""Per-window grouping, bytes per token, shares (setting and env var), max_tokens, sizing."""

from __future__ import annotations

import warnings
from typing import Any

import pytest

from npuw_kv.kv.blocks import (
    BlockManagerConfig,
    BudgetTooSmallError,
    ConfigError,
    KVBlockManager,
    LayerSpec,
    SharesError,
    WindowTooLargeError,
    plan_windows,
    resolve_shares,
    uniform_layers,
)

MiB = 1 << 20


def test_layers_grouped_by_window_with_bytes_per_token() -> None:
    layers = [
        LayerSpec(512, 4, 64),
        LayerSpec(None, 8, 128),
        LayerSpec(512, 2, 64),
        LayerSpec(4096, 8, 128),  # == max_seq_len: full attention
    ]
    cfg = BlockManagerConfig(layers, max_seq_len=4096, kv_budget_bytes=64 * MiB)
    groups = {g.window: g for g in plan_windows(cfg, env={})}
    assert sorted(groups) == [512, 4096]
    swa, full = groups[512], groups[4096]
    assert swa.layers == (0, 2) and full.layers == (1, 3)
    assert swa.bytes_per_token == 2 * (4 * 64 + 2 * 64) * 2  # K+V, fp16
    assert full.bytes_per_token == 2 * 2 * (8 * 128) * 2
    assert swa.is_swa and not full.is_swa
    assert swa.tokens_per_block == 32  # default
    assert swa.max_blocks_per_seq == 4096 // 32 + 1 and full.max_blocks_per_seq == 4096 // 32
    # equal split by default
    assert swa.share == full.share == 0.5
    assert swa.primary_blocks == (32 * MiB) // swa.block_bytes
    assert full.primary_blocks == (32 * MiB) // full.block_bytes


def test_tokens_per_block_is_configurable() -> None:
    cfg = BlockManagerConfig(
        uniform_layers([None], 1, 8), max_seq_len=64, kv_budget_bytes=1 << 16, tokens_per_block=16
    )
    (g,) = plan_windows(cfg, env={})
    assert g.tokens_per_block == 16 and g.block_bytes == 16 * 2 * 8 * 2


def _shares_config(**kw: object) -> BlockManagerConfig:
    return BlockManagerConfig(
        [LayerSpec(512, 1, 64), LayerSpec(None, 1, 64)],
        max_seq_len=32768,
        kv_budget_bytes=16 * MiB,
        **kw,  # type: ignore[arg-type]
    )


def test_shares_example_from_env_var() -> None:
    groups = plan_windows(_shares_config(), env={"NPUW_KV_WINDOW_SIZE_SHARES": "0.4,0.6"})
    g512, gfull = groups
    assert (g512.window, gfull.window) == (512, 32768)
    assert g512.share == pytest.approx(0.4) and gfull.share == pytest.approx(0.6)
    block = 32 * 2 * 64 * 2  # tpb * K+V * head_dim * fp16
    assert g512.primary_blocks == int(16 * MiB * 0.4) // block == 819
    assert gfull.primary_blocks == int(16 * MiB * 0.6) // block == 1228
    # bytes actually allocated follow the shares
    mgr = KVBlockManager(_shares_config(), env={"NPUW_KV_WINDOW_SIZE_SHARES": "0.4,0.6"})
    st = mgr.stats()
    assert st.windows[512].primary_bytes == 819 * block
    assert st.windows[32768].primary_bytes == 1228 * block


def test_shares_env_var_read_from_process_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NPUW_KV_WINDOW_SIZE_SHARES", " 0.2 , 0.3 ")  # normalised: 0.4, 0.6
    g512, gfull = plan_windows(_shares_config())
    assert g512.share == pytest.approx(0.4) and gfull.share == pytest.approx(0.6)


def test_shares_setting_wins_over_env_with_warning() -> None:
    with pytest.warns(UserWarning, match="NPUW_KV_WINDOW_SIZE_SHARES"):
        g512, gfull = plan_windows(
            _shares_config(window_size_shares=[0.25, 0.75]),
            env={"NPUW_KV_WINDOW_SIZE_SHARES": "0.4,0.6"},
        )
    assert g512.share == pytest.approx(0.25) and gfull.share == pytest.approx(0.75)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("0.4", "has 1 values but the model has 2 window sizes"),
        ("0.2,0.3,0.5", "has 3 values"),
        ("0.4,1.5", r"share 1.5 for window 32768 is outside \[0, 1\]"),
        ("-0.1,0.6", "outside"),
        ("0,0", "sum to 0"),
        ("a,b", "not a comma-separated list"),
    ],
)
def test_bad_shares_are_clear_errors(text: str, match: str) -> None:
    with pytest.raises(SharesError, match=match):
        plan_windows(_shares_config(), env={"NPUW_KV_WINDOW_SIZE_SHARES": text})
    with pytest.raises(ValueError):  # SharesError is a ValueError
        resolve_shares([512, 32768], None, {"NPUW_KV_WINDOW_SIZE_SHARES": text})


def test_max_tokens_ignored_for_vswa_with_warning() -> None:
    with pytest.warns(UserWarning, match="max_tokens=2048 ignored"):
        groups = plan_windows(_shares_config(max_tokens=2048), env={})
    # pools follow budget and equal shares, not the 2048-token cap
    assert [g.primary_blocks for g in groups] == [1024, 1024]
    assert sum(g.primary_blocks for g in groups) * 32 > 2048


def test_max_tokens_applies_to_a_single_window() -> None:
    cfg = BlockManagerConfig(
        [LayerSpec(None, 1, 64)], max_seq_len=1024, kv_budget_bytes=16 * MiB, max_tokens=2000
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        (g,) = plan_windows(cfg, env={})
    assert g.primary_blocks == 63  # ceil(2000 / 32), far below the 2048 the budget holds


def test_window_larger_than_max_seq_len_is_rejected() -> None:
    cfg = BlockManagerConfig(
        uniform_layers([64, 4096], 1, 8), max_seq_len=1024, kv_budget_bytes=MiB
    )
    with pytest.raises(WindowTooLargeError, match="layer 1 has window 4096 > max_seq_len 1024"):
        KVBlockManager(cfg, env={})


def test_budget_too_small_says_how_much_is_needed() -> None:
    cfg = BlockManagerConfig(
        uniform_layers([64, None], 1, 8),
        max_seq_len=1024,
        kv_budget_bytes=20_000,
        tokens_per_block=16,
        max_tokens_per_call=1,
    )
    with pytest.raises(BudgetTooSmallError) as info:
        KVBlockManager(cfg, env={})
    msg = str(info.value)
    # full window: 1024/16 = 64 blocks of 16*32 bytes = 32768 bytes at share 0.5 -> 65536
    assert "window 1024" in msg and "needs 64 blocks" in msg and "65536 bytes" in msg
    assert "raise kv_budget_bytes" in msg and "max_tokens_per_call" in msg
    ok = BlockManagerConfig(
        uniform_layers([64, None], 1, 8),
        max_seq_len=1024,
        kv_budget_bytes=65536,
        tokens_per_block=16,
        max_tokens_per_call=1,
    )
    mgr = KVBlockManager(ok, env={})
    # the SWA window needs only its window plus one block (grown a token at a time)
    assert mgr.groups[64].min_blocks_per_seq == 64 // 16 + 1


def test_budget_check_is_sized_for_max_tokens_per_call() -> None:
    """A call holds all its blocks until the next one, so the minimum grows with the chunk."""
    base: dict[str, Any] = {"max_seq_len": 1024, "kv_budget_bytes": 1 << 20, "tokens_per_block": 16}
    layers = uniform_layers([64, None], 1, 8)
    by_chunk = {
        c: KVBlockManager(BlockManagerConfig(layers, max_tokens_per_call=c, **base), env={})
        for c in (1, 16, 100, 512, 4096)
    }
    # window + chunk tokens, block-aligned, +1 block for a chunk straddling a boundary
    assert [m.groups[64].min_blocks_per_seq for m in by_chunk.values()] == [5, 6, 12, 37, 64]
    assert by_chunk[4096].groups[64].max_tokens_per_call == 1024  # capped at max_seq_len
    assert BlockManagerConfig(layers, **base).max_tokens_per_call == 512  # default
    small = BlockManagerConfig(
        layers,
        max_seq_len=1024,
        kv_budget_bytes=2 * 64 * 512 + 2 * 5 * 512,
        tokens_per_block=16,
        window_size_shares=[5 / 69, 64 / 69],
    )
    with pytest.raises(BudgetTooSmallError, match="added 512 tokens a call at most"):
        KVBlockManager(small, env={})
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ConfigError, match=f"max_tokens_per_call={bad!r} must be an integer"):
            cfg = BlockManagerConfig(layers, max_tokens_per_call=bad, **base)  # type: ignore[arg-type]
            KVBlockManager(cfg, env={})
