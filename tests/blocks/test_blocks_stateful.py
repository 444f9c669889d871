"""Hypothesis state machine: random add/extend/remove/lookup on >= 3 window sizes.

Small pools, reuse on, host pools on or off. After every step the manager's invariants are
checked and, like a runtime would, every token's KV row is written with a fingerprint of its
prefix; every cached block must still hold the fingerprints of its tree path (so offload,
onboard and SWA copies move real bytes), and every reused block must hold the prompt's rows.

The total number of random operations is counted and asserted (>= 10**5 per run).
"""

from __future__ import annotations

import os

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)

from npuw_kv.kv.blocks import (
    BlockManagerConfig,
    KVBlockManager,
    OutOfBlocksError,
    PriorityRange,
    SequenceExistsError,
    SequenceTooLongError,
    UnknownSequenceError,
    uniform_layers,
)
from npuw_kv.kv.blocks.sequence import min_live_blocks

OPS = {"ops": 0, "adds": 0, "hits": 0, "errors": 0, "offloads": 0, "onboards": 0}
MIN_TOTAL_OPS = 100_000
MASK = 0xFFFFFFFF


def fingerprints(tokens: list[int], start_hash: int = 0) -> list[int]:
    """Rolling hash of each prefix: what the KV row at that position depends on."""
    out, h = [], start_hash
    for t in tokens:
        h = ((h * 1_000_003) ^ (t + 7)) & MASK
        out.append(h)
    return out


def row_bytes(fp: int, width: int) -> np.ndarray:
    return np.resize(np.frombuffer(fp.to_bytes(4, "little"), dtype=np.uint8), width)


def snapshot(mgr: KVBlockManager) -> tuple:
    tables = {
        (sid, w): tuple(mgr.block_table(sid, w)) for sid in mgr.sequence_ids for w in mgr.windows
    }
    return mgr.stats(), tables


class BlockMachine(RuleBasedStateMachine):
    mgr: KVBlockManager

    @initialize(
        tpb=st.sampled_from([1, 2, 3, 4]),
        max_seq_len=st.integers(10, 36),
        n_swa=st.sampled_from([2, 3]),
        data=st.data(),
    )
    def setup(self, tpb: int, max_seq_len: int, n_swa: int, data: st.DataObject) -> None:
        swa = data.draw(
            st.lists(st.integers(1, max_seq_len - 1), min_size=n_swa, max_size=n_swa, unique=True)
        )
        windows = sorted(swa) + [max_seq_len]
        extra = data.draw(st.lists(st.integers(0, 6), min_size=len(windows), max_size=len(windows)))
        blocks = [
            min_live_blocks(max_seq_len, w, tpb) + e for w, e in zip(windows, extra, strict=True)
        ]
        host_fraction = data.draw(st.sampled_from([0.0, 0.5, 1.0]))
        block_bytes = 4 * tpb  # one layer per window: 1 kv head, head_dim 1, float16, K+V
        total = sum(blocks)
        cfg = BlockManagerConfig(
            layers=uniform_layers(swa + [None], 1, 1),
            max_seq_len=max_seq_len,
            kv_budget_bytes=total * block_bytes + block_bytes // 2,
            host_budget_bytes=int(total * host_fraction) * block_bytes + block_bytes // 2,
            tokens_per_block=tpb,
            window_size_shares=[b / total for b in blocks],
            offload_min_priority=data.draw(st.sampled_from([0, 35, 60])),
        )
        self.mgr = KVBlockManager(cfg, env={})
        for w, b in zip(windows, blocks, strict=True):
            assert self.mgr.groups[w].primary_blocks == b
        self.tpb, self.max_len = tpb, max_seq_len
        self.vocab = data.draw(st.integers(2, 4))
        self.tokens: dict[int, list[int]] = {}
        self.corpus: list[list[int]] = [[]]
        self.removed: list[int] = []
        self.next_id = 0

    # ---- helpers -------------------------------------------------------------------------
    def _draw_tokens(self, data: st.DataObject) -> list[int]:
        base = data.draw(st.sampled_from(self.corpus[-8:]))
        # half the time the whole earlier conversation plus a new turn (multi-turn chat)
        cut = len(base) if data.draw(st.booleans()) else data.draw(st.integers(0, len(base)))
        tail = data.draw(st.lists(st.integers(0, self.vocab - 1), max_size=8))
        return (base[:cut] + tail)[: self.max_len + 2]

    def _write_rows(self, sid: int, n_old: int) -> None:
        toks = self.tokens[sid]
        fps = fingerprints(toks)
        for w, g in self.mgr.groups.items():
            table = self.mgr.block_table(sid, w)
            store = self.mgr.storage(w)
            for p in range(n_old, len(toks)):
                slot = table[p // self.tpb]
                assert slot >= 0, f"row {p} of window {w} is in a detached slot"
                store[slot, p % self.tpb] = row_bytes(fps[p], g.bytes_per_token)

    def _check_reused(self, sid: int, hit: int) -> None:
        fps = fingerprints(self.tokens[sid])
        for w, g in self.mgr.groups.items():
            table = self.mgr.block_table(sid, w)
            store = self.mgr.storage(w)
            for p in range(hit):
                slot = table[p // self.tpb]
                if slot >= 0:
                    got = store[slot, p % self.tpb]
                    assert np.array_equal(got, row_bytes(fps[p], g.bytes_per_token)), (
                        f"window {w}: reused row {p} lost its contents"
                    )

    def _expect_unchanged(self, before: tuple) -> None:
        assert snapshot(self.mgr) == before, "a failed call changed the manager"
        OPS["errors"] += 1

    # ---- rules ---------------------------------------------------------------------------
    @rule(data=st.data())
    def add(self, data: st.DataObject) -> None:
        OPS["ops"] += 1
        toks = self._draw_tokens(data)
        kind = data.draw(st.sampled_from(["none", "int", "ranges"]))
        prio: int | list[PriorityRange] | None = None
        if kind == "int":
            prio = data.draw(st.sampled_from([10, 35, 80]))
        elif kind == "ranges":
            prio = [PriorityRange(0, 2 * self.tpb, 90), PriorityRange(2 * self.tpb, None, 20)]
        expected = self.mgr.lookup(toks).hit_tokens
        before = snapshot(self.mgr)
        sid = self.next_id
        try:
            hit = self.mgr.add_sequence(sid, toks, priority=prio)
        except (OutOfBlocksError, SequenceTooLongError) as exc:
            assert len(toks) > self.max_len or isinstance(exc, OutOfBlocksError)
            self._expect_unchanged(before)
            return
        self.next_id += 1
        assert hit == expected and hit % self.tpb == 0 and hit <= max(0, len(toks) - 1)
        OPS["adds"] += 1
        OPS["hits"] += hit > 0
        self.tokens[sid] = list(toks)
        self._check_reused(sid, hit)
        self._write_rows(sid, hit)

    @rule(data=st.data())
    def extend(self, data: st.DataObject) -> None:
        OPS["ops"] += 1
        if not self.tokens:
            return
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        new = data.draw(st.lists(st.integers(0, self.vocab - 1), min_size=1, max_size=6))
        before = snapshot(self.mgr)
        n_old = len(self.tokens[sid])
        try:
            self.mgr.add_tokens(sid, new)
        except (OutOfBlocksError, SequenceTooLongError) as exc:
            assert n_old + len(new) > self.max_len or isinstance(exc, OutOfBlocksError)
            self._expect_unchanged(before)
            return
        self.tokens[sid].extend(new)
        self._write_rows(sid, n_old)

    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        OPS["ops"] += 1
        if not self.tokens:
            return
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        self.mgr.remove_sequence(sid)
        self.corpus.append(self.tokens.pop(sid))
        self.removed.append(sid)

    @rule(data=st.data())
    def lookup(self, data: st.DataObject) -> None:
        OPS["ops"] += 1
        toks = self._draw_tokens(data)
        hit = self.mgr.lookup(toks)
        assert hit.hit_tokens % self.tpb == 0 and hit.hit_tokens <= max(0, len(toks) - 1)
        assert all(v >= 0 for v in hit.per_window.values())

    @rule(data=st.data())
    def bad_call(self, data: st.DataObject) -> None:
        OPS["ops"] += 1
        before = snapshot(self.mgr)
        choice = data.draw(st.sampled_from(["removed", "unknown", "duplicate"]))
        try:
            if choice == "removed" and self.removed:
                self.mgr.add_tokens(self.removed[-1], [0])
            elif choice == "duplicate" and self.tokens:
                self.mgr.add_sequence(next(iter(self.tokens)), [0])
            else:
                self.mgr.remove_sequence(-1)
        except (UnknownSequenceError, SequenceExistsError):
            self._expect_unchanged(before)
        else:
            raise AssertionError("bad call was accepted")

    # ---- invariants ----------------------------------------------------------------------
    @invariant()
    def consistent(self) -> None:
        self.mgr.check_invariants()
        for w, wm in self.mgr.windows.items():
            assert wm.tree is not None
            width = wm.group.bytes_per_token
            stack = [(child, 0) for child in wm.tree.root.children.values()]
            while stack:
                node, h = stack.pop()
                fps = fingerprints(list(node.key), h)
                if node.block is not None:
                    rows = wm.pools[node.block.pool].store[node.block.slot]
                    for i, fp in enumerate(fps):
                        assert np.array_equal(rows[i], row_bytes(fp, width)), (
                            f"window {w}: cached block at depth {node.depth} has wrong bytes"
                        )
                stack.extend((c, fps[-1]) for c in node.children.values())

    def teardown(self) -> None:
        if hasattr(self, "mgr"):
            st_ = self.mgr.stats()
            OPS["offloads"] += st_.offloads
            OPS["onboards"] += st_.onboards


def test_random_operations() -> None:
    """Runs the machine in rounds until >= 10**5 random operations have been checked.

    ``NPUW_KV_STATEFUL_OPS`` raises the target for a longer soak.
    """
    target = max(MIN_TOTAL_OPS, int(os.environ.get("NPUW_KV_STATEFUL_OPS", "0")))
    rounds = 0
    while OPS["ops"] < target and rounds < 50:
        run_state_machine_as_test(
            BlockMachine,
            settings=settings(
                max_examples=200,
                stateful_step_count=200,
                deadline=None,
                suppress_health_check=list(HealthCheck),
            ),
        )
        rounds += 1
    print(f"random operations in {rounds} rounds: {OPS}")
    assert OPS["ops"] >= target, f"only {OPS['ops']} random operations ran"
    assert OPS["hits"] > 0 and OPS["offloads"] > 0 and OPS["onboards"] > 0 and OPS["errors"] > 0
