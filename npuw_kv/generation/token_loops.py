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
from ..runtime.paged.scheduler import OutOfRoom, Scheduler
from .assisted_lane import AssistedLane
from .beam_search import BeamJob
from .decode import OutOfKVRoom, decode_loop, sample_rng
from .logits_process import LogitsConstraint
from .prompt_scores import PromptScores, wanted

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
    chose.  An error in one loop ends that sequence only.  With ``lane``, requests added
    with :meth:`add_assisted` run there, one at a time, in steps where no sequence of the
    scheduler is live (:mod:`.assisted_lane`)."""

    def __init__(
        self,
        scheduler: Scheduler,
        tokenizer: Any,
        position_limit: int | None = None,
        lane: AssistedLane | None = None,
    ) -> None:
        self.scheduler, self.tokenizer = scheduler, tokenizer
        self.position_limit = position_limit
        self.lane = lane
        self.steps = 0  # steps run, the scheduler's and the lane's
        self.last_requests = 0  # requests (a beam search: one) the last step ran
        self.last_duration_us = 0.0  # its model call (the lane: its whole step)
        self.loops: dict[int, Loop] = {}  # scheduler handle -> its sequence's loop
        self.times: dict[int, BatchTimes] = {}  # loop's or beam search's handle -> its times
        self.jobs: dict[int, BeamJob] = {}  # beam search's handle (its root) -> the search
        self.beams: dict[int, BeamJob] = {}  # live beam's scheduler handle -> its search

    @property
    def running(self) -> bool:
        return bool(self.loops or self.jobs) or (self.lane is not None and self.lane.running)

    def __contains__(self, handle: int) -> bool:
        in_lane = self.lane is not None and handle in self.lane
        return handle in self.loops or handle in self.jobs or in_lane

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
        prompt = [int(t) for t in ids.reshape(-1)]
        scores = PromptScores(prompt, config.logprobs) if wanted(config) else None
        handle = self.scheduler.submit(prompt, held, scores)
        loop = decode_loop(
            self.tokenizer,
            ids,
            config,
            streamer,
            lambda: self.scheduler.remaining(handle),
            self.position_limit,
            constraint,
            sample_rng(config.rng_seed, sample),
            scores,
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

    def add_assisted(
        self,
        ids: np.ndarray,
        config: GenerationConfig,
        constraint: LogitsConstraint | None = None,
        streamer: Any = None,
        times: BatchTimes | None = None,
    ) -> int:
        """An assisted request (prompt lookup, a draft model), run in the lane; its handle."""
        if self.lane is None:
            raise AssertionError("assisted request without an assisted lane")
        handle = self.lane.add(ids, config, constraint, streamer, times)
        if times is not None:
            self.times[handle] = times
        return handle

    def step(self) -> tuple[dict[int, list[int]], dict[int, Outcome]]:
        """One step: the tokens each sequence chose (and was fed; one, or an assisted
        request's accepted candidates too), and the outcomes of those that finished (their
        blocks given back).  If the model call fails, every sequence ends with its error;
        if it is interrupted (``KeyboardInterrupt``), none does.  The lane's request runs
        when no sequence of the scheduler is live."""
        self.steps += 1
        start = time.perf_counter() * 1e6
        if self.lane is not None and self.lane.running and not self.scheduler.busy:
            chosen, ended = self.lane.step()
            for handle in ended:
                self.times.pop(handle, None)
            self.last_requests, self.last_duration_us = 1, time.perf_counter() * 1e6 - start
            return chosen, ended
        try:
            ready = self.scheduler.step()
            end = time.perf_counter() * 1e6
            self.last_duration_us = end - start
            self.last_requests = len(
                {self.beams[h].root if h in self.beams else h for h in self.scheduler.scheduled}
            )
            owners = [self.beams[h].root if h in self.beams else h for h in ready]
            for times in {
                id(self.times[h]): self.times[h] for h in owners if h in self.times
            }.values():
                times.ends.append(end)
                times.durations.append(end - start)
                times.sizes.append(len(ready))
        except OutOfRoom as full:  # as genai: the requests holding blocks end as they are
            return {}, self._cut_short(full.holding)
        except Exception as exc:
            failed: dict[int, Outcome] = dict.fromkeys([*self.loops, *self.jobs], exc)
            for handle in failed:  # the lane's requests did not take part
                self.drop(handle)
            return {}, failed
        except BaseException:
            # Ctrl-C landing in the model call: the step never happened, and every sequence
            # is read again at its next one (the caller decides whose call ends)
            self.scheduler.restart()
            raise
        tokens: dict[int, list[int]] = {}
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
            tokens[handle] = [token]
            self.scheduler.feed(handle, token)
        return tokens, done

    def _cut_short(self, holding: Sequence[int]) -> dict[int, Outcome]:
        """End the requests of these sequences with what they generated so far (a token loop's
        tokens, a beam search's best hypotheses); their blocks go back."""
        done: dict[int, Outcome] = {}
        for handle in holding:
            job = self.beams.get(handle)
            if job is not None:
                if job.root not in done:
                    done[job.root] = job.cut_short()
                    self.drop(job.root)
                continue
            loop = self.loops.get(handle)
            if loop is None:
                continue
            try:
                loop.throw(OutOfKVRoom())
                raise AssertionError("a token loop went on after OutOfKVRoom")
            except StopIteration as stop:
                done[handle] = stop.value
            except BaseException as exc:  # noqa: BLE001 - its streamer, this sequence only
                done[handle] = exc
            self.drop(handle)
        for outcome in done.values():
            for result in outcome if isinstance(outcome, list) else [outcome]:
                if isinstance(result, GenerationResult):
                    result.out_of_room = True
        return done

    def _track(self, job: BeamJob) -> None:
        """Map the search's live beams (some forked, some ended this step) to it."""
        for handle in [h for h, j in self.beams.items() if j is job and h not in job.live]:
            del self.beams[handle]
        self.beams.update(dict.fromkeys(job.live, job))

    def drop(self, handle: int) -> None:
        """End a request now (finished, stopped, cancelled or failed): its blocks go back."""
        times = self.times.pop(handle, None)
        if self.lane is not None and handle in self.lane:
            self.lane.drop(handle)
            return
        job = self.jobs.pop(handle, None)
        if job is not None:
            if times is not None:
                times.beam_steps += job.steps
                live = self.scheduler.live
                times.preemptions += sum(live[h].preemptions for h in job.live if h in live)
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
        if self.lane is not None:
            self.lane.close()


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
