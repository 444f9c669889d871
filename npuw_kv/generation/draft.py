"""The draft model of speculative decoding, as ``LLMPipeline(..., draft_model=...)`` takes it.

openvino-genai's ``draft_model(path, device, **props)`` returns an opaque object (an ``OVAny``
holding a C++ ``ModelDesc``: its value cannot be converted, ``str()`` is empty, pickling fails),
so genai's samples, run with only the pipeline swapped, would hand us something unreadable.
:func:`record_genai_drafts` wraps genai's function (its objects unchanged) to remember what each
was made from; :func:`draft_model` is ours, for code that imports npuw_kv only.
:func:`build_draft` loads it.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import UsageError
from ..runtime.runner import SPECULATIVE_PATH, Runner


@dataclass(frozen=True)
class DraftModel:
    """A draft model to load: what ``npuw_kv.draft_model`` (and, once npuw_kv is imported,
    ``openvino_genai.draft_model``) records."""

    path: Path
    device: str = ""
    properties: Mapping[str, Any] = field(default_factory=dict)


def draft_model(models_path: Any, device: str = "", **properties: Any) -> DraftModel:
    """The draft model for ``LLMPipeline(..., draft_model=...)``, as genai's function."""
    return DraftModel(Path(models_path), device, dict(properties))


# genai's draft_model returns an opaque OVAny (a C++ ModelDesc Python cannot read: its value
# cannot be converted, str() is empty, pickling fails); the wrapper below remembers what each
# one was made from, by identity, while it lives
_GENAI_DRAFTS: dict[int, DraftModel] = {}
_RECORDERS: list[Any] = []  # the wrappers installed as openvino_genai.draft_model


def record_genai_drafts() -> None:
    """Wrap ``openvino_genai.draft_model`` so the objects it returns (unchanged: genai's own
    pipeline takes them as before) can be read back by :func:`resolve_draft`."""
    import openvino_genai

    original = openvino_genai.draft_model
    if original in _RECORDERS:  # wrapped already
        return

    def recording(models_path: Any, device: str = "", **kwargs: Any) -> Any:
        desc = original(models_path, device, **kwargs)
        key = id(desc)
        _GENAI_DRAFTS[key] = draft_model(models_path, device, **kwargs)
        weakref.finalize(desc, _GENAI_DRAFTS.pop, key, None)
        return desc

    recording.__doc__ = original.__doc__
    recording.__wrapped__ = original  # type: ignore[attr-defined]
    _RECORDERS.append(recording)
    openvino_genai.draft_model = recording


def resolve_draft(value: Any) -> DraftModel:
    """Our :class:`DraftModel` for ``draft_model=``: ours, genai's (recorded), or a path."""
    if isinstance(value, DraftModel):
        return value
    if isinstance(value, (str, Path)):
        return draft_model(value)
    recorded = _GENAI_DRAFTS.get(id(value))
    if recorded is not None:
        return recorded
    raise UsageError(
        f"draft_model={type(value).__name__} cannot be read: openvino_genai.draft_model "
        "returns an opaque object whose path Python cannot see, and this one was made before "
        "npuw_kv could record it (import npuw_kv after openvino_genai, before calling "
        "draft_model); or pass npuw_kv.draft_model(path, device) or the draft's directory"
    )


def build_draft(
    draft: DraftModel, main_device: str, settings: Mapping[str, Any]
) -> tuple[Runner, int]:
    """The draft's runner (PagedAttention on CPU) and vocabulary size.  It takes the main
    pipeline's settings (chunk, lengths, precision) with the draft's own properties on top."""
    import openvino as ov

    from ..config.pipeline_config import PipelineConfig
    from ..model.families import trained_context
    from ..model.source import read_ir, resolve_model
    from ..runtime.build import build_runner

    merged = {**settings, **draft.properties}
    config = PipelineConfig.from_kwargs(draft.device or main_device, **merged)
    if not config.paged:
        raise UsageError(f"draft_model on {config.device}: {SPECULATIVE_PATH}")
    path = resolve_model(draft.path, zero_points=config.gguf_zero_points)
    core = ov.Core()
    capacity = config.kv_capacity(trained_context(path))
    built = build_runner(core, path, read_ir(core, path), config, capacity, merged)
    if not built.config.paged:  # PagedAttention did not compile: auto fell back
        raise UsageError(f"draft_model: {SPECULATIVE_PATH}")
    return built.runner, built.vocab_size
