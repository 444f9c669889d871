"""``npuw-kv accuracy --ray``: the matrix as Ray tasks on whatever nodes a cluster has, merged
into the rows (and so the report) a local run gives, in the same order.

One task per prompt length makes its exact f32 reference and runs the peers; one task per
(prompt length, device, mode, chunk) runs that configuration against the reference, which Ray
hands it from the first task (the ``device-default`` rows also take that prompt length's
``ir-default`` peer).  Each task resolves the model on its own node (a path must be the same on
every machine), and asks Ray for ``cpus`` CPUs, so a node of one CPU runs one task at a time.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ...model.source import resolve_model
from .peers import load_torch
from .reference import EXACT_REFERENCE, GenaiReference, StatefulReference
from .result import Result
from .run import (
    PromptReference,
    baseline_of,
    case_keys,
    check_modes,
    reference_and_peers,
    run_case,
)


def _references(
    model: str | None,
    zero_points: str,
    prompt_len: int,
    new_tokens: int,
    modes: Sequence[str],
    peer: bool,
    torch_source: str | None,
) -> tuple[PromptReference, list[Result]]:
    model_dir = resolve_model(model, zero_points=zero_points)
    references = (GenaiReference(model_dir, "CPU", **EXACT_REFERENCE), StatefulReference(model_dir))
    source = Path(torch_source) if torch_source else None
    torch = functools.partial(load_torch, source) if peer else None
    return reference_and_peers(model_dir, references, prompt_len, new_tokens, modes, torch)


def _case(
    model: str | None,
    zero_points: str,
    made: tuple[PromptReference, list[Result]],
    key: tuple[str, str, int],
    new_tokens: int,
) -> Result:
    ref, peers = made
    model_dir = resolve_model(model, zero_points=zero_points, log=lambda *_: None)
    return run_case(model_dir, ref, key, new_tokens, baseline_of(peers))


def run_matrix_on_ray(
    address: str | None,
    model: str | None,
    zero_points: str,
    prompt_lens: Sequence[int],
    new_tokens: int,
    devices: Sequence[str],
    modes: Sequence[str],
    chunks: Sequence[int],
    progress: Callable[[str], None] = lambda _: None,
    peer: bool = True,
    torch_source: Path | None = None,
    cpus: float = 1.0,
) -> list[Result]:
    """:func:`~.run.run_matrix`'s rows, computed on the Ray cluster at ``address`` (None:
    this machine's, or a new one for this call)."""
    import ray

    check_modes(modes)
    ray.init(address=address or None, namespace="npuw-kv", log_to_driver=False)
    try:
        references: Any = ray.remote(num_cpus=cpus)(_references)
        case: Any = ray.remote(num_cpus=cpus)(_case)
        source = str(torch_source) if torch_source else None
        made = {
            n: references.remote(model, zero_points, n, new_tokens, list(modes), peer, source)
            for n in prompt_lens
        }
        keys = case_keys(devices, modes, list(chunks))
        cases = {
            (n, key): case.remote(model, zero_points, made[n], key, new_tokens)
            for n in prompt_lens
            for key in keys
        }
        names = {ref: f"{key[0]}/{key[1]}/C{key[2]}/{n}" for (n, key), ref in cases.items()}
        pending = list(cases.values())
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            progress(names[done[0]])
        results: list[Result] = []
        for n in prompt_lens:  # a task whose process died (or node left) is one row's error
            with contextlib.suppress(ray.exceptions.RayError):  # its cases say why
                results += ray.get(made[n])[1]
            for key in keys:
                try:
                    results.append(ray.get(cases[n, key]))
                except ray.exceptions.RayError as exc:
                    results.append(_lost(n, key, new_tokens, exc))
        return results
    finally:
        ray.shutdown()


def _lost(n: int, key: tuple[str, str, int], new_tokens: int, exc: Exception) -> Result:
    result = Result(n, key[0], key[1], key[2], new_tokens)
    result.error = f"the Ray task failed: {str(exc).strip().splitlines()[-1][:200]}"
    return result
