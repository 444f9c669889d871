"""The configuration matrix: every (prompt length, device, mode, chunk) against the references.

Both sides are teacher-forced on the reference's greedy continuation, so every generated
position compares the two next-token distributions on the same context; our greedy choice at
each position gives the token agreement (identical to free-running up to the first divergence).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Sequence
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
    unknown = [mode for mode in modes if mode not in MODES]
    if unknown:  # before any reference runs: a typo should not cost the matrix
        raise ValueError(f"unknown accuracy mode {unknown[0]!r}; choose from {', '.join(MODES)}")
    results: list[Result] = []
    torch: TorchReference | Exception | None = None  # loaded on first use, once
    genai_ref = GenaiReference(model_dir, "CPU", **EXACT_REFERENCE)
    stateful = StatefulReference(model_dir)
    for prompt_len in prompt_lens:
        try:
            ids = prompt_ids(genai_ref.pipe.get_tokenizer(), prompt_len)
            ref_tokens = genai_ref.generate(ids, new_tokens)
            ppl_ref, ref_logits = stateful.run(ids, ref_tokens)
        except Exception as exc:  # e.g. a prompt longer than the stdlib text
            for device in devices:
                for mode in modes:
                    for chunk in chunks:
                        r = Result(prompt_len, device, mode, chunk, new_tokens)
                        r.error = f"reference failed: {exc}"
                        results.append(r)
            continue
        baseline: Result | None = None  # the ir-default peer, device-default's yardstick
        if peer:
            for label, device, props in peer_configs(modes, prompt_len, new_tokens):
                result = Result(prompt_len, device, f"{label} (peer)", 256, new_tokens)
                run_peer(result, props, model_dir, ids, ref_tokens, ref_logits)
                results.append(result)
                if label == "ir-default":
                    baseline = result
            if torch is None:
                torch = load_torch(torch_source)
            results.append(torch_peer(torch, ids, ref_tokens, ref_logits))
        for device in devices:
            for mode in modes:
                for chunk in chunks:
                    result = Result(prompt_len, device, mode, chunk, new_tokens, ppl_ref=ppl_ref)
                    _run_one(result, model_dir, ids, ref_tokens, ref_logits, baseline)
                    results.append(result)
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
