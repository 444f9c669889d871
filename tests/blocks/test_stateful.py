"""Hypothesis state machine: random add/extend/remove/lookup on >= 3 window sizes.

Small pools sized exactly for the drawn ``max_tokens_per_call`` (plus a few spare blocks),
sequences up to 96 tokens with 1-4 tokens per block (so SWA windows detach, hit, claim, copy,
offload and onboard many blocks), multi-token calls, varied default / offload priorities,
reuse on or off, host pools on or off.

Like a runtime, every call writes each new token's KV row with a fingerprint of its prefix,
and before writing, every row the call's first token reads (its window, including the rows a
prefix hit hands out) must hold the fingerprint of the tokens the sequence claims: a wrong or
detached row there is a silently wrong answer. After every step the manager's invariants are
checked and every cached block must hold the fingerprints of its tree path (so offload,
onboard, SWA copies and stale ownership are checked on real bytes).

Operations are counted two ways: every rule run (``rules``) and calls attempted on a live or
valid target (``attempted``); the test asserts >= 10**5 attempted per run.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from blocks_helpers import check_read_rows, check_tree_bytes, fingerprints, write_prefix_rows
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from npuw_kv.kv.blocks import (
    BlockManagerConfig,
    ChunkTooLargeError,
    KVBlockManager,
    OutOfBlocksError,
    PriorityRange,
    SequenceExistsError,
    SequenceTooLongError,
    UnknownSequenceError,
    uniform_layers,
)
from npuw_kv.kv.blocks.sequence import min_live_blocks

OPS = {
    "rules": 0,
    "attempted": 0,
    "adds": 0,
    "hits": 0,
    "errors": 0,
    "offloads": 0,
    "onboards": 0,
    "copies": 0,
    "cached_checked": 0,
}
MIN_TOTAL_OPS = 100_000
GROW = (ChunkTooLargeError, OutOfBlocksError, SequenceTooLongError)


def snapshot(mgr: KVBlockManager) -> tuple:
    tables = {
        (sid, w): tuple(mgr.block_table(sid, w)) for sid in mgr.sequence_ids for w in mgr.windows
    }
    return mgr.stats(), tables


class BlockMachine(RuleBasedStateMachine):
    mgr: KVBlockManager

    @initialize(
        tpb=st.sampled_from([1, 1, 2, 3, 4]),
        # short sequences cycle small pools fastest; long ones detach many blocks
        max_seq_len=st.one_of(st.integers(8, 24), st.integers(12, 96)),
        n_swa=st.sampled_from([2, 3, 3]),
        data=st.data(),
    )
    def setup(self, tpb: int, max_seq_len: int, n_swa: int, data: st.DataObject) -> None:
        swa = data.draw(
            st.lists(
                st.one_of(st.integers(1, 4), st.integers(1, min(24, max_seq_len - 1))),
                min_size=n_swa,
                max_size=n_swa,
                unique=True,
            )
        )
        # a full-attention layer, or SWA only (its hits are then never capped by a full window)
        full: list[int | None] = [None] if n_swa == 2 or data.draw(st.booleans()) else []
        windows = sorted(swa) + [max_seq_len] * len(full)
        chunk = data.draw(st.sampled_from([1, 1, 2, tpb, 3 * tpb, 12]))
        spare = st.sampled_from([0, 0, 1, 2, 5])  # tight pools: blocks cycle between owners
        extra = data.draw(st.lists(spare, min_size=len(windows), max_size=len(windows)))
        blocks = [
            min_live_blocks(max_seq_len, w, tpb, chunk) + e
            for w, e in zip(windows, extra, strict=True)
        ]
        host_fraction = data.draw(st.sampled_from([0.0, 0.5, 1.0]))
        cfg = BlockManagerConfig(
            layers=uniform_layers([*swa, *full], 1, 1),
            max_seq_len=max_seq_len,
            primary_blocks=dict(zip(windows, blocks, strict=True)),
            host_blocks={w: int(b * host_fraction) for w, b in zip(windows, blocks, strict=True)},
            tokens_per_block=tpb,
            enable_reuse=data.draw(st.sampled_from([True, True, True, False])),
            default_priority=data.draw(st.sampled_from([0, 35, 100])),
            offload_min_priority=data.draw(st.sampled_from([0, 35, 60, 100])),
            max_tokens_per_call=chunk,
        )
        self.mgr = KVBlockManager(cfg)
        self.tpb, self.max_len, self.chunk = tpb, max_seq_len, chunk
        self.vocab = data.draw(st.integers(2, 4))
        self.tokens: dict[int, list[int]] = {}
        self.corpus: list[list[int]] = [[]]
        self.removed: list[int] = []
        self.next_id = 0

    # ---- helpers -------------------------------------------------------------------------
    def _new_tokens(self, data: st.DataObject) -> list[int]:
        """Mostly within ``max_tokens_per_call``, sometimes one over (must be refused)."""
        if data.draw(st.booleans()):
            n = 1  # decoding
        else:
            over = data.draw(st.booleans())
            n = data.draw(st.integers(1, self.chunk + 1 if over else self.chunk))
        return data.draw(st.lists(st.integers(0, self.vocab - 1), min_size=n, max_size=n))

    def _expect_unchanged(self, before: tuple, exc: Exception, n_old: int, n_new: int) -> None:
        assert snapshot(self.mgr) == before, "a failed call changed the manager"
        if isinstance(exc, SequenceTooLongError):
            assert n_old + n_new > self.max_len
        elif isinstance(exc, ChunkTooLargeError):
            assert n_new > self.chunk
        OPS["errors"] += 1

    # ---- rules ---------------------------------------------------------------------------
    @rule(data=st.data())
    def add(self, data: st.DataObject) -> None:
        OPS["rules"] += 1
        OPS["attempted"] += 1
        # an earlier conversation, or the prompt of a live one (a hit then claims its detached
        # cached blocks or copies its live ones)
        live = [self.tokens[s] for s in sorted(self.tokens)[-4:]]
        base = data.draw(st.sampled_from(self.corpus[-8:] + live))
        # half the time the whole earlier conversation plus a new turn (multi-turn chat)
        cut = len(base) if data.draw(st.booleans()) else data.draw(st.integers(0, len(base)))
        hit_before = self.mgr.lookup(base[:cut] + [0]).hit_tokens if cut else 0
        toks = (base[:hit_before] + base[hit_before:cut] + self._new_tokens(data))[
            : self.max_len + 1
        ]
        if data.draw(st.integers(0, 3)):  # mostly the runtime protocol: a chunk after the hit
            toks = toks[: self.mgr.lookup(toks).hit_tokens + self.chunk]
        kind = data.draw(st.sampled_from(["none", "int", "numpy", "ranges"]))
        prio: int | list[PriorityRange] | None = None
        if kind == "int":
            prio = data.draw(st.sampled_from([0, 10, 35, 80, 100]))
        elif kind == "numpy":
            prio = np.int64(data.draw(st.integers(0, 100)))  # type: ignore[assignment]
        elif kind == "ranges":
            prio = [PriorityRange(0, 2 * self.tpb, 90), PriorityRange(2 * self.tpb, None, 20)]
        reuse = data.draw(st.integers(0, 7)) > 0  # now and then a cold run (reuse=False)
        expected = self.mgr.lookup(toks).hit_tokens if reuse else 0
        before = snapshot(self.mgr)
        sid = self.next_id
        try:
            hit = self.mgr.add_sequence(sid, toks, priority=prio, reuse=reuse)
        except GROW as exc:
            self._expect_unchanged(before, exc, expected, len(toks) - expected)
            return
        self.next_id += 1
        assert hit == expected and hit % self.tpb == 0 and hit <= max(0, len(toks) - 1)
        OPS["adds"] += 1
        OPS["hits"] += hit > 0
        self.tokens[sid] = list(toks)
        check_read_rows(self.mgr, sid, toks, hit)  # the rows the hit hands out
        write_prefix_rows(self.mgr, sid, toks, hit)

    @precondition(lambda self: bool(self.tokens))
    @rule(data=st.data())
    def extend(self, data: st.DataObject) -> None:
        OPS["rules"] += 1
        OPS["attempted"] += 1
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        new = self._new_tokens(data)
        before = snapshot(self.mgr)
        n_old = len(self.tokens[sid])
        try:
            self.mgr.add_tokens(sid, new)
        except GROW as exc:
            self._expect_unchanged(before, exc, n_old, len(new))
            return
        self.tokens[sid].extend(new)
        check_read_rows(self.mgr, sid, self.tokens[sid], n_old)
        write_prefix_rows(self.mgr, sid, self.tokens[sid], n_old)

    @precondition(lambda self: bool(self.tokens))
    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        OPS["rules"] += 1
        OPS["attempted"] += 1
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        self.mgr.remove_sequence(sid)
        self.corpus.append(self.tokens.pop(sid))
        self.removed.append(sid)

    @rule(data=st.data())
    def lookup(self, data: st.DataObject) -> None:
        OPS["rules"] += 1
        OPS["attempted"] += 1
        base = data.draw(st.sampled_from(self.corpus[-8:]))
        toks = base + data.draw(st.lists(st.integers(0, self.vocab - 1), max_size=3))
        hit = self.mgr.lookup(toks)
        assert hit.hit_tokens % self.tpb == 0 and hit.hit_tokens <= max(0, len(toks) - 1)
        assert all(v >= 0 for v in hit.per_window.values())

    @rule(data=st.data())
    def bad_call(self, data: st.DataObject) -> None:
        OPS["rules"] += 1  # deliberately invalid target: not counted as attempted
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
            assert snapshot(self.mgr) == before, "a failed call changed the manager"
        else:
            raise AssertionError("bad call was accepted")

    # ---- invariants ----------------------------------------------------------------------
    @invariant()
    def consistent(self) -> None:
        self.mgr.check_invariants()
        OPS["cached_checked"] += check_tree_bytes(self.mgr)

    def teardown(self) -> None:
        if hasattr(self, "mgr"):
            st_ = self.mgr.stats()
            OPS["offloads"] += st_.offloads
            OPS["onboards"] += st_.onboards
            OPS["copies"] += sum(w.counters.copied_blocks for w in st_.windows.values())


# builds no model, but a soak of 10**5 operations is no quick test: the full suite runs it
@pytest.mark.slow(seconds=220)
def test_random_operations() -> None:
    """Runs the machine in rounds until >= 10**5 operations on valid targets have been checked.

    ``NPUW_KV_STATEFUL_OPS`` raises the target for a longer soak.
    """
    target = max(MIN_TOTAL_OPS, int(os.environ.get("NPUW_KV_STATEFUL_OPS", "0")))
    rounds = 0
    while OPS["attempted"] < target and rounds < 50:
        run_state_machine_as_test(
            BlockMachine,
            settings=settings(
                max_examples=100,
                stateful_step_count=200,
                deadline=None,
                suppress_health_check=list(HealthCheck),
            ),
        )
        rounds += 1
    print(f"random operations in {rounds} rounds: {OPS}")
    assert OPS["attempted"] >= target, f"only {OPS['attempted']} operations were attempted"
    assert OPS["hits"] > 0 and OPS["offloads"] > 0 and OPS["onboards"] > 0
    assert OPS["errors"] > 0 and OPS["copies"] > 0 and OPS["cached_checked"] > 0


@pytest.mark.unit  # builds no model (the quick tier)
def test_fingerprint_helper_depends_on_the_whole_prefix() -> None:
    assert fingerprints([1, 2])[1] != fingerprints([3, 2])[1]
