"""Bad input gives clear errors and leaves the manager unchanged and consistent."""

from __future__ import annotations

import numpy as np
import pytest
from blocks_helpers import build

from npuw_kv.kv.blocks import (
    BlockManagerConfig,
    BudgetTooSmallError,
    ConfigError,
    InvalidTokensError,
    KVBlockManager,
    OutOfBlocksError,
    PriorityRange,
    SequenceExistsError,
    SequenceTooLongError,
    UnknownSequenceError,
    WindowTooLargeError,
    uniform_layers,
)

pytestmark = pytest.mark.unit  # builds no model (the quick tier)


def _state(mgr: KVBlockManager) -> tuple:
    return mgr.stats(), {
        (s, w): mgr.block_table(s, w) for s in mgr.sequence_ids for w in mgr.windows
    }


@pytest.fixture
def mgr() -> KVBlockManager:
    m = build([4, None], [16, 12], max_seq_len=16, tpb=2)
    m.add_sequence("live", [1, 2, 3, 4, 5])
    m.add_sequence("gone", [1, 2, 3])
    m.remove_sequence("gone")
    return m


def test_unknown_sequence_id(mgr: KVBlockManager) -> None:
    before = _state(mgr)
    for call in (
        lambda: mgr.add_tokens("nope", [1]),
        lambda: mgr.remove_sequence("nope"),
        lambda: mgr.block_table("nope", 4),
    ):
        with pytest.raises(UnknownSequenceError, match="unknown sequence 'nope'; call add_seq"):
            call()
    with pytest.raises(KeyError):  # it is a KeyError
        mgr.add_tokens("nope", [1])
    assert _state(mgr) == before
    mgr.check_invariants()


def test_extending_a_removed_sequence(mgr: KVBlockManager) -> None:
    before = _state(mgr)
    with pytest.raises(UnknownSequenceError, match="sequence 'gone' was removed"):
        mgr.add_tokens("gone", [7])
    with pytest.raises(UnknownSequenceError, match="was removed"):
        mgr.remove_sequence("gone")
    assert _state(mgr) == before
    mgr.check_invariants()


def test_duplicate_too_long_bad_tokens_bad_priority(mgr: KVBlockManager) -> None:
    before = _state(mgr)
    with pytest.raises(SequenceExistsError, match="'live' is already live"):
        mgr.add_sequence("live", [1])
    with pytest.raises(SequenceTooLongError, match="17 tokens .* max_seq_len is 16"):
        mgr.add_sequence("long", list(range(17)))
    with pytest.raises(SequenceTooLongError, match="would hold 17 tokens \\(has 5\\)"):
        mgr.add_tokens("live", list(range(12)))
    with pytest.raises(InvalidTokensError, match="integers"):
        mgr.add_sequence("f", [1.5])  # type: ignore[list-item]
    with pytest.raises(ConfigError, match="outside \\[0, 100\\]"):
        mgr.add_sequence("p", [1], priority=101)
    with pytest.raises(ConfigError, match="not a token range"):
        mgr.add_sequence("p", [1], priority=[PriorityRange(4, 2, 50)])
    assert _state(mgr) == before
    assert "long" not in mgr.sequence_ids and "p" not in mgr.sequence_ids
    mgr.check_invariants()


def test_out_of_blocks_leaves_manager_unchanged(mgr: KVBlockManager) -> None:
    mgr.add_sequence("big", list(range(14)))  # the full window now has 12 - 3 - 7 = 2 free
    before = _state(mgr)
    with pytest.raises(OutOfBlocksError, match="window 16 needs 4 free primary blocks") as info:
        mgr.add_sequence("more", list(range(20, 27)))
    msg = str(info.value)
    assert "remove a sequence, or raise primary_blocks" in msg
    assert "only 2 are reclaimable (10 are held by 2 live sequences)" in msg
    assert "a call adding at most 4 tokens fits now" in msg  # 2 blocks of 2 tokens
    assert _state(mgr) == before
    mgr.check_invariants()
    mgr.add_sequence("fits", list(range(20, 24)))  # ... and it does
    mgr.remove_sequence("fits")
    mgr.remove_sequence("big")
    mgr.add_sequence("more", list(range(20, 27)))  # fits once blocks are back
    mgr.check_invariants()


def test_budget_too_small_for_one_sequence() -> None:
    cfg = BlockManagerConfig(
        uniform_layers([None], 2, 16), max_seq_len=256, kv_budget_bytes=4096, tokens_per_block=16
    )
    with pytest.raises(BudgetTooSmallError, match="holds 2 blocks for window 256 but one sequence"):
        KVBlockManager(cfg)
    with pytest.raises(ValueError, match="needs 32768 bytes of kv_budget_bytes"):
        KVBlockManager(cfg)


def test_window_larger_than_max_seq_len() -> None:
    cfg = BlockManagerConfig(uniform_layers([300], 1, 8), max_seq_len=256, kv_budget_bytes=1 << 20)
    with pytest.raises(WindowTooLargeError, match="raise max_seq_len"):
        KVBlockManager(cfg)


def test_bad_layer_and_block_settings() -> None:
    with pytest.raises(ConfigError, match="tokens_per_block=0"):
        KVBlockManager(
            BlockManagerConfig(uniform_layers([None], 1, 8), 64, 1 << 20, tokens_per_block=0)
        )
    with pytest.raises(ConfigError, match="layers is empty"):
        KVBlockManager(BlockManagerConfig([], 64, 1 << 20))
    with pytest.raises(ConfigError, match="num_kv_heads and head_dim"):
        KVBlockManager(BlockManagerConfig(uniform_layers([None], 0, 8), 64, 1 << 20))
    with pytest.raises(ConfigError, match="not a numpy dtype"):
        KVBlockManager(BlockManagerConfig(uniform_layers([None], 1, 8), 64, 1 << 20, dtype="f17"))


def test_out_of_blocks_says_the_largest_call_that_fits() -> None:
    mgr = build([None], [10], max_seq_len=16, tpb=2)
    mgr.add_sequence("a", list(range(8)))  # 4 blocks
    mgr.add_sequence("b", list(range(50, 58)))  # 4 blocks, 2 free
    before = mgr.stats()
    with pytest.raises(OutOfBlocksError, match="a call adding at most 4 tokens fits now"):
        mgr.add_tokens("a", [1, 2, 3, 4, 5, 6])  # 3 blocks
    assert mgr.stats() == before
    mgr.add_tokens("a", [1, 2, 3, 4])  # ... and 4 tokens do fit
    with pytest.raises(OutOfBlocksError, match="no call fits now, not even one token"):
        mgr.add_sequence("c", [9, 9, 9])
    mgr.check_invariants()


@pytest.mark.parametrize(
    ("priority", "match"),
    [
        (50.0, "priority=50.0 is not an integer"),
        ("50", "priority='50' is not an integer"),
        (True, "priority=True is not an integer"),
        ([50], "50 is not a PriorityRange"),
        ([PriorityRange(0, None, 1.5)], r"PriorityRange.priority=1.5 is not an integer"),  # type: ignore[arg-type]
        (np.int64(101), r"priority=101 is outside \[0, 100\]"),
    ],
)
def test_bad_priority_types_are_config_errors(priority: object, match: str) -> None:
    mgr = build([4, None], [8, 16], max_seq_len=16, tpb=2)
    before = mgr.stats()
    with pytest.raises(ConfigError, match=match):
        mgr.add_sequence("p", [1, 2, 3], priority=priority)  # type: ignore[arg-type]
    assert mgr.stats() == before and not mgr.sequence_ids
    mgr.check_invariants()
