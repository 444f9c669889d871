"""The genai-shaped API on SmolLM2: sampling, streaming, stop rules, chat."""

from __future__ import annotations

import numpy as np
import openvino_genai
import pytest
from conftest import make_pipe

from npuw_kv import GenerationConfig


@pytest.fixture(scope="module")
def pipe(smol_dir):
    return make_pipe(smol_dir, "CPU")


def test_text_generation_and_eos(pipe):
    result = pipe.generate(
        "The capital of France is Paris. The capital of Germany is",
        max_new_tokens=5,
        apply_chat_template=False,
    )
    assert "Berlin" in result.text and str(result) == result.text
    pipe.start_chat()
    try:
        answer = pipe.generate("Say only the word yes.", max_new_tokens=64)
    finally:
        pipe.finish_chat()
    assert answer.finish_reason == "stop" and len(answer.tokens) < 64  # ended at EOS


def test_seeded_sampling_is_repeatable_and_differs_from_greedy(pipe, text_ids):
    ids = text_ids(40)
    kwargs = dict(
        max_new_tokens=16, do_sample=True, temperature=1.3, top_k=50, top_p=0.95, ignore_eos=True
    )
    a = pipe.generate(ids, rng_seed=7, **kwargs)
    b = pipe.generate(ids, rng_seed=7, **kwargs)
    c = pipe.generate(ids, rng_seed=8, **kwargs)
    greedy = pipe.generate(ids, max_new_tokens=16, ignore_eos=True)
    assert a.tokens == b.tokens
    assert a.tokens != c.tokens or a.tokens != greedy.tokens


def test_streamer_receives_the_text_and_can_stop(pipe, text_ids):
    pieces: list[str] = []
    result = pipe.generate(
        text_ids(30), max_new_tokens=12, ignore_eos=True, streamer=lambda s: pieces.append(s)
    )
    assert "".join(pieces) == result.text and len(pieces) > 1
    seen: list[str] = []

    def stop_after_three(text: str) -> openvino_genai.StreamingStatus:
        seen.append(text)
        return (
            openvino_genai.StreamingStatus.STOP
            if len(seen) >= 3
            else openvino_genai.StreamingStatus.RUNNING
        )

    stopped = pipe.generate(
        text_ids(30), max_new_tokens=50, ignore_eos=True, streamer=stop_after_three
    )
    assert stopped.finish_reason == "stop" and len(stopped.tokens) < 50
    calls: list[str] = []

    def cancel(text: str) -> openvino_genai.StreamingStatus:
        calls.append(text)
        return openvino_genai.StreamingStatus.CANCEL

    cancelled = pipe.generate(text_ids(30), max_new_tokens=50, ignore_eos=True, streamer=cancel)
    # TextStreamer may hold a few tokens back before the first call; one call ends it
    assert cancelled.finish_reason == "cancelled" and len(calls) == 1
    assert len(cancelled.tokens) < 10


def test_stop_string_ends_generation(pipe):
    prompt = "Count: 1, 2, 3, 4, 5, 6,"
    free = pipe.generate(prompt, max_new_tokens=20, ignore_eos=True, apply_chat_template=False)
    assert " 8" in free.text
    cut = pipe.generate(
        prompt, max_new_tokens=20, ignore_eos=True, stop_strings={" 8"}, apply_chat_template=False
    )
    assert cut.finish_reason == "stop" and " 8" not in cut.text and len(cut.tokens) < 20


def test_chat_keeps_history_through_the_template(pipe):
    pipe.start_chat("You are terse.")
    try:
        first = pipe.generate("My name is Ada. Reply with OK.", max_new_tokens=16)
        assert first.prompt_tokens > 10
        second = pipe.generate("What is my name?", max_new_tokens=16)
        # the second prompt holds the first turn: system + 2 user turns + 1 answer
        assert second.prompt_tokens > first.prompt_tokens + len(first.tokens)
        history_prompt = pipe.tokenizer.decode(pipe.encode("And now?", chat=True).tolist())
        assert "My name is Ada" in history_prompt and "What is my name?" in history_prompt
        assert first.text.strip()[:10] in history_prompt
    finally:
        pipe.finish_chat()


def test_long_chat_drops_the_oldest_exchanges_to_fit(pipe):
    """A chat longer than MAX_PROMPT_LEN loses its oldest exchanges, not the new message, down
    to half of MAX_PROMPT_LEN, so the next turns find the history unchanged in the cache."""
    limit = pipe.config.max_prompt_len
    pipe.start_chat("You are terse.")
    try:
        exchanges = [
            (f"Question {i}: {'tell me more ' * 12}", f"Answer {i}: {'ok ' * 20}")
            for i in range(40)
        ]
        for question, answer in exchanges:
            pipe._history += [
                {"role": "user", "content": question},
                {"role": "assistant", "content": answer},
            ]
        message = "What was the last question?"
        assert pipe.encode(message, chat=True).size > limit  # as it stands it cannot run
        dropped = pipe.fit_chat_history(message)
        history = pipe._history
        assert 0 < dropped < len(exchanges)
        assert history[0] == {"role": "system", "content": "You are terse."}
        assert history[1]["content"] == exchanges[dropped][0]  # the oldest kept is next in line
        assert history[-1]["content"] == exchanges[-1][1]  # the newest is kept
        assert pipe.encode(message, chat=True).size <= limit // 2
        # down to half and no further: keeping one more exchange would not fit in half
        one_more = [
            history[0],
            *[
                {"role": r, "content": c}
                for r, c in zip(("user", "assistant"), exchanges[dropped - 1], strict=True)
            ],
            *history[1:],
        ]
        size = pipe.engine.encoder.messages([*one_more, {"role": "user", "content": message}]).size
        assert size > limit // 2
        assert pipe.generate(message, max_new_tokens=4).tokens
        assert pipe.fit_chat_history("And the one before?") == 0  # room left: nothing dropped
        # a message too long on its own: history untouched, generate names the setting
        before = list(pipe._history)
        huge = "word " * (2 * limit)
        assert pipe.fit_chat_history(huge) == 0 and pipe._history == before
        with pytest.raises(ValueError, match="MAX_PROMPT_LEN"):
            pipe.generate(huge, max_new_tokens=4)
        assert pipe._history == before
    finally:
        pipe.finish_chat()
    with pytest.raises(ValueError, match="start_chat"):
        pipe.fit_chat_history("hi")


def test_repetition_penalty_discourages_seen_tokens(pipe):
    from npuw_kv.api.generation_config import GenerationConfig
    from npuw_kv.generation.sampling import Sampler

    logits = np.array([3.0, 2.9, -1.0, 0.5], np.float32)
    assert Sampler(GenerationConfig(), prompt=np.array([0]))(logits) == 0
    penalized = Sampler(GenerationConfig(repetition_penalty=1.2), prompt=np.array([0]))
    assert penalized(logits) == 1  # 3.0 / 1.2 = 2.5 < 2.9
    assert penalized(np.array([-1.0, -1.1, -1.15, -5.0], np.float32)) == 2  # -1.2, -1.32 (seen)
    with pytest.raises(ValueError, match="repetition_penalty"):
        GenerationConfig(max_new_tokens=8, repetition_penalty=0).validate()
    prompt = "Why is the sky blue?"
    plain = pipe.generate(prompt, max_new_tokens=48, ignore_eos=True)
    varied = pipe.generate(prompt, max_new_tokens=48, ignore_eos=True, repetition_penalty=1.3)
    assert varied.tokens != plain.tokens
    assert len(set(varied.tokens)) >= len(set(plain.tokens))


def test_a_config_without_eos_still_stops_at_eos(pipe):
    """genai's GenerationConfig leaves eos_token_id at -1: the tokenizer's EOS still ends it."""
    theirs = openvino_genai.GenerationConfig()
    theirs.max_new_tokens = 64
    assert theirs.eos_token_id == -1
    for config in (GenerationConfig(max_new_tokens=64), theirs):
        result = pipe.generate("Say only the word yes.", config)
        assert result.finish_reason == "stop" and len(result.tokens) < 64
    default = pipe.get_generation_config()
    try:
        pipe.set_generation_config(GenerationConfig(max_new_tokens=64))
        assert pipe.generate("Say only the word yes.").finish_reason == "stop"
    finally:
        pipe.set_generation_config(default)


def test_stop_strings_cut_text_tokens_and_stream_alike(pipe):
    prompt, settings = (
        "Count: 1, 2, 3, 4, 5, 6,",
        {"ignore_eos": True, "apply_chat_template": False},
    )
    tokenizer = pipe.get_tokenizer()
    free = pipe.generate(prompt, max_new_tokens=30, **settings)
    pieces: list[str] = []
    cut = pipe.generate(
        prompt, max_new_tokens=30, stop_strings={" 8"}, streamer=pieces.append, **settings
    )
    decoded = tokenizer.decode(cut.tokens)
    assert cut.finish_reason == "stop" and " 8" not in decoded and " 8" not in "".join(pieces)
    assert "".join(pieces) == decoded and cut.text.startswith(decoded)
    assert free.text.startswith(cut.text)
    # a stop string spanning 20 tokens is seen as soon as it completes
    long_stop = tokenizer.decode(free.tokens[5:25])
    assert len(long_stop) > 16
    stopped = pipe.generate(prompt, max_new_tokens=30, stop_strings={long_stop}, **settings)
    assert stopped.finish_reason == "stop" and stopped.tokens == free.tokens[:5]


def test_a_stop_string_starting_inside_a_token_streams_the_text_before_it(pipe):
    """The text streamer gets the part of the cut token before the stop string, so what was
    streamed is exactly ``text``; ``tokens`` keeps only the tokens wholly before it."""
    prompt, settings = (
        "The capital of France is",
        {"ignore_eos": True, "apply_chat_template": False},
    )
    tokenizer = pipe.get_tokenizer()
    free = pipe.generate(prompt, max_new_tokens=20, **settings)
    pieces = [tokenizer.decode([t]) for t in free.tokens]
    k = next(i for i, piece in enumerate(pieces) if i > 0 and len(piece.strip()) >= 4)
    stop = pieces[k][-2:] + pieces[k + 1][:2]
    assert stop not in "".join(pieces[:k]) + pieces[k][:-2]
    streamed: list[str] = []
    cut = pipe.generate(
        prompt, max_new_tokens=20, stop_strings={stop}, streamer=streamed.append, **settings
    )
    assert cut.finish_reason == "stop" and cut.tokens == free.tokens[:k]
    assert cut.text == "".join(pieces[:k]) + pieces[k][:-2] == "".join(streamed)


def test_a_streamer_that_stops_while_held_back_text_is_flushed_gets_no_more(pipe):
    """With a stop string set, the newest tokens wait; a streamer that says STOP when they are
    finally sent must not be handed the rest of the text after all."""
    streamed: list[str] = []

    def stop_at_once(text: str) -> openvino_genai.StreamingStatus:
        streamed.append(text)
        return openvino_genai.StreamingStatus.STOP

    result = pipe.generate(
        "Count: 1, 2, 3, 4, 5, 6,",
        max_new_tokens=4,
        ignore_eos=True,
        apply_chat_template=False,
        stop_strings={"a stop string longer than the answer"},  # holds back every token
        streamer=stop_at_once,
    )
    assert len(result.tokens) == 4 and streamed
    assert len("".join(streamed)) < len(result.text)


def test_a_token_level_streamer_object_is_accepted(pipe, text_ids):
    class Collect(openvino_genai.StreamerBase):
        def __init__(self) -> None:
            super().__init__()
            self.tokens: list[int] = []
            self.ended = False

        def write(self, token: int) -> openvino_genai.StreamingStatus:
            self.tokens.append(token)
            return openvino_genai.StreamingStatus.RUNNING

        def end(self) -> None:
            self.ended = True

    collect = Collect()
    result = pipe.generate(text_ids(20), max_new_tokens=6, ignore_eos=True, streamer=collect)
    assert collect.tokens == result.tokens and collect.ended
    pieces: list[str] = []
    text_streamer = openvino_genai.TextStreamer(pipe.get_tokenizer(), pieces.append)
    streamed = pipe.generate(
        text_ids(20), max_new_tokens=6, ignore_eos=True, streamer=text_streamer
    )
    assert "".join(pieces) == streamed.text
    with pytest.raises(ValueError, match="streamer must return None, a bool"):
        pipe.generate(text_ids(20), max_new_tokens=3, streamer=lambda text: "x")

    class Odd(openvino_genai.StreamerBase):  # a token streamer held to the same rule
        def write(self, token):
            return "x"

        def end(self) -> None:
            pass

    with pytest.raises(ValueError, match="streamer must return None, a bool.* got 'x'"):
        pipe.generate(text_ids(20), max_new_tokens=3, streamer=Odd())
    assert pipe.generate(text_ids(20), max_new_tokens=3).tokens  # the pipeline still serves
    with pytest.raises(ValueError, match="streamer must be a callable"):
        pipe.generate(text_ids(20), max_new_tokens=3, streamer="print")


class _StopAfter(openvino_genai.StreamerBase):
    """Returns ``status`` at the ``n``-th token."""

    def __init__(self, n: int, status: object) -> None:
        super().__init__()
        self.n, self.status, self.seen = n, status, []

    def write(self, token: int) -> object:
        self.seen.append(token)
        return self.status if len(self.seen) == self.n else openvino_genai.StreamingStatus.RUNNING

    def end(self) -> None:
        pass


def test_a_streamer_that_stops_gets_nothing_more(pipe, text_ids):
    """With stop strings the streamer lags a few tokens; once it says stop, no held-back token
    reaches it (a UI stop button must stop the text)."""
    for status in (True, openvino_genai.StreamingStatus.STOP):
        streamer = _StopAfter(3, status)
        result = pipe.generate(
            text_ids(20),
            max_new_tokens=30,
            ignore_eos=True,
            stop_strings={"@@@@"},  # 4 bytes: the streamer lags 4 tokens
            streamer=streamer,
        )
        assert result.finish_reason == "stop" and len(streamer.seen) == 3
        assert result.tokens[:3] == streamer.seen and len(result.tokens) > 3  # ran ahead
