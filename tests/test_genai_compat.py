"""openvino-genai's inputs, outputs and constructor forms (issue #16), on SmolLM2.

What genai 2026.4 does, checked by running it: a str prompt gives a plain ``str``; a list of
prompts or a ``ChatHistory`` gives ``DecodedResults`` (the history object is not changed);
token ids as ``ov.Tensor`` / ``TokenizedInputs`` give ``EncodedResults``.
"""

from __future__ import annotations

import gc
import json
import pickle
import sys
import tempfile
from dataclasses import fields

import numpy as np
import openvino as ov
import openvino_genai
import pytest
from conftest import CHUNK, MAX_PROMPT, MIN_RESPONSE, make_pipe

import npuw_kv
from npuw_kv import GenerationConfig, LLMPipeline
from npuw_kv.api.generation_result import GenerationResult
from npuw_kv.api.perf_metrics import PerfMetrics
from npuw_kv.api.pipeline_args import pipeline_args, scheduler_settings
from npuw_kv.api.results import DecodedResults, EncodedResults, TextResult
from npuw_kv.config.settings import EXACT_F32

QUESTION = "What is the capital of France?"
NEW = 6
# make_pipe's settings, so a pipeline built another way must give the same greedy tokens
SAME = {
    "prefill_chunk_size": CHUNK,
    "max_prompt_len": MAX_PROMPT,
    "min_response_len": MIN_RESPONSE,
    **EXACT_F32,
}


@pytest.fixture(scope="module")
def pipe(smol_dir):
    return make_pipe(smol_dir, "CPU")


@pytest.fixture(scope="module")
def expected(pipe):
    """The module pipeline's greedy answer to QUESTION."""
    return pipe.generate(QUESTION, max_new_tokens=NEW)


def test_a_text_prompt_gives_a_str_carrying_our_fields(pipe, expected):
    assert isinstance(expected, str) and isinstance(expected, TextResult)
    assert expected == expected.text and str(expected) == expected.text
    assert type(str(expected)) is str and expected.find(expected[:3]) == 0
    assert json.loads(json.dumps({"answer": expected}))["answer"] == expected
    assert 0 < len(expected.tokens) <= NEW and expected.finish_reason in ("stop", "length")
    assert expected.prompt_tokens > 5 and expected.ttft_s > 0 and expected.first_logits is not None
    assert all(hasattr(expected, f.name) for f in fields(GenerationResult))  # all of ours
    copy = pickle.loads(pickle.dumps(expected))
    assert copy == expected and copy.tokens == expected.tokens
    assert pipe(QUESTION, max_new_tokens=NEW) == expected  # __call__ is generate


def test_chat_history_is_templated_and_left_unchanged(pipe):
    history = openvino_genai.ChatHistory([{"role": "system", "content": "You are terse."}])
    history.append({"role": "user", "content": "Name a colour."})
    first = pipe.generate(history, max_new_tokens=NEW)
    assert isinstance(first, DecodedResults) and len(first.texts) == 1
    assert str(first) == first.texts[0] and len(history) == 2  # genai does not append
    assert isinstance(first.finish_reasons[0], openvino_genai.GenerationFinishReason)
    assert first.scores == [0.0] and first.parsed == [] and first.extended_perf_metrics is None
    # the caller keeps the history, as genai's chat sample does
    history.append({"role": "assistant", "content": first.texts[0]})
    history.append({"role": "user", "content": "And another one?"})
    second = pipe.generate(history, max_new_tokens=NEW)
    grown = second.perf_metrics.get_num_input_tokens() - first.perf_metrics.get_num_input_tokens()
    assert grown > len(first.results[0].tokens)
    # a list of message dicts is the same chat
    as_dicts = pipe.generate(history.get_messages(), max_new_tokens=NEW)
    assert as_dicts.texts == second.texts
    # tools reach the chat template (SmolLM2's template lists them in the system prompt)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    history.set_tools(tools)
    with_tools = pipe.generate(history, max_new_tokens=2)
    assert (
        with_tools.perf_metrics.get_num_input_tokens() > second.perf_metrics.get_num_input_tokens()
    )


def test_a_batch_of_prompts_gives_each_prompts_own_answer(pipe):
    prompts = ["Name a fruit.", QUESTION, "Count to three."]
    batch = pipe.generate(prompts, max_new_tokens=NEW)
    alone = [pipe.generate(p, max_new_tokens=NEW) for p in prompts]
    assert isinstance(batch, DecodedResults) and batch.texts == [str(a) for a in alone]
    assert [r.tokens for r in batch.results] == [a.tokens for a in alone]
    metrics = batch.perf_metrics
    assert metrics.get_num_input_tokens() == sum(a.prompt_tokens for a in alone)
    # genai counts the stop token that ended an answer as generated
    ended = sum(a.stop_token is not None for a in alone)
    assert metrics.get_num_generated_tokens() == sum(len(a.tokens) for a in alone) + ended
    assert len(metrics.raw_metrics.tokenization_durations) == len(prompts)
    assert str(batch).count("\n") == len(prompts) - 1 and str(batch).startswith("0.000000: ")


def test_several_answers_per_prompt_come_as_decoded_results(pipe):
    sampled = {"max_new_tokens": 4, "do_sample": True, "rng_seed": 3, "ignore_eos": True}
    result = pipe.generate(QUESTION, num_return_sequences=2, **sampled)
    assert isinstance(result, DecodedResults) and len(result.texts) == 2
    assert all(score < 0 for score in result.scores)  # sampled: summed log-probabilities
    assert str(result).count("\n") == 1 and str(result).startswith(f"{result.scores[0]:.6f}: ")
    assert pipe.generate(QUESTION, **sampled) == result.texts[0]  # the first of one generator
    assert len(result.perf_metrics.raw_metrics.m_times_to_first_token) == 2


def test_token_ids_in_tensors_give_encoded_results(pipe):
    tokenizer = pipe.get_tokenizer()
    texts = ["The sky is blue because the", "Hi"]
    alone = [
        pipe.generate(tokenizer.encode(t).input_ids.data[0].tolist(), max_new_tokens=NEW)
        for t in texts
    ]
    padded = tokenizer.encode(texts)  # the short one is padded (left, for this tokenizer)
    assert padded.input_ids.get_shape()[0] == 2
    result = pipe.generate(padded, max_new_tokens=NEW)
    assert isinstance(result, EncodedResults)
    assert result.tokens == [a.tokens for a in alone]
    # right padding: the attention mask says where the tokens are
    ids = [tokenizer.encode(t).input_ids.data[0] for t in texts]
    width = max(len(i) for i in ids)
    rows = np.zeros((2, width), np.int64)
    mask = np.zeros((2, width), np.int64)
    for row, i in enumerate(ids):
        rows[row, : len(i)], mask[row, : len(i)] = i, 1
    right = openvino_genai.TokenizedInputs(ov.Tensor(rows), ov.Tensor(mask))
    assert pipe.generate(right, max_new_tokens=NEW).tokens == result.tokens
    one = pipe.generate(ov.Tensor(rows[:1]), max_new_tokens=NEW)
    assert one.tokens == result.tokens[:1] and one.perf_metrics.get_num_input_tokens() == width
    assert one.perf_metrics.raw_metrics.detokenization_durations == []  # ids out: no decoding


def test_perf_metrics_have_genai_getters_and_units(pipe):
    a = pipe.generate(QUESTION, max_new_tokens=8, ignore_eos=True).perf_metrics
    b = pipe.generate(["Hello"], max_new_tokens=4, ignore_eos=True).perf_metrics
    assert a.get_num_generated_tokens() == 8 and a.get_num_input_tokens() > 5
    ttft, tpot = a.get_ttft(), a.get_tpot()
    assert 0 < ttft.mean < 60_000 and ttft.std == 0  # ms, one prompt
    assert 0 < tpot.mean < ttft.mean + 10_000 and tpot.std >= 0
    assert len(a.raw_metrics.m_durations) == 7  # 8 tokens, 7 steps between them
    assert a.get_throughput().mean == pytest.approx(1000 / tpot.mean)
    assert a.get_ipot().mean > 0 and a.get_inference_duration().mean > 0
    generate = a.get_generate_duration().mean
    assert generate >= a.get_inference_duration().mean and generate >= ttft.mean
    for getter in ("tokenization", "detokenization", "chat_template"):
        assert 0 < getattr(a, f"get_{getter}_duration")().mean < generate
    mean, std = a.get_ttft()  # a MeanStdPair unpacks, as genai's
    assert (mean, std) == (ttft.mean, ttft.std)
    assert a.get_load_time() == pytest.approx(pipe.load_time) and a.get_load_time() > 0
    total = a + b
    assert total.get_num_generated_tokens() == 12
    assert len(total.raw_metrics.m_times_to_first_token) == 2
    assert total.get_ttft().mean == pytest.approx((a.get_ttft().mean + b.get_ttft().mean) / 2)
    a += b
    assert a.get_num_generated_tokens() == 12 and a.get_num_input_tokens() > 5
    with pytest.raises(ValueError, match="same pipeline"):
        a + PerfMetrics(load_time=1.0)
    empty = PerfMetrics()
    assert tuple(empty.get_ttft()) == (-1.0, -1.0) and empty.get_throughput().mean == -1000.0


def test_the_constructor_takes_a_properties_dict_with_a_scheduler_config(smol_dir, expected):
    scheduler = openvino_genai.SchedulerConfig()
    scheduler.enable_prefix_caching = False
    scheduler.max_num_batched_tokens = sys.maxsize  # the whole prompt in one step
    scheduler.num_kv_blocks = 40
    settings = {k: v for k, v in SAME.items() if k != "prefill_chunk_size"}  # the scheduler's
    pipe = LLMPipeline(str(smol_dir), "CPU", {"scheduler_config": scheduler, **settings})
    try:
        assert pipe.config.paged and not pipe.config.prefix_reuse
        assert pipe.config.prefill_chunk_size == MAX_PROMPT
        assert pipe.kv_stats()["kv_capacity_tokens"] == 40 * 32
        answer = pipe.generate(QUESTION, max_new_tokens=NEW)
        assert answer.tokens == expected.tokens
        pipe.generate(QUESTION, max_new_tokens=NEW)
        assert pipe.kv_stats()["reused_tokens"] == 0  # prefix caching off
    finally:
        del pipe
        gc.collect()


def test_the_constructor_takes_a_tokenizer(smol_dir, expected):
    tokenizer = openvino_genai.Tokenizer(str(smol_dir))
    pipe = LLMPipeline(smol_dir, tokenizer, "CPU", **SAME)
    try:
        assert pipe.get_tokenizer() is tokenizer
        assert pipe.generate(QUESTION, max_new_tokens=NEW) == expected
    finally:
        del pipe
        gc.collect()


def test_the_constructor_takes_a_model_in_memory(smol_dir, expected, tmp_path, monkeypatch):
    """genai's encrypted-model form: the IR as XML text and its weights as a tensor."""
    xml = (smol_dir / "openvino_model.xml").read_text()
    weights = ov.Tensor(np.fromfile(smol_dir / "openvino_model.bin", np.uint8))
    tokenizer = openvino_genai.Tokenizer(str(smol_dir))
    config = openvino_genai.GenerationConfig()
    config.max_new_tokens = 3
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the IR is written
    pipe = LLMPipeline(xml, weights, tokenizer, "CPU", config, **SAME)
    try:
        assert list(tmp_path.iterdir()) == [] and pipe.model_dir is None  # removed once compiled
        answer = pipe.generate(QUESTION)  # the given generation config: 3 new tokens
        assert answer.tokens == expected.tokens[:3]
    finally:
        del pipe
        gc.collect()


@pytest.mark.parametrize(
    ("device", "settings", "fields", "message"),
    [
        ("NPU", {"max_num_seqs": 1}, {}, "batched steps: use device CPU"),  # one at a time
        ("NPU", {}, {"num_kv_blocks": 100}, "sizes the paged path's KV blocks"),
        ("CPU", {"attention_backend": "sdpa"}, {}, "batched steps"),
        ("CPU", {"PREFIX_CACHE_TOKENS": 64}, {"cache_size": 1}, "cache_size and PREFIX_CACHE"),
        ("CPU", {"SPLIT_FUSE": True}, {"dynamic_split_fuse": False}, "dynamic_split_fuse and"),
        ("CPU", {}, {"use_cache_eviction": True}, "use_cache_eviction"),
        ("CPU", {"PREFIX_REUSE": "YES"}, {}, "enable_prefix_caching and PREFIX_REUSE"),
        ("CPU", {"prefill_chunk_size": 64}, {"max_num_batched_tokens": 128}, "max_num_batched"),
    ],
)
def test_a_scheduler_config_we_cannot_honour_is_refused(
    smol_dir, device, settings, fields, message
):
    scheduler = openvino_genai.SchedulerConfig()
    for name, value in fields.items():
        setattr(scheduler, name, value)
    with pytest.raises(ValueError, match=message):
        LLMPipeline(smol_dir, device, scheduler_config=scheduler, **settings)


def test_bad_constructor_arguments_are_refused(smol_dir):
    with pytest.raises(ValueError, match="SchedulerConfig"):
        LLMPipeline(smol_dir, "CPU", scheduler_config={"cache_size": 1})
    with pytest.raises(ValueError, match="needs an openvino_genai.Tokenizer"):
        LLMPipeline("<net/>", ov.Tensor(np.zeros(4, np.uint8)), "CPU")
    with pytest.raises(ValueError, match="device given twice"):
        LLMPipeline(smol_dir, "CPU", device="NPU")
    with pytest.raises(ValueError, match="dict of properties"):
        LLMPipeline(smol_dir, "CPU", "f32")


def test_genais_empty_adapter_config_means_no_adapter(smol_dir):
    # genai's own AdapterConfig cannot be read (tests/test_lora.py), but an empty one needs
    # nothing read: the base model, at construction and per call
    given = pipeline_args(smol_dir, ("CPU",), {"adapters": openvino_genai.AdapterConfig()})
    assert given.adapters is not None and not given.adapters
    assert not GenerationConfig(adapters=openvino_genai.AdapterConfig()).adapters


class _StopAfter(openvino_genai.IncrementalParser):
    """Tags every delta it sees and asks to stop (a tool call) after ``deltas`` of them."""

    def __init__(self, deltas: int) -> None:
        super().__init__()
        self.deltas, self.seen = deltas, 0

    def parse(self, message, delta_text, delta_tokens=None):
        self.seen += 1
        message["seen"] = str(self.seen)  # a string field: concatenated into the message
        if self.seen == self.deltas:
            self.set_status(openvino_genai.StreamingStatus.TOOL_CALL_STOP)
        return delta_text

    def reset(self):
        self.seen = 0
        self.set_status(openvino_genai.StreamingStatus.RUNNING)


class _Messages(openvino_genai.TextParserStreamer):
    """A parser streamer as genai's samples write one: ``write`` takes the parsed message."""

    def __init__(self, tokenizer, parsers) -> None:
        super().__init__(tokenizer, parsers=parsers)
        self.messages: list[dict] = []

    def write(self, message):
        self.messages.append(dict(message))
        return openvino_genai.StreamingStatus.RUNNING


def test_a_parser_streamer_gets_parsed_messages_and_fills_parsed(pipe):
    prompt = [{"role": "user", "content": QUESTION}]
    streamer = _Messages(pipe.get_tokenizer(), [_StopAfter(deltas=1000)])
    whole = pipe.generate(prompt, max_new_tokens=NEW, streamer=streamer)
    assert whole.texts == pipe.generate(prompt, max_new_tokens=NEW).texts  # same answer
    assert "".join(m["content"] for m in streamer.messages) == whole.texts[0]
    assert whole.parsed == [streamer.get_parsed_message()]
    assert whole.parsed[0]["content"] == whole.texts[0] and "seen" in whole.parsed[0]
    # a parser's stop status (a tool call found) ends generation there
    parser = _StopAfter(deltas=1)
    stopped = pipe.generate(
        prompt, max_new_tokens=NEW, streamer=_Messages(pipe.get_tokenizer(), [parser])
    )
    # as genai: the finish reason says a tool call ended it
    assert stopped.finish_reasons == [openvino_genai.GenerationFinishReason.TOOL_CALL]
    assert stopped.results[0].finish_reason == "tool_call"
    assert len(stopped.results[0].tokens) < NEW and stopped.parsed[0]["seen"].startswith("1")
    again = pipe.generate(prompt, max_new_tokens=NEW, streamer=streamer)
    # every call starts afresh (genai resets the streamer and its parsers): not the text twice
    assert again.parsed[0]["content"] == whole.texts[0]


def test_bad_inputs_are_named_and_the_pipeline_goes_on(pipe, expected):
    tokenizer = pipe.get_tokenizer()
    mismatched = openvino_genai.TokenizedInputs(
        ov.Tensor(np.ones((2, 3), np.int64)), ov.Tensor(np.ones((2, 4), np.int64))
    )
    bad = [
        ([], "empty input"),
        (["a prompt", 7], "a list of int, str"),
        ([{"content": "no role"}], "must be a dict with a 'role'"),
        ([{"role": "user", "content": 5}], "content must be text"),
        (openvino_genai.ChatHistory(), "empty chat history"),
        (mismatched, "attention_mask of shape"),
        (5, "sequence of token ids"),
    ]
    for inputs, message in bad:
        with pytest.raises(ValueError, match=message):
            pipe.generate(inputs, max_new_tokens=2)
    chat = [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match="chat template"):
        pipe.generate(chat, max_new_tokens=2, apply_chat_template=False)
    with pytest.raises(ValueError, match="a streamer takes one answer"):
        pipe.generate(["a", "b"], max_new_tokens=2, streamer=print)
    pipe.start_chat()
    try:
        with pytest.raises(ValueError, match="one prompt at a time"):
            pipe.generate(["a", "b"], max_new_tokens=2)
    finally:
        pipe.finish_chat()
    with pytest.raises(ValueError, match="needs do_sample=True"):
        pipe.generate(QUESTION, max_new_tokens=2, num_return_sequences=2)
    with pytest.raises(ValueError, match="pass the ids as an ov.Tensor"):
        pipe.generate([1, 9690], max_new_tokens=2, do_sample=True, num_return_sequences=2)
    assert tokenizer.decode(expected.tokens) == expected
    assert pipe.generate(QUESTION, max_new_tokens=NEW) == expected  # still usable


def test_code_written_for_genai_runs_unchanged(pipe, smol_dir, expected):
    """What genai's own tests and users' code do: property values as ``ov.Type`` and hint
    names, ``except RuntimeError`` around bad input, ``isinstance`` on genai's result class,
    genai's names taken from the module, the model's EOS kept by ``set_generation_config``."""
    import openvino.properties.hint as hints

    import npuw_kv

    typed = LLMPipeline(
        smol_dir, "CPU", {hints.kv_cache_precision: ov.Type.f32, **SAME}, attention_backend="pa"
    )
    assert typed.kv_stats()["kv_precision"] == "f32"
    assert typed.generate(QUESTION, max_new_tokens=NEW) == expected
    for bad in ([], openvino_genai.ChatHistory()):
        with pytest.raises(RuntimeError):  # genai's type; still our documented ValueError
            pipe.generate(bad, max_new_tokens=2)
    with pytest.raises(RuntimeError, match="streamer"):
        pipe.generate(["a", "b"], max_new_tokens=2, streamer=print)
    with pytest.raises(RuntimeError, match="do_sample"):
        pipe.generate(QUESTION, max_new_tokens=2, num_beams=2, do_sample=True)
    with pytest.raises(RuntimeError, match="MAX_PROMPT_LEN"):
        pipe.generate([1] * (MAX_PROMPT + 1), max_new_tokens=2)
    results = pipe.generate([QUESTION], max_new_tokens=NEW)
    assert isinstance(results, openvino_genai.DecodedResults) and results.texts == [expected]
    for name in ("ChatHistory", "StreamingStatus", "StreamerBase", "Tokenizer", "TextStreamer",
                 "SchedulerConfig", "StructuredOutputConfig", "TokenizedInputs",
                 "GenerationFinishReason"):  # fmt: skip
        assert getattr(npuw_kv, name) is getattr(openvino_genai, name)
    before = pipe.get_generation_config()
    config = openvino_genai.GenerationConfig()
    config.max_new_tokens = 3
    pipe.set_generation_config(config)
    try:
        assert pipe.get_generation_config().eos_token_id == pipe.tokenizer.get_eos_token_id()
    finally:
        pipe.set_generation_config(before)


def test_a_scheduler_cache_size_sizes_the_paged_cache(smol_dir, expected):
    """genai's ``cache_size`` (GB): the paged cache takes that many bytes, what one sequence
    needs and prefix-cache room for the rest; a batch is preempted in it rather than grow."""
    scheduler = openvino_genai.SchedulerConfig()
    scheduler.cache_size = 1
    pipe = LLMPipeline(smol_dir, "CPU", scheduler_config=scheduler, **SAME)
    stats = pipe.kv_stats()
    assert 0.99 * 2**30 <= stats["kv_bytes_allocated"] <= 2**30
    assert pipe.generate(QUESTION, max_new_tokens=NEW) == expected
    assert pipe.kv_stats()["kv_bytes_allocated"] == stats["kv_bytes_allocated"]  # not grown
    # 1 GB holds more than any sequence of this model: fewer bytes (as a larger model's KV
    # would need) are refused, and the pipeline keeps its cache
    with pytest.raises(ValueError, match="cache_size holds .* fewer than one sequence"):
        pipe.runner.size_cache(2**20, "scheduler_config.cache_size")
    assert pipe.kv_stats()["kv_bytes_allocated"] == stats["kv_bytes_allocated"]


def test_generated_tokens_count_the_stop_token_as_genai_does(f32_pipe, genai_f32_pipe):
    """benchmark_genai's "Output token size": an answer ended by EOS counts the EOS too."""
    ours = f32_pipe.generate(["Hi"], max_new_tokens=40)
    theirs = genai_f32_pipe.generate(["Hi"], max_new_tokens=40)
    assert ours.results[0].stop_token is not None  # the answer ended at EOS
    assert ours.perf_metrics.get_num_generated_tokens() == len(ours.results[0].tokens) + 1
    assert theirs.perf_metrics.get_num_generated_tokens() == len(ours.results[0].tokens) + 1


def test_special_ids_from_the_directory_survive_the_tokenizer_rebuild(smol_dir, tmp_path):
    """genai reads an id the tokenizer IR lacks from config.json (genai's own test:
    eos_token_id 37); the tokenizer npuw-kv rebuilds without the length cut keeps it."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(smol_dir, model)
    for name in ("openvino_tokenizer.xml", "openvino_detokenizer.xml"):
        xml = model / name
        lines = xml.read_text().splitlines(keepends=True)
        xml.write_text("".join(line for line in lines if "<eos_token_id" not in line))
    (model / "config.json").write_text('{"eos_token_id": 37}')
    assert openvino_genai.Tokenizer(str(model)).get_eos_token_id() == 37
    pipe = LLMPipeline(model, "CPU")
    assert pipe.get_tokenizer().get_eos_token_id() == 37
    pipe.set_generation_config(GenerationConfig(do_sample=True))
    assert pipe.get_generation_config().eos_token_id == 37


@pytest.mark.parametrize("path", ["CPU/pa", "CPU/sdpa"])
def test_empty_token_ids_raise_what_genai_raises(smol_dir, path):
    pipe = make_pipe(smol_dir, "CPU", attention_backend=path.split("/")[1])
    empty = ov.Tensor(np.zeros((1, 0), np.int64))
    with pytest.raises(RuntimeError, match="prompt is empty"):
        pipe.generate(empty, max_new_tokens=2)
    assert pipe.generate("Hi", max_new_tokens=2).tokens


def test_a_scheduler_config_under_auto_means_the_paged_path():
    """Even with a KV precision that alone would pick the static path (genai runs its paged
    pipeline for any SchedulerConfig)."""
    scheduler = openvino_genai.SchedulerConfig()
    settings = scheduler_settings(scheduler, "CPU", {"KV_CACHE_PRECISION": "f32"})
    assert settings["attention_backend"] == "pa"
    with pytest.raises(ValueError, match="scheduler_config means batched steps"):
        scheduler_settings(openvino_genai.SchedulerConfig(), "NPU", {"max_num_seqs": 1})


TURNS = ("What is 2+2?", "And times three?", "Say it in French.")


def _token_chat(pipe, tokenizer) -> list[list[int]]:
    """genai's chat with encoded inputs: each turn passes the tokens after the last answer."""
    history: list[dict[str, str]] = []
    answers, seen = [], 0
    pipe.start_chat()
    try:
        for question in TURNS:
            history.append({"role": "user", "content": question})
            text = tokenizer.apply_chat_template(history, add_generation_prompt=True)
            ids = tokenizer.encode(text, add_special_tokens=False).input_ids.data[0]
            new = ids[None, seen:].copy()
            turn = openvino_genai.TokenizedInputs(ov.Tensor(new), ov.Tensor(np.ones_like(new)))
            result = pipe.generate(turn, max_new_tokens=12)
            tokens = [int(t) for t in result.tokens[0]]
            answers.append(tokens)
            history.append({"role": "assistant", "content": tokenizer.decode(tokens)})
            seen = ids.size + len(tokens)
    finally:
        pipe.finish_chat()
    return answers


@pytest.mark.parametrize("backend", ["pa", "sdpa"])
def test_a_chat_of_token_id_turns_continues_as_genais_stateful_chat(smol_dir, backend):
    """Each turn's ids continue the chat's (the earlier turns' ids and answers), as genai's
    stateful pipeline does with encoded inputs."""
    tokenizer = openvino_genai.Tokenizer(str(smol_dir))
    genai = openvino_genai.LLMPipeline(
        str(smol_dir), "CPU", ATTENTION_BACKEND="SDPA", KV_CACHE_PRECISION="f32", **EXACT_F32
    )
    want = _token_chat(genai, tokenizer)
    extra = {"kv_precision": "f32"} if backend == "pa" else {}
    pipe = make_pipe(smol_dir, "CPU", attention_backend=backend, **extra)
    assert _token_chat(pipe, tokenizer) == want
    assert all(want) and want[1] != want[2]


def test_a_chat_goes_on_in_the_form_it_started(smol_dir):
    pipe = make_pipe(smol_dir, "CPU", attention_backend="pa", kv_precision="f32")
    pipe.start_chat()
    try:
        pipe.generate("Hi", max_new_tokens=2)
        with pytest.raises(ValueError, match="this chat has text turns"):
            pipe.generate(ov.Tensor(np.array([[1, 2, 3]], np.int64)), max_new_tokens=2)
        pipe.finish_chat()
        pipe.start_chat()
        pipe.generate(ov.Tensor(np.array([[1, 2, 3]], np.int64)), max_new_tokens=2)
        with pytest.raises(ValueError, match="this chat has token-id turns"):
            pipe.generate("Hi", max_new_tokens=2)
        with pytest.raises(ValueError, match="one prompt at a time"):
            pipe.generate(ov.Tensor(np.array([[1, 2], [3, 4]], np.int64)), max_new_tokens=2)
    finally:
        pipe.finish_chat()


def test_token_lists_end_with_the_stop_token_as_genais(smol_dir, genai_f32_pipe):
    """genai's EncodedResults and continuous-batching ids end with the EOS that ended the
    answer; our own GenerationResult names it apart (stop_token)."""
    tokenizer = openvino_genai.Tokenizer(str(smol_dir))
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Reply with one word: yes or no. Is water wet?"}],
        add_generation_prompt=True,
    )
    ids = tokenizer.encode(text, add_special_tokens=False).input_ids
    want = [int(t) for t in genai_f32_pipe.generate(ids, max_new_tokens=30).tokens[0]]
    assert want[-1] == tokenizer.get_eos_token_id() and len(want) < 30  # it stopped at EOS
    pipe = make_pipe(smol_dir, "CPU", attention_backend="pa", kv_precision="f32")
    assert pipe.generate(ids, max_new_tokens=30).tokens[0] == want
    ours = pipe.generate(list(ids.data[0]), max_new_tokens=30)
    assert ours.tokens == want[:-1] and ours.stop_token == want[-1]
    batching = npuw_kv.ContinuousBatchingPipeline(
        str(smol_dir), openvino_genai.SchedulerConfig(), "CPU", {"kv_precision": "f32", **SAME}
    )
    config = GenerationConfig(max_new_tokens=30)
    assert batching.generate([ids], [config])[0].m_generation_ids[0] == want
