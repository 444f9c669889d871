"""Beam search on the PagedAttention path: openvino-genai's sequences and scores, with the
beams sharing the prompt's KV blocks.

References come from genai's own CPU pipeline on SmolLM2, both exact f32 with f32 KV, running
the same config (ours converted with ``to_genai``).  genai's tokens end with the stop token of
a hypothesis that stopped; ours leave it out (its log-prob is in the score, as in genai's).
"""

from __future__ import annotations

import numpy as np
import openvino as ov
import pytest
from conftest import TINY_NPU, make_pipe

from npuw_kv.api.generation_config import GenerationConfig
from npuw_kv.kv.blocks.sequence import blocks_for
from npuw_kv.pipeline import LLMPipeline
from npuw_kv.runtime.static.runner import StaticRunner

BEAMS = {"num_beams": 4, "num_return_sequences": 4, "max_new_tokens": 16}
SCORE_TOL = 1e-5  # float32 sums of log-probs; measured differences are <= 1.2e-7


@pytest.fixture(scope="module")
def both(f32_pipe, genai_f32_pipe):
    """``both(ids, **settings)``: (genai's EncodedResults, ours) for the same config."""
    eos = f32_pipe.tokenizer.get_eos_token_id()

    def run(ids, **settings):
        config = GenerationConfig.build(f32_pipe.get_generation_config(), **settings)
        tensor = ov.Tensor(np.array([ids], np.int64))
        theirs = genai_f32_pipe.generate(tensor, config.to_genai())
        ours = f32_pipe.generate(tensor, config)
        tokens = [[int(t) for t in seq] for seq in theirs.tokens]
        tokens = [seq[:-1] if seq and seq[-1] == eos else seq for seq in tokens]
        return (tokens, list(theirs.scores)), ours

    return run


def assert_same(theirs, ours) -> None:
    tokens, scores = theirs
    assert ours.tokens == tokens
    np.testing.assert_allclose(ours.scores, scores, rtol=0, atol=SCORE_TOL)


@pytest.fixture(scope="module")
def chat_ids(f32_pipe):
    return lambda text: f32_pipe.encode(text).tolist()


@pytest.mark.parametrize("length", [16, 200, 500])
def test_beams_give_genai_sequences_and_scores(both, text_ids, length):
    theirs, ours = both(text_ids(length).tolist(), **BEAMS)
    assert len(ours.tokens) == 4
    assert_same(theirs, ours)
    assert ours.scores == sorted(ours.scores, reverse=True)  # best first, as genai


def test_group_beam_search_with_diversity_matches_genai(both, chat_ids):
    ids = chat_ids("Write a short poem about the sea.")
    plain = both(ids, **BEAMS)[1]
    theirs, ours = both(ids, **BEAMS, num_beam_groups=2, diversity_penalty=1.0)
    assert_same(theirs, ours)
    assert ours.tokens != plain.tokens  # the second group is pushed off the first's tokens


@pytest.mark.parametrize(
    "settings",
    [
        {
            "length_penalty": 0.3,
            "stop_criteria": "early",
            "num_beams": 3,
            "num_return_sequences": 2,
        },
        {"length_penalty": 2.0, "stop_criteria": "never", "no_repeat_ngram_size": 3},
        {"length_penalty": 0.0, "stop_criteria": "heuristic"},
    ],
)
def test_length_penalty_and_stop_criteria_as_genai(both, chat_ids, settings):
    """An answer that ends at EOS early: finished hypotheses compete with running beams."""
    ids = chat_ids("Say only the word yes.")
    default = both(ids, **{**BEAMS, "max_new_tokens": 20})[1]
    theirs, ours = both(ids, **{**BEAMS, "max_new_tokens": 20, **settings})
    assert_same(theirs, ours)
    assert (ours.tokens, ours.scores) != (default.tokens, default.scores)


def test_a_batch_of_prompts_gives_each_its_beams(f32_pipe, genai_f32_pipe):
    prompts = ["Hi", "What is 2+2?"]
    config = GenerationConfig.build(
        f32_pipe.get_generation_config(), num_beams=3, num_return_sequences=3, max_new_tokens=8
    )
    ours = f32_pipe.generate(prompts, config)
    theirs = genai_f32_pipe.generate(prompts, config.to_genai())
    assert len(ours.texts) == 6 and ours.texts == theirs.texts
    np.testing.assert_allclose(ours.scores, theirs.scores, rtol=0, atol=SCORE_TOL)


def test_beam_steps_are_timed_as_genai_counts_them(f32_pipe, genai_f32_pipe):
    """PerfMetrics of beam search: one generated token per step (all beams', as genai counts
    it, the prefill's first included), one TTFT per prompt; the counts equal genai's for the
    same sequences.  The two prompts' beams run in the same steps (a TPOT value per step)."""
    prompts = ["What is 2+2? Answer with one digit.", "Hi"]
    config = GenerationConfig.build(
        f32_pipe.get_generation_config(), num_beams=4, num_return_sequences=4, max_new_tokens=12
    )
    ours = f32_pipe.generate(prompts, config)
    theirs = genai_f32_pipe.generate(prompts, config.to_genai())
    assert ours.texts == theirs.texts
    metrics, raw = ours.perf_metrics, ours.perf_metrics.raw_metrics
    steps = theirs.perf_metrics.get_num_generated_tokens()
    assert metrics.get_num_generated_tokens() == steps
    assert steps < sum(len(r.tokens) for r in ours.results)
    assert len(raw.m_times_to_first_token) == 2
    calls = len(raw.token_infer_durations)
    assert calls < steps and max(raw.m_batch_sizes) > 4  # both prompts' beams in one call
    assert len(raw.m_durations) == calls - 1
    assert metrics.get_tpot().mean > 0 and metrics.get_ttft().mean > 0
    assert metrics.get_throughput().mean == pytest.approx(1000 / metrics.get_tpot().mean)
    assert sum(raw.m_durations) < raw.generate_durations[0]


def test_beams_share_the_prompt_blocks_and_copy_on_write(f32_pipe, text_ids, genai_reference):
    """The prompt's full blocks are in every beam's table once, not once per beam; a beam
    forked from another copies only the block it will write next.  The cache stays usable."""
    ids = text_ids(500)
    runner = f32_pipe.runner
    copied = runner.host_bytes_copied
    greedy = f32_pipe.generate(ids, max_new_tokens=8, ignore_eos=True).tokens
    f32_pipe.generate(ids, num_beams=4, max_new_tokens=16)
    size = runner.cache.block_size
    prompt_full = len(ids) // size
    tail = blocks_for(len(ids) + 16, size) - prompt_full  # one beam's own blocks at most
    stats = f32_pipe.kv_stats()
    peak, moved = stats["beam_peak_blocks"], stats["beam_copied_bytes"]
    assert blocks_for(len(ids) + 1, size) <= peak <= prompt_full + 4 * tail
    assert peak < 2 * blocks_for(len(ids), size)  # not 4 x the prompt
    assert moved > 0
    assert runner.host_bytes_copied - copied == moved
    # the next call starts from a valid cache: the same greedy tokens as before, and genai's
    assert (
        f32_pipe.generate(ids, max_new_tokens=8, ignore_eos=True).tokens
        == greedy
        == genai_reference(ids, 8)
    )


@pytest.fixture(scope="module")
def static_pipe(smol_dir):
    """The static-shape path on the CPU, exact f32 with f32 KV: beams take turns in it."""
    return make_pipe(smol_dir, "CPU", attention_backend="sdpa", kv_precision="f32")


@pytest.mark.parametrize(
    "length,settings",
    [
        (16, BEAMS),
        (200, {**BEAMS, "max_new_tokens": 10}),
        (16, {**BEAMS, "num_beam_groups": 2, "diversity_penalty": 1.0, "max_new_tokens": 10}),
    ],
)
def test_static_path_beams_give_genai_sequences_and_scores(
    static_pipe, genai_f32_pipe, genai_reference, text_ids, length, settings, monkeypatch
):
    """genai's stateful (SDPA) pipeline runs beams, so the static path does: the same
    sequences and scores as genai's, one beam at a time in the runner's one sequence.  A beam
    parting from the cached one in its last token steps on from there (a step costs less
    than the prompt chunk reading it would)."""
    ids = text_ids(length).tolist()
    config = GenerationConfig.build(static_pipe.get_generation_config(), **settings)
    tensor = ov.Tensor(np.array([ids], np.int64))
    theirs = genai_f32_pipe.generate(tensor, config.to_genai())
    kept: list[int] = []
    truncate = StaticRunner.truncate
    monkeypatch.setattr(StaticRunner, "truncate", lambda r, n: (kept.append(n), truncate(r, n)))
    ours = static_pipe.generate(tensor, config)
    assert kept and all(length <= n for n in kept)  # stepped on, never into the prompt
    eos = static_pipe.tokenizer.get_eos_token_id()
    tokens = [[int(t) for t in seq] for seq in theirs.tokens]
    assert ours.tokens == [seq[:-1] if seq and seq[-1] == eos else seq for seq in tokens]
    np.testing.assert_allclose(ours.scores, list(theirs.scores), rtol=0, atol=1e-4)
    # the cache is left usable: greedy after beams is genai's greedy
    again = static_pipe.generate(text_ids(length), max_new_tokens=6, ignore_eos=True).tokens
    assert again == genai_reference(text_ids(length), 6)


def test_static_path_beams_end_where_a_beam_no_longer_fits_one_prompt(static_pipe, text_ids):
    """A beam taking its turn is read as a prompt: the answers stop at max_prompt_len."""
    room = 3
    ids = text_ids(static_pipe.runner.max_prompt_len - room)
    result = static_pipe.generate(
        ov.Tensor(ids.reshape(1, -1)), num_beams=2, num_return_sequences=2, max_new_tokens=16
    )
    assert all(len(tokens) <= room for tokens in result.tokens)
    assert any(len(tokens) == room for tokens in result.tokens)


def test_npu_path_refuses_beams_by_name_and_stays_usable(tiny_dir):
    """With one sequence at a time (max_num_seqs=1); in slots they run (test_packed_slots.py)."""
    pipe = LLMPipeline(tiny_dir, "NPU", max_num_seqs=1, **TINY_NPU)
    ids = np.arange(100, 120, dtype=np.int64)
    before = pipe.generate(ids, max_new_tokens=6, ignore_eos=True).tokens
    with pytest.raises(ValueError, match="num_beams > 1 runs.*max_num_seqs > 1.*NPU path here"):
        pipe.generate(ids, num_beams=2, max_new_tokens=6)
    assert pipe.generate(ids, max_new_tokens=6, ignore_eos=True).tokens == before


def test_streamer_is_refused_with_beams(f32_pipe, text_ids):
    with pytest.raises(ValueError, match="streamer.*num_beams=2"):
        f32_pipe.generate(text_ids(16), num_beams=2, max_new_tokens=4, streamer=lambda s: None)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"num_beams": 2, "num_return_sequences": 3}, "num_return_sequences .3. must be <="),
        ({"num_beams": 4, "num_beam_groups": 3}, "divisible by num_beam_groups"),
        ({"num_beams": 4, "num_beam_groups": 2}, "diversity_penalty"),
        ({"num_beams": 4, "diversity_penalty": 1.0}, "diversity_penalty"),
        ({"num_beams": 2, "do_sample": True}, "cannot sample"),
        ({"num_beams": 2, "repetition_penalty": 1.2}, "repetition_penalty"),
        ({"num_return_sequences": 2}, "needs do_sample=True .* or num_beams > 1"),
    ],
)
def test_beam_settings_are_checked_as_genai(settings, message):
    with pytest.raises(ValueError, match=message):
        GenerationConfig(max_new_tokens=8, **settings).validate()
