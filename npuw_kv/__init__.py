"""npuw-kv: static-shape LLM execution on OpenVINO with one shared KV cache."""

from __future__ import annotations

import sys
from importlib import metadata
from typing import Any

from .errors import (
    CapacityError,
    CompileError,
    ModelLayoutError,
    ModelLoadError,
    ModelSourceError,
    NumericError,
    UsageError,
)


def _version() -> str:
    """npuw-kv's version, with the openvino-genai it follows as a local label
    (``0.1.0+genai.2026.4.1.0``): a program written for genai prints
    ``openvino_genai.__version__``, and under ``import npuw_kv as openvino_genai`` that should
    say what runs."""
    try:
        ours = metadata.version("npuw-kv")
    except metadata.PackageNotFoundError:  # a source tree on sys.path, not installed
        ours = "0.1.0"
    try:
        return f"{ours}+genai.{metadata.version('openvino-genai')}"
    except metadata.PackageNotFoundError:
        return ours


__version__ = _version()


def get_version() -> str:
    """``__version__``, as genai's ``get_version()`` returns its ``__version__``."""
    return __version__


# openvino-genai's own types that an LLM program passes to a pipeline or gets from it: the
# same objects here, so that `import npuw_kv as openvino_genai` runs genai's text samples.
# SchedulerConfig's eviction and sparse-attention configs are refused by field when enabled
# (npuw_kv/api/pipeline_args.py).
GENAI_TYPES = (
    "AggregationMode",
    "CacheEvictionConfig",
    "ChatHistory",
    "DeepSeekR1ReasoningIncrementalParser",
    "DeepSeekR1ReasoningParser",
    "GenerationFinishReason",
    "GenerationResult",  # ContinuousBatchingPipeline's results are shaped as it is
    "GenerationStatus",
    "IncrementalParser",
    "KVCrushAnchorPointMode",
    "KVCrushConfig",
    "Llama3JsonToolParser",
    "Llama3PythonicToolParser",
    "Parser",
    "Phi4ReasoningIncrementalParser",
    "Phi4ReasoningParser",
    "RawPerfMetrics",
    "ReasoningIncrementalParser",
    "ReasoningParser",
    "SchedulerConfig",
    "SparseAttentionConfig",
    "SparseAttentionMode",
    "StopCriteria",
    "StreamerBase",
    "StreamingStatus",
    "StructuralTagItem",
    "StructuralTagsConfig",
    "StructuredOutputConfig",
    "TextParserStreamer",
    "TextStreamer",
    "TokenizedInputs",
    "Tokenizer",
    "VLLMParserWrapper",
)
# genai's text-generation names npuw-kv implements itself
OWN_NAMES = (
    "Adapter",
    "AdapterConfig",
    "ContinuousBatchingPipeline",
    "DecodedResults",
    "EncodedResults",
    "GenerationConfig",
    "LLMPipeline",
    "PerfMetrics",
    "draft_model",
    "get_version",
)
# `from npuw_kv import *`: the text-generation API; genai's other names resolve when named
__all__ = [
    "Adapter",
    "AdapterConfig",
    "CapacityError",
    "CompileError",
    *GENAI_TYPES,
    "ContinuousBatchingPipeline",
    "DecodedResults",
    "DraftModel",
    "EncodedResults",
    "GenerationConfig",
    "LLMPipeline",
    "MeanStdPair",
    "ModelLayoutError",
    "ModelLoadError",
    "ModelSourceError",
    "NumericError",
    "PerfMetrics",
    "PipelineConfig",
    "TextResult",
    "UsageError",
    "draft_model",
    "get_version",
]
if "openvino_genai" in sys.modules:  # its draft_model objects are opaque: record their paths
    from .generation.draft import record_genai_drafts

    record_genai_drafts()
_RESULTS = ("DecodedResults", "EncodedResults", "PerfMetrics", "TextResult")


def __getattr__(name: str) -> Any:
    # Lazy, so that `npuw_kv.kv.blocks` (pure numpy) can be imported without OpenVINO.
    if name == "LLMPipeline":
        from . import pipeline

        return getattr(pipeline, name)
    if name in _RESULTS:  # genai-shaped results (npuw_kv/api/results.py)
        from .api import results

        return getattr(results, name)
    if name == "MeanStdPair":
        from .api.perf_metrics import MeanStdPair

        return MeanStdPair
    if name == "GenerationConfig":
        from .api.generation_config import GenerationConfig

        return GenerationConfig
    if name in ("draft_model", "DraftModel"):  # speculative decoding's draft
        from .generation import draft

        return getattr(draft, name)
    if name in ("ContinuousBatchingPipeline", "GenerationHandle"):
        from . import continuous

        return getattr(continuous, name)
    if name == "PipelineConfig":
        from .config.pipeline_config import PipelineConfig

        return PipelineConfig
    if name in GENAI_TYPES:
        import openvino_genai

        return getattr(openvino_genai, name)
    if name in ("Adapter", "AdapterConfig"):  # LoRA (npuw_kv/api/adapters.py)
        from .api import adapters

        return getattr(adapters, name)
    if name in _genai_public():  # outside text generation (Whisper, VLM, images...): genai's
        import openvino_genai

        return getattr(openvino_genai, name)
    raise AttributeError(f"module 'npuw_kv' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__, *_genai_public()})


def _genai_public() -> tuple[str, ...]:
    """The public names of the installed openvino_genai (its submodules and imports aside),
    which npuw_kv passes through where it has none of its own; none without genai."""
    global _GENAI_PUBLIC
    if _GENAI_PUBLIC is None:
        try:
            import openvino_genai
        except ImportError:
            return ()
        _GENAI_PUBLIC = tuple(
            name
            for name, value in vars(openvino_genai).items()
            if not name.startswith("_") and not isinstance(value, type(sys))
        )
    return _GENAI_PUBLIC


_GENAI_PUBLIC: tuple[str, ...] | None = None
