"""ContinuousBatchingPipeline as openvino-genai's: assisted generation per request (prompt
lookup, a draft model), a few KV blocks handled at run time, start_chat / finish_chat,
get_metrics, tokenizer properties, and genai's Adapter and draft_model whatever the import
order.  SmolLM2, exact f32: assisted answers are plain decoding's token for token."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import openvino as ov
import openvino.properties.hint as hints
import openvino_genai
import pytest

from npuw_kv import ContinuousBatchingPipeline, LLMPipeline
from npuw_kv.api import encoding
from npuw_kv.config.settings import EXACT_F32

SETTINGS = {**EXACT_F32, "kv_precision": "f32", "attention_backend": "pa"}
CODE = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"
PROMPTS = ["Repeat this code exactly:\n" + CODE, "The Sun is yellow because"]
NEW = 24


def make_cb(smol_dir, scheduler=None, tokenizer_properties=None, **props):
    return ContinuousBatchingPipeline(
        smol_dir, scheduler, "CPU", {**SETTINGS, **props}, tokenizer_properties
    )


def config(**fields) -> openvino_genai.GenerationConfig:
    out = openvino_genai.GenerationConfig(max_new_tokens=NEW, ignore_eos=True)
    out.apply_chat_template = False
    for name, value in fields.items():
        setattr(out, name, value)
    return out


def run(pipe, prompts, generation_config) -> tuple[list[list[int]], int]:
    """Each prompt added as a request, stepped to the end: the tokens, and the steps."""
    handles = [pipe.add_request(i, p, generation_config) for i, p in enumerate(prompts)]
    steps = 0
    while pipe.has_non_finished_requests():
        pipe.step()
        steps += 1
    return [h.read_all()[0].generated_ids for h in handles], steps


@pytest.fixture(scope="module")
def plain(smol_dir):
    """Built with genai's tokenizer_properties (refused before): they compile its tokenizer."""
    return make_cb(smol_dir, tokenizer_properties={hints.inference_precision: ov.Type.f32})


@pytest.fixture(scope="module")
def greedy(plain):
    tokens, _ = run(plain, PROMPTS, config())
    assert all(len(t) == NEW for t in tokens)
    return tokens


@pytest.mark.slow(seconds=40)
def test_prompt_lookup_requests_answer_as_plain_decoding_in_fewer_steps(smol_dir, greedy):
    lookup = make_cb(smol_dir, prompt_lookup=True)
    tokens, steps = run(lookup, PROMPTS, config(num_assistant_tokens=5, max_ngram_size=3))
    assert tokens == greedy
    assert steps < 2 * NEW  # the code's repeats were accepted: several tokens in some steps
    assert lookup.engine.kv_stats()["speculative"]["accepted"] > 0
    with pytest.raises(ValueError, match="runs one sequence: not with num_beams > 1"):
        lookup.add_request(9, "hi", config(num_assistant_tokens=5, max_ngram_size=3, num_beams=2))
    assert not lookup.has_non_finished_requests()  # refused before anything was queued


@pytest.mark.slow(seconds=40)
def test_draft_model_requests_answer_as_plain_decoding(smol_dir, greedy):
    """genai's own draft_model object in the properties, as genai's tests pass it."""
    pipe = make_cb(smol_dir, draft_model=openvino_genai.draft_model(str(smol_dir), "CPU"))
    tokens, steps = run(pipe, PROMPTS, config(num_assistant_tokens=4))
    assert tokens == greedy
    assert steps < 2 * NEW  # the draft is the model itself: its candidates are accepted
    # genai's tests' setting: the draft stops at its first unsure token
    tokens, _ = run(pipe, PROMPTS[:1], config(assistant_confidence_threshold=0.9))
    assert tokens == greedy[:1]
    # tree search: the draft's tree checked in one main-model call per step
    tree = config(num_assistant_tokens=6, tree_depth=3, branching_factor=2)
    tokens, steps = run(pipe, PROMPTS, tree)
    assert tokens == greedy and steps < 2 * NEW
    assert pipe.engine.kv_stats()["speculative"]["accepted"] > 0


def test_without_a_scheduler_config_it_pages_as_genai_does(smol_dir, greedy):
    """genai's continuous batching always pages its KV: a KV precision named with no
    ``SchedulerConfig`` and no backend (which keeps LLMPipeline's ``auto`` on the static path)
    does not turn the pipeline away; the answers are the paged pipeline's."""
    properties = {**EXACT_F32, "KV_CACHE_PRECISION": "f32"}
    pipe = ContinuousBatchingPipeline(smol_dir, device="CPU", properties=properties)
    assert pipe.engine.decided.paged
    assert run(pipe, PROMPTS, config())[0] == greedy


def test_num_assistant_tokens_without_an_assistant_decodes_plainly(plain, greedy):
    """As genai (its test of extended_perf_metrics without a draft): a warning, no refusal."""
    with pytest.warns(RuntimeWarning, match="num_assistant_tokens=5 has no effect"):
        tokens, _ = run(plain, PROMPTS[1:], config(num_assistant_tokens=5))
    assert tokens == greedy[1:]


def _scheduler(**fields) -> openvino_genai.SchedulerConfig:
    out = openvino_genai.SchedulerConfig()
    for name, value in fields.items():
        setattr(out, name, value)
    return out


@pytest.mark.slow(seconds=40)
def test_a_few_kv_blocks_preempt_at_run_time_instead_of_refusing(smol_dir, plain):
    """Three blocks of 32 tokens (refused when built before, as fewer than one sequence of
    max_prompt_len + min_response_len needs): both requests start, then outgrow the pools
    together and one is preempted; a request that outgrows the pools alone ends with what it
    generated."""
    pipe = make_cb(smol_dir, _scheduler(num_kv_blocks=3))
    prompts = ["The Sun is", "Paris is the capital of"]
    tokens, _ = run(pipe, prompts, config(max_new_tokens=40))
    assert tokens == run(plain, prompts, config(max_new_tokens=40))[0]
    assert pipe.batch.scheduler.stats.preemptions > 0
    handle = pipe.add_request(3, "The Sun is", config(max_new_tokens=200))
    while pipe.has_non_finished_requests():
        pipe.step()
    (out,) = handle.read_all()
    prompt = pipe.get_tokenizer().encode("The Sun is").input_ids.get_size()
    assert len(out.generated_ids) == 3 * 32 - prompt + 1  # the last one's KV is never written
    assert out.finish_reason == openvino_genai.GenerationFinishReason.LENGTH
    assert handle.get_status() == openvino_genai.GenerationStatus.FINISHED  # its own length
    # group beam search of two requests in pools too small for their beams together: each
    # ends with its best hypotheses so far (a beam preempted while its siblings were run
    # used to be fed before its logits came, and failed)
    beams = config(max_new_tokens=40, num_beams=6, num_beam_groups=3, diversity_penalty=1.0)
    beams.num_return_sequences = 6
    results = pipe.generate(prompts, [beams, beams])
    assert [len(r.m_generation_ids) for r in results] == [6, 6]
    assert all(text for r in results for text in r.m_generation_ids)
    # ended for want of KV room, as genai reports them
    assert [r.m_status for r in results] == [openvino_genai.GenerationStatus.IGNORED] * 2


def test_chat_turns_are_llm_pipeline_chat_turns(plain):
    chat = LLMPipeline(plain.engine)
    turn = openvino_genai.GenerationConfig(max_new_tokens=8)
    with pytest.warns(DeprecationWarning):
        plain.start_chat("Answer briefly.")
    chat.start_chat("Answer briefly.")
    for question in ("1+1=", "What did I ask?"):
        (result,) = plain.generate([question], [turn])
        assert result.m_generation_ids == [str(chat.generate(question, turn))]
    with pytest.raises(ValueError, match="in a chat .* one text prompt"):
        plain.generate(["a", "b"], turn)
    with pytest.warns(DeprecationWarning):
        plain.finish_chat()
    chat.finish_chat()
    assert plain.generate(["1+1="], [turn])[0].m_generation_ids == [
        str(chat.generate("1+1=", turn))
    ]


def test_get_metrics_follows_the_steps(plain):
    handles = [plain.add_request(i, p, config(max_new_tokens=4)) for i, p in enumerate(PROMPTS)]
    plain.step()
    metrics = plain.get_metrics()
    assert metrics.requests == 2 and metrics.scheduled_requests == 2
    assert 0 < metrics.cache_usage <= 100 and metrics.inference_duration > 0
    assert metrics.cache_size_in_bytes == metrics.kv_cache_size_in_bytes > 0
    while plain.has_non_finished_requests():
        plain.step()
    done = plain.get_metrics()
    assert done.requests == 0 and done.cache_usage == 0
    assert done.max_cache_usage >= metrics.cache_usage and done.avg_cache_usage > 0
    assert all(h.get_status() == openvino_genai.GenerationStatus.FINISHED for h in handles)


def test_tokenizer_properties_compile_the_tokenizer(smol_dir, monkeypatch):
    seen = []
    real = openvino_genai.Tokenizer

    def recording(*args, **kwargs):
        seen.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(encoding.openvino_genai, "Tokenizer", recording)
    tokenizer = encoding.load_tokenizer(smol_dir, {hints.inference_precision: "f32"})
    assert seen and all(kw == {"INFERENCE_PRECISION_HINT": "f32"} for kw in seen)
    assert tokenizer.encode("hi").input_ids.get_size() > 0


@pytest.mark.slow(seconds=60)
def test_genai_adapter_and_draft_made_before_npuw_kv_is_imported(smol_dir, tmp_path):
    """The objects genai's samples make before the swapped class is imported."""
    from make_lora_adapter import make_lora_adapter  # models/, on the path (conftest)

    lora = make_lora_adapter(smol_dir, tmp_path / "lora.safetensors", rank=4, std=0.05, seed=1)
    script = textwrap.dedent(
        f"""
        import warnings
        import openvino_genai as og
        draft = og.draft_model({str(smol_dir)!r}, "CPU")
        adapters = og.AdapterConfig(og.Adapter({str(lora)!r}), 0.5)
        import npuw_kv
        from npuw_kv.config.settings import EXACT_F32
        kw = dict(attention_backend="pa", kv_precision="f32", **EXACT_F32)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            spec = npuw_kv.LLMPipeline({str(smol_dir)!r}, "CPU", draft_model=draft, **kw)
        assert any("read from" in str(w.message) for w in caught), caught
        plain = npuw_kv.LLMPipeline({str(smol_dir)!r}, "CPU", adapters=adapters, **kw)
        base = plain.generate("The Sun is", max_new_tokens=8, adapters=og.AdapterConfig())
        print(spec.generate("The Sun is", max_new_tokens=8) == base)
        print(plain.generate("The Sun is", max_new_tokens=8) != base)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["True", "True"]


def test_non_finite_logits_name_only_settings_not_set(smol_dir, monkeypatch):
    """NaN logits in a batched step end the call with the engine's NumericError: at exact f32
    (compute, KV, no NPUW) it names no setting left to change, so none already set."""
    from npuw_kv.errors import NumericError

    cb = make_cb(smol_dir)
    runner = cb.engine.runner

    def nan_rows(parts, *args, **kwargs):
        return np.full((len(parts), cb.engine.vocab_size), np.nan, np.float32)

    monkeypatch.setattr(runner, "last_logits", nan_rows)
    with pytest.raises(NumericError, match="no precision setting removes it") as caught:
        cb.generate(["The Sun is yellow because"], config())
    assert "NPUW_F16IC" not in str(caught.value)
