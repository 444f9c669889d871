"""npuw-kv: static-shape LLM execution on OpenVINO with one shared KV cache."""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = [
    "CapacityError",
    "CompileError",
    "GenerationConfig",
    "GenerationResult",
    "LLMPipeline",
    "ModelLoadError",
    "ModelSourceError",
    "PipelineConfig",
]
# error types: where each lives (imported lazily, like everything that needs OpenVINO)
_ERRORS = {
    "CapacityError": "runtime.engine",
    "CompileError": "runtime.compile",
    "ModelLoadError": "model.variants",
    "ModelSourceError": "model.source",
}


def __getattr__(name: str) -> Any:
    # Lazy, so that `npuw_kv.kv.blocks` (pure numpy) can be imported without OpenVINO.
    if name in ("LLMPipeline", "GenerationResult"):
        from . import pipeline

        return getattr(pipeline, name)
    if name == "GenerationConfig":
        from .sampling import GenerationConfig

        return GenerationConfig
    if name == "PipelineConfig":
        from .config import PipelineConfig

        return PipelineConfig
    if name in _ERRORS:
        from importlib import import_module

        return getattr(import_module(f".{_ERRORS[name]}", __name__), name)
    raise AttributeError(f"module 'npuw_kv' has no attribute {name!r}")
