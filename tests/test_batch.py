"""Several sequences in batched steps on the paged path (runtime/paged/scheduler.py): each gets
exactly the tokens it gets alone (exact f32), whatever runs beside it, when it arrives or
leaves, and when the KV pools are too small for all of them at once (preemption)."""

from __future__ import annotations

import json
import random
import re

import numpy as np
import pytest
from conftest import make_pipe

from npuw_kv import LLMPipeline
from npuw_kv.api.generation_config import GenerationConfig
from npuw_kv.config import EXACT_F32
from npuw_kv.generation.decode import generate_sequences
from npuw_kv.generation.token_loops import generate_batch
from npuw_kv.runtime.paged.runner import PagedRunner
from npuw_kv.runtime.paged.scheduler import Scheduler

PA_F32 = {"attention_backend": "pa", "kv_precision": "f32"}


def _prompts(text_ids, lengths: list[int]) -> list[np.ndarray]:
    """Prompts of the given lengths that differ from their first token on (cut at offsets of
    the same text, so a cached prefix is no accident)."""
    text = text_ids(max(lengths) + 40 * len(lengths))
    return [text[7 * i + 40 * i : 7 * i + 40 * i + n] for i, n in enumerate(lengths)]


def _alone(pipe: LLMPipeline, ids: np.ndarray, new: int) -> list[int]:
    result = pipe.generate([int(t) for t in ids], max_new_tokens=new, ignore_eos=True)
    return list(result.tokens)


def _texts(pipe: LLMPipeline, prompts: list[np.ndarray]) -> list[str]:
    return [pipe.tokenizer.decode([int(t) for t in p]) for p in prompts]


def test_a_list_of_prompts_runs_batched_with_each_prompts_own_tokens(f32_pipe, text_ids):
    prompts = _texts(f32_pipe, _prompts(text_ids, [31, 300, 5, 270, 64, 129, 511]))
    kw = {"max_new_tokens": 12, "ignore_eos": True, "apply_chat_template": False}
    alone = [f32_pipe.generate(p, **kw) for p in prompts]
    batch = f32_pipe.generate(prompts, **kw)
    assert batch.texts == [str(r) for r in alone]
    stats = f32_pipe.kv_stats()
    assert stats["batch_peak_sequences"] == len(prompts)
    # one step per token after the prompts' chunks, not one per sequence and token
    assert stats["batch_steps"] < 2 * 12 + 4
    assert batch.perf_metrics.get_num_generated_tokens() == 12 * len(prompts)


def test_each_prompt_its_own_budget_and_sampled_sequences_batched(f32_pipe, text_ids):
    runner = f32_pipe.runner
    assert isinstance(runner, PagedRunner)
    prompts = _prompts(text_ids, [40, 260, 9])
    budgets = [3, 17, 9]
    configs = [GenerationConfig(max_new_tokens=n, ignore_eos=True) for n in budgets]
    nested = generate_batch(Scheduler(runner, 8), f32_pipe.tokenizer, prompts, configs)
    for ids, n, results in zip(prompts, budgets, nested, strict=True):
        assert [list(r.tokens) for r in results] == [_alone(f32_pipe, ids, n)]
    # sampled: several sequences of one prompt, reproducible from the seed
    sampled = dict(do_sample=True, top_k=20, rng_seed=7, num_return_sequences=3)
    config = GenerationConfig(max_new_tokens=8, ignore_eos=True, **sampled)
    first = generate_batch(Scheduler(runner, 8), f32_pipe.tokenizer, prompts[:1], [config])
    again = generate_batch(Scheduler(runner, 8), f32_pipe.tokenizer, prompts[:1], [config])
    tokens = [list(r.tokens) for r in first[0]]
    assert tokens == [list(r.tokens) for r in again[0]] and len(tokens) == 3
    assert len({tuple(t) for t in tokens}) > 1  # three samples, not one repeated
    # each sample its own generator: one after another on the lone runner, the same samples
    serial = generate_sequences(runner, f32_pipe.tokenizer, prompts[0], config)
    assert [list(r.tokens) for r in serial] == tokens


def test_a_small_kv_room_preempts_and_every_sequence_gets_its_own_tokens(smol_dir, text_ids):
    # room for one full sequence and 64 tokens more: six prompts of ~300 do not fit at once
    pipe = make_pipe(smol_dir, "CPU", prefix_cache_tokens=64, **PA_F32)
    prompts = _prompts(text_ids, [300, 280, 310, 250, 290, 305])
    texts = _texts(pipe, prompts)
    kw = {"max_new_tokens": 24, "ignore_eos": True, "apply_chat_template": False}
    alone = [str(pipe.generate(t, **kw)) for t in texts]
    batch = pipe.generate(texts, **kw)
    assert batch.texts == alone
    stats = pipe.kv_stats()
    assert stats["batch_preemptions"] > 0 and stats["batch_peak_sequences"] < len(prompts)
    assert pipe.runner.cache.bytes_allocated == pipe.kv_stats()["kv_bytes_allocated"]


def test_max_num_seqs_bounds_the_batch(smol_dir, text_ids):
    pipe = make_pipe(smol_dir, "CPU", max_num_seqs=2, **PA_F32)
    texts = _texts(pipe, _prompts(text_ids, [20, 40, 60, 80, 100]))
    kw = {"max_new_tokens": 6, "ignore_eos": True, "apply_chat_template": False}
    batch = pipe.generate(texts, **kw)
    assert pipe.kv_stats()["batch_peak_sequences"] == 2
    assert batch.texts == [str(pipe.generate(t, **kw)) for t in texts]


@pytest.mark.parametrize("seed", [1, 2])
def test_random_arrivals_lengths_and_cancellations_against_each_alone(f32_pipe, text_ids, seed):
    """The engine driven as a server would: sequences join between steps, some are cancelled
    mid-way; the others' greedy tokens equal those they get alone, and the block manager's
    invariants hold after every step."""
    rng = random.Random(seed)
    runner = f32_pipe.runner
    engine = Scheduler(runner, max_num_seqs=rng.choice([3, 5]), max_batched_tokens=300)
    lengths = [rng.randint(1, 400) for _ in range(8)]
    prompts = _prompts(text_ids, lengths)
    budgets = [rng.randint(1, 20) for _ in prompts]
    cancel = {i for i in range(len(prompts)) if rng.random() < 0.25}
    arrivals = sorted(range(len(prompts)), key=lambda _: rng.random())
    out: dict[int, list[int]] = {}
    handles: dict[int, int] = {}
    pending = list(arrivals)
    while pending or engine.busy:
        for _ in range(rng.randint(0, 2)):  # zero to two new requests before each step
            if pending:
                i = pending.pop(0)
                handles[engine.submit([int(t) for t in prompts[i]])] = i
                out[i] = []
        if not engine.busy:
            continue
        ready = engine.step()
        runner.blocks.check_invariants()
        for handle, logits in ready.items():
            i = handles[handle]
            out[i].append(int(np.argmax(logits)))
            if len(out[i]) == budgets[i] or (i in cancel and len(out[i]) == budgets[i] // 2):
                engine.finish(handle)
            else:
                engine.feed(handle, out[i][-1])
    assert not runner.blocks.sequence_ids  # every sequence's blocks went back
    for i, ids in enumerate(prompts):
        want = _alone(f32_pipe, ids, budgets[i])
        done = out[i]
        assert done == want[: len(done)], f"prompt {i} ({lengths[i]} tokens)"
        if i not in cancel:
            assert len(done) == budgets[i]


def test_a_prompt_over_max_prompt_len_fails_alone_before_the_batch(f32_pipe, text_ids):
    engine = Scheduler(f32_pipe.runner, 4)
    with pytest.raises(ValueError, match="MAX_PROMPT_LEN"):
        engine.submit([1] * (f32_pipe.runner.max_prompt_len + 1))
    assert not engine.busy
    handle = engine.submit([int(t) for t in text_ids(10)])
    assert handle in engine.step()  # the engine is still usable
    engine.finish(handle)


@pytest.fixture(scope="module")
def cb_pipe(smol_dir):
    from npuw_kv import ContinuousBatchingPipeline

    return ContinuousBatchingPipeline(smol_dir, None, "CPU", {**EXACT_F32, **PA_F32})


@pytest.mark.parametrize(
    ("ids", "refused"),
    [
        (np.array([[5, -1, 7]], np.int64), "token id -1 is outside the vocabulary"),
        (np.array([[5, 49152]], np.int64), r"49152 is outside the vocabulary \[0, 49152\)"),
        (np.array([[5.0, 7.5]], np.float32), "token ids must be integers"),
        (np.array([[5, 6], [7, 8]], np.int64), r"add_request takes one prompt: .* \[2, 2\]"),
        (np.zeros((1, 0), np.int64), "prompt is empty"),
    ],
)
def test_add_request_refuses_the_ids_llm_pipeline_refuses(cb_pipe, f32_pipe, ids, refused):
    """The same refusals as LLMPipeline's, before anything is queued; the pipeline still
    serves the next request."""
    import openvino as ov

    from npuw_kv.errors import UsageError

    with pytest.raises(UsageError, match=refused):
        cb_pipe.add_request(90, ov.Tensor(ids), GenerationConfig(max_new_tokens=2))
    good = np.array([[1, 2, 3, 4]], np.int64)
    config = GenerationConfig(max_new_tokens=4, ignore_eos=True)
    result = cb_pipe.generate([ov.Tensor(good)], config)
    assert result[0].m_generation_ids[0] == _alone(f32_pipe, good[0], 4)


def test_requests_join_and_leave_between_steps(cb_pipe, f32_pipe, text_ids):
    """genai's request-level API: requests added between steps join the batch, each handle
    reads its tokens as they come; stop keeps what came, cancel drops it."""
    import openvino as ov
    import openvino_genai

    prompts = _prompts(text_ids, [50, 120, 30])
    config = openvino_genai.GenerationConfig()
    config.max_new_tokens, config.ignore_eos = 10, True
    first = cb_pipe.add_request(0, ov.Tensor(prompts[0][None]), config)
    cb_pipe.step()
    cb_pipe.step()
    assert first.can_read()
    got = first.read()[0].generated_ids
    second = cb_pipe.add_request(1, ov.Tensor(prompts[1][None]), config)
    third = cb_pipe.add_request(2, ov.Tensor(prompts[2][None]), config)
    cb_pipe.step()
    third.cancel()
    assert third.get_status() == openvino_genai.GenerationStatus.CANCEL
    assert third.read_all()[0].generated_ids == []
    while cb_pipe.has_non_finished_requests():
        cb_pipe.step()
    assert first.get_status() == second.get_status() == openvino_genai.GenerationStatus.FINISHED
    got += first.read()[0].generated_ids
    assert got == first.read_all()[0].generated_ids == _alone(f32_pipe, prompts[0], 10)
    assert second.read_all()[0].generated_ids == _alone(f32_pipe, prompts[1], 10)
    assert not cb_pipe.runner.blocks.sequence_ids


def test_generate_takes_one_config_per_prompt(cb_pipe, f32_pipe, text_ids):
    import openvino_genai

    texts = _texts(f32_pipe, _prompts(text_ids, [40, 90]))
    configs = []
    for n in (3, 9):
        config = openvino_genai.GenerationConfig()
        config.max_new_tokens, config.ignore_eos, config.apply_chat_template = n, True, False
        configs.append(config)
    results = cb_pipe.generate(texts, configs)
    kw = {"ignore_eos": True, "apply_chat_template": False}
    want = [
        str(f32_pipe.generate(t, max_new_tokens=n, **kw))
        for t, n in zip(texts, (3, 9), strict=True)
    ]
    assert [r.m_generation_ids[0] for r in results] == want
    with pytest.raises(ValueError, match="one per prompt"):
        cb_pipe.generate(texts, configs[:1] * 3)


def test_eight_threads_join_one_batch_and_failures_stay_their_own(smol_dir, text_ids):
    """Calls from eight threads at once share steps (no lock queues them); each gets the
    tokens it gets alone.  A too-long prompt and a streamer that raises fail their own call
    only, and the pipeline serves the next call."""
    import threading

    pipe = make_pipe(smol_dir, "CPU", **PA_F32)
    rng = random.Random(3)
    prompts = _prompts(text_ids, [rng.randint(5, 300) for _ in range(8)])
    budgets = [rng.randint(4, 24) for _ in prompts]
    want = [_alone(pipe, p, n) for p, n in zip(prompts, budgets, strict=True)]
    start = threading.Barrier(10)
    got: dict[int, list[int]] = {}
    errors: dict[str, BaseException] = {}

    def call(i: int) -> None:
        start.wait()
        ids = [int(t) for t in prompts[i]]
        got[i] = list(pipe.generate(ids, max_new_tokens=budgets[i], ignore_eos=True).tokens)

    def too_long() -> None:
        start.wait()
        try:
            pipe.generate([1] * (pipe.runner.max_prompt_len + 1), max_new_tokens=3)
        except ValueError as exc:
            errors["long"] = exc

    def raising_streamer() -> None:
        def stream(_: str) -> None:
            raise KeyError("streamer broke")

        start.wait()
        try:
            pipe.generate(text_ids(40), max_new_tokens=20, ignore_eos=True, streamer=stream)
        except KeyError as exc:
            errors["streamer"] = exc

    threads = [threading.Thread(target=call, args=(i,)) for i in range(8)]
    threads += [threading.Thread(target=too_long), threading.Thread(target=raising_streamer)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads)
    assert got == dict(enumerate(want))
    assert "MAX_PROMPT_LEN" in str(errors["long"]) and "streamer broke" in str(errors["streamer"])
    batch = pipe.engine.batch
    assert batch is not None and batch.scheduler.stats.peak_batch > 1  # they ran together
    assert not batch.busy and not pipe.runner.blocks.sequence_ids
    assert _alone(pipe, prompts[0], 5) == want[0][:5]


def test_without_split_fuse_prompts_are_read_in_steps_of_their_own(smol_dir, text_ids):
    """genai's ``dynamic_split_fuse=False``: no step mixes decode tokens with prompt chunks
    (decoding waits while a prompt is read); every prompt still gets its own tokens."""
    import openvino_genai

    scheduler = openvino_genai.SchedulerConfig()
    scheduler.dynamic_split_fuse = False
    pipe = make_pipe(smol_dir, "CPU", scheduler_config=scheduler, **PA_F32)
    texts = _texts(pipe, _prompts(text_ids, [300, 40, 260, 90]))
    kw = {"max_new_tokens": 8, "ignore_eos": True, "apply_chat_template": False}
    alone = [str(pipe.generate(t, **kw)) for t in texts]
    steps: list[list[int]] = []
    run = pipe.runner.run

    def record(parts: list, rows: int = 1) -> np.ndarray:
        steps.append([int(p[1].size) for p in parts])
        return run(parts, rows)

    pipe.runner.run = record  # type: ignore[method-assign]
    try:
        assert pipe.generate(texts, **kw).texts == alone
    finally:
        del pipe.runner.run
    reading = [s for s in steps if any(n > 1 for n in s)]  # (no chunk of these is 1 token)
    assert reading and len(reading) < len(steps)
    assert all(n > 1 for s in reading for n in s), steps  # no decode token beside a chunk


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    """A tiny Qwen2 with a window of two blocks (64 tokens) on every other layer."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
    from make_tiny_optimum_ir import make_tiny_optimum_ir

    return make_tiny_optimum_ir(tmp_path_factory.mktemp("w64"), arch="qwen2", sliding_window=64)


# seeds whose batch preempts in a pool of only the decoders' blocks (30 here; measured)
@pytest.mark.parametrize("seed", [18, 21])
def test_window_pools_sized_for_a_batch_preempt_nothing(windowed, text_ids, seed):
    """The window pool a batch is given holds each sequence's window and a block, plus the
    blocks one step's prompt tokens span and one for a read the budget cut mid-block: prompts
    of random lengths, read in chunks beside decode tokens, never run out of it (no
    preemption) and each gets its own tokens."""
    from npuw_kv.kv.blocks.sequence import min_live_blocks

    rng = random.Random(seed)
    chunk, total = 64, 320 + 40
    pipe = LLMPipeline(
        windowed, "CPU", prefill_chunk_size=chunk, max_prompt_len=320, min_response_len=40,
        prefix_reuse=False, **PA_F32, **EXACT_F32,
    )  # fmt: skip
    prompts = _prompts(text_ids, [rng.randint(1, 280) for _ in range(10)])
    texts = _texts(pipe, prompts)
    kw = {"max_new_tokens": rng.randint(20, 40), "ignore_eos": True, "apply_chat_template": False}
    alone = [str(pipe.generate(t, **kw)) for t in texts]
    batch = pipe.generate(texts, **kw)
    assert pipe.batch_stats["batch_preemptions"] == 0
    assert batch.texts == alone
    longest = max(len(pipe.tokenizer.encode(t).input_ids.data[0]) for t in texts)
    length = min(longest + kw["max_new_tokens"], total)
    decoding = min_live_blocks(length, 64, 32, 1)
    reading = min_live_blocks(length, 64, 32, chunk)
    assert pipe.kv_stats()["kv_pool_blocks"]["64"] == 10 * decoding + chunk // 32 + 1
    assert chunk // 32 + 1 < 10 * (reading - decoding)  # tighter than a chunk per sequence


LONG_PROMPT = "hi " * 1100  # over the MAX_PROMPT_LEN of 1024 of conftest's f32 pipelines
# bad inputs every entry point can be given, and the refusal each gets
REFUSALS = [
    (LONG_PROMPT, {}, r"prompt has \d+ tokens but MAX_PROMPT_LEN is 1024"),
    ("a\ud800b", {}, r"text is not valid Unicode: surrogates not allowed at character 1"),
    ("hi", {"num_assistant_tokens": 3, "num_beams": 2}, r"assisted generation .* runs one seq"),
    ("hi", {"num_return_sequences": 2000, "do_sample": True}, r"= 2000 sequences in one call"),
]


def _refusal(call) -> str:
    with pytest.raises(ValueError) as info:
        call()
    return str(info.value)


@pytest.mark.parametrize(
    ("prompt", "fields", "refused"), REFUSALS, ids=["long", "surrogate", "assisted", "too-many"]
)
def test_every_entry_point_refuses_a_bad_input_with_one_message(
    cb_pipe, monkeypatch, capsys, prompt, fields, refused
):
    """LLMPipeline.generate, ContinuousBatchingPipeline.add_request and generate, the server
    and the CLI go through one check (Engine.admit): the same input, the same message."""
    import openvino_genai
    from starlette.testclient import TestClient

    from npuw_kv.cli import commands
    from npuw_kv.serve.app import make_app

    config = openvino_genai.GenerationConfig()
    config.max_new_tokens = 2
    config.apply_chat_template = False  # raw text, as /v1/completions and --no-chat-template
    for name, value in fields.items():
        setattr(config, name, value)
    pipe = LLMPipeline(cb_pipe.engine)
    messages = {
        "LLMPipeline.generate": _refusal(lambda: pipe.generate(prompt, config)),
        "add_request": _refusal(lambda: cb_pipe.add_request(7, prompt, config)),
        "ContinuousBatchingPipeline.generate": _refusal(lambda: cb_pipe.generate([prompt], config)),
    }
    if not fields:  # the server and the CLI set these fields their own way (n, no draft)
        app = make_app(pipe, "m", live=1, queue=1)
        with TestClient(app, base_url="http://127.0.0.1") as client:  # the Host it serves
            body = {"model": "m", "prompt": prompt, "max_tokens": 2}  # "\ud800" stays escaped
            reply = client.post(
                "/v1/completions", content=json.dumps(body),
                headers={"Content-Type": "application/json"},
            )  # fmt: skip
        assert reply.status_code == 400, reply.text
        messages["server"] = reply.json()["error"]["message"]
    if prompt == LONG_PROMPT:  # a shell's argv carries no lone surrogate (its own refusal)
        monkeypatch.setattr(commands, "_load", lambda args: pipe)
        argv = ["generate", "--no-chat-template", "--max-new-tokens", "2", prompt]
        assert commands._main(argv) == 2
        messages["CLI"] = capsys.readouterr().err
    core = {name: re.search(refused, text) for name, text in messages.items()}
    assert all(core.values()), messages
    assert len({m.group(0) for m in core.values() if m}) == 1, messages
    assert not cb_pipe.has_non_finished_requests()  # nothing was queued
    assert pipe.generate("hi", max_new_tokens=2, ignore_eos=True) is not None


def test_a_handle_read_from_another_thread_loses_no_token(cb_pipe, text_ids):
    """One thread steps, another reads the same handle: the last token and the finish reason
    survive the two threads taking the outcomes at once."""
    import threading

    import openvino as ov
    import openvino_genai

    config = GenerationConfig(max_new_tokens=24, ignore_eos=True)
    ids = ov.Tensor(np.asarray(text_ids(20), np.int64)[None])
    for request in range(6):
        handle = cb_pipe.add_request(500 + request, ids, config)
        seen: list[int] = []

        def reader(handle=handle, seen=seen) -> None:
            while handle.get_status() == openvino_genai.GenerationStatus.RUNNING:
                for output in handle.read().values():
                    seen.extend(output.generated_ids)

        thread = threading.Thread(target=reader)
        thread.start()
        while handle.get_status() == openvino_genai.GenerationStatus.RUNNING:
            cb_pipe.step()
        thread.join(timeout=60)
        for output in handle.read().values():
            seen.extend(output.generated_ids)
        (whole,) = handle.read_all()
        assert len(whole.generated_ids) == 24 and seen == whole.generated_ids
        assert whole.finish_reason == openvino_genai.GenerationFinishReason.LENGTH


@pytest.mark.parametrize("request_id", ["abc", "5", 2.5, True])
def test_a_request_id_that_is_not_an_integer_is_named(cb_pipe, request_id):
    with pytest.raises(ValueError, match="request_id must be an integer"):
        cb_pipe.add_request(request_id, "hi", GenerationConfig(max_new_tokens=2))
    assert not cb_pipe.has_non_finished_requests()


def test_a_streamer_raising_stop_iteration_is_named(f32_pipe):
    def streamer(text: str) -> None:
        raise StopIteration

    with pytest.raises(ValueError, match="the streamer raised StopIteration: to end generation"):
        f32_pipe.generate("hi", max_new_tokens=4, ignore_eos=True, streamer=streamer)
    assert len(f32_pipe.generate("hi", max_new_tokens=2, ignore_eos=True).tokens) == 2
