"""The configuration matrix: every (prompt length, device, mode, chunk) against the references.

Both sides are teacher-forced on the reference's greedy continuation, so every generated
position compares the two next-token distributions on the same context; our greedy choice at
each position gives the token agreement (identical to free-running up to the first divergence).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..pipeline import LLMPipeline
from ..prompts import prompt_ids, stdlib_text
from ..runtime.compile import last_line
from . import metrics
from .modes import DEFAULT_PARTS, MODES, NOT_ON_DEVICE, PEER_SLACK, TOLERANCE
from .reference import (
    EXACT_REFERENCE,
    GenaiReference,
    NpuwLLM,
    StatefulReference,
    TorchReference,
)

SECRET = "4721"


@dataclass
class Result:
    prompt_len: int
    device: str
    mode: str
    chunk: int
    new_tokens: int
    matched: int = 0
    first_divergence: int | None = None
    max_abs_dlogit: float = float("nan")
    mean_kl: float = float("nan")
    ppl: float = float("nan")
    ppl_ref: float = float("nan")
    # where the paths part, how far the reference's logit for its token is ahead of its logit
    # for the token chosen instead: an error that size flips it, so a small lead marks a
    # near-tie, not a defect
    ref_margin: float = float("nan")
    retrieval_found: bool | None = None
    tolerance: float | None = None
    error: str | None = None
    passed: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.device}/{self.mode}/C{self.chunk}/{self.prompt_len}"

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "name": self.name}


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
        "ref_margin": _lead_at(ref_logits, ref_tokens, greedy, divergence),
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
            for label, device, props in _peers(modes, prompt_len, new_tokens):
                result = Result(prompt_len, device, f"{label} (peer)", 256, new_tokens)
                _peer(result, props, model_dir, ids, ref_tokens, ref_logits)
                results.append(result)
                if label == "ir-default":
                    baseline = result
            if torch is None:
                torch = _load_torch(torch_source)
            results.append(_torch_peer(torch, ids, ref_tokens, ref_logits))
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
        _gate_against_peer(result, baseline)
        return
    result.tolerance = TOLERANCE[result.mode][result.device]
    result.passed = (
        result.max_abs_dlogit <= result.tolerance and result.matched == result.new_tokens
    )


def _gate_against_peer(result: Result, baseline: Result | None) -> None:
    """Pass when our error is within PEER_SLACK of the ir-default peer's on the same prompt."""
    if baseline is None:  # --no-peer: the user chose to run without the yardstick
        result.passed = True
        result.extra["gate"] = "not gated: run without peers (--no-peer)"
        return
    if baseline.error is not None:  # asked for, but missing: fail rather than pass unchecked
        result.error = f"no ir-default peer to hold device-default to: {baseline.error}"
        return
    limits = {key: factor * getattr(baseline, key) for key, factor in PEER_SLACK.items()}
    result.tolerance = limits["max_abs_dlogit"]
    result.extra["gate"] = "peer"
    result.extra["kl_limit"] = limits["mean_kl"]
    result.passed = all(getattr(result, key) <= limit for key, limit in limits.items())


def _peer(
    result: Result,
    properties: dict[str, Any],
    model_dir: Path,
    ids: np.ndarray,
    ref_tokens: list[int],
    ref_logits: np.ndarray,
) -> None:
    """Another runtime against the reference: reported, never gated.

    NPUW's LLM pipeline and the stateful IR at the CPU's defaults are teacher-forced like
    ours (tokens, |dlogit|, KL); genai at its defaults runs free (tokens only).
    """
    label = result.mode.removesuffix(" (peer)")
    result.passed = True
    logits: np.ndarray | None = None
    tokens: list[int] | None = None
    try:
        if label == "npuw-llm":
            logits = NpuwLLM(model_dir, **properties).run(ids, ref_tokens)
        elif label == "ir-default":
            logits = StatefulReference(model_dir, properties=properties).run(ids, ref_tokens)[1]
        else:
            genai = GenaiReference(model_dir, result.device, **properties)
            tokens = genai.generate(ids, result.new_tokens)
    except Exception as exc:
        reason = last_line(exc)[:200]
        result.error = f"{label} cannot run this model: {reason}"
        return
    _score_peer(result, logits, ref_tokens, ref_logits, tokens)


def _load_torch(source: Path | None) -> TorchReference | Exception:
    try:
        return TorchReference(source)
    except Exception as exc:  # not installed, no weights: each torch row says so
        return exc


def _torch_peer(
    reference: TorchReference | Exception,
    ids: np.ndarray,
    ref_tokens: list[int],
    ref_logits: np.ndarray,
) -> Result:
    """transformers on the same weights: an implementation independent of OpenVINO."""
    result = Result(len(ids), "CPU", "torch (peer)", len(ids), len(ref_tokens), passed=True)
    try:
        if isinstance(reference, Exception):
            raise reference
        result.ppl, logits = reference.run(ids, ref_tokens)
    except Exception as exc:
        result.error = f"torch reference: {last_line(exc)[:200]}"
        return result
    _score_peer(result, logits, ref_tokens, ref_logits)
    return result


def _score_peer(
    result: Result,
    logits: np.ndarray | None,
    ref_tokens: list[int],
    ref_logits: np.ndarray,
    tokens: list[int] | None = None,
) -> None:
    """Agreement of a peer's teacher-forced ``logits`` (or free-running ``tokens``)."""
    if logits is not None:
        tokens = [int(np.argmax(row)) for row in logits]
        result.max_abs_dlogit = float(np.abs(logits - ref_logits).max())
        result.mean_kl = float(metrics.kl_divergence(ref_logits, logits).mean())
    divergence = metrics.first_divergence(tokens or [], ref_tokens)
    result.matched = result.new_tokens if divergence is None else divergence
    result.first_divergence = divergence
    result.ref_margin = _lead_at(ref_logits, ref_tokens, tokens or [], divergence)


def _lead_at(
    ref_logits: np.ndarray, ref_tokens: list[int], chosen: list[int], position: int | None
) -> float:
    """The reference's logit for its token minus its logit for ``chosen`` at ``position``."""
    if position is None or position >= min(len(ref_logits), len(chosen)):
        return float("nan")
    row = ref_logits[position]
    return float(row[ref_tokens[position]] - row[chosen[position]])


def _peers(modes: Sequence[str], prompt_len: int, new_tokens: int) -> list[tuple[str, str, dict]]:
    """NPUW's own LLM pipeline always.  Next to our device-default mode: the untouched stateful
    IR and genai, both at the CPU's defaults, so a divergence there can be read against what
    the plugin itself does with the same precision settings."""
    npuw = {
        "NPUW_DEVICES": "CPU",
        "NPUW_LLM_MAX_PROMPT_LEN": -(-prompt_len // 256) * 256,
        "NPUW_LLM_MIN_RESPONSE_LEN": max(new_tokens, 64),
        "NPUW_LLM_PREFILL_CHUNK_SIZE": 256,
    }
    peers = [("npuw-llm", "NPU", npuw)]
    if "device-default" in modes:
        peers += [("ir-default", "CPU", {}), ("genai-default", "CPU", {})]
    return peers


__all__ = [
    "DEFAULT_PARTS",
    "MODES",
    "PEER_SLACK",
    "TOLERANCE",
    "Result",
    "run_matrix",
    "stdlib_text",
]
