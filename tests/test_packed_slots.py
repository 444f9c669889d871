"""Many sequences at once on the NPU path: packed generate models over slots of one KV pool
(model/packed.py, runtime/static/packed.py, runtime/static/slot_scheduler.py), on tiny random
Llamas with NPUW on the CPU, exact f32.

Every sequence's greedy tokens must be openvino-genai's for its prompt alone: a row that read
another sequence's slots, its own at the wrong positions, or a padding row's would change them.
"""

from __future__ import annotations

import threading

import numpy as np
import openvino as ov
import openvino_genai
import pytest
from conftest import TINY_NPU

from npuw_kv.config import decide
from npuw_kv.config.pipeline_config import PipelineConfig
from npuw_kv.errors import UsageError
from npuw_kv.pipeline import LLMPipeline

pytestmark = pytest.mark.npu_path  # also run under the NPU rules double

LENGTHS = (5, 30, 17, 50, 40, 9, 33)
EXACT = (
    "INFERENCE_PRECISION_HINT",
    "DYNAMIC_QUANTIZATION_GROUP_SIZE",
)  # padded fronts of every size, one chunk to four


def _ids(n: int, seed: int) -> np.ndarray:
    return ((np.arange(n, dtype=np.int64) * 7919 + seed * 13) % 49000 + 100).astype(np.int64)


def _together(pipe: LLMPipeline, prompts: list[np.ndarray], new: int) -> list[list[int]]:
    """Each prompt from its own thread, all at once: they join one running batch."""
    out: list = [None] * len(prompts)
    start = threading.Barrier(len(prompts))

    def call(i: int) -> None:
        start.wait()
        out[i] = pipe.generate(prompts[i], max_new_tokens=new, ignore_eos=True).tokens

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


@pytest.mark.unit
def test_packed_models_by_max_num_seqs():
    """A model for each of 4, 16, 64 below max_num_seqs and one for it; none off the static
    models, at 1, or with V transposed asked for (which both asked for refuses by name)."""
    npu = lambda **kw: PipelineConfig.from_kwargs("NPU", **kw)  # noqa: E731
    assert decide.packed_slots(npu()) == (4, 16)
    assert decide.packed_slots(npu(max_num_seqs=4)) == (4,)
    assert decide.packed_slots(npu(max_num_seqs=6)) == (4, 6)
    assert decide.packed_slots(npu(max_num_seqs=40)) == (4, 16, 40)
    assert decide.packed_slots(npu(max_num_seqs=1)) == ()
    # the default stands for as many slots as 16 x 2048 tokens of capacity hold
    assert decide.packed_slots(npu(max_prompt_len=4096)) == (4, 7)
    assert decide.packed_slots(npu(max_prompt_len=16128, min_response_len=128)) == (2,)
    assert decide.packed_slots(npu(max_prompt_len=16128, max_num_seqs=8)) == (4, 8)  # as set
    assert decide.packed_slots(npu(optimize_v_tensors=True)) == ()
    cpu = PipelineConfig.from_kwargs("CPU", attention_backend="sdpa")
    assert decide.packed_slots(cpu) == ()
    with pytest.raises(UsageError, match=r"max_num_seqs \(MAX_NUM_SEQS\) 1"):
        npu(optimize_v_tensors=True, max_num_seqs=8)
    with pytest.raises(UsageError, match="max_num_seqs"):  # the CPU's one dynamic model
        PipelineConfig.from_kwargs("CPU", attention_backend="sdpa", max_num_seqs=4)


def test_concurrent_sequences_match_each_alone(tiny_dir, tiny_reference):
    pipe = LLMPipeline(tiny_dir, "NPU", max_num_seqs=6, **TINY_NPU)
    prompts = [_ids(n, seed) for seed, n in enumerate(LENGTHS)]  # 7 for 6 slots: one waits
    together = _together(pipe, prompts, 14)
    for prompt, tokens in zip(prompts, together, strict=True):
        assert tokens == tiny_reference(prompt, 14)
        assert len(set(tokens)) > 4  # a meaningful comparison, not a constant loop
    stats = pipe.kv_stats()
    assert stats["packed_slots"] == [4, 6]
    # packed calls ran, several rows each (not one sequence after another)
    assert stats["packed_steps"] > 0 and stats["packed_rows"] >= 2 * stats["packed_steps"]
    assert stats["batch_peak_sequences"] >= 2


def test_a_list_of_prompts_and_samples_batch(tiny_dir, tiny_reference):
    """``generate(list)`` and ``num_return_sequences`` run in the slots too; each sample as a
    lone call with its seed gives it."""
    pipe = LLMPipeline(tiny_dir, "NPU", **TINY_NPU)
    config = openvino_genai.GenerationConfig()
    config.max_new_tokens, config.ignore_eos = 10, True
    prompts = [_ids(n, seed) for seed, n in enumerate(LENGTHS[:3])]
    batch = ov.Tensor(np.stack([p[:5] for p in prompts]))  # a [3, 5] batch of ids
    got = pipe.generate(batch, config).tokens
    assert got == [tiny_reference(p[:5], 10) for p in prompts]
    config.do_sample, config.num_return_sequences, config.rng_seed = True, 3, 7
    samples = pipe.generate(ov.Tensor(prompts[1][None]), config).tokens
    assert len({tuple(s) for s in samples}) == 3
    assert pipe.kv_stats()["batch_peak_sequences"] == 3


def test_beams_fork_into_free_slots_as_genai(tiny_dir):
    """A beam search on the NPU path: each new beam's KV copied into a free slot."""
    pipe = LLMPipeline(tiny_dir, "NPU", **TINY_NPU)
    reference = openvino_genai.LLMPipeline(
        str(tiny_dir), "CPU", KV_CACHE_PRECISION="f32", **{k: TINY_NPU[k] for k in EXACT}
    )
    config = openvino_genai.GenerationConfig()
    config.max_new_tokens, config.num_beams, config.num_return_sequences = 10, 3, 3
    config.ignore_eos = True
    ids = ov.Tensor(_ids(20, 1)[None])
    ours, theirs = pipe.generate(ids, config), reference.generate(ids, config)
    assert [list(t) for t in ours.tokens] == [list(t) for t in theirs.tokens]
    assert np.allclose(ours.scores, theirs.scores, atol=1e-4)
    assert pipe.kv_stats()["beam_copied_bytes"] > 0


def test_a_chat_turn_returns_to_the_slot_that_holds_its_history(tiny_dir, tiny_reference):
    """A prompt that extends an earlier sequence goes to that sequence's slot, and only its
    new tokens run (the others keep theirs)."""
    pipe = LLMPipeline(tiny_dir, "NPU", **TINY_NPU)
    first = [_ids(n, seed) for seed, n in enumerate((20, 25, 30))]
    answers = _together(pipe, first, 6)
    turn = np.concatenate([first[1], answers[1], _ids(4, 9)])
    again = _together(pipe, [turn, _ids(12, 5)], 6)
    assert again[0] == tiny_reference(turn, 6)
    assert again[1] == tiny_reference(_ids(12, 5), 6)
    slots = pipe.engine.batch.scheduler.lanes
    assert max(lane.reused_tokens for lane in slots) >= 25  # the history, not recomputed


def test_continuous_batching_pipeline_steps_the_slots(tiny_dir, tiny_reference):
    """genai's ContinuousBatchingPipeline on the NPU path: requests added, then stepped; a
    step decodes every running request at once."""
    from npuw_kv import ContinuousBatchingPipeline

    pipe = ContinuousBatchingPipeline(
        tiny_dir, openvino_genai.SchedulerConfig(), "NPU", dict(TINY_NPU)
    )
    config = openvino_genai.GenerationConfig()
    config.max_new_tokens, config.ignore_eos = 8, True
    prompts = [_ids(n, seed) for seed, n in enumerate(LENGTHS[:4])]
    handles = [pipe.add_request(i, ov.Tensor(p[None]), config) for i, p in enumerate(prompts)]
    steps = 0
    while pipe.has_non_finished_requests():
        pipe.step()
        steps += 1
    for prompt, handle in zip(prompts, handles, strict=True):
        assert list(handle.read_all()[0].generated_ids) == tiny_reference(prompt, 8)
    # a step per prompt chunk, and (at most) 8 more that each decode all four
    chunks = sum(-(-p.size // TINY_NPU["prefill_chunk_size"]) for p in prompts)
    assert steps <= chunks + 8 + 1
    assert pipe.get_metrics().cache_usage >= 0


@pytest.mark.unit
def test_a_scheduler_config_on_the_npu_path_sets_its_slots():
    from npuw_kv.api.pipeline_args import scheduler_settings

    scheduler = openvino_genai.SchedulerConfig()
    scheduler.max_num_seqs, scheduler.enable_prefix_caching = 8, False
    assert scheduler_settings(scheduler, "NPU", {}) == {"max_num_seqs": 8, "prefix_reuse": False}
    scheduler.num_kv_blocks = 100
    with pytest.raises(UsageError, match="num_kv_blocks=100 sizes the paged path"):
        scheduler_settings(scheduler, "NPU", {})
    with pytest.raises(UsageError, match="batched steps"):  # one sequence at a time there
        scheduler_settings(openvino_genai.SchedulerConfig(), "NPU", {"max_num_seqs": 1})


def test_a_long_prompt_is_read_between_the_others_steps(tiny_dir, tiny_reference):
    """An eight-chunk prompt arriving while others decode is read a few chunks at a time
    between their packed steps; every sequence still gets its tokens alone."""
    settings = {**TINY_NPU, "max_prompt_len": 128}
    pipe = LLMPipeline(tiny_dir, "NPU", max_num_seqs=4, **settings)
    scheduler = pipe.engine.batch.scheduler
    short = [_ids(6, seed) for seed in range(3)]
    long = _ids(120, 7)
    handles = [scheduler.submit(p.tolist()) for p in short]
    tokens: dict[int, list[int]] = {h: [] for h in handles}
    late, steps = None, []
    while scheduler.busy:
        out = scheduler.step()
        reading = late is not None and not tokens[late] and scheduler.scheduled == [late]
        steps.append("late" if reading else len(scheduler.scheduled))
        for handle, logits in out.items():
            tokens[handle].append(int(np.argmax(logits)))
            if len(tokens[handle]) == 12:
                scheduler.finish(handle)
            else:
                scheduler.feed(handle, tokens[handle][-1])
        if late is None and all(len(t) >= 2 for t in tokens.values()):
            late = scheduler.submit(long.tolist())
            tokens[late] = []
    for prompt, handle in zip([*short, long], [*handles, late], strict=True):
        assert tokens[handle] == tiny_reference(prompt, 12)
    first, last = steps.index("late"), len(steps) - 1 - steps[::-1].index("late")
    assert steps.count("late") == 8  # its 8 chunks, one a step
    assert 3 in steps[first:last]  # the others' packed step between its first and last chunk


def test_a_prefix_held_by_a_live_sequence_is_copied_not_recomputed(tiny_dir, tiny_reference):
    """Two chats sharing a system prompt of two chunks, the second arriving while the first
    decodes: the shared slots are copied into the second's slot and only its own tail runs."""
    pipe = LLMPipeline(tiny_dir, "NPU", max_num_seqs=4, **TINY_NPU)
    scheduler = pipe.engine.batch.scheduler
    system = _ids(32, 11)
    first = np.concatenate([system, _ids(7, 1)])
    second = np.concatenate([system, _ids(9, 2)])
    one = scheduler.submit(first.tolist())
    tokens: dict[int, list[int]] = {one: []}
    later = None
    while scheduler.busy:
        for handle, logits in scheduler.step().items():
            tokens[handle].append(int(np.argmax(logits)))
            if len(tokens[handle]) == 8:
                scheduler.finish(handle)
            else:
                scheduler.feed(handle, tokens[handle][-1])
        if later is None and tokens[one]:  # the first decodes: its slot holds the prompt
            later = scheduler.submit(second.tolist())
            tokens[later] = []
    assert list(tokens.values()) == [tiny_reference(first, 8), tiny_reference(second, 8)]
    slots = scheduler.lanes
    assert slots[1].reused_tokens >= 32 and scheduler.moved_bytes > 0
    # what /metrics reports as vLLM's prefix-cache queries and hits
    assert scheduler.prompt_tokens == first.size + second.size
    assert scheduler.hit_tokens == slots[1].reused_tokens


def test_kv_stats_report_the_slot_whose_prompt_ran_last(tiny_dir):
    """A four-chunk prompt in slot 0, then a one-chunk prompt in slot 1: the static figures of
    kv_stats() are slot 1's, the last prompt's (slot 0 alone would say four chunks)."""
    pipe = LLMPipeline(tiny_dir, "NPU", max_num_seqs=4, **TINY_NPU)
    scheduler = pipe.engine.batch.scheduler
    handles = [scheduler.submit(_ids(50, 1).tolist()), scheduler.submit(_ids(5, 2).tolist())]
    while any(scheduler.live[h].computed == 0 for h in handles):
        scheduler.step()
    assert scheduler.latest is scheduler.lanes[1]
    assert len(scheduler.lanes[0].prefill_pasts_used) == 4
    assert len(pipe.kv_stats()["prefill_pasts_used"]) == 1
    for handle in handles:
        scheduler.finish(handle)
