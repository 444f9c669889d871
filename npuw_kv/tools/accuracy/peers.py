"""The other runtimes measured against the same reference: NPUW's own LLM pipeline, the
untouched stateful IR and genai at the CPU's defaults, and transformers on the same weights.

Peers are reported, never gated themselves; the ``ir-default`` peer is the yardstick our
``device-default`` mode is gated on (``gate_against_peer``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import last_line
from . import metrics
from .modes import PEER_SLACK
from .reference import GenaiReference, NpuwLLM, StatefulReference, TorchReference
from .result import Result


def gate_against_peer(result: Result, baseline: Result | None) -> None:
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


def run_peer(
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
    score_peer(result, logits, ref_tokens, ref_logits, tokens)


def load_torch(source: Path | None) -> TorchReference | Exception:
    try:
        return TorchReference(source)
    except Exception as exc:  # not installed, no weights: each torch row says so
        return exc


def torch_peer(
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
    score_peer(result, logits, ref_tokens, ref_logits)
    return result


def score_peer(
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
    result.ref_margin = metrics.lead_at(ref_logits, ref_tokens, tokens or [], divergence)


def peer_configs(
    modes: Sequence[str], prompt_len: int, new_tokens: int
) -> list[tuple[str, str, dict]]:
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
