"""The generation loop of one sequence: prefill, then choose and step token by token.

It owns what happens between the runner's logits and the caller's tokens: the sampler, the
stopping rules and the streamer.  :class:`~npuw_kv.pipeline.LLMPipeline` prepares the prompt's
token ids and shapes the result; the runner owns the KV cache.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .runtime.runner import Runner
from .sampling import GenerationConfig, Sampler
from .stopping import StopStrings, TokenOutput

# a callable taking text (wrapped in openvino-genai's TextStreamer) or a token-level
# openvino_genai.StreamerBase; either may return None, a bool or a StreamingStatus
Streamer = Any


@dataclass
class GenerationResult:
    tokens: list[int]
    text: str
    finish_reason: str  # "stop" (EOS / stop string / streamer), "length", "cancelled"
    prompt_tokens: int
    ttft_s: float = 0.0
    decode_s: float = 0.0
    first_logits: np.ndarray | None = field(default=None, repr=False)

    @property
    def ms_per_token(self) -> float:
        steps = max(len(self.tokens) - 1, 1)
        return 1000.0 * self.decode_s / steps

    def __str__(self) -> str:
        return self.text


def generate_tokens(
    runner: Runner,
    tokenizer: Any,
    ids: np.ndarray,
    config: GenerationConfig,
    streamer: Streamer,
    position_limit: int | None = None,
) -> GenerationResult:
    """Run ``ids`` through ``runner`` and generate up to ``config.max_new_tokens`` tokens.

    ``position_limit``: the model's trained context; generation stops (``"length"``) when the
    prompt and the answer fill it, as it does when the KV cache is full.
    """
    sampler = Sampler(config, ids)
    stops = StopStrings(tokenizer, config.stop_strings)
    out = TokenOutput(tokenizer, streamer, stops)
    eos = None if config.ignore_eos else config.eos_token_id
    start = time.perf_counter()
    logits = first_logits = runner.prefill(ids)
    tokens: list[int] = []
    finish = "length"
    ttft = decode_start = time.perf_counter() - start
    while len(tokens) < config.max_new_tokens:
        token = sampler(logits)
        if not tokens:
            ttft = decode_start = time.perf_counter() - start
        if token == eos:
            finish = "stop"
            break
        tokens.append(token)
        if stops.hit(tokens):
            finish = "stop"
            break
        halted = out.push(tokens)
        if halted:
            finish = halted
            break  # the streamer said stop: it gets nothing more
        if len(tokens) >= config.max_new_tokens:
            break
        at_limit = position_limit is not None and ids.size + len(tokens) >= position_limit
        if runner.remaining_capacity <= 0 or at_limit:
            finish = "length"
            break
        logits = runner.step(token)
    text, kept = stops.cut(tokens)
    finish = out.close(tokens, kept, text, finish)
    decode_s = time.perf_counter() - start - decode_start
    return GenerationResult(
        tokens[:kept], text, finish, int(ids.size), ttft, decode_s, first_logits
    )
