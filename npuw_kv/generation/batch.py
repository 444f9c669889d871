"""Many prompts, and several samples of a prompt, generated together: each sequence's token
loop (:func:`~.decode.decode_loop`) driven by the paged path's batch engine, one step at a time
for all of them (:class:`~npuw_kv.runtime.paged.batch.BatchEngine`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..api.generation_config import GenerationConfig
from ..api.generation_result import GenerationResult
from ..runtime.paged.batch import BatchEngine
from .decode import decode_loop, sample_rng
from .logits_process import LogitsConstraint

Loop = Generator[int | None, np.ndarray, GenerationResult]


@dataclass
class BatchTimes:
    """What the steps of one batched run took: each step's end and duration (µs) and how many
    sequences it ran, for the call's PerfMetrics."""

    ends: list[float] = field(default_factory=list)
    durations: list[float] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)


class BatchDriver:
    """Token loops whose logits come from one batch engine's steps: each added sample is a
    :func:`~.decode.decode_loop` and a sequence of the engine, fed the token its loop chose."""

    def __init__(
        self,
        engine: BatchEngine,
        tokenizer: Any,
        position_limit: int | None = None,
        times: BatchTimes | None = None,
    ) -> None:
        self.engine, self.tokenizer = engine, tokenizer
        self.position_limit, self.times = position_limit, times
        self.loops: dict[int, Loop] = {}  # engine handle -> its sequence's loop

    def add(
        self,
        ids: np.ndarray,
        config: GenerationConfig,
        sample: int,
        constraint: LogitsConstraint | None = None,
    ) -> int:
        """Sample ``sample`` of prompt ``ids`` (its own random generator,
        :func:`~.decode.sample_rng`); its engine handle."""
        handle = self.engine.submit([int(t) for t in ids.reshape(-1)])
        loop = decode_loop(
            self.tokenizer,
            ids,
            config,
            None,
            lambda: self.engine.remaining(handle),
            self.position_limit,
            constraint,
            sample_rng(config.rng_seed, sample),
        )
        next(loop)
        self.loops[handle] = loop
        return handle

    def step(self) -> tuple[dict[int, int], dict[int, GenerationResult]]:
        """One engine step: the token each sequence chose (and was fed), and the results of
        those that finished (their blocks given back)."""
        start = time.perf_counter() * 1e6
        ready = self.engine.step()
        end = time.perf_counter() * 1e6
        if self.times is not None:
            self.times.ends.append(end)
            self.times.durations.append(end - start)
            self.times.sizes.append(len(ready))
        tokens: dict[int, int] = {}
        done: dict[int, GenerationResult] = {}
        for handle, logits in ready.items():
            try:
                token = self.loops[handle].send(logits)
            except StopIteration as stop:
                done[handle] = stop.value
                self.drop(handle)
                continue
            assert token is not None
            tokens[handle] = token
            self.engine.feed(handle, token)
        return tokens, done

    def drop(self, handle: int) -> None:
        """End a sequence now (finished, stopped or cancelled): its blocks go back."""
        self.loops.pop(handle).close()
        self.engine.finish(handle)

    def close(self) -> None:
        """End every sequence still running (after an error)."""
        for handle in list(self.loops):
            self.drop(handle)


def generate_batch(
    engine: BatchEngine,
    tokenizer: Any,
    prompts: Sequence[np.ndarray],
    configs: Sequence[GenerationConfig],
    position_limit: int | None = None,
    make_constraint: Callable[[GenerationConfig], LogitsConstraint | None] | None = None,
    times: BatchTimes | None = None,
) -> list[list[GenerationResult]]:
    """Each prompt's ``num_return_sequences`` results, the prompt's config applied to it; all
    sequences run in the engine's steps together.  Each sample has its own random generator
    (:func:`~.decode.sample_rng`), so the samples equal those run one after another."""
    driver = BatchDriver(engine, tokenizer, position_limit, times)
    slot: dict[int, tuple[int, int]] = {}  # engine handle -> (prompt, sample)
    results: list[list[GenerationResult | None]] = []
    try:
        for index, (ids, config) in enumerate(zip(prompts, configs, strict=True)):
            results.append([None] * config.num_return_sequences)
            for sample in range(config.num_return_sequences):
                constraint = make_constraint(config) if make_constraint is not None else None
                slot[driver.add(ids, config, sample, constraint)] = (index, sample)
        while driver.loops:
            for handle, result in driver.step()[1].items():
                prompt, sample = slot[handle]
                results[prompt][sample] = result
    finally:
        driver.close()
    return [[r for r in rs if r is not None] for rs in results]
