"""What a model's own files say about its family, and the quirks that follow from it.

``config.json`` (a transformers export) or the GGUF conversion's source info name the trained
context, the sliding window some layers use, and the architecture (``model_type``).  A few
architectures need the runtime to act differently (wider activations, NPUW unpartitioned); they
are listed here, each with why, so the quirks of one family live in one place.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..errors import ModelLayoutError, ModelLoadError
from .ir_cache import SOURCE_INFO
from .source import read_json


def trained_context(ir_dir: Path) -> tuple[int, str] | None:
    """The model's trained context length and where it was read, or None if nothing says.

    A GGUF conversion records it in :data:`SOURCE_INFO`; an optimum-intel export keeps the
    Hugging Face ``config.json`` with ``max_position_embeddings``.
    """
    source = ir_dir / SOURCE_INFO
    if source.is_file():
        info = read_json(source)
        if "context_length" in info:
            length = info["context_length"]
            if isinstance(length, bool) or not isinstance(length, int) or length <= 0:
                raise ModelLoadError(
                    f"{source}: context_length must be a positive integer, got {length!r}; "
                    "if the directory is an npuw-kv cache entry, delete it and it is converted "
                    "again"
                )
            return length, str(info.get("context_length_from", source.name))
    config = ir_dir / "config.json"
    if config.is_file():
        length = read_json(config).get("max_position_embeddings")
        if isinstance(length, int) and length > 0:
            return length, "config.json max_position_embeddings"
    return None


# architectures whose hidden state leaves the f16 range between layers (Gemma scales its
# embeddings by sqrt(hidden size)): NPUW's f16 tensors between sub-graphs overflow there
# (Gemma 3 270M, a 1000-token prompt: every logit NaN with NPUW_F16IC=YES, exact with NO)
_WIDE_ACTIVATIONS = ("gemma",)


def model_type(model_dir: Path) -> str:
    """The ``model_type`` the model's ``config.json`` names (its ``text_config``'s for a
    multimodal export); "" without one."""
    path = model_dir / "config.json"
    if not path.is_file():
        return ""
    config = read_json(path)
    return str((config.get("text_config") or config).get("model_type") or "")


@contextmanager
def family_named(model_dir: Path) -> Iterator[None]:
    """A ``ModelLayoutError`` raised inside names the model's family (its ``config.json``'s
    ``model_type``) too: which rewrite failed, on what kind of model."""
    try:
        yield
    except ModelLayoutError as exc:
        family = model_type(model_dir)
        if not family or family in str(exc):
            raise
        raise ModelLayoutError(f"a {family} model: {exc}") from exc


def wide_activations(model_dir: Path) -> bool:
    """Whether the model's ``config.json`` names an architecture whose activations between
    layers exceed f16 (:data:`_WIDE_ACTIVATIONS`)."""
    return model_type(model_dir).startswith(_WIDE_ACTIVATIONS)


# architectures NPUW's online partitioner runs wrongly in npuw-kv's static models: GPT-NeoX
# (Pythia; parallel residual, RoPE on part of each head) gives wrong tokens from the first
# generate step, with no error, while the same models unpartitioned give openvino-genai's;
# StarCoder2 with f16 KV (the NPU default) from the prompt's token on, even at f32 compute,
# sometimes as NaN logits, sometimes as other tokens (the tiny one at std 0.15 and 0.3)
_UNPARTITIONED = ("gpt_neox", "starcoder2")


def npuw_unpartitioned(model_dir: Path) -> str | None:
    """The model family, when NPUW must run this model unpartitioned (:data:`_UNPARTITIONED`);
    else None."""
    kind = model_type(model_dir)
    return kind if kind in _UNPARTITIONED else None


def declared_window(model_dir: Path, capacity: int | None = None) -> int | None:
    """The sliding window the model's config declares for some layers (None: none declared).

    ``config.json`` of a transformers export (or its ``text_config``): ``layer_types`` names
    sliding layers where it is given; else ``use_sliding_window`` says whether
    ``sliding_window`` applies (Qwen2/3, where it is off unless set, and only from layer
    ``max_window_layers`` on); else a ``sliding_window`` number means it does (Mistral).  A GGUF
    conversion records ``<arch>.attention.sliding_window`` in its source info.  A window of at
    least ``capacity`` tokens (the KV capacity) cannot change anything and reads as None.
    """
    for name in (SOURCE_INFO, "config.json"):
        path = model_dir / name
        if not path.is_file():
            continue
        config = read_json(path)
        config = config.get("text_config") or config
        window = config.get("sliding_window")
        if not isinstance(window, int) or window <= 0:
            continue
        if capacity is not None and window >= capacity:
            return None
        if isinstance(config.get("layer_types"), list):
            if "sliding_attention" not in config["layer_types"]:
                continue
        elif "use_sliding_window" in config or str(config.get("model_type")).startswith("qwen"):
            layers = config.get("num_hidden_layers")
            first = config.get("max_window_layers", 0)
            if not config.get("use_sliding_window") or (
                isinstance(layers, int) and isinstance(first, int) and first >= layers
            ):
                continue
        return window
    return None
