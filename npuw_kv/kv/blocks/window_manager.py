"""Blocks of one window group: allocation, linear writing, detach, reuse, onboard; which block
a call takes, and offloading its victim, is :class:`~.reclaim.Reclaimer`'s.

Its choices — which block is freed first, when a victim is offloaded, how sliding-window blocks
are claimed or copied on a hit, and when a sequence may still store its chain (owners and
generations) — are set out in docs/design.md, "Choices inside one window group".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from .block import EMPTY_LEVEL, KVBlock, PoolKind, TreeNode
from .eviction import PrioritySpec
from .planning import WindowGroup
from .pool import BlockPool, SlotCopier, copy_bytes, move_bytes, numpy_copier
from .reclaim import Reclaimer
from .reuse_tree import ReuseTree
from .sequence import (
    SeqBlocks,
    blocks_for,
    detached_after,
    live_after_call,
    required_trailing_blocks,
)
from .stats import KVCacheEvent, WindowCounters


@dataclass
class WindowMatch:
    """Tree path for a prompt and which hit lengths (in blocks) this window can serve."""

    path: list[TreeNode]
    valid: list[bool]  # valid[k]: a hit of k blocks works for this window

    def best(self) -> int:
        return max(k for k, ok in enumerate(self.valid) if ok)


class WindowManager:
    """Primary + host pools, reuse tree and sequence tables of one attention window."""

    def __init__(
        self,
        group: WindowGroup,
        *,
        enable_reuse: bool,
        default_priority: int,
        offload_min_priority: int,
        sink: Callable[[KVCacheEvent], None],
        copier: SlotCopier | None = None,
    ) -> None:
        self.group = group
        self.policy = group.policy
        self.window = group.window
        self.tpb = group.tokens_per_block
        stores = copier is None
        self.primary = BlockPool(PoolKind.PRIMARY, group, group.primary_blocks, stores)
        self.host = BlockPool(PoolKind.HOST, group, group.host_blocks, stores)
        self.pools = {PoolKind.PRIMARY: self.primary, PoolKind.HOST: self.host}
        self._copy = numpy_copier(self.pools) if copier is None else copier
        self.blocks: list[KVBlock] = []
        self._default_priority = default_priority
        for pool in (self.primary, self.host):
            self._new_blocks(pool, pool.num_slots)
        self.tree = (
            ReuseTree(self.tpb, cut_on_evict=self.policy.cut_on_evict, sink=self._on_tree_event)
            if enable_reuse
            else None
        )
        self.seqs: dict[int, SeqBlocks] = {}
        self.counters = WindowCounters()
        self._sink = sink
        self._trailing = required_trailing_blocks(group.window, self.tpb)
        self._reclaim = Reclaimer(
            self.pools,
            tree=self.tree,
            seqs=self.seqs,
            counters=self.counters,
            copy=self._copy,
            emit_move=self._emit_move,
            default_priority=default_priority,
            offload_min_priority=offload_min_priority,
        )

    def _new_blocks(self, pool: BlockPool, count: int) -> None:
        """Blocks for ``pool``'s last ``count`` slots (its ``num_slots`` counts them already),
        empty and free."""
        first = pool.num_slots - count
        for slot in range(first, pool.num_slots):
            block = KVBlock(len(self.blocks), pool.kind, slot, priority=self._default_priority)
            self.blocks.append(block)
            pool.queue.push(block, EMPTY_LEVEL)

    def grow_primary(self, blocks: int) -> None:
        """``blocks`` primary slots in all (more than now): the new ones empty and free, every
        live sequence and cached block where it was (the runtime's tensors grew, copied)."""
        pool = self.primary
        extra = blocks - pool.num_slots
        if extra <= 0:
            raise ValueError(f"window {self.window}: {blocks} primary blocks is no growth")
        pool.num_slots = blocks
        width = pool.store.shape[2]
        grown = np.zeros((blocks, self.tpb, width), dtype=np.uint8)
        grown[: blocks - extra] = pool.store
        pool.store = grown
        self._new_blocks(pool, extra)
        self.group = replace(self.group, primary_blocks=blocks)
        pool.group = self.group

    # ---- queries -------------------------------------------------------------------------
    def match(self, tokens: Sequence[int], max_blocks: int) -> WindowMatch:
        """Which hit lengths this window could serve for ``tokens`` (no state change)."""
        if self.tree is None:
            return WindowMatch([], [True])
        path = self.tree.walk(tokens, max_blocks)
        valid, run = [True], 0
        for depth, node in enumerate(path, start=1):
            run = run + 1 if node.block is not None else 0
            valid.append(run >= min(self._trailing, depth))
        return WindowMatch(path, valid)

    def first_live_for_hit(self, k: int) -> int:
        return max(0, k - self._trailing)

    def cost_of_add(self, match: WindowMatch, k: int, n_tokens: int) -> int:
        """Reclaimable primary blocks ``add`` would consume (checked before any change)."""
        fl = self.first_live_for_hit(k)
        cost = 0
        for node in match.path[fl:k]:
            b = node.block
            assert b is not None
            if b.pool is PoolKind.HOST or b.ref_count == 0 or not self.policy.shares_hit_blocks:
                cost += 1
        live = live_after_call(k * self.tpb, n_tokens, self.window, self.tpb, fl)
        return cost + max(0, live - (k - fl))

    def cost_of_extend(self, serial: int, n_old: int, n_new: int) -> int:
        seq = self.seqs[serial]
        live = live_after_call(n_old, n_new, self.window, self.tpb, seq.first_live)
        return max(0, live - (len(seq.table) - seq.first_live))

    def available(self) -> int:
        return self.primary.free_count()

    def block_table(self, serial: int) -> list[int]:
        """Primary slots of the sequence's blocks; -1 for detached (never read) slots."""
        seq = self.seqs[serial]
        return [-1] * seq.first_live + [b.slot for b in seq.live()]

    # ---- state changes -------------------------------------------------------------------
    def add(
        self,
        serial: int,
        tokens: Sequence[int],
        match: WindowMatch,
        k: int,
        priorities: PrioritySpec,
    ) -> None:
        """Start a sequence: claim the hit's blocks (pin first, then onboard/copy), write rest."""
        fl = self.first_live_for_hit(k)
        seq = SeqBlocks(serial, priorities, table=[None] * k, gens=[-1] * k, first_live=fl)
        self.seqs[serial] = seq
        plan: list[tuple[int, KVBlock, str]] = []
        for j in range(fl, k):
            b = match.path[j].block
            assert b is not None
            if b.queue_level is not None:  # pin so no allocation below can take it
                self.pools[b.pool].queue.remove(b)
                plan.append((j, b, "onboard" if b.pool is PoolKind.HOST else "claim"))
            elif not self.policy.shares_hit_blocks:
                plan.append((j, b, "copy"))
            else:
                b.ref_count += 1  # shared full-attention block, pinned by its refcount
                plan.append((j, b, "share"))
        for j, b, action in plan:
            if action == "copy":
                fresh = self._reclaim.take_free_primary(serial, j)
                copy_bytes(b, fresh, self._copy)
                fresh.ref_count = 1
                fresh.priority = priorities.for_block(j)
                seq.put(j, fresh)
                self.counters.copied_blocks += 1
                continue
            if action == "onboard":
                empty = self._reclaim.take_free_primary(serial, j)
                move_bytes(b, empty, self._copy)
                empty.last_owner = None  # holds no one's bytes now (it must not invalidate us)
                empty.position = None
                self.host.queue.push(empty, EMPTY_LEVEL)
                self.counters.onboards += 1
                self._emit_move("onboarded", b)
            if action != "share":
                b.ref_count = 1
            b.last_owner = serial
            b.priority = priorities.for_block(j)
            seq.put(j, b)
            self.counters.reused_blocks += 1
        if k and self.policy.stores_while_filling:
            seq.stored_depth, seq.stored_node = k, match.path[k - 1]
        self._grow(seq, tokens, k * self.tpb, len(tokens))

    def cost_of_fork(self, serial: int, n_tokens: int) -> int:
        """Free primary blocks :meth:`fork` takes: each live block it cannot share."""
        seq, full = self.seqs[serial], n_tokens // self.tpb
        return sum(1 for i in range(seq.first_live, len(seq.table)) if not self._shared(i, full))

    def _shared(self, index: int, full: int) -> bool:
        return self.policy.shares_hit_blocks and index < full

    def fork(self, serial: int, child: int, n_tokens: int) -> None:
        """Start sequence ``child`` with ``serial``'s ``n_tokens`` tokens: its full blocks
        shared where the policy shares blocks, every other live block copied."""
        src = self.seqs[serial]
        size, full = len(src.table), n_tokens // self.tpb
        seq = SeqBlocks(
            child,
            src.priorities,
            table=[None] * size,
            gens=[-1] * size,
            first_live=src.first_live,
            store_upto=src.store_upto,
            stored_depth=src.stored_depth,
            stored_node=src.stored_node,
        )
        self.seqs[child] = seq
        for idx in range(src.first_live, size):
            block = src.table[idx]
            assert block is not None
            if self._shared(idx, full):
                block.ref_count += 1
                seq.put(idx, block)
                continue
            fresh = self._reclaim.take_free_primary(child, idx)
            copy_bytes(block, fresh, self._copy)
            fresh.ref_count = 1
            fresh.priority = seq.priorities.for_block(idx)
            seq.put(idx, fresh)
            self.counters.copied_blocks += 1

    def extend(self, serial: int, tokens: Sequence[int], n_old: int, store: bool = True) -> None:
        """Append ``tokens[n_old:]`` (``tokens`` is the whole sequence).

        ``store=False`` seals the sequence: no block from here on is stored for reuse (the
        blocks complete before it still are).
        """
        seq = self.seqs[serial]
        if not store and seq.store_upto is None:
            seq.store_upto = n_old // self.tpb
        self._grow(seq, tokens, n_old, len(tokens))

    def detach_unseen(self, serial: int, n_tokens: int) -> None:
        """Detach what the next token of the sequence (of ``n_tokens``) cannot see, as its
        next call would."""
        self._detach_upto(self.seqs[serial], n_tokens + 1)

    def remove(self, serial: int, tokens: Sequence[int]) -> None:
        """End a sequence: store its chain (SWA: the slots that still hold their bytes, unless
        another sequence took one), release its blocks."""
        seq = self.seqs[serial]
        upto = seq.storable_upto(len(tokens) // self.tpb)
        if self.tree is not None and upto and not self.policy.stores_while_filling:
            self._store_chain(seq, tokens, self.tree.root, 0, upto)
        elif self.tree is not None and upto:
            self._store_full(seq, tokens, upto)  # again, if an eviction cut our chain since
        for idx in self.policy.release_order(range(seq.first_live, len(seq.table))):
            block = seq.table[idx]
            assert block is not None
            self._release(seq, block, idx, final=True)
        if self.tree is not None and self.policy.keeps_detached_for_store:
            self._reclaim.drop_kept(seq)  # kept for storing, now stored or worthless
        del self.seqs[serial]

    def truncate_error(self, serial: int, n_tokens: int) -> str | None:
        """Why ``truncate(serial, n_tokens)`` cannot be done (None: it can).  Only the
        sequence's own live blocks can be cut: a shared or detached one holds rows other
        sequences (or none) read."""
        seq = self.seqs[serial]
        if seq.first_live > detached_after(n_tokens + 1, self.window, self.tpb, 0):
            return f"window {self.window} already released blocks token {n_tokens} reads"
        first = max(n_tokens // self.tpb, 0)
        for idx in range(first, len(seq.table)):
            block = seq.table[idx]
            if idx < seq.first_live or block is None or block.ref_count != 1:
                return f"block {idx} of window {self.window} is detached or shared"
        return None

    def truncate(self, serial: int, n_tokens: int) -> None:
        """Drop the sequence's tokens from ``n_tokens`` on (speculative decoding's rejected
        candidates): blocks past the new end are released, and every block that is no longer
        full leaves the reuse tree, since its rows are about to be overwritten."""
        seq = self.seqs[serial]
        full, keep = n_tokens // self.tpb, blocks_for(n_tokens, self.tpb)
        for idx in range(full, len(seq.table)):
            block = seq.table[idx]
            assert block is not None
            if block.node is not None:
                self._reclaim.uncache(block)
            if idx >= keep:
                self._release(seq, block, idx, final=True)
        del seq.table[keep:]
        del seq.gens[keep:]
        if seq.stored_depth > full:  # stored again from the last full block as it refills
            node = seq.stored_node
            for _ in range(seq.stored_depth - full):
                node = node.parent if node is not None else None
            seq.stored_depth, seq.stored_node = full, node if full else None

    # ---- internals -----------------------------------------------------------------------
    def _grow(self, seq: SeqBlocks, tokens: Sequence[int], n_from: int, n_to: int) -> None:
        if n_to <= n_from:
            return
        # what the call's first token cannot see; detached before allocating, so reusable
        self._detach_upto(seq, n_from + 1)
        for idx in range(len(seq.table), blocks_for(n_to, self.tpb)):
            block = self._reclaim.take_free_primary(seq.serial, idx)
            block.ref_count = 1
            block.priority = seq.priorities.for_block(idx)
            seq.put(idx, block)
            self.counters.allocated_blocks += 1
        upto = seq.storable_upto(n_to // self.tpb)
        if self.tree is not None and self.policy.stores_while_filling and upto:
            self._store_full(seq, tokens, upto)

    def _detach_upto(self, seq: SeqBlocks, n_tokens: int) -> None:
        target = detached_after(n_tokens, self.window, self.tpb, seq.first_live)
        while seq.first_live < target:
            idx = seq.first_live
            block = seq.table[idx]
            assert block is not None
            seq.first_live += 1
            self._release(seq, block, idx, final=False)
            self.counters.detached_blocks += 1

    def _release(self, seq: SeqBlocks, block: KVBlock, idx: int, *, final: bool) -> None:
        block.ref_count -= 1
        if block.ref_count < 0:
            raise RuntimeError(f"refcount below zero on {block} (window {self.window})")
        if block.ref_count:
            return
        block.priority = seq.priorities.for_block(idx)
        keep = block.node is not None or (
            not final
            and self.tree is not None
            and self.policy.keeps_detached_for_store
            and idx < seq.storable_upto(idx + 1)
            and seq.holds_bytes(idx)
        )
        self.pools[block.pool].queue.push(block, block.priority if keep else EMPTY_LEVEL)

    def _store_full(self, seq: SeqBlocks, tokens: Sequence[int], upto: int) -> None:
        """Cache the full blocks below ``upto`` not stored yet; all of them again if evicting
        a cached ancestor (a block this sequence computed privately) cut our chain."""
        node = seq.stored_node
        cut = node is not None and not node.attached
        if seq.stored_depth >= upto and not cut:
            return
        assert self.tree is not None
        if node is None or cut:  # walk again from the root
            self._store_chain(seq, tokens, self.tree.root, 0, upto)
        else:
            self._store_chain(seq, tokens, node, seq.stored_depth, upto)

    def _store_chain(
        self, seq: SeqBlocks, tokens: Sequence[int], node: TreeNode, depth: int, upto: int
    ) -> None:
        """Cache blocks ``depth..upto-1`` of ``seq`` below ``node`` where the tree has none."""
        assert self.tree is not None
        for j in range(depth, upto):
            node = self.tree.get_or_create(node, self.tree.key_at(tokens, j))
            b = seq.table[j]
            if (
                node.block is None
                and b is not None
                and b.node is None
                and seq.holds_bytes(j)  # not handed out since: still this slot's tokens
            ):
                self.tree.attach(node, b)
        seq.stored_depth, seq.stored_node = upto, node
        self.tree.prune(node)

    def _emit_move(self, kind: str, block: KVBlock) -> None:
        """Event for bytes moving between pools (hashes 0: a detached block not yet cached)."""
        node = block.node
        block_hash = parent_hash = 0
        if node is not None:
            block_hash = node.block_hash
            parent_hash = node.parent.block_hash if node.parent is not None else 0
        self._sink(KVCacheEvent(kind, self.window, block_hash, parent_hash, self.tpb))

    def _on_tree_event(self, kind: str, block_hash: int, parent_hash: int, n: int) -> None:
        if kind == "stored":
            self.counters.stored_blocks += 1
        else:
            self.counters.removed_blocks += 1
        self._sink(KVCacheEvent(kind, self.window, block_hash, parent_hash, n))
