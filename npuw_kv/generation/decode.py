"""The generation loop of one sequence: prefill, then choose and step token by token.

It owns what happens between the runner's logits and the caller's tokens: the sampler, the
stopping rules and the streamer.  :class:`~npuw_kv.pipeline.LLMPipeline` prepares the prompt's
token ids and shapes the result; the runner owns the KV cache.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from typing import Any, cast

import numpy as np

from ..api.generation_config import GenerationConfig
from ..api.generation_result import GenerationResult
from ..errors import UsageError
from ..runtime.runner import Runner
from .logits_process import LogitsConstraint
from .prompt_scores import PromptScores, wanted
from .sampling import Sampler
from .stopping import StopStrings, TokenOutput


class OutOfKVRoom(Exception):  # noqa: N818 - a signal, thrown into a token loop
    """Thrown into a token loop (:func:`decode_loop`) waiting for logits that will not come:
    the pools cannot hold its sequence now.  The loop ends with what it generated, its finish
    reason "length", as when the sequence fills its KV room."""


# a callable taking text (wrapped in openvino-genai's TextStreamer) or a token-level
# openvino_genai.StreamerBase; either may return None, a bool or a StreamingStatus
Streamer = Any


def decode_loop(
    tokenizer: Any,
    ids: np.ndarray,
    config: GenerationConfig,
    streamer: Streamer,
    remaining: Callable[[], int],
    position_limit: int | None = None,
    constraint: LogitsConstraint | None = None,
    rng: np.random.Generator | None = None,
    scores: PromptScores | None = None,
) -> Generator[int | None, np.ndarray, GenerationResult]:
    """One sequence's token loop, driven from outside: it yields None for the prompt's logits,
    then each chosen token whose next logits it needs, and returns the sequence's result.

    A lone runner drives it through :func:`generate_tokens`; the scheduler drives many at
    once (:mod:`.batch`).  ``remaining()``: how many more tokens the sequence's KV room takes.
    ``position_limit``: the model's trained context; generation stops (``"length"``) when the
    prompt and the answer fill it, as it does when the KV cache is full.  ``constraint``
    restricts each next token (structured output) and ends generation when it is done.
    ``rng``: the sample's random generator (:func:`sample_rng`).  ``scores``: the prompt's
    log-probabilities, which the driver fills from the prefill's rows (echo with logprobs).
    """
    if config.structured_output_config is not None and constraint is None:
        raise UsageError(
            "structured_output_config is set but no constraint was built from it "
            "(npuw_kv.generation.structured builds one for generate_tokens' constraint argument)"
        )
    budget = config.new_token_budget(int(ids.size))
    sampler = Sampler(config, ids, rng)
    stops = StopStrings(tokenizer, config.stop_strings, config.include_stop_str_in_output)
    prompt = [int(t) for t in ids.reshape(-1)] if config.echo else []
    out = TokenOutput(tokenizer, streamer, stops, echo=prompt)
    stop_ids = set() if config.ignore_eos else config.stop_ids()
    start = time.perf_counter()
    try:
        logits = yield None
    except OutOfKVRoom:
        logits = None
    # a scheduler step's rows live for one step
    first_logits = None if logits is None else np.array(logits, copy=True)
    tokens: list[int] = []
    logprobs: list[float] = []
    top: list[list[tuple[int, float]]] = []
    stop_logprob = 0.0
    stop_token: int | None = None
    finish = "length"
    ttft = decode_start = time.perf_counter() - start
    while logits is not None and (budget is None or len(tokens) < budget):
        choice = sampler.sample(logits, constraint)
        token = choice.token
        if not tokens:
            ttft = decode_start = time.perf_counter() - start
        if token in stop_ids:
            finish, stop_logprob, stop_token = "stop", choice.logprob, token
            break
        tokens.append(token)
        logprobs.append(choice.logprob)
        top.append(choice.top)
        if constraint is not None:
            constraint.accept(token)
        if stops.hit(tokens):
            finish = "stop"
            break
        halted = out.push(tokens)
        if halted:
            finish = halted
            break  # the streamer said stop: it gets nothing more
        if constraint is not None and constraint.done():
            finish = "stop"
            break
        if budget is not None and len(tokens) >= budget:
            break
        at_limit = position_limit is not None and ids.size + len(tokens) >= position_limit
        if remaining() <= 0 or at_limit:
            finish = "length"
            break
        try:
            logits = yield token
        except OutOfKVRoom:
            break  # "length": no room for the sequence now
    text, kept = stops.cut(tokens)
    if prompt:  # genai decodes prompt and answer as one sequence
        answer = tokenizer.decode(tokens[:kept]) if kept else ""
        text = tokenizer.decode(prompt + tokens[:kept]) + text[len(answer) :]
    finish = out.close(tokens, kept, text, finish)
    decode_s = time.perf_counter() - start - decode_start
    score = float(sum(logprobs[:kept])) + stop_logprob
    result = GenerationResult(
        tokens[:kept],
        text,
        finish,
        int(ids.size),
        ttft,
        decode_s,
        first_logits,
        logprobs[:kept],
        top[:kept] if config.logprobs else [],
        score,
        stop_token,
    )
    if scores is not None and logits is not None:  # (no logits: the prompt was not read)
        scores.check_complete()
        result.prompt_ids = list(scores.ids)
        result.prompt_logprobs = list(scores.logprobs)
        result.prompt_top_logprobs = [list(t) for t in scores.tops]
    return result


def generate_tokens(
    runner: Runner,
    tokenizer: Any,
    ids: np.ndarray,
    config: GenerationConfig,
    streamer: Streamer,
    position_limit: int | None = None,
    constraint: LogitsConstraint | None = None,
    rng: np.random.Generator | None = None,
) -> GenerationResult:
    """Run ``ids`` through ``runner`` and generate one sequence (:func:`decode_loop`),
    whatever ``num_return_sequences`` says (:func:`generate_sequences` runs that many).
    With echo and logprobs, the prefill hands every prompt row's logits to the prompt's
    scores (:mod:`.prompt_scores`)."""
    scores = PromptScores(ids.reshape(-1), config.logprobs) if wanted(config) else None
    loop = decode_loop(
        tokenizer,
        ids,
        config,
        streamer,
        lambda: runner.remaining_capacity,
        position_limit,
        constraint,
        rng,
        scores,
    )
    next(loop)
    logits = runner.prefill(ids) if scores is None else runner.prefill_every_row(ids, scores.add)
    try:
        while True:
            token = loop.send(logits)
            assert token is not None
            logits = runner.step(token)
    except StopIteration as done:
        return cast(GenerationResult, done.value)


def generate_sequences(
    runner: Runner,
    tokenizer: Any,
    ids: np.ndarray,
    config: GenerationConfig,
    streamer: Streamer = None,
    position_limit: int | None = None,
    make_constraint: Callable[[], LogitsConstraint | None] | None = None,
) -> list[GenerationResult]:
    """``config.num_return_sequences`` sequences, one after another, each from its own random
    generator (:func:`sample_rng`; genai forks them after the prompt; here each prefills again,
    which the runner serves from the prompt's cached KV where it can).  One streamer cannot take
    several sequences (genai refuses it too): give a list of ``n`` streamers, one for each."""
    n = config.num_return_sequences
    if isinstance(streamer, (list, tuple)):
        if len(streamer) != n:
            raise UsageError(f"{len(streamer)} streamers for num_return_sequences={n}")
        streamers = list(streamer)
    elif n > 1 and streamer is not None:
        raise UsageError(f"a streamer takes one sequence, not num_return_sequences={n}")
    else:
        streamers = [streamer] * n
    if config.num_beams > 1:  # the pipeline sends these to npuw_kv.generation.beam_search
        raise UsageError(f"num_beams={config.num_beams}: beam search is beam_search.beam_search's")
    return [
        generate_tokens(
            runner,
            tokenizer,
            ids,
            config,
            streamers[i],
            position_limit,
            make_constraint() if make_constraint is not None else None,
            sample_rng(config.rng_seed, i),
        )
        for i in range(n)
    ]


def sample_rng(seed: int | None, index: int) -> np.random.Generator:
    """The random generator of sample ``index`` of a prompt: the seed's own for the first (so
    one sample equals the first of several), an independent stream for each other one, so the
    samples come out the same whether they run one after another or batched together (no
    seed: fresh entropy for each)."""
    if seed is None or index == 0:
        return np.random.default_rng(seed)
    return np.random.default_rng([seed, index])
