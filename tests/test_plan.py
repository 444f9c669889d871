"""Slot layout, masks and position ids of the chunk loop (pure numpy, no model)."""

from __future__ import annotations

import numpy as np
import pytest

from npuw_kv.runtime.static.plan import (
    PromptPlan,
    Slots,
    chunk_past_len,
    generate_inputs,
    prefill_inputs,
)

pytestmark = pytest.mark.unit  # builds no model (the quick tier)


@pytest.mark.parametrize(
    ("n", "chunks", "pad"), [(1, 1, 3), (3, 1, 1), (4, 1, 0), (5, 2, 3), (8, 2, 0)]
)
def test_front_padding_fills_every_chunk(n, chunks, pad):
    plan = PromptPlan(n, 4)
    assert (plan.num_chunks, plan.pad) == (chunks, pad)
    assert plan.padded_len == chunks * 4


def test_empty_prompt_is_rejected():
    with pytest.raises(ValueError, match="empty"):
        PromptPlan(0, 4)


def test_prefill_inputs_place_tokens_and_mask_pads():
    ids = np.arange(100, 106)  # 6 tokens, chunk 4 -> pad 2
    plan = PromptPlan(6, 4)
    past_len = 8
    first = prefill_inputs(ids, plan, 0, past_len)
    assert first.input_ids.tolist() == [[0, 0, 100, 101]]
    assert first.position_ids.tolist() == [[0, 0, 0, 1]]
    assert first.attention_mask.tolist() == [[0] * 8 + [0, 0, 1, 1]]
    assert first.write_slots == (0, 4)
    second = prefill_inputs(ids, plan, 1, past_len)
    assert second.input_ids.tolist() == [[102, 103, 104, 105]]
    assert second.position_ids.tolist() == [[2, 3, 4, 5]]
    # past slots 2, 3 hold tokens 0, 1; pads (0, 1) and unwritten slots stay masked
    assert second.attention_mask.tolist() == [[0, 0, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1]]
    assert second.write_slots == (4, 8)


def test_prefill_chunk_beyond_past_is_refused():
    with pytest.raises(ValueError, match="beyond past length"):
        prefill_inputs(np.arange(12), PromptPlan(12, 4), 2, past_len=4)


def test_generate_inputs_mask_live_slots_and_current_token():
    step = generate_inputs(7, slot=8, position=6, first_slot=2, past_len=10)
    assert step.input_ids.tolist() == [[7]]
    assert step.position_ids.tolist() == [[6]]
    assert step.attention_mask.tolist() == [[0, 0, 1, 1, 1, 1, 1, 1, 0, 0, 1]]
    assert step.write_slots == (8, 9)
    with pytest.raises(ValueError):
        generate_inputs(7, slot=11, position=9, first_slot=2, past_len=10)


def test_continuation_keeps_slots_and_ends_on_the_last_token():
    """9 tokens, token 0 at slot 2, the first 6 cached: one chunk of 4 ending at slot 11,
    which recomputes token 5 into its own slot and masks nothing it needs."""
    ids = np.arange(100, 109)
    plan = PromptPlan(9, 4, first_slot=2, cached=6)
    assert (plan.num_chunks, plan.pad, plan.padded_len, plan.start) == (1, 2, 11, 7)
    step = prefill_inputs(ids, plan, 0, past_len=8)
    assert step.write_slots == (7, 11)
    assert step.input_ids.tolist() == [[105, 106, 107, 108]]
    assert step.position_ids.tolist() == [[5, 6, 7, 8]]
    # past: slots 2..6 hold tokens 0..4; slot 7 is rewritten by this chunk, so it is not past
    assert step.attention_mask.tolist() == [[0, 0, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1]]


def test_continuation_chunks_may_start_in_the_padding():
    plan = PromptPlan(3, 4, first_slot=2, cached=1)  # ends at slot 5: chunk [1, 5)
    step = prefill_inputs(np.array([100, 101, 102]), plan, 0, past_len=4)
    assert step.write_slots == (1, 5)
    assert step.input_ids.tolist() == [[0, 100, 101, 102]]
    assert step.attention_mask.tolist() == [[0] * 4 + [0, 1, 1, 1]]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"cached": 2}, "need the first_slot"),
        ({"first_slot": 0, "cached": 5}, "at least one must be run"),
        ({"first_slot": 0}, "would start at slot -3"),  # two chunks back from slot 5
    ],
)
def test_impossible_continuations_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PromptPlan(5, 4, **kwargs)


def test_slots_follow_a_prompt_and_its_steps_to_the_end_of_the_buffer():
    """5 tokens in chunks of 4 (3 pad slots), then steps up to a buffer of 10 slots: the last
    token fed writes scratch (not kept), and nothing more can be fed."""
    slots = Slots(capacity=10)
    slots.start(PromptPlan(5, 4))
    assert (slots.first, slots.next, slots.position) == (3, 8, 5)
    assert slots.tokens_in_cache == 5 and slots.remaining == 3
    kept = []
    while slots.remaining:
        step = slots.step_inputs(1, past_len=10)
        assert step.write_slots == (slots.next, slots.next + 1)
        assert step.position_ids[0, 0] == slots.position
        kept.append(slots.keeps_next)
        slots.advance()
    assert kept == [True, True, False] and slots.tokens_in_cache == 7


def test_a_chunk_reads_the_slots_before_it_only_when_its_past_grows():
    plan = PromptPlan(10, 4)  # pad 2: chunks at slots 0, 4, 8
    assert [chunk_past_len(plan, k, True, 8) for k in range(3)] == [0, 4, 8]
    assert [chunk_past_len(plan, k, False, 8) for k in range(3)] == [8, 8, 8]
