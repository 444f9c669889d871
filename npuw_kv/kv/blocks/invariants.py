"""Whole-state consistency checks (what ``KVBlockManager.check_invariants`` runs).

Cheap local checks sit where state changes (refcounts, queue membership); this module checks
the global picture after an operation, for tests and for debugging a live engine. Each failure
raises ``AssertionError`` with a message that names the window, the block and the rule.

The manager never sees K/V values (the runtime writes them), so these checks cannot prove that
a cached block holds its tokens' rows; they check the bookkeeping that guarantees it (a live
slot's generation is current, a detached slot whose generation still matches was not reset
since, a block is cached or read only at the block position it was written for, only cached or
still storable blocks are queued above the worthless level, sizes and refcounts add up). Tests
that write token-derived bytes check the bytes themselves (``tests/blocks/test_stateful.py``,
``tests/blocks/fuzz_driver.py``).

The checks read window managers and a stats snapshot, never the manager itself: the manager
calls them, so they must not depend on it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from .block import EMPTY_LEVEL, KVBlock, PoolKind
from .reuse_tree import chain_hash
from .sequence import blocks_for
from .stats import ManagerStats
from .window_manager import WindowManager


def _fail(wm: WindowManager, msg: str) -> None:
    raise AssertionError(f"window {wm.window}: {msg}")


def check_window(wm: WindowManager, live: dict[int, int]) -> None:
    """Check one window group; ``live`` maps live serials to their token counts."""
    if set(wm.seqs) != set(live):
        _fail(wm, f"sequence serials {sorted(wm.seqs)} != live {sorted(live)}")
    for pool in (wm.primary, wm.host):
        members = [b for b in wm.blocks if b.pool is pool.kind]
        if sorted(b.slot for b in members) != list(range(pool.num_slots)):
            _fail(wm, f"{pool.kind.value} slots are not a permutation of 0..{pool.num_slots - 1}")
        queued = list(pool.queue.blocks())
        if len(queued) != len(pool.queue) or len({id(b) for b in queued}) != len(queued):
            _fail(wm, f"{pool.kind.value} queue size disagrees with its contents")
        for b in queued:
            if b.pool is not pool.kind or b not in pool.queue:
                _fail(wm, f"{b} queued in the {pool.kind.value} queue but lives elsewhere")
        used = sum(1 for b in members if b.ref_count > 0)
        if len(queued) + used != pool.num_slots:
            _fail(
                wm,
                f"{pool.kind.value}: free {len(queued)} + used {used} != total {pool.num_slots}",
            )

    # refcounts equal the number of live table slots holding the block
    holders: Counter[int] = Counter()
    for serial, seq in wm.seqs.items():
        n = live[serial]
        if len(seq.table) != blocks_for(n, wm.tpb):
            _fail(wm, f"serial {serial}: {len(seq.table)} table slots for {n} tokens")
        if len(seq.table) > wm.group.max_blocks_per_seq:
            _fail(wm, f"serial {serial}: table longer than max_blocks_per_seq")
        # the next token (position n) reads from n + 1 - window on: no block there is detached
        # (after a whole-prompt hit it is the first token the sequence computes)
        if seq.first_live * wm.tpb > max(0, n + 1 - wm.window) or seq.first_live > len(seq.table):
            _fail(wm, f"serial {serial}: detached {seq.first_live} blocks, in window of {n} tokens")
        if len(seq.gens) != len(seq.table):
            _fail(wm, f"serial {serial}: {len(seq.gens)} generations for {len(seq.table)} slots")
        for j, old in enumerate(seq.table[: seq.first_live]):
            if old is not None and seq.holds_bytes(j) and old.position != j:  # reset, same gen
                _fail(wm, f"serial {serial}: detached slot {j} still claims {old} reset since")
        for j, b in enumerate(seq.live(), start=seq.first_live):
            holders[b.block_id] += 1
            if b.pool is not PoolKind.PRIMARY:
                _fail(wm, f"serial {serial} holds {b} which is not in the primary pool")
            if not seq.holds_bytes(j):  # a held block was handed out: two writers, one row
                _fail(wm, f"serial {serial}: live slot {j} holds {b} handed out again since")
            if b.position != j:
                _fail(wm, f"serial {serial}: live slot {j} holds {b} written for {b.position}")
    for b in wm.blocks:
        if b.ref_count < 0:
            _fail(wm, f"negative refcount on {b}")
        if b.ref_count != holders[b.block_id]:
            _fail(wm, f"{b} refcount != {holders[b.block_id]} live holders")
        if (b.ref_count == 0) != (b.queue_level is not None):
            _fail(wm, f"{b}: a block is free iff its refcount is 0 (both free and owned?)")
        if not wm.policy.shares_hit_blocks and b.ref_count > 1:
            _fail(wm, f"live SWA block shared by {b.ref_count} sequences: {b}")
        if b.queue_level == EMPTY_LEVEL and b.node is not None:
            _fail(wm, f"cached {b} sits at the worthless (empty) queue level")
        if b.queue_level not in (None, EMPTY_LEVEL) and b.node is None and not _kept(wm, b):
            _fail(wm, f"worthless {b} is queued above the empty level (outlives cached blocks)")
    _check_tree(wm)


def _kept(wm: WindowManager, b: KVBlock) -> bool:
    """True if ``b`` is a detached SWA block its live last owner may still store."""
    owner = wm.seqs.get(b.last_owner) if b.last_owner is not None else None
    j = b.position
    return (
        wm.tree is not None
        and wm.policy.keeps_detached_for_store
        and owner is not None
        and j is not None
        and j < owner.first_live
        and owner.table[j] is b
        and owner.holds_bytes(j)
        and j < owner.storable_upto(j + 1)
    )


def _check_tree(wm: WindowManager) -> None:
    tree = wm.tree
    if tree is None:
        if any(b.node is not None for b in wm.blocks):
            _fail(wm, "reuse is off but a block is cached")
        return
    cached = 0
    for node in tree.nodes():
        parent = node.parent
        if parent is None or parent.children.get(node.key) is not node or not node.attached:
            _fail(wm, f"{node} is not linked from its parent")
        assert parent is not None
        if node.block_hash != chain_hash(parent.block_hash, node.key):
            _fail(wm, f"{node} hash is not chained with its parent")
        if len(node.key) != wm.tpb:
            _fail(wm, f"{node} holds a partial block")
        block = node.block
        if block is None:
            if wm.policy.cut_on_evict:
                _fail(wm, f"hollow node in a {wm.policy.name} tree: {node}")
            if not node.children:
                _fail(wm, f"hollow leaf left in the tree: {node}")
            continue
        cached += 1
        if block.node is not node:
            _fail(wm, f"tree points at {block} whose node is elsewhere (freed block?)")
        if block.position != node.depth - 1:  # e.g. a stale detached slot stored for reuse
            _fail(wm, f"{block} cached at block {node.depth - 1} but written for {block.position}")
    if cached != tree.cached_blocks:
        _fail(wm, f"tree holds {cached} blocks but counts {tree.cached_blocks}")
    for b in wm.blocks:
        at = b.node
        if at is not None and (not at.attached or at.block is not b):
            _fail(wm, f"{b} believes it is cached but the tree does not hold it")
    c = wm.counters
    if c.stored_blocks - c.removed_blocks != cached:
        _fail(wm, f"stored {c.stored_blocks} - removed {c.removed_blocks} != cached {cached}")


def check_manager(
    windows: Mapping[int, WindowManager], live: dict[int, int], num_ids: int, st: ManagerStats
) -> None:
    """Check every window and the stats; ``live`` maps the serial of each of the ``num_ids``
    live sequences to its token count, ``st`` is a snapshot taken with them."""
    if len(live) != num_ids:
        raise AssertionError("two live sequences share a serial")
    for wm in windows.values():
        check_window(wm, live)
    if st.hit_tokens + st.miss_tokens != st.prompt_tokens or st.miss_tokens < 0:
        raise AssertionError(
            f"hit {st.hit_tokens} + miss {st.miss_tokens} != prompt tokens {st.prompt_tokens}"
        )
    if st.sequences_added - st.sequences_removed != st.live_sequences:
        raise AssertionError("added - removed sequences != live sequences")
    for w, ws in st.windows.items():
        if ws.primary_free + ws.primary_used != ws.primary_total:
            raise AssertionError(f"window {w}: primary free + used != total")
        stores = windows[w].primary.store.shape[2] > 0  # else the runtime holds the bytes
        per_block = ws.bytes_per_token * ws.tokens_per_block if stores else 0
        if ws.primary_bytes != ws.primary_total * per_block:
            raise AssertionError(f"window {w}: primary bytes disagree with block count")


__all__ = ["check_manager", "check_window"]
