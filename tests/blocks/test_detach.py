"""Linear writing and out-of-window detach."""

from __future__ import annotations

import pytest
from blocks_helpers import build

from npuw_kv.kv.blocks import PoolKind

pytestmark = pytest.mark.unit  # builds no model (the quick tier)


def test_detach_at_exact_token_counts() -> None:
    # window 8, 4 tokens per block: detach while n - detached*4 >= 8 + 4
    mgr = build([8, None], [6, 20], max_seq_len=40, tpb=4, max_tokens_per_call=1)
    mgr.add_sequence("s", [1])
    seen = {}
    for n in range(2, 41):
        mgr.add_tokens("s", [n])
        table = mgr.block_table("s", 8)
        assert len(table) == -(-n // 4)  # linear: one slot per block of the sequence
        seen[n] = table.count(-1)
        full = mgr.block_table("s", 40)
        assert -1 not in full  # full attention never detaches
        mgr.check_invariants()
    expected = {n: max(0, (n - 8) // 4) for n in seen}
    assert seen == expected
    # the first detach happens exactly at 12 = window + tpb tokens, the next at 16
    assert seen[11] == 0 and seen[12] == 1 and seen[15] == 1 and seen[16] == 2
    # detached slots stay detached: never handed back to the sequence
    assert mgr.block_table("s", 8)[: seen[40]] == [-1] * seen[40]
    assert mgr.groups[8].max_blocks_per_seq == 40 // 4 + 1


def test_detached_block_refcount_drops_and_is_reclaimable() -> None:
    mgr = build([4, None], [5, 16], max_seq_len=16, tpb=2, max_tokens_per_call=5)
    wm = mgr.windows[4]
    mgr.add_sequence("a", [1, 2, 3, 4, 5])
    first = wm.seqs[0].table[0]
    assert first is not None and first.ref_count == 1
    free_before = wm.primary.free_count()
    mgr.add_tokens("a", [6])  # 6 - 0 >= 4 + 2: block 0 detaches
    assert mgr.block_table("a", 4)[0] == -1
    assert first.ref_count == 0 and first in wm.primary.queue
    assert wm.primary.free_count() == free_before + 1  # token 6 fits in block 2: no allocation
    mgr.add_tokens("a", [7])  # needs block 3: allocation may take the detached one
    mgr.check_invariants()
    assert mgr.stats().windows[4].counters.detached_blocks == 1


def test_a_multi_token_call_keeps_what_its_first_token_reads() -> None:
    mgr = build([4, None], [12, 16], max_seq_len=24, tpb=2)
    mgr.add_sequence("p", list(range(20)))  # a 20-token prompt in one call
    # the prompt's first computed token (position 0) reads nothing before it, but the runtime
    # still has to write every row: nothing of this call is detached yet
    assert mgr.block_table("p", 4).count(-1) == 0
    mgr.add_tokens("p", [99])  # next call: catch up to (21 - 4) // 2 = 8 detached
    assert mgr.block_table("p", 4).count(-1) == 8
    mgr.add_tokens("p", [1, 2, 3])  # evaluated at its first token: 22 -> 9
    assert mgr.block_table("p", 4).count(-1) == 9
    mgr.check_invariants()


def test_detach_unseen_lets_a_waiting_sequence_hold_only_what_it_reads_next() -> None:
    """Between calls a batch detaches what a sequence's next token cannot see: a prompt read
    in part gives back its chunk's early blocks at once (its next call would give the same
    ones back), the next call sees the same table, and truncating behind them is refused."""
    mgr = build([4, None], [12, 16], max_seq_len=24, tpb=2)
    mgr.add_sequence("p", list(range(10)))  # 10 tokens in one call: all 5 blocks live
    assert mgr.block_table("p", 4).count(-1) == 0
    held = mgr.stats().windows[4].primary_used
    mgr.detach_unseen("p")  # token 10 reads 7..10: blocks 0-2 are behind its window
    assert mgr.block_table("p", 4)[:3] == [-1] * 3
    assert mgr.stats().windows[4].primary_used == held - 3
    mgr.detach_unseen("p")  # idempotent
    assert mgr.block_table("p", 4).count(-1) == 3
    with pytest.raises(ValueError, match="already released"):
        mgr.truncate("p", 4)
    twin = build([4, None], [12, 16], max_seq_len=24, tpb=2)
    twin.add_sequence("p", list(range(10)))
    mgr.add_tokens("p", [10, 11])
    twin.add_tokens("p", [10, 11])
    assert mgr.block_table("p", 4).count(-1) == twin.block_table("p", 4).count(-1) == 3
    mgr.check_invariants()


def test_detached_block_offloaded_to_host_when_reclaimed() -> None:
    mgr = build([4, None], [4, 16], max_seq_len=16, tpb=2, host=[2, 8], max_tokens_per_call=2)
    wm = mgr.windows[4]
    mgr.add_sequence("a", [1])
    for t in range(2, 9):
        mgr.add_tokens("a", [t])  # 8 tokens: 2 detached, 2 live, pool of 4 all used
    detached = [b for b in wm.seqs[0].table[:2] if b is not None]
    assert all(b.ref_count == 0 for b in detached)
    mgr.add_sequence("b", [50, 51])  # needs one block: victim is a's oldest detached block
    assert wm.counters.offloads == 1
    assert detached[0].pool is PoolKind.HOST  # offloaded, bytes kept, a stays storable
    assert wm.seqs[0].storable
    mgr.check_invariants()


def test_long_prompt_added_in_chunks_holds_window_plus_chunk() -> None:
    # SWA-8, tpb 2, prompt of 60 tokens added as lookup + chunks of 6 (the runtime protocol)
    mgr = build([8, None], [12, 40], max_seq_len=64, tpb=2, max_tokens_per_call=6)
    prompt = list(range(60))
    hit = mgr.lookup(prompt).hit_tokens
    assert mgr.add_sequence("p", prompt[: hit + 6]) == hit == 0
    peak = 0
    for start in range(6, 60, 6):
        mgr.add_tokens("p", prompt[start : start + 6])
        peak = max(peak, mgr.stats().windows[8].primary_used)
        table = mgr.block_table("p", 8)
        # the chunk's first token still sees its 7 predecessors: all of them are live
        first = start
        assert all(table[p // 2] >= 0 for p in range(max(0, first - 7), start + 6))
    assert peak <= -(-(8 + 6) // 2) + 1  # (window + chunk) / tpb, plus one partial block
    mgr.check_invariants()
