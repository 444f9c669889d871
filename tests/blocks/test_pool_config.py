"""Per-window grouping, bytes per token, pools sized in bytes (shares from the setting or the
env var, max_tokens) or in blocks, and the size check."""

from __future__ import annotations

import os
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
    parse_shares,
    plan_windows,
    resolve_shares,
    uniform_layers,
    with_env_shares,
)

pytestmark = pytest.mark.unit  # builds no model (the quick tier)

MiB = 1 << 20


def test_layers_grouped_by_window_with_bytes_per_token() -> None:
    layers = [
        LayerSpec(512, 4, 64),
        LayerSpec(None, 8, 128),
        LayerSpec(512, 2, 64),
        LayerSpec(4096, 8, 128),  # == max_seq_len: full attention
    ]
    cfg = BlockManagerConfig(layers, max_seq_len=4096, kv_budget_bytes=64 * MiB)
    groups = {g.window: g for g in plan_windows(cfg)}
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
    (g,) = plan_windows(cfg)
    assert g.tokens_per_block == 16 and g.block_bytes == 16 * 2 * 8 * 2


def _shares_config(**kw: object) -> BlockManagerConfig:
    return BlockManagerConfig(
        [LayerSpec(512, 1, 64), LayerSpec(None, 1, 64)],
        max_seq_len=32768,
        kv_budget_bytes=16 * MiB,
        **kw,  # type: ignore[arg-type]
    )


def test_shares_example_from_env_var() -> None:
    env = {"NPUW_KV_WINDOW_SIZE_SHARES": "0.4,0.6"}
    groups = plan_windows(with_env_shares(_shares_config(), env))
    g512, gfull = groups
    assert (g512.window, gfull.window) == (512, 32768)
    assert g512.share == pytest.approx(0.4) and gfull.share == pytest.approx(0.6)
    block = 32 * 2 * 64 * 2  # tpb * K+V * head_dim * fp16
    assert g512.primary_blocks == int(16 * MiB * 0.4) // block == 819
    assert gfull.primary_blocks == int(16 * MiB * 0.6) // block == 1228
    # bytes actually allocated follow the shares
    mgr = KVBlockManager(with_env_shares(_shares_config(), env))
    st = mgr.stats()
    assert st.windows[512].primary_bytes == 819 * block
    assert st.windows[32768].primary_bytes == 1228 * block


def test_env_shares_helper_reads_the_process_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NPUW_KV_WINDOW_SIZE_SHARES", " 0.2 , 0.3 ")  # normalised: 0.4, 0.6
    g512, gfull = plan_windows(with_env_shares(_shares_config(), os.environ))
    assert g512.share == pytest.approx(0.4) and gfull.share == pytest.approx(0.6)


def test_the_manager_never_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NPUW_KV_WINDOW_SIZE_SHARES", "not shares")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mgr = KVBlockManager(_shares_config())
    assert [g.share for g in mgr.groups.values()] == [0.5, 0.5]


def test_shares_setting_wins_over_env_with_warning() -> None:
    with pytest.warns(UserWarning, match="NPUW_KV_WINDOW_SIZE_SHARES"):
        cfg = with_env_shares(
            _shares_config(window_size_shares=[0.25, 0.75]),
            {"NPUW_KV_WINDOW_SIZE_SHARES": "0.4,0.6"},
        )
    g512, gfull = plan_windows(cfg)
    assert g512.share == pytest.approx(0.25) and gfull.share == pytest.approx(0.75)


def test_env_shares_do_not_apply_to_pools_sized_in_blocks() -> None:
    cfg = BlockManagerConfig(
        [LayerSpec(512, 1, 64), LayerSpec(None, 1, 64)],
        max_seq_len=4096,
        primary_blocks={512: 40, 4096: 128},
    )
    with pytest.warns(UserWarning, match="ignored: pools are sized in blocks"):
        assert with_env_shares(cfg, {"NPUW_KV_WINDOW_SIZE_SHARES": "0.4,0.6"}) is cfg
    assert with_env_shares(cfg, {}) is cfg


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
    env = {"NPUW_KV_WINDOW_SIZE_SHARES": text}
    with pytest.raises(SharesError, match=f"NPUW_KV_WINDOW_SIZE_SHARES.*{match}"):
        with_env_shares(_shares_config(), env)
    with pytest.raises(ValueError):  # SharesError is a ValueError
        resolve_shares([512, 32768], parse_shares(text))
    if match != "not a comma-separated list":  # the setting takes the same checks
        with pytest.raises(SharesError, match=f"window_size_shares.*{match}"):
            plan_windows(_shares_config(window_size_shares=parse_shares(text)))


def test_max_tokens_ignored_for_vswa_with_warning() -> None:
    with pytest.warns(UserWarning, match="max_tokens=2048 ignored"):
        groups = plan_windows(_shares_config(max_tokens=2048))
    # pools follow budget and equal shares, not the 2048-token cap
    assert [g.primary_blocks for g in groups] == [1024, 1024]
    assert sum(g.primary_blocks for g in groups) * 32 > 2048


def test_max_tokens_applies_to_a_single_window() -> None:
    cfg = BlockManagerConfig(
        [LayerSpec(None, 1, 64)], max_seq_len=1024, kv_budget_bytes=16 * MiB, max_tokens=2000
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        (g,) = plan_windows(cfg)
    assert g.primary_blocks == 63  # ceil(2000 / 32), far below the 2048 the budget holds


def test_window_larger_than_max_seq_len_is_rejected() -> None:
    cfg = BlockManagerConfig(
        uniform_layers([64, 4096], 1, 8), max_seq_len=1024, kv_budget_bytes=MiB
    )
    with pytest.raises(WindowTooLargeError, match="layer 1 has window 4096 > max_seq_len 1024"):
        KVBlockManager(cfg)


def test_budget_too_small_says_how_much_is_needed() -> None:
    cfg = BlockManagerConfig(
        uniform_layers([64, None], 1, 8),
        max_seq_len=1024,
        kv_budget_bytes=20_000,
        tokens_per_block=16,
        max_tokens_per_call=1,
    )
    with pytest.raises(BudgetTooSmallError) as info:
        KVBlockManager(cfg)
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
    mgr = KVBlockManager(ok)
    # the SWA window needs only its window plus one block (grown a token at a time)
    assert mgr.groups[64].min_blocks_per_seq == 64 // 16 + 1


def test_budget_check_is_sized_for_max_tokens_per_call() -> None:
    """A call holds all its blocks until the next one, so the minimum grows with the chunk."""
    base: dict[str, Any] = {"max_seq_len": 1024, "kv_budget_bytes": 1 << 20, "tokens_per_block": 16}
    layers = uniform_layers([64, None], 1, 8)
    by_chunk = {
        c: KVBlockManager(BlockManagerConfig(layers, max_tokens_per_call=c, **base))
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
        KVBlockManager(small)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ConfigError, match=f"max_tokens_per_call={bad!r} must be an integer"):
            cfg = BlockManagerConfig(layers, max_tokens_per_call=bad, **base)  # type: ignore[arg-type]
            KVBlockManager(cfg)


BLOCKS = {512: 40, 4096: 128}


def _blocks_config(**kw: object) -> BlockManagerConfig:
    return BlockManagerConfig(
        [LayerSpec(512, 1, 64), LayerSpec(None, 2, 64)],
        max_seq_len=4096,
        **kw,  # type: ignore[arg-type]
    )


def test_pools_sized_in_blocks_get_exactly_those_blocks() -> None:
    cfg = _blocks_config(primary_blocks=BLOCKS, host_blocks={4096: 16})
    mgr = KVBlockManager(cfg)
    swa, full = mgr.groups[512], mgr.groups[4096]
    assert (swa.primary_blocks, swa.host_blocks) == (40, 0)  # a window left out gets no host
    assert (full.primary_blocks, full.host_blocks) == (128, 16)
    # the share is the window's part of the primary bytes (full blocks are twice as large)
    assert swa.share == pytest.approx(40 / (40 + 2 * 128))
    st = mgr.stats().windows
    assert st[512].primary_bytes == 40 * swa.block_bytes
    assert st[4096].host_bytes == 16 * full.block_bytes


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({}, "not neither"),
        ({"kv_budget_bytes": MiB, "primary_blocks": BLOCKS}, "not both"),
        ({"kv_budget_bytes": MiB, "host_blocks": {512: 1}}, "host_blocks goes with primary"),
        ({"primary_blocks": BLOCKS, "host_budget_bytes": MiB}, "host_budget_bytes sizes pools"),
        ({"primary_blocks": BLOCKS, "window_size_shares": [0.5, 0.5]}, "window_size_shares siz"),
        ({"primary_blocks": BLOCKS, "max_tokens": 1024}, "max_tokens sizes pools in bytes"),
        ({"primary_blocks": {512: 40}}, r"sizes \[512\] but the model's are \[512, 4096\]"),
        ({"primary_blocks": BLOCKS, "host_blocks": {64: 1}}, r"host_blocks has window sizes"),
        ({"primary_blocks": {512: 40, 4096: -1}}, r"primary_blocks\[4096\]=-1 must be"),
        ({"primary_blocks": {512: 40.0, 4096: 128}}, r"primary_blocks\[512\]=40.0 must be"),
        ({"primary_blocks": BLOCKS, "host_blocks": {512: True}}, r"host_blocks\[512\]=True"),
    ],
)
def test_pools_are_sized_one_way(kw: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        KVBlockManager(_blocks_config(**kw))


def test_too_few_blocks_says_how_many_are_needed() -> None:
    with pytest.raises(BudgetTooSmallError) as info:
        KVBlockManager(_blocks_config(primary_blocks={512: 32, 4096: 128}))
    msg = str(info.value)
    assert "primary_blocks[512]=32 but one sequence of max_seq_len 4096" in msg
    assert "needs 33 blocks; raise primary_blocks[512]" in msg
    assert KVBlockManager(_blocks_config(primary_blocks={512: 33, 4096: 128}))
