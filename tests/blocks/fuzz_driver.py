"""Random driver of ``KVBlockManager``, shared by ``test_random_driver.py`` and
``fuzz.py`` (the long runs).

Episodes draw a layout (>= 3 window sizes: 2-3 sliding windows, usually with full attention),
tight primary pools, host pools from 1 block to twice the primary, priorities, chunk size and
store kind; then random operations drive one manager like a serving engine would: prompts that
continue earlier or live conversations (``lookup``, then ``add_sequence`` of the hit plus one
chunk, the rest with ``add_tokens`` chunk by chunk), decoding, sealing (``store=False``),
removals, lookups, calls that must be refused, and preemption when the pools are full.

Every call that succeeds writes its rows (``fuzz_shadow``); after every operation the manager's
invariants hold, every live row and every cached block holds exactly the rows of its tokens (so
a prefix hit is checked on the bytes it hands out), the stored/removed events replay into the
tree, and a refused call changed nothing (and was refused for the right reason: a lone sequence
never runs out of blocks). Right after a sequence ends, windows that held its blocks must serve
its whole prefix. A run is reproducible from ``(seed, episode)``; a failure names both and the
last operations.
"""

from __future__ import annotations

import itertools
import random
import re
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import SupportsIndex

import numpy as np
from fuzz_episode import Episode
from fuzz_shadow import (
    ROW_BYTES,
    ExternalStore,
    OwnStore,
    RowWords,
    check_live_rows,
    check_tree_rows,
    write_rows,
)

from npuw_kv.kv.blocks import (
    BlockManagerError,
    ChunkTooLargeError,
    KVBlockManager,
    OutOfBlocksError,
    PriorityRange,
    SequenceExistsError,
    SequenceTooLongError,
    UnknownSequenceError,
)
from npuw_kv.kv.blocks.sequence import required_trailing_blocks

_FITS = re.compile(r"at most (\d+) tokens fits now")


class FuzzFailure(AssertionError):
    """A check failed; the message says how to replay the episode."""


@dataclass
class FuzzStats:
    """What a run exercised (the test asserts every path was taken)."""

    ops: int = 0
    episodes: int = 0
    adds: int = 0
    hits: int = 0
    hit_tokens: int = 0
    extends: int = 0
    forks: int = 0
    grows: int = 0
    removes: int = 0
    lookups: int = 0
    preemptions: int = 0
    rows_checked: int = 0
    cached_checked: int = 0
    refused: Counter[str] = field(default_factory=Counter)
    manager: Counter[str] = field(default_factory=Counter)  # summed WindowCounters


@dataclass
class _Seq:
    tokens: list[int]
    words: RowWords
    pending: list[int]  # prompt tokens still to add, chunk by chunk
    sealed: bool = False  # add_tokens(store=False) was called: later blocks are not cached


class Driver:
    """One episode: a manager, its byte store, the live sequences and earlier conversations."""

    def __init__(self, ep: Episode, rng: random.Random, stats: FuzzStats) -> None:
        self.ep, self.rng, self.stats = ep, rng, stats
        self.store = ExternalStore() if ep.external else OwnStore()
        copier = self.store.copy if isinstance(self.store, ExternalStore) else None
        self.mgr = KVBlockManager(ep.config(), copy_slots=copier)
        for g, b in zip(self.mgr.groups.values(), ep.blocks, strict=True):
            assert g.primary_blocks == b and g.bytes_per_token == ROW_BYTES, (g, b)
        self.store.bind(self.mgr)
        self.live: dict[int, _Seq] = {}
        self.corpus: list[list[int]] = []
        self.gone: list[int] = []
        self.next_id = 0
        self.log: deque[str] = deque(maxlen=30)
        self.cached: dict[int, Counter[int]] = {w: Counter() for w in self.mgr.windows}

    # ---- one operation ---------------------------------------------------------------------
    def step(self) -> None:
        r = self.rng.random()
        if r < 0.25 or not self.live:
            self.add()
        elif r < 0.29:
            self.fork()
        elif r < 0.295:
            self.grow()
        elif r < 0.72:
            self.extend()
        elif r < 0.87:
            self.remove(self.rng.choice(list(self.live)))
        elif r < 0.97:
            self.lookup()
        else:
            self.bad_call()
        self.check()

    def check(self) -> None:
        self.mgr.check_invariants()
        for sid, seq in self.live.items():
            n = len(seq.tokens)
            self.stats.rows_checked += check_live_rows(self.mgr, self.store, sid, seq.words, n, n)
        self.stats.cached_checked += check_tree_rows(self.mgr, self.store)
        self._check_events()

    def _check_events(self) -> None:
        """The stored/removed events replay into exactly the tree's cached hashes."""
        for ev in self.mgr.drain_events():
            cached = self.cached[ev.window_size]
            if ev.kind == "stored":
                cached[ev.block_hash] += 1
            elif ev.kind == "removed":
                assert cached[ev.block_hash] > 0, f"{ev} for a block never stored"
                cached[ev.block_hash] -= 1
            else:  # offloaded / onboarded: a cached block, or a detached one not cached yet
                assert ev.block_hash == 0 or cached[ev.block_hash] > 0, ev
        assert self.mgr.stats().events_dropped == 0
        for w, wm in self.mgr.windows.items():
            tree = Counter(n.block_hash for n in wm.tree.nodes() if n.block) if wm.tree else {}
            assert +self.cached[w] == tree, f"window {w}: events disagree with the tree"

    # ---- operations ------------------------------------------------------------------------
    def add(self) -> None:
        if len(self.live) >= self.ep.max_live:
            self.remove(self.rng.choice(list(self.live)))
            return
        prompt = self._prompt()
        reuse = self.rng.random() < 0.9
        hit = self.mgr.lookup(prompt).hit_tokens if reuse else 0
        step = self.ep.chunk + 1 if self.rng.random() < 0.03 else self.rng.randint(1, self.ep.chunk)
        first = prompt[: hit + step]
        self._add(self.next_id, prompt, first, hit, reuse)

    def _add(self, sid: int, prompt: list[int], first: list[int], hit: int, reuse: bool) -> None:
        prio = self._priority()
        self.log.append(
            f"add {sid} first={first} pending={prompt[len(first) :]} hit={hit} "
            f"reuse={reuse} prio={prio!r}"
        )
        large = len(first) - hit > self.ep.chunk
        before = self._snapshot()
        self.stats.ops += 1
        try:
            got = self.mgr.add_sequence(sid, first, priority=prio, reuse=reuse)
        except BlockManagerError as exc:
            self._refused(before, exc, long=False, large=large, alone=not self.live)
            fits = _FITS.search(str(exc)) if isinstance(exc, OutOfBlocksError) else None
            if fits:  # the scheduler shrinks the call to what the error says fits
                self._add(sid, prompt, first[: hit + int(fits.group(1))], hit, reuse)
            elif isinstance(exc, OutOfBlocksError):
                self._preempt()
            return
        assert not large, f"add_sequence accepted {len(first) - hit} tokens after the hit"
        assert got == hit, f"add_sequence reused {got} tokens, lookup said {hit}"
        self.next_id += 1
        seq = self.live[sid] = _Seq(list(first), RowWords(), prompt[len(first) :])
        seq.words.extend(first)
        self.stats.adds += 1
        self.stats.hits += hit > 0
        self.stats.hit_tokens += hit
        # the rows the hit hands out: every claimed, copied or onboarded block, on its bytes
        self.stats.rows_checked += check_live_rows(self.mgr, self.store, sid, seq.words, hit, hit)
        write_rows(self.mgr, self.store, sid, seq.words, hit, len(first))

    def extend(self) -> None:
        sid = self.rng.choice(list(self.live))
        seq = self.live[sid]
        n = self.rng.randint(1, self.ep.chunk)
        if seq.pending:
            over = self.rng.random() < 0.03
            new = seq.pending[: self.ep.chunk + 1 if over else n]
        else:
            new = self._tokens(1 if self.rng.random() < 0.7 else n)
        too_long = len(seq.tokens) + len(new) > self.ep.max_seq_len
        if too_long and self.rng.random() < 0.8:
            self.remove(sid)  # the conversation is over
            return
        store = bool(seq.pending) or self.rng.random() > 0.05
        if self.rng.random() < 0.1:  # a batch step it waits out: only what it reads next stays
            self.mgr.detach_unseen(sid)
            self.mgr.check_invariants()
        self._extend(sid, new, store)

    def _extend(self, sid: int, new: list[int], store: bool) -> None:
        seq = self.live[sid]
        n_old = len(seq.tokens)
        self.log.append(f"extend {sid} at {n_old} new={new} store={store}")
        long = n_old + len(new) > self.ep.max_seq_len
        large = len(new) > self.ep.chunk
        before = self._snapshot()
        self.stats.ops += 1
        try:
            self.mgr.add_tokens(sid, new, store=store)
        except BlockManagerError as exc:
            self._refused(before, exc, long=long, large=large, alone=len(self.live) == 1)
            fits = _FITS.search(str(exc)) if isinstance(exc, OutOfBlocksError) else None
            if fits:
                self._extend(sid, new[: int(fits.group(1))], store)
            elif isinstance(exc, OutOfBlocksError):
                self._preempt(keep=sid)
            return
        assert not (long or large), f"add_tokens accepted {len(new)} tokens at {n_old}"
        if seq.pending[: len(new)] == new:
            del seq.pending[: len(new)]
        seq.tokens += new
        seq.sealed |= not store
        seq.words.extend(new)
        self.stats.extends += 1
        self.stats.rows_checked += check_live_rows(
            self.mgr, self.store, sid, seq.words, n_old, n_old
        )
        write_rows(self.mgr, self.store, sid, seq.words, n_old, len(seq.tokens))

    def fork(self) -> None:
        """A beam parting from another: the child reads the parent's rows, and both go on."""
        if len(self.live) >= self.ep.max_live:
            self.remove(self.rng.choice(list(self.live)))
            return
        parent = self.rng.choice(list(self.live))
        src, sid = self.live[parent], self.next_id
        self.log.append(f"fork {parent} -> {sid}")
        before = self._snapshot()
        self.stats.ops += 1
        try:
            self.mgr.fork(parent, sid)
        except OutOfBlocksError as exc:
            self._refused(before, exc, long=False, large=False, alone=False)
            if len(self.live) > 1:  # the pools may hold only one sequence: no fork then
                self._preempt(keep=parent)
            return
        self.next_id += 1
        seq = self.live[sid] = _Seq(list(src.tokens), RowWords(), list(src.pending), src.sealed)
        seq.words.extend(seq.tokens)
        self.stats.forks += 1
        n = len(seq.tokens)
        self.stats.rows_checked += check_live_rows(self.mgr, self.store, sid, seq.words, n, n)

    def grow(self) -> None:
        """The runtime grows a window's pool with sequences live (a batch outgrew it): every
        live row and cached block must read the same after it."""
        window = self.rng.choice(sorted(self.mgr.windows))
        blocks = self.mgr.windows[window].primary.num_slots + self.rng.randint(1, 4)
        self.log.append(f"grow window {window} to {blocks} blocks")
        self.stats.ops += 1
        if isinstance(self.store, ExternalStore):
            self.store.grow(window, blocks)
        self.mgr.grow_primary(window, blocks)
        self.stats.grows += 1

    def remove(self, sid: int) -> None:
        self.log.append(f"remove {sid}")
        self.stats.ops += 1
        want = self._served_after_remove(sid)
        self.mgr.remove_sequence(sid)
        seq = self.live.pop(sid)
        self.corpus.append(seq.tokens)
        del self.corpus[:-24]
        self.gone.append(sid)
        self.stats.removes += 1
        if want:
            got = self.mgr.lookup(seq.tokens + [0]).per_window
            for w, tokens in want.items():
                assert got[w] == tokens, f"window {w} serves {got[w]} of {tokens} tokens of {sid}"

    def _served_after_remove(self, sid: int) -> dict[int, int]:
        """Windows that must serve all full blocks of ``sid`` right after it ends: full
        attention (it held every block until then), and SWA windows whose sequence is still
        storable and holds the blocks before its last full one live (white-box: reads the
        window managers' tables)."""
        seq, ep = self.live[sid], self.ep
        k = len(seq.tokens) // ep.tpb
        if not (ep.enable_reuse and k) or seq.sealed:
            return {}
        want = {ep.max_seq_len: k * ep.tpb} if ep.full else {}
        serial = self.mgr._seqs[sid].serial
        for w in ep.swa:
            needs = max(1, required_trailing_blocks(w, ep.tpb))  # window 1: the node at k
            first_live = self.mgr.block_table(sid, w).count(-1)
            if self.mgr.windows[w].seqs[serial].storable and k - needs >= first_live:
                want[w] = k * ep.tpb
        return want

    def lookup(self) -> None:
        toks = self._prompt()
        self.log.append(f"lookup {toks}")
        self.stats.ops += 1
        hit = self.mgr.lookup(toks)
        assert hit.hit_tokens % self.ep.tpb == 0 and 0 <= hit.hit_tokens <= max(0, len(toks) - 1)
        assert all(hit.hit_tokens <= v <= len(toks) for v in hit.per_window.values()), hit
        self.stats.lookups += 1

    def bad_call(self) -> None:
        """Calls on a wrong target are refused and change nothing."""
        before = self._snapshot()
        self.stats.ops += 1
        try:
            if self.gone and self.rng.random() < 0.5:
                self.log.append(f"bad: add_tokens to removed {self.gone[-1]}")
                self.mgr.add_tokens(self.gone[-1], [0])
            elif self.live:
                sid = self.rng.choice(list(self.live))
                self.log.append(f"bad: add_sequence with live id {sid}")
                self.mgr.add_sequence(sid, [0])
            else:
                self.log.append("bad: remove unknown id")
                self.mgr.remove_sequence(-1)
        except (UnknownSequenceError, SequenceExistsError) as exc:
            assert self._snapshot() == before, "a refused call changed the manager"
            self.stats.refused[type(exc).__name__] += 1
        else:
            raise AssertionError("a call on a wrong target was accepted")

    # ---- helpers ---------------------------------------------------------------------------
    def _refused(
        self, before: tuple, exc: BlockManagerError, *, long: bool, large: bool, alone: bool
    ) -> None:
        self.log.append(f"  refused: {type(exc).__name__}")
        assert self._snapshot() == before, f"a refused call changed the manager: {exc}"
        if isinstance(exc, SequenceTooLongError):
            assert long, exc
        elif isinstance(exc, ChunkTooLargeError):
            assert large and not long, exc
        elif isinstance(exc, OutOfBlocksError):
            assert not (long or large), exc
            # the budget check's promise: one sequence, calls <= chunk, always fits
            assert not alone, f"a lone sequence ran out of blocks: {exc}"
        else:
            raise exc
        self.stats.refused[type(exc).__name__] += 1

    def _preempt(self, keep: int | None = None) -> None:
        """What a scheduler does when nothing fits: end another sequence."""
        others = [s for s in self.live if s != keep]
        assert others, "nothing fits but no other sequence holds blocks"
        self.stats.preemptions += 1
        self.remove(self.rng.choice(others))

    def _snapshot(self) -> tuple:
        tables = {
            (sid, w): tuple(self.mgr.block_table(sid, w))
            for sid in self.live
            for w in self.mgr.windows
        }
        return self.mgr.stats(), tables

    def _tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(self.ep.vocab) for _ in range(n)]

    def _prompt(self) -> list[int]:
        """A new turn after (part of) an earlier or a live conversation, or a fresh prompt."""
        r = self.rng.random()
        base: list[int] = []
        if self.corpus and r < 0.5:
            base = self.rng.choice(self.corpus[-8:])
        elif self.live and r < 0.75:
            base = self.live[self.rng.choice(list(self.live))].tokens
        cut = len(base) if self.rng.random() < 0.5 else self.rng.randint(0, len(base))
        turn = self._tokens(self.rng.randint(1, 2 * self.ep.chunk + 2))
        return (base[:cut] + turn)[: self.ep.max_seq_len]

    def _priority(self) -> SupportsIndex | list[PriorityRange] | None:
        r = self.rng.random()
        if r < 0.3:
            return None
        if r < 0.6:
            return self.rng.choice([0, 10, 35, 80, 100])
        if r < 0.75:
            return np.int64(self.rng.randint(0, 100))
        head = self.rng.randint(1, 3) * self.ep.tpb
        return [PriorityRange(0, head, 90), PriorityRange(head, None, self.rng.choice([0, 20]))]

    def finish(self) -> None:
        for wm in self.mgr.windows.values():
            self.stats.manager.update({k: v for k, v in vars(wm.counters).items() if v})
        self.stats.manager["external_copies"] += getattr(self.store, "copies", 0)
        self.stats.episodes += 1


def run(ops: int, seed: int, *, episode: int | None = None, progress: bool = False) -> FuzzStats:
    """Run episodes until ``ops`` operations were made; ``episode``: replay that one only."""
    stats = FuzzStats()
    for index in itertools.count() if episode is None else [episode]:
        rng = random.Random(f"{seed}:{index}")
        ep = Episode.draw(rng, first=index == 0)
        driver = Driver(ep, rng, stats)
        for _ in range(ep.ops):
            try:
                driver.step()
            except (AssertionError, BlockManagerError) as exc:
                recent = "\n  ".join(driver.log)
                raise FuzzFailure(
                    f"seed {seed} episode {index} ({ep}): {type(exc).__name__}: {exc}\n"
                    f"replay: python tests/blocks/fuzz.py --seed {seed} --episode {index}\n"
                    f"last operations:\n  {recent}"
                ) from exc
            if episode is None and stats.ops >= ops:
                break
        driver.finish()
        if progress:
            print(
                f"episode {index}: {stats.ops} ops, windows {ep.windows}, tpb {ep.tpb}, "
                f"chunk {ep.chunk}, host {ep.host_blocks}, {driver.store.name} store",
                flush=True,
            )
        if stats.ops >= ops:
            break
    return stats
