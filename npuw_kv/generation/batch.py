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
    loops: dict[int, tuple[Loop, int, int]] = {}  # handle -> (loop, prompt, sample)
    results: list[list[GenerationResult | None]] = []
    try:
        for index, (ids, config) in enumerate(zip(prompts, configs, strict=True)):
            results.append([None] * config.num_return_sequences)
            for sample in range(config.num_return_sequences):
                handle = engine.submit([int(t) for t in ids.reshape(-1)])
                constraint = make_constraint(config) if make_constraint is not None else None
                loop = decode_loop(
                    tokenizer,
                    ids,
                    config,
                    None,
                    _remaining(engine, handle),
                    position_limit,
                    constraint,
                    sample_rng(config.rng_seed, sample),
                )
                next(loop)
                loops[handle] = (loop, index, sample)
        while loops:
            start = time.perf_counter() * 1e6
            ready = engine.step()
            end = time.perf_counter() * 1e6
            if times is not None:
                times.ends.append(end)
                times.durations.append(end - start)
                times.sizes.append(len(ready))
            for handle, logits in ready.items():
                loop, prompt, sample = loops[handle]
                try:
                    token = loop.send(logits)
                except StopIteration as done:
                    results[prompt][sample] = done.value
                    engine.finish(handle)
                    del loops[handle]
                    continue
                assert token is not None
                engine.feed(handle, token)
    finally:
        for handle in list(engine.live):
            engine.finish(handle)
    return [[r for r in rs if r is not None] for rs in results]


def _remaining(engine: BatchEngine, handle: int) -> Callable[[], int]:
    return lambda: engine.remaining(handle)
