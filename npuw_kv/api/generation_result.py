"""What the token loop returns for one sequence: its tokens and text, why it stopped, its
timings and scores (the pipeline shapes these as genai's results, :mod:`npuw_kv.api.results`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class GenerationResult:
    tokens: list[int]
    text: str  # with ``echo``, the prompt's text first
    # "stop" (stop token / string / constraint / streamer), "length", "cancelled", "tool_call"
    # (a streamer's TOOL_CALL_STOP)
    finish_reason: str
    prompt_tokens: int
    ttft_s: float = 0.0
    decode_s: float = 0.0
    first_logits: np.ndarray | None = field(default=None, repr=False)
    # per token: its log-probability as genai scores it (see npuw_kv.generation.sampling)
    logprobs: list[float] = field(default_factory=list, repr=False)
    # per token, with ``logprobs`` > 0: the most likely (token, log-prob) pairs, best first
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list, repr=False)
    # genai's ``scores[i]``: the sum of ``logprobs`` and of the stop token's, which genai counts
    score: float = 0.0
    # the stop token that ended the sequence (not in ``tokens``; genai counts it as generated)
    stop_token: int | None = None
    # ended because the KV pools ran out with no sequence able to go on (genai's request status
    # IGNORED; the finish reason says "length")
    out_of_room: bool = False
    # with ``echo`` and ``logprobs`` > 0 (npuw_kv.generation.prompt_scores): the prompt's ids,
    # each one's log-probability under the model (None for the first: nothing predicts it) and
    # its ``logprobs`` likeliest alternatives
    prompt_ids: list[int] = field(default_factory=list, repr=False)
    prompt_logprobs: list[float | None] = field(default_factory=list, repr=False)
    prompt_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list, repr=False)

    @property
    def genai_tokens(self) -> list[int]:
        """The tokens as genai lists them (``EncodedResults``, continuous batching): ending with
        the stop token that ended the answer, if one did."""
        return [*self.tokens, *([] if self.stop_token is None else [self.stop_token])]

    @property
    def ms_per_token(self) -> float:
        steps = max(len(self.tokens) - 1, 1)
        return 1000.0 * self.decode_s / steps

    def __str__(self) -> str:
        return self.text
