"""Many prompts, and several samples of a prompt, generated together: each sequence's token
loop (:func:`~.decode.decode_loop`) fed by the paged path's scheduler, one step at a time for
all of them (:class:`~npuw_kv.runtime.paged.scheduler.Scheduler`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..api.generation_config import GenerationConfig
from ..api.generation_result import GenerationResult
from ..runtime.paged.scheduler import Scheduler
from .beam_search import BeamJob
from .decode import decode_loop, sample_rng
from .logits_process import LogitsConstraint

Loop = Generator[int | None, np.ndarray, GenerationResult]


@dataclass
class BatchTimes:
    """What the steps one call's sequences ran in took: each step's end and duration (µs),
    how many sequences it ran, and how often the call's sequences were preempted, for the
    call's PerfMetrics and kv_stats."""

    ends: list[float] = field(default_factory=list)
    durations: list[float] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    preemptions: int = 0
    beam_steps: int = 0  # beam search: its steps, counted as genai counts generated tokens


Outcome = GenerationResult | list[GenerationResult] | BaseException
"""A finished request: a sequence's result (a beam search's results), or the error that ended
it alone (its streamer raised, a sampling setting failed; a ``KeyboardInterrupt`` from its
streamer too, which its call raises) or ended every request of the step (the model call
failed)."""


class TokenLoops:
    """Token loops whose logits come from one scheduler's steps: each added sample is a
    :func:`~.decode.decode_loop` and a sequence of the scheduler, fed the token its loop
    chose.  An error in one loop ends that sequence only."""

    def __init__(
        self, scheduler: Scheduler, tokenizer: Any, position_limit: int | None = None
    ) -> None:
        self.scheduler, self.tokenizer = scheduler, tokenizer
        self.position_limit = position_limit
        self.loops: dict[int, Loop] = {}  # scheduler handle -> its sequence's loop
        self.times: dict[int, BatchTimes] = {}  # loop's or beam search's handle -> its times
        self.jobs: dict[int, BeamJob] = {}  # beam search's handle (its root) -> the search
        self.beams: dict[int, BeamJob] = {}  # live beam's scheduler handle -> its search

    @property
    def running(self) -> bool:
        return bool(self.loops or self.jobs)

    def __contains__(self, handle: int) -> bool:
        return handle in self.loops or handle in self.jobs

    def add(
        self,
        ids: np.ndarray,
        config: GenerationConfig,
        sample: int,
        constraint: LogitsConstraint | None = None,
        streamer: Any = None,
        held: int = 0,
        times: BatchTimes | None = None,
    ) -> int:
        """Sample ``sample`` of prompt ``ids`` (its own random generator,
        :func:`~.decode.sample_rng`), its text streamed to ``streamer``, its first ``held``
        tokens kept cached at a chat system prompt's priority; its scheduler handle."""
        handle = self.scheduler.submit([int(t) for t in ids.reshape(-1)], held)
        loop = decode_loop(
            self.tokenizer,
            ids,
            config,
            streamer,
            lambda: self.scheduler.remaining(handle),
            self.position_limit,
            constraint,
            sample_rng(config.rng_seed, sample),
        )
        try:
            next(loop)
        except BaseException:
            self.scheduler.finish(handle)
            raise
        self.loops[handle] = loop
        if times is not None:
            self.times[handle] = times
        return handle

    def add_beams(
        self, ids: np.ndarray, config: GenerationConfig, times: BatchTimes | None = None
    ) -> int:
        """A beam search over prompt ``ids`` (:class:`~.beam_search.BeamJob`); its handle,
        under which its results come."""
        job = BeamJob(self.scheduler, self.tokenizer, ids, config, self.position_limit)
        self.jobs[job.root] = job
        self.beams[job.root] = job
        if times is not None:
            self.times[job.root] = times
        return job.root

    def step(self) -> tuple[dict[int, int], dict[int, Outcome]]:
        """One scheduler step: the token each sequence chose (and was fed), and the outcomes of
        those that finished (their blocks given back).  If the model call fails, every
        sequence ends with its error; if it is interrupted (``KeyboardInterrupt``), none does."""
        start = time.perf_counter() * 1e6
        try:
            ready = self.scheduler.step()
            end = time.perf_counter() * 1e6
            owners = [self.beams[h].root if h in self.beams else h for h in ready]
            for times in {
                id(self.times[h]): self.times[h] for h in owners if h in self.times
            }.values():
                times.ends.append(end)
                times.durations.append(end - start)
                times.sizes.append(len(ready))
        except Exception as exc:
            failed: dict[int, Outcome] = dict.fromkeys([*self.loops, *self.jobs], exc)
            self.close()
            return {}, failed
        except BaseException:
            # Ctrl-C landing in the model call: the step never happened, and every sequence
            # is read again at its next one (the caller decides whose call ends)
            self.scheduler.restart()
            raise
        tokens: dict[int, int] = {}
        done: dict[int, Outcome] = {}
        for handle, logits in ready.items():
            if handle in self.beams:
                job = self.beams[handle]
                results: list[GenerationResult] | BaseException | None
                try:
                    results = job.take(handle, logits.copy())  # kept until its beams are in
                except BaseException as exc:  # noqa: BLE001 - this search only
                    results = exc
                if results is not None:
                    done[job.root] = results
                    self.drop(job.root)
                else:
                    self._track(job)
                continue
            try:
                token = self.loops[handle].send(logits)
            except StopIteration as stop:
                done[handle] = stop.value
                self.drop(handle)
                continue
            except BaseException as exc:  # its streamer or its settings: this sequence only
                # (a KeyboardInterrupt from its streamer too: its call raises it, in its own
                # thread; the other sequences of this step go on)
                done[handle] = exc
                self.drop(handle)
                continue
            assert token is not None
            tokens[handle] = token
            self.scheduler.feed(handle, token)
        return tokens, done

    def _track(self, job: BeamJob) -> None:
        """Map the search's live beams (some forked, some ended this step) to it."""
        for handle in [h for h, j in self.beams.items() if j is job and h not in job.live]:
            del self.beams[handle]
        self.beams.update(dict.fromkeys(job.live, job))

    def drop(self, handle: int) -> None:
        """End a request now (finished, stopped, cancelled or failed): its blocks go back."""
        times = self.times.pop(handle, None)
        job = self.jobs.pop(handle, None)
        if job is not None:
            if times is not None:
                times.beam_steps += job.steps
                times.preemptions += sum(self.scheduler.live[h].preemptions for h in job.live)
            job.close()
            for beam in [h for h, j in self.beams.items() if j is job]:
                del self.beams[beam]
            self.scheduler.stats.beam_peak_blocks = job.peak_blocks
            self.scheduler.stats.beam_copied_bytes = job.copied_bytes
            return
        if times is not None:
            times.preemptions += self.scheduler.live[handle].preemptions
        self.loops.pop(handle).close()
        self.scheduler.finish(handle)

    def close(self) -> None:
        """End every request still running (after an error)."""
        for handle in [*self.loops, *self.jobs]:
            self.drop(handle)


def generate_batch(
    scheduler: Scheduler,
    tokenizer: Any,
    prompts: Sequence[np.ndarray],
    configs: Sequence[GenerationConfig],
    position_limit: int | None = None,
    make_constraint: Callable[[GenerationConfig], LogitsConstraint | None] | None = None,
    times: BatchTimes | None = None,
) -> list[list[GenerationResult]]:
    """Each prompt's ``num_return_sequences`` results, the prompt's config applied to it; all
    sequences (and beam searches) run in the scheduler's steps together.  Each sample has its own
    random generator (:func:`~.decode.sample_rng`), so the samples equal those run one after
    another."""
    driver = TokenLoops(scheduler, tokenizer, position_limit)
    slot: dict[int, tuple[int, int]] = {}  # scheduler handle -> (prompt, sample)
    results: list[list[GenerationResult]] = []
    try:
        for index, (ids, config) in enumerate(zip(prompts, configs, strict=True)):
            results.append([])
            if config.num_beams > 1:
                slot[driver.add_beams(ids, config, times)] = (index, 0)
                continue
            for sample in range(config.num_return_sequences):
                constraint = make_constraint(config) if make_constraint is not None else None
                handle = driver.add(ids, config, sample, constraint, times=times)
                slot[handle] = (index, sample)
        outcomes: dict[tuple[int, int], Outcome] = {}
        while driver.running:
            for handle, outcome in driver.step()[1].items():
                if isinstance(outcome, BaseException):
                    raise outcome
                outcomes[slot[handle]] = outcome
    finally:
        driver.close()
    for (prompt, _), outcome in sorted(outcomes.items(), key=lambda kv: kv[0]):
        assert not isinstance(outcome, BaseException)
        results[prompt] += outcome if isinstance(outcome, list) else [outcome]
    return results
