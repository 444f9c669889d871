"""The prompt's own log-probabilities in-process (``echo`` with ``logprobs``: genai's fields):
equal to the original model's (its stateful IR, every row, exact f32) on the paged path, in
the running batch beside other requests and alone, with a cached prefix, and on the
static-shape path from every prefill row's logits (full_prefill_logits) or, by default, from
its generate model token by token; beam search is refused by name."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from conftest import make_pipe

from npuw_kv.api.generation_config import GenerationConfig
from npuw_kv.errors import UsageError
from npuw_kv.generation.decode import generate_tokens

TOLERANCE = 1e-4  # the paged kernels and the stateful IR's, both exact f32


def check_scores(result, ids, reference, top: int) -> None:
    assert result.prompt_ids == [int(t) for t in ids]
    assert result.prompt_logprobs[0] is None and result.prompt_top_logprobs[0] == []
    got = np.array(result.prompt_logprobs[1:], np.float64)
    assert np.abs(got - reference(ids)[0]).max() <= TOLERANCE
    for chosen, best in zip(got, result.prompt_top_logprobs[1:], strict=True):
        assert len(best) == top and best[0][1] >= chosen
        assert [p for _, p in best] == sorted((p for _, p in best), reverse=True)


def test_paged_batch_scores_the_prompt_beside_other_requests(
    f32_pipe, text_ids, prompt_logprobs_reference
):
    """Two prompts of several chunks scored while another request generates in the same
    steps; a second call served from the cached prefix still scores every token."""
    long, short = text_ids(300), text_ids(23)
    results: dict[str, object] = {}

    def run(name: str, prompt, **fields) -> None:
        results[name] = f32_pipe.generate(prompt, **fields)

    threads = [
        threading.Thread(target=run, args=("long", long.tolist()),
                         kwargs=dict(echo=True, logprobs=3, max_new_tokens=0)),
        threading.Thread(target=run, args=("short", short.tolist()),
                         kwargs=dict(echo=True, logprobs=2, max_new_tokens=4)),
        threading.Thread(target=run, args=("other", "Once upon a time"),
                         kwargs=dict(max_new_tokens=24)),
    ]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    check_scores(results["long"], long, prompt_logprobs_reference, 3)
    check_scores(results["short"], short, prompt_logprobs_reference, 2)
    assert results["long"].tokens == [] and len(results["short"].tokens) == 4
    again = f32_pipe.generate(long.tolist(), echo=True, logprobs=3, max_new_tokens=1)
    check_scores(again, long, prompt_logprobs_reference, 3)
    plain = f32_pipe.generate(long.tolist(), echo=True, max_new_tokens=1)
    assert plain.prompt_logprobs == []  # echo alone: the text only, no rows computed


def test_paged_lone_run_scores_the_prompt(f32_pipe, text_ids, prompt_logprobs_reference):
    """The runner alone (the path of speculative decoding and chat turns): its prefill hands
    every row of each chunk to the scores."""
    ids = text_ids(270)
    config = GenerationConfig(max_new_tokens=2, echo=True, logprobs=1)
    result = generate_tokens(f32_pipe.runner, f32_pipe.tokenizer, ids, config, None)
    check_scores(result, ids, prompt_logprobs_reference, 1)


@pytest.mark.parametrize(
    ("device", "backend"),
    [("CPU", {"attention_backend": "sdpa"}), pytest.param("NPU", {}, marks=pytest.mark.npu_path)],
)
def test_static_path_with_every_rows_logits(
    smol_dir, text_ids, prompt_logprobs_reference, device, backend
):
    """The static-shape path (the CPU's, and the NPU path: NPUW, here on the CPU) keeps the
    head on every row with full_prefill_logits; the prompt is then read whole."""
    pipe = make_pipe(smol_dir, device, full_prefill_logits=True, **backend)
    ids = text_ids(300)
    result = pipe.generate(ids.tolist(), echo=True, logprobs=2, max_new_tokens=0)
    check_scores(result, ids, prompt_logprobs_reference, 2)


@pytest.mark.parametrize(
    ("device", "backend"),
    [("CPU", {"attention_backend": "sdpa"}), pytest.param("NPU", {}, marks=pytest.mark.npu_path)],
)
def test_static_path_at_its_defaults_reads_the_prompt_by_steps(
    smol_dir, text_ids, prompt_logprobs_reference, device, backend
):
    """Without full_prefill_logits (the NPU path's default: the head sees the last row) the
    prompt's first token is prefilled and each next one fed as a generate step: the same
    scores, and the answer after them the same as a plain call's."""
    pipe = make_pipe(smol_dir, device, **backend)
    ids = text_ids(40)
    scored = pipe.generate(ids.tolist(), echo=True, logprobs=3, max_new_tokens=5, ignore_eos=True)
    check_scores(scored, ids, prompt_logprobs_reference, 3)
    plain = pipe.generate(ids.tolist(), max_new_tokens=5, ignore_eos=True)
    assert scored.tokens == plain.tokens


def test_refused_by_name_where_it_cannot_be_done(f32_pipe):
    with pytest.raises(UsageError, match="num_beams"):
        f32_pipe.generate("Hi", echo=True, logprobs=1, max_new_tokens=2, num_beams=2,
                          num_return_sequences=2)  # fmt: skip
