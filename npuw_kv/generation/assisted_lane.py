"""Assisted generation (prompt lookup, a draft model) for the running batch's requests.

Speculation checks one sequence's candidate tokens in one main-model call over the runner's
lone sequence (:class:`~.speculative.SpeculativeRunner`), so an assisted request runs on the
runner alone.  The lane holds the assisted requests of a ``ContinuousBatchingPipeline`` in
arrival order and runs the first one whenever no batched sequence is live: a step of the
running batch is then one main-model call of that request (the prompt; or the token just
chosen with the next candidates), with the candidates it accepted.  The other assisted
requests wait for it to end.  Each token is still chosen by the request's own token loop
(:func:`~.decode.decode_loop`) from the logits plain decoding computes, so the answer is plain
decoding's (up to the rounding of a chunk of several rows against a row alone).
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Generator
from typing import Any

import numpy as np

from ..api.generation_config import GenerationConfig
from ..api.generation_result import GenerationResult
from ..runtime.paged.runner import PagedRunner
from .decode import decode_loop, sample_rng
from .logits_process import LogitsConstraint
from .prompt_scores import PromptScores, wanted
from .speculative import Assisted, SpeculativeRunner

# what a job yields per step: the tokens it chose (and fed) in that step
JobSteps = Generator[list[int], None, GenerationResult]


class AssistedJob:
    """One assisted request: its token loop over a speculative runner, run step by step."""

    def __init__(
        self,
        handle: int,
        ids: np.ndarray,
        config: GenerationConfig,
        constraint: LogitsConstraint | None,
        streamer: Any,
        times: Any,
    ) -> None:
        self.handle, self.ids, self.config = handle, ids, config
        self.constraint, self.streamer, self.times = constraint, streamer, times
        self.steps: JobSteps | None = None  # set when it starts

    def start(
        self, assisted: Assisted, runner: PagedRunner, tokenizer: Any, limit: int | None
    ) -> None:
        self.steps = self._run(assisted, runner, tokenizer, limit)

    def _run(
        self, assisted: Assisted, runner: PagedRunner, tokenizer: Any, limit: int | None
    ) -> JobSteps:
        """Yield after the prompt and after each later main-model call."""
        spec = assisted.runner(runner, self.config)
        assert isinstance(spec, SpeculativeRunner)  # the lane exists when the pipeline speculates
        scores = (
            PromptScores(self.ids.reshape(-1), self.config.logprobs)
            if wanted(self.config)
            else None
        )
        loop = decode_loop(
            tokenizer,
            self.ids,
            self.config,
            self.streamer,
            lambda: spec.remaining_capacity,
            limit,
            self.constraint,
            sample_rng(self.config.rng_seed, 0),
            scores,
        )
        next(loop)
        logits = spec.prefill(self.ids, None if scores is None else scores.add)
        yield []
        chosen: list[int] = []
        while True:
            try:
                token = loop.send(logits)
            except StopIteration as done:
                return done.value
            assert token is not None
            chosen.append(token)
            calls = spec.counts.verify_calls
            logits = spec.step(token)
            if spec.counts.verify_calls != calls:  # the model ran: the step ends here
                yield chosen
                chosen = []


class AssistedLane:
    """The assisted requests of one running batch, run one at a time on its runner alone."""

    def __init__(
        self,
        assisted: Assisted,
        runner: PagedRunner,
        tokenizer: Any,
        position_limit: int | None = None,
    ) -> None:
        self.assisted, self.runner, self.tokenizer = assisted, runner, tokenizer
        self.position_limit = position_limit
        self.jobs: deque[AssistedJob] = deque()  # the first one runs (once started)
        # handles apart from the scheduler's (which count up from 0)
        self._handles = itertools.count(-1, -1)

    @property
    def running(self) -> bool:
        return bool(self.jobs)

    def __contains__(self, handle: int) -> bool:
        return any(job.handle == handle for job in self.jobs)

    def add(
        self,
        ids: np.ndarray,
        config: GenerationConfig,
        constraint: LogitsConstraint | None = None,
        streamer: Any = None,
        times: Any = None,
    ) -> int:
        """Queue an assisted request; its handle.  What its token loop would refuse when it
        starts (a prompt too long, ``max_length`` within the prompt) is refused now."""
        self.runner.check_prompt(int(ids.size))
        config.new_token_budget(int(ids.size))
        job = AssistedJob(next(self._handles), ids, config, constraint, streamer, times)
        self.jobs.append(job)
        return job.handle

    def step(self) -> tuple[dict[int, list[int]], dict[int, Any]]:
        """One step of the first request: the tokens it chose, and its outcome if it ended
        (its result, or the error that ended it alone)."""
        job = self.jobs[0]
        if job.steps is None:
            self.runner.release()  # a sequence left by an earlier call: cached, not live
            self.assisted.start()  # its figures are this request's
            job.start(self.assisted, self.runner, self.tokenizer, self.position_limit)
        assert job.steps is not None
        start = time.perf_counter() * 1e6
        outcome: Any
        try:
            tokens = next(job.steps)
        except StopIteration as done:
            outcome = done.value
        except BaseException as exc:  # noqa: BLE001 - this request only (its call raises it)
            outcome = exc
        else:
            self._time(job, start)
            return {job.handle: tokens}, {}
        self._time(job, start)
        self.drop(job.handle)
        return {}, {job.handle: outcome}

    @staticmethod
    def _time(job: AssistedJob, start: float) -> None:
        if job.times is not None:
            end = time.perf_counter() * 1e6
            job.times.ends.append(end)
            job.times.durations.append(end - start)
            job.times.sizes.append(1)

    def drop(self, handle: int) -> None:
        """End a request (finished, stopped, cancelled or failed): the runner's lone sequence
        is left cached, the unused candidates' KV dropped."""
        for job in list(self.jobs):
            if job.handle != handle:
                continue
            self.jobs.remove(job)
            if job.steps is not None:
                job.steps.close()
                self.assisted.finish()
                self.runner.release()

    def close(self) -> None:
        for job in list(self.jobs):
            self.drop(job.handle)
