"""npuw-kv: static-shape LLM execution on OpenVINO with one shared KV cache."""

from __future__ import annotations

import sys
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

__version__ = "0.1.0"
# openvino-genai's own types that an LLM program passes to a pipeline or gets from it: the
# same objects here, so that `import npuw_kv as openvino_genai` runs genai's text samples
GENAI_TYPES = (
    "ChatHistory",
    "DeepSeekR1ReasoningIncrementalParser",
    "DeepSeekR1ReasoningParser",
    "GenerationFinishReason",
    "GenerationStatus",
    "IncrementalParser",
    "Llama3JsonToolParser",
    "Llama3PythonicToolParser",
    "Parser",
    "Phi4ReasoningIncrementalParser",
    "Phi4ReasoningParser",
    "RawPerfMetrics",
    "ReasoningIncrementalParser",
    "ReasoningParser",
    "SchedulerConfig",
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
    "get_version",
)
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
    "GenerationResult",
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
]
if "openvino_genai" in sys.modules:  # its draft_model objects are opaque: record their paths
    from .generation.draft import record_genai_drafts

    record_genai_drafts()
_RESULTS = ("DecodedResults", "EncodedResults", "PerfMetrics", "TextResult")


def __getattr__(name: str) -> Any:
    # Lazy, so that `npuw_kv.kv.blocks` (pure numpy) can be imported without OpenVINO.
    if name in ("LLMPipeline", "GenerationResult"):
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
    raise AttributeError(f"module 'npuw_kv' has no attribute {name!r}")
