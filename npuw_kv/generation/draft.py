"""The draft model of speculative decoding, as ``LLMPipeline(..., draft_model=...)`` takes it.

openvino-genai's ``draft_model(path, device, **props)`` returns an opaque object (an ``OVAny``
holding a C++ ``ModelDesc``: its value cannot be converted, ``str()`` is empty, pickling fails),
so genai's samples, run with only the pipeline swapped, would hand us something unreadable.
:func:`record_genai_drafts` wraps genai's function (its objects unchanged) to remember what each
was made from; :func:`draft_model` is ours, for code that imports npuw_kv only.
:func:`build_draft` loads it.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..api.genai_objects import mapped_model_dirs
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
    pipeline takes them as before) can be read back by :func:`resolve_draft`; genai's
    ``Adapter`` is recorded too (:func:`~npuw_kv.api.genai_objects.record_genai_adapters`)."""
    import openvino_genai

    from ..api.genai_objects import record_genai_adapters

    record_genai_adapters()

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
    # made before npuw_kv was imported: the model directory genai keeps mapped for it
    dirs = mapped_model_dirs() if type(value).__name__ == "OVAny" else []
    if len(dirs) == 1:
        warnings.warn(
            f"draft_model: openvino_genai's object was made before npuw_kv could record it; "
            f"it is read from {dirs[0]}, the one model directory it keeps mapped, on the main "
            "model's device with the main model's properties (its own cannot be read: make "
            "it after importing npuw_kv, or use npuw_kv.draft_model, to keep them)",
            RuntimeWarning,
            stacklevel=4,
        )
        return draft_model(dirs[0])
    raise UsageError(
        f"draft_model={type(value).__name__} cannot be read: openvino_genai.draft_model "
        "returns an opaque object whose path Python cannot see, this one was made before "
        f"npuw_kv could record it, and {len(dirs)} model directories are mapped "
        f"({', '.join(map(str, dirs)) or 'none'}): import npuw_kv before calling "
        "draft_model, or pass npuw_kv.draft_model(path, device) or the draft's directory"
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
    # the tree mask: tree search grows its layers over the draft's cache in one call each
    built = build_runner(core, path, read_ir(core, path), config, capacity, merged, tree_mask=True)
    if not built.config.paged:  # PagedAttention did not compile: auto fell back
        raise UsageError(f"draft_model: {SPECULATIVE_PATH}")
    return built.runner, built.vocab_size
