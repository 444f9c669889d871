"""The configuration matrix: every (prompt length, device, mode, chunk) against the references.

Both sides are teacher-forced on the reference's greedy continuation, so every generated
position compares the two next-token distributions on the same context; our greedy choice at
each position gives the token agreement (identical to free-running up to the first divergence).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ...pipeline import LLMPipeline
from ..prompts import prompt_ids, stdlib_text
from . import metrics
from .modes import DEFAULT_PARTS, MODES, NOT_ON_DEVICE, TOLERANCE
from .peers import gate_against_peer, load_torch, peer_configs, run_peer, torch_peer
from .reference import EXACT_REFERENCE, GenaiReference, StatefulReference, TorchReference
from .result import Result

SECRET = "4721"


def retrieval_prompt(pipe: LLMPipeline, num_tokens: int) -> np.ndarray:
    """A fact near the start, ~num_tokens of real text, then the question (chat template)."""
    question = "\n\nWhat is the secret number mentioned at the very beginning? Answer with it."
    fact = f"Remember this: the secret number is {SECRET}.\n\n"
    budget = num_tokens - len(pipe.encode(fact + question)) - 8
    while True:
        filler = pipe.tokenizer.decode(prompt_ids(pipe.tokenizer, max(budget, 1)).tolist())
        ids = pipe.encode(fact + filler + question)
        if len(ids) <= num_tokens or budget <= 1:
            return ids
        budget -= len(ids) - num_tokens + 8  # re-tokenised text can come out a bit longer


def evaluate(
    pipe: LLMPipeline, ids: np.ndarray, ref_tokens: list[int], ref_logits: np.ndarray
) -> dict[str, Any]:
    """Teacher-forced comparison of ``pipe`` against the reference continuation."""
    nlls: list[np.ndarray] = []

    def on_chunk(positions: np.ndarray, logits: np.ndarray) -> None:
        keep = positions + 1 < len(ids)
        nlls.append(metrics.nll(logits[keep], ids[positions[keep] + 1]))

    ours = [pipe.runner.prefill(ids, on_chunk=on_chunk)]
    for token in ref_tokens[:-1]:
        ours.append(pipe.runner.step(token))
    our_logits = np.stack(ours)
    greedy = [int(np.argmax(row)) for row in our_logits]
    divergence = metrics.first_divergence(greedy, ref_tokens)
    return {
        "matched": len(ref_tokens) if divergence is None else divergence,
        "first_divergence": divergence,
        "ref_margin": metrics.lead_at(ref_logits, ref_tokens, greedy, divergence),
        "max_abs_dlogit": float(np.abs(our_logits - ref_logits).max()),
        "mean_kl": float(metrics.kl_divergence(ref_logits, our_logits).mean()),
        "ppl": metrics.perplexity(nlls),
    }


@dataclass
class PromptReference:
    """One prompt length's exact f32 reference: the prompt, the reference's greedy tokens and
    its logits (teacher-forced), its perplexity; or why it could not be made."""

    prompt_len: int
    ids: np.ndarray | None = None
    tokens: list[int] = field(default_factory=list)
    logits: np.ndarray | None = None
    ppl: float = float("nan")
    error: str | None = None


def check_modes(modes: Sequence[str]) -> None:
    unknown = [mode for mode in modes if mode not in MODES]
    if unknown:  # before any reference runs: a typo should not cost the matrix
        raise ValueError(f"unknown accuracy mode {unknown[0]!r}; choose from {', '.join(MODES)}")


def make_reference(
    genai_ref: GenaiReference, stateful: StatefulReference, prompt_len: int, new_tokens: int
) -> PromptReference:
    ref = PromptReference(prompt_len)
    try:
        ref.ids = prompt_ids(genai_ref.pipe.get_tokenizer(), prompt_len)
        ref.tokens = genai_ref.generate(ref.ids, new_tokens)
        ref.ppl, ref.logits = stateful.run(ref.ids, ref.tokens)
    except Exception as exc:  # e.g. a prompt longer than the stdlib text
        ref.error = f"reference failed: {exc}"
    return ref


def reference_and_peers(
    model_dir: Path,
    references: tuple[GenaiReference, StatefulReference],
    prompt_len: int,
    new_tokens: int,
    modes: Sequence[str],
    torch: Callable[[], TorchReference | Exception] | None,
) -> tuple[PromptReference, list[Result]]:
    """One prompt length's reference and, given ``torch`` (how to get the PyTorch peer; None:
    no peers), the peers' rows."""
    ref = make_reference(*references, prompt_len, new_tokens)
    if torch is None or ref.error is not None:
        return ref, []
    return ref, run_peers(model_dir, ref, modes, new_tokens, torch())


def run_peers(
    model_dir: Path,
    ref: PromptReference,
    modes: Sequence[str],
    new_tokens: int,
    torch: TorchReference | Exception,
) -> list[Result]:
    """The peers' rows for one prompt length (the ir-default one, if any, is the yardstick of
    ``device-default``: :func:`baseline_of`)."""
    assert ref.ids is not None and ref.logits is not None
    results = []
    for label, device, props in peer_configs(modes, ref.prompt_len, new_tokens):
        result = Result(ref.prompt_len, device, f"{label} (peer)", 256, new_tokens)
        run_peer(result, props, model_dir, ref.ids, ref.tokens, ref.logits)
        results.append(result)
    results.append(torch_peer(torch, ref.ids, ref.tokens, ref.logits))
    return results


def baseline_of(peers: Sequence[Result]) -> Result | None:
    return next((r for r in peers if r.mode == "ir-default (peer)"), None)


def run_case(
    model_dir: Path,
    ref: PromptReference,
    key: tuple[str, str, int],
    new_tokens: int,
    baseline: Result | None,
) -> Result:
    """One (device, mode, chunk) configuration at ``ref``'s prompt length."""
    device, mode, chunk = key
    result = Result(ref.prompt_len, device, mode, chunk, new_tokens, ppl_ref=ref.ppl)
    if ref.error is not None:
        result.ppl_ref = float("nan")
        result.error = ref.error
        return result
    assert ref.ids is not None and ref.logits is not None
    _run_one(result, model_dir, ref.ids, ref.tokens, ref.logits, baseline)
    return result


def case_keys(
    devices: Sequence[str], modes: Sequence[str], chunks: Iterable[int]
) -> list[tuple[str, str, int]]:
    """The (device, mode, chunk) configurations of one prompt length, in the report's order."""
    return [(d, m, c) for d in devices for m in modes for c in chunks]


def run_matrix(
    model_dir: Path,
    prompt_lens: Iterable[int],
    new_tokens: int,
    devices: Sequence[str],
    modes: Sequence[str],
    chunks: Iterable[int],
    progress: Callable[[str], None] = lambda _: None,
    peer: bool = True,
    torch_source: Path | None = None,
) -> list[Result]:
    """Run every configuration; failures are recorded in their Result, never raised.

    ``torch_source``: weights for the PyTorch peer (a GGUF or a transformers directory).
    """
    check_modes(modes)
    results: list[Result] = []
    torch = functools.cache(functools.partial(load_torch, torch_source)) if peer else None
    references = (GenaiReference(model_dir, "CPU", **EXACT_REFERENCE), StatefulReference(model_dir))
    keys = case_keys(devices, modes, list(chunks))
    for prompt_len in prompt_lens:  # torch is loaded on first use, once
        ref, peers = reference_and_peers(
            model_dir, references, prompt_len, new_tokens, modes, torch
        )
        results += peers
        for key in keys:
            result = run_case(model_dir, ref, key, new_tokens, baseline_of(peers))
            results.append(result)
            if ref.error is None:
                progress(result.name)
    return results


def _run_one(
    result: Result,
    model_dir: Path,
    ids: np.ndarray,
    ref_tokens: list[int],
    ref_logits: np.ndarray,
    baseline: Result | None = None,
) -> None:
    if result.mode not in MODES:
        result.error = f"unknown mode {result.mode!r}; choose from {', '.join(MODES)}"
        return
    if (result.mode, result.device) in NOT_ON_DEVICE:
        result.error = NOT_ON_DEVICE[result.mode, result.device]
        result.passed = True
        return
    try:
        with warnings.catch_warnings():  # bf16-kv is measured on purpose: no advice to use f16
            warnings.filterwarnings("ignore", "kv_precision='bf16' under f32", RuntimeWarning)
            pipe = LLMPipeline(
                model_dir,
                result.device,
                prefill_chunk_size=result.chunk,
                max_prompt_len=result.prompt_len,
                min_response_len=result.new_tokens,
                full_prefill_logits=True,
                **MODES[result.mode],
            )
        for key, value in evaluate(pipe, ids, ref_tokens, ref_logits).items():
            setattr(result, key, value)
        answer = pipe.generate(retrieval_prompt(pipe, result.prompt_len), max_new_tokens=24)
        result.retrieval_found = SECRET in answer.text
        result.extra["retrieval_answer"] = answer.text
    except Exception as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return
    if result.mode in DEFAULT_PARTS:
        result.passed = True
        result.extra["gate"] = "not gated: reported only"
        return
    if result.mode not in TOLERANCE:
        gate_against_peer(result, baseline)
        return
    result.tolerance = TOLERANCE[result.mode][result.device]
    result.passed = (
        result.max_abs_dlogit <= result.tolerance and result.matched == result.new_tokens
    )


__all__ = [
    "DEFAULT_PARTS",
    "MODES",
    "TOLERANCE",
    "Result",
    "run_matrix",
    "stdlib_text",
]
