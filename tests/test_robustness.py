"""What no caller can break: threads sharing a pipeline, text the tokenizer cannot take, sizes
beyond the machine, and long chats that must keep their cache."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from conftest import make_pipe

from npuw_kv import LLMPipeline
from npuw_kv.config.settings import EXACT_F32


def test_two_threads_get_what_one_thread_gets(any_pipe, text_ids):
    """Calls from two threads (joining one batch on the paged path, taking turns on the static
    path): every result equals the single-threaded one."""
    prompts = [text_ids(90)[i * 7 : i * 7 + 30 + 9 * i] for i in range(4)]
    want = [any_pipe.generate(p, max_new_tokens=6, ignore_eos=True).tokens for p in prompts]
    got: dict[tuple[int, int], list[int]] = {}
    errors: list[BaseException] = []

    def worker(thread: int) -> None:
        try:
            for round_ in range(2):
                for i in range(thread, len(prompts), 2):
                    result = any_pipe.generate(prompts[i], max_new_tokens=6, ignore_eos=True)
                    got[(i, round_)] = result.tokens
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(got) == 2 * len(prompts)
    for (i, _), tokens in got.items():
        assert tokens == want[i], f"prompt {i}"


def test_a_streamer_calling_back_into_its_pipeline_is_refused(smol_dir, text_ids):
    pipe = make_pipe(smol_dir, "CPU")
    seen: list[str] = []

    def reenter(text: str) -> None:
        try:
            pipe.generate("hello", max_new_tokens=2)
        except RuntimeError as exc:
            seen.append(str(exc))

    result = pipe.generate(text_ids(20), max_new_tokens=3, ignore_eos=True, streamer=reenter)
    assert seen and "its streamer" in seen[0] and len(result.tokens) == 3
    assert len(pipe.generate(text_ids(20), max_new_tokens=2, ignore_eos=True).tokens) == 2


@pytest.mark.parametrize("text", ["caf\udce9", "\ud800 lone", "ok \udcff"])
def test_text_the_tokenizer_cannot_take_is_a_value_error(smol_dir, text):
    pipe = make_pipe(smol_dir, "CPU")
    with pytest.raises(ValueError, match="not valid Unicode"):
        pipe.generate(text, max_new_tokens=2)
    with pytest.raises(ValueError, match="not valid Unicode"):
        pipe.generate(text, max_new_tokens=2, apply_chat_template=False)
    pipe.start_chat("be brief")
    try:
        with pytest.raises(ValueError, match="not valid Unicode"):
            pipe.fit_chat_history(text)
        with pytest.raises(ValueError, match="not valid Unicode"):
            pipe.generate(text, max_new_tokens=2)
        assert pipe._history == [{"role": "system", "content": "be brief"}]
        assert pipe.generate("hi", max_new_tokens=2).tokens
    finally:
        pipe.finish_chat()


@pytest.mark.parametrize("ids", [[2**63 + 5], [2**70, 1], np.array([2**64 - 1], np.uint64)])
def test_huge_token_ids_are_named_as_given(smol_dir, ids):
    pipe = make_pipe(smol_dir, "CPU")
    first = int(np.asarray(ids, object).flat[0])
    with pytest.raises(ValueError, match=f"token id {first} is outside"):
        pipe.generate(ids, max_new_tokens=1)


@pytest.mark.parametrize(
    "settings",
    [
        {"attention_backend": "sdpa", "PREFIX_CACHE_TOKENS": 10**9},
        {"PREFIX_CACHE_TOKENS": 10**8},
        {"PREFIX_CACHE_TOKENS": 10**9},
        {"device": "NPU", "PREFIX_CACHE_TOKENS": 10**9},
        {"PREFIX_CACHE_HOST_TOKENS": 10**9},
    ],
)
def test_a_size_beyond_the_machine_is_refused_before_allocating(smol_dir, settings):
    """Checked against the available memory first: a clear error naming the setting, and the
    process does not grow (bookkeeping is not sized by the setting either)."""
    device = settings.pop("device", "CPU")
    setting = next(k for k in settings if k.isupper())  # the advice names the size asked for
    with pytest.raises(ValueError, match=rf"cannot allocate.*available.*lower.*{setting}\)$"):
        LLMPipeline(smol_dir, device, max_prompt_len=64, prefill_chunk_size=64, **settings)


def test_a_long_chat_keeps_reusing_its_cache(smol_dir):
    """Past MAX_PROMPT_LEN the chat trims to half and the turns after a trim reuse the kept
    history, so most of each prompt comes from the cache."""
    pipe = LLMPipeline(
        smol_dir,
        "CPU",
        max_prompt_len=256,
        min_response_len=32,
        prefill_chunk_size=64,
        **EXACT_F32,
    )
    pipe.start_chat("You answer in one short sentence.")
    reused, prompts, trims = [], [], 0
    for turn in range(24):
        message = f"Question {turn}: name a colour and a fruit."
        trims += pipe.fit_chat_history(message) > 0
        result = pipe.generate(message, max_new_tokens=12)
        reused.append(pipe.kv_stats()["reused_tokens"])
        prompts.append(result.prompt_tokens)
    assert trims >= 2  # the chat outgrew MAX_PROMPT_LEN more than once
    share = sum(reused[1:]) / sum(prompts[1:])
    print(f"{trims} trims, reused {share:.0%} of the prompt tokens")
    assert share >= 0.5


@pytest.mark.parametrize("device", ["CPU", "NPU"])
def test_an_absurd_length_is_refused_before_compiling(smol_dir, device, monkeypatch):
    """A model that declares no trained context cannot cap MAX_PROMPT_LEN: the KV it would need
    is checked before static shapes of that length reach the compiler."""
    monkeypatch.setattr("npuw_kv.engine.trained_context", lambda model_dir: None)
    monkeypatch.setattr(
        "npuw_kv.runtime.build.compile_requests", lambda *a: pytest.fail("compiled first")
    )
    with pytest.raises(ValueError, match=r"cannot allocate a KV cache of \d+ tokens.*MAX_PROMPT"):
        LLMPipeline(
            smol_dir, device, attention_backend="sdpa", max_prompt_len=10**9, prefill_chunk_size=64
        )


def test_a_prompt_past_the_tokenizers_own_cut_is_never_shortened(smol_dir):
    """SmolLM2's tokenizer IR cuts at 8192 tokens from the left (openvino-genai applies it
    whatever ``truncation`` says): the pipeline's tokenizer gives every token, so a long prompt
    is refused with its real length instead of losing its beginning."""
    import openvino_genai

    from npuw_kv.errors import CapacityError

    text = "word " * 9000 + "\nHow many words?"
    cut = openvino_genai.Tokenizer(str(smol_dir)).encode(text).input_ids.data.size
    assert cut == 8192  # what a plain genai tokenizer of this IR gives
    pipe = make_pipe(smol_dir, "CPU")
    whole = pipe.encode(text, template=False).size
    assert whole > 9000
    with pytest.raises(CapacityError, match=f"prompt has {whole} tokens"):
        pipe.generate(text, apply_chat_template=False, max_new_tokens=2)
    assert pipe.encode("Hello there", template=False).tolist() == [
        int(i)
        for i in openvino_genai.Tokenizer(str(smol_dir)).encode("Hello there").input_ids.data[0]
    ]


def test_a_list_of_streamers_streams_every_answer(any_pipe):
    """One streamer per answer (prompts x samples): each gets exactly its answer's text, on
    the batched path and on the one-at-a-time paths alike."""
    pieces: list[list[str]] = [[] for _ in range(4)]
    streamers = [pieces[i].append for i in range(4)]
    result = any_pipe.generate(
        ["Hi there", "Name a fruit"], max_new_tokens=8, num_return_sequences=2, do_sample=True,
        rng_seed=3, ignore_eos=True, streamer=streamers,
    )  # fmt: skip
    assert ["".join(p) for p in pieces] == list(result.texts)
    assert all(pieces)
    with pytest.raises(ValueError, match="one streamer per answer"):
        any_pipe.generate("Hi", max_new_tokens=2, streamer=streamers)
    with pytest.raises(ValueError, match="list of 2 streamers"):
        any_pipe.generate(
            "Hi", max_new_tokens=2, num_return_sequences=2, do_sample=True, streamer=print
        )
