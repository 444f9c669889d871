"""Beam search on a runner that holds one sequence: the static-shape path on the CPU.

The paged path runs each beam as a sequence of its own, forked in the block manager
(:class:`~.beam_search.BeamJob`).  The static-shape runner holds one sequence, so here the
beams take turns in it: the beam whose tokens continue the cached sequence by one takes a
generate step; any other is read as a prompt, which the runner's prefix reuse runs from where
its tokens part from the cached ones (from the last block boundary before), so a switch costs
the beams' differing tail, not the whole sequence (with ``prefix_reuse`` off, the whole of it).
A beam that parts from the cached one only a few tokens back is stepped on from there instead
(the runner's ``truncate``), when those steps cost less than reading the tail as a prompt did
(both timed as the search runs: a chunk costs a few to tens of steps, by model and device).
The beams are visited in token order, so beams with a long common tail follow each other.  The
search itself is :class:`~.beam_search.GroupBeamSearch`, genai's semantics, so the answers are
the paged path's up to the rounding of the models that computed the KV.

Since a switch reads the beam as a prompt, a beam can grow only to ``max_prompt_len`` tokens in
all: the answers end there with finish reason ``length``, as they end at ``max_new_tokens``.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from ..api.generation_config import GenerationConfig
from ..api.generation_result import GenerationResult
from ..runtime.runner import Runner
from ..runtime.static.prompt_reuse import shared_prefix
from .beam_search import GroupBeamSearch, check_beam_request, hypothesis_results
from .stopping import StopStrings


class BeamsAlone:
    """One prompt's beam search on ``runner`` alone, the beams taking turns in its cache."""

    def __init__(
        self,
        runner: Runner,
        tokenizer: Any,
        ids: np.ndarray,
        config: GenerationConfig,
        position_limit: int | None = None,
    ) -> None:
        self.runner = runner
        self.prompt = [int(t) for t in np.asarray(ids).reshape(-1)]
        self.config = config
        self.stops = StopStrings(tokenizer, config.stop_strings, config.include_stop_str_in_output)
        self.budget = config.new_token_budget(len(self.prompt))
        # a beam is read again as a prompt when it takes its turn: it fits in one
        self.limit = min(runner.max_prompt_len, position_limit or runner.max_prompt_len)
        self.cached: list[int] = []  # the tokens whose KV the runner holds now
        self.step_s = 0.0  # the last generate step's wall time
        self.chunk_s = 0.0  # a prefill chunk's, from the last prompt read

    def run(self) -> list[GenerationResult]:
        start = time.perf_counter()
        first = self._feed(self.prompt)
        ttft = time.perf_counter() - start
        room = min(self.limit - len(self.prompt), self.runner.remaining_capacity)
        search = GroupBeamSearch(self.config, self.prompt, 0, self.budget, self.stops)
        rows = {0: first}
        serial = 0
        while True:
            search.select(rows)
            beams = search.running
            grown = len(beams[0].tokens) if beams else 0
            if not beams or grown >= room or (self.budget is not None and grown >= self.budget):
                break
            rows = {}
            for beam in sorted(beams, key=lambda b: b.tokens):  # common tails in a row
                serial += 1
                beam.seq = serial
                rows[serial] = self._feed(self.prompt + beam.tokens)
        if beams:
            search.finalize()
        decode_s = time.perf_counter() - start - ttft
        return hypothesis_results(search, self.stops, len(self.prompt), ttft, decode_s, first)

    def _feed(self, tokens: list[int]) -> np.ndarray:
        """The logits after ``tokens``, with the runner's cache holding them afterwards."""
        ids = np.asarray(tokens, np.int64)
        if self.cached and tokens[:-1] == self.cached:
            logits = self._step(tokens[-1])
        elif self._steps_cheaper(part := shared_prefix(self.cached, ids), ids.size):
            self.runner.truncate(part)
            for token in tokens[part:]:
                logits = self._step(token)
        else:
            start = time.perf_counter()
            logits = self.runner.prefill(ids)
            self.chunk_s = (time.perf_counter() - start) / self._chunks(part, ids.size)
        self.cached = list(tokens)
        return logits

    def _step(self, token: int) -> np.ndarray:
        start = time.perf_counter()
        logits = self.runner.step(token)
        self.step_s = time.perf_counter() - start
        return logits

    def _chunks(self, part: int, length: int) -> int:
        """About how many prefill chunks reading ``length`` tokens as a prompt runs when the
        cache holds their first ``part`` (reused from the chunk boundary before)."""
        chunk = self.runner.chunk
        return max(1, -(-length // chunk) - part // chunk)

    def _steps_cheaper(self, part: int, length: int) -> bool:
        """Whether stepping on from the cached sequence's first ``part`` tokens to ``length``
        costs less than reading them as a prompt, by the last step's and chunk's times."""
        if not (self.step_s and self.chunk_s) or not self.runner.can_truncate(part):
            return False
        tail = length - part
        cheaper = tail * self.step_s < self.chunk_s * self._chunks(part, length)
        return cheaper and tail <= self.runner.remaining_capacity


def beams_alone(
    runner: Runner,
    tokenizer: Any,
    ids: np.ndarray,
    config: GenerationConfig,
    streamer: Any = None,
    constraint: Any = None,
    position_limit: int | None = None,
) -> list[GenerationResult]:
    """Beam search of one prompt on ``runner`` alone: genai's answers, best first."""
    check_beam_request(config, streamer, constraint)
    return BeamsAlone(runner, tokenizer, ids, config, position_limit).run()
