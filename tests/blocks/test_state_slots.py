"""State slots of a hybrid model's linear-attention layers, driven against a simulated device.

The device double does what the plugin's paged linear-attention ops do with the slots it is
given: read the state from the first slot, write the state at the end of each interval the
call touches into the following ones.  A slot's "state" here is the token prefix it covers,
so every read checks that the slot holds exactly the state of the tokens before the call,
and no call may write a slot another sequence of the same call reads or writes.
"""

from __future__ import annotations

import random
from collections.abc import Hashable

import pytest
from blocks_helpers import build

from npuw_kv.kv.blocks import HybridBlockManager, StatePaging, StateSlots
from npuw_kv.kv.blocks.state_slots import ZERO

pytestmark = pytest.mark.unit  # builds no model (the quick tier)


class Device:
    """Slot contents (the token prefix each state covers) and the op's reads and writes."""

    def __init__(self, slots: int) -> None:
        self.content: dict[int, tuple[int, ...]] = {s: () for s in range(slots)}
        self.grows = 0

    def grow(self, slots: int) -> None:
        assert slots > len(self.content)
        self.content.update({s: () for s in range(len(self.content), slots)})
        self.grows += 1

    def copy(self, src: int, dst: int) -> None:
        assert dst != ZERO
        self.content[dst] = self.content[src]

    def call(self, paging: StatePaging, tokens: list[list[int]]) -> None:
        reads: list[int] = []
        for i, seq_tokens in enumerate(tokens):
            slots = paging.slots[paging.begins[i] : paging.begins[i + 1]].tolist()
            past, size = int(paging.past_lens[i]), int(paging.intervals[i])
            assert self.content[slots[0]] == tuple(seq_tokens[:past]), "read a wrong state"
            reads.append(slots[0])
            first = past // size
            assert len(slots) - 1 == (len(seq_tokens) - 1) // size - first + 1
            for k, slot in enumerate(slots[1:]):
                assert slot != ZERO, "the zero state written"
                end = min((first + k + 1) * size, len(seq_tokens))
                self.content[slot] = tuple(seq_tokens[:end])
        # the op runs the sequences side by side: none may write what another reads or writes
        own = [tuple(paging.slots[paging.begins[i] + 1 : paging.begins[i + 1]].tolist())
               for i in range(len(tokens))]  # fmt: skip
        for i, slot in enumerate(reads):
            others = {s for j, w in enumerate(own) if j != i for s in w}
            assert slot not in others, "a slot read and written by different sequences"
        for i, w in enumerate(own):
            others = {s for j, o in enumerate(own) if j != i for s in o}
            assert not set(w) & others, "a slot written by two sequences"


def slots(n: int = 4, interval: int = 4, checkpoints: int = 8) -> tuple[StateSlots, Device]:
    device = Device(n)
    return StateSlots(n, interval, checkpoints, grow=device.grow, copy=device.copy), device


def run(states: StateSlots, device: Device, calls: dict[Hashable, tuple[list[int], int]]) -> None:
    """One call: each sequence's tokens so far and how many of them are new."""
    parts = [(s, toks, len(toks) - new, new) for s, (toks, new) in calls.items()]
    device.call(states.plan(parts), [toks for toks, _ in calls.values()])
    states.check_invariants()


def test_chunks_checkpoint_every_interval_and_a_prefix_starts_from_one() -> None:
    states, device = slots(interval=4)
    prompt = list(range(100, 111))  # 11 tokens: intervals end at 4 and 8
    states.start("a", prompt, 0)
    run(states, device, {"a": (prompt[:6], 6)})
    run(states, device, {"a": (prompt, 5)})
    assert states.checkpoints == 2
    assert states.reusable(prompt + [7], 11) == 8
    assert states.reusable(prompt[:8] + [0, 0, 0], 10) == 8
    assert states.reusable([1] + prompt[1:], 11) == 0  # another first token: nothing
    assert states.reusable(prompt, 7) == 4  # the KV hit caps it
    states.end("a")
    states.start("b", prompt + [5, 6], 8)
    assert states.reused == 1
    run(states, device, {"b": (prompt + [5, 6], 5)})  # reads the checkpoint after 8 tokens
    assert device.content[ZERO] == ()


def test_batched_calls_fork_and_end_keep_every_state_right() -> None:
    rng = random.Random(7)
    states, device = slots(n=3, interval=3, checkpoints=4)
    tokens: dict[Hashable, list[int]] = {}
    serial = 0
    for _ in range(400):
        live = list(tokens)
        action = rng.random()
        if action < 0.15 or not live:
            serial += 1
            shared = rng.choice(([0, 1, 2, 0, 1, 2, 0], [2, 2, 1, 1, 0, 0, 2], []))
            tail = [rng.randrange(3) for _ in range(rng.randrange(1, 5))]
            prompt = shared[: rng.randrange(len(shared) + 1)] + tail
            hit = states.reusable(prompt, len(prompt) - 1)
            states.start(serial, prompt, hit)
            tokens[serial] = prompt[:hit]
            pending = prompt[hit:]
            run(states, device, {serial: (prompt, len(pending))})
            tokens[serial] = prompt
        elif action < 0.25:
            parent = rng.choice(live)
            serial += 1
            states.fork(parent, serial)
            tokens[serial] = list(tokens[parent])
        elif action < 0.35 and len(live) > 1:
            gone = rng.choice(live)
            states.end(gone)
            tokens.pop(gone)
        else:
            calls = {}
            for seq in rng.sample(live, rng.randrange(1, len(live) + 1)):
                new = [rng.randrange(3) for _ in range(rng.choice([1, 1, 2, 5]))]
                tokens[seq] = tokens[seq] + new
                calls[seq] = (tokens[seq], len(new))
            run(states, device, calls)
        states.check_invariants()
    assert device.grows and states.copies and states.reused  # every path was taken
    for seq in list(tokens):
        states.end(seq)
    states.check_invariants()
    assert states.used == states.checkpoints  # only the cached checkpoints hold slots


def test_a_verify_keeps_each_tokens_state_for_the_rollback() -> None:
    states, device = slots(interval=4)
    prompt = [5, 6, 7]
    states.start("s", prompt, 0)
    run(states, device, {"s": (prompt, 3)})
    draft = prompt + [8, 9, 10]
    paging = states.plan([("s", draft, 3, 3)], per_token=True)
    assert paging.intervals.tolist() == [1]
    device.call(paging, [draft])
    with pytest.raises(ValueError, match="after 2 tokens is not kept"):
        states.rollback("s", 2)
    states.rollback("s", 4)  # one candidate accepted
    states.check_invariants()
    assert states.tokens("s") == 4
    run(states, device, {"s": (draft[:4] + [11], 1)})  # reads the state after 4 tokens
    states.end("s")
    states.check_invariants()


def test_a_slot_read_this_call_is_never_evicted_for_a_checkpoint() -> None:
    states, device = slots(n=3, interval=2, checkpoints=1)
    states.start("a", [1, 2], 0)
    run(states, device, {"a": ([1, 2], 2)})  # its state: the checkpoint after [1, 2]
    states.start("b", [7, 8], 0)
    # a moves on from the checkpoint, which no sequence then holds; b needs two slots, and
    # the checkpoint a reads in this very call must not be one of them: the tables grow
    run(states, device, {"a": ([1, 2, 3], 1), "b": ([7, 8], 2)})
    assert device.grows == 1
    assert states.checkpoints == 1 and states.reusable([1, 2, 5], 2) == 2


def test_a_slot_released_while_its_call_reads_it_is_not_handed_out_in_that_call() -> None:
    states, device = slots(n=4, interval=4, checkpoints=0)
    states.start("a", [1, 2, 3], 0)
    run(states, device, {"a": ([1, 2, 3], 3)})
    draft = [1, 2, 3, 4, 5]
    device.call(states.plan([("a", draft, 3, 2)], per_token=True), [draft])  # all accepted
    # a reads the verify's last slot once more, and lets it go in the same plan; b must not
    # get it to write into
    states.start("b", [9], 0)
    run(states, device, {"a": (draft + [6], 1), "b": ([9], 1)})
    assert not device.grows


def test_the_manager_cuts_a_kv_hit_to_a_checkpointed_prefix() -> None:
    kv = build([None], [40], max_seq_len=64, tpb=2)
    states, device = slots(interval=4)
    mgr = HybridBlockManager(kv.config, states=states)
    prompt = list(range(10, 21))  # 11 tokens
    assert mgr.add_sequence("a", prompt[:6]) == 0
    device.call(mgr.state_paging([("a", 0, 6)]), [prompt[:6]])
    mgr.add_tokens("a", prompt[6:])
    device.call(mgr.state_paging([("a", 6, 5)]), [prompt])
    mgr.remove_sequence("a")
    # the KV blocks hold 10 tokens of it (whole blocks, one left to run); the states 8
    assert mgr.lookup(prompt + [1]).hit_tokens == 8
    assert mgr.add_sequence("b", prompt + [1]) == 8
    device.call(mgr.state_paging([("b", 8, 4)]), [prompt + [1]])
    mgr.fork("b", "c")
    mgr.check_invariants()
    with pytest.raises(ValueError, match="state after 10 tokens is not kept"):
        mgr.truncate("c", 10)
    assert mgr.num_tokens("c") == 12  # nothing changed
    mgr.remove_sequence("b")
    mgr.remove_sequence("c")
    mgr.check_invariants()
