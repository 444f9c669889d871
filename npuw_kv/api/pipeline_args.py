"""The constructor of :class:`~npuw_kv.pipeline.LLMPipeline` in openvino-genai's forms, made
uniform (:func:`pipeline_args`, :func:`model_directory` for a model given in memory) and genai's
``SchedulerConfig`` mapped onto our settings or refused by field (:func:`scheduler_settings`).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import openvino as ov
import openvino_genai

from ..config import decide
from ..config.decide import scheduled_attention
from ..config.pipeline_config import PipelineConfig
from ..errors import UsageError
from ..model.source import resolve_model
from .adapters import AdapterConfig, adapter_config

# tokens per block of the CPU plugin's PagedAttention cache (what num_kv_blocks counts)
PAGED_BLOCK_TOKENS = 32


@dataclass
class PipelineArgs:
    """The constructor's arguments, whichever of genai's forms they came in."""

    model: str | os.PathLike[str] | None
    device: str = "CPU"
    settings: dict[str, Any] = field(default_factory=dict)
    tokenizer: openvino_genai.Tokenizer | None = None
    weights: ov.Tensor | None = None  # set: ``model`` is the IR's XML text
    generation_config: Any = None
    scheduler_config: Any = None
    adapters: AdapterConfig | None = None


def pipeline_args(model: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> PipelineArgs:
    """Read genai's forms: ``(models_path, device, config, **props)``, ``(models_path,
    tokenizer, device, config, **props)`` and ``(model_xml, weights, tokenizer, device,
    generation_config, **props)``, plus ours, ``(model, device, **settings)``."""
    rest, props = list(args), dict(kwargs)
    out = PipelineArgs(model)
    if rest and isinstance(rest[0], ov.Tensor):
        if not isinstance(model, str):
            raise UsageError("with model weights given as an ov.Tensor, the model is its IR XML")
        out.weights = rest.pop(0)
    if rest and isinstance(rest[0], openvino_genai.Tokenizer):
        out.tokenizer = rest.pop(0)
    elif isinstance(props.get("tokenizer"), openvino_genai.Tokenizer):
        out.tokenizer = props.pop("tokenizer")
    if out.weights is not None and out.tokenizer is None:
        raise UsageError("a model given as XML text and weights needs an openvino_genai.Tokenizer")
    if rest:
        if "device" in props:
            raise UsageError("device given twice: positionally and as device=")
        props["device"] = rest.pop(0)
    out.device = props.pop("device", "CPU")
    if not isinstance(out.device, str):
        raise UsageError(f"device must be a string such as 'CPU' or 'NPU', got {out.device!r}")
    config: Any = {}
    if rest and out.weights is not None:
        out.generation_config = rest.pop(0)
    elif rest:
        config = rest.pop(0)
        if not isinstance(config, Mapping):
            raise UsageError(f"expected a dict of properties after the device, got {config!r}")
    if rest:
        raise UsageError(f"too many positional arguments: {rest!r}")
    if not config and isinstance(props.get("config"), Mapping):  # genai's keyword name
        config = props.pop("config")
    if out.weights is not None and "generation_config" in props:
        out.generation_config = props.pop("generation_config")
    for key, value in config.items():
        if key in props and props[key] is not value and props[key] != value:
            raise UsageError(f"{key} given twice, as {value!r} and {props[key]!r}")
        props[key] = value
    # genai's LoRA adapters, registered at construction (calls choose among them)
    out.adapters = adapter_config(props.pop("adapters", None))
    out.scheduler_config = props.pop("scheduler_config", None)
    out.settings = props
    return out


@contextmanager
def model_directory(given: PipelineArgs, zero_points: str) -> Iterator[Path]:
    """The directory holding the IR: a model given in memory (XML text and weights) is
    written to a temporary one, removed when the block ends (once compiled)."""
    if given.weights is not None:
        with tempfile.TemporaryDirectory(prefix="npuw-kv-", ignore_cleanup_errors=True) as tmp:
            xml = Path(tmp) / "openvino_model.xml"
            xml.write_text(str(given.model), encoding="utf-8")
            np.asarray(given.weights.data).tofile(xml.with_suffix(".bin"))
            yield xml.parent
        return
    path = None if given.model is None else Path(given.model)
    if given.tokenizer is not None and path and (path / "openvino_model.xml").is_file():
        yield path  # the tokenizer was given: its IRs need not be here
        return
    yield resolve_model(given.model, zero_points=zero_points)


# SchedulerConfig fields npuw-kv cannot honour: (is it set?, why)
_UNSUPPORTED = {
    "use_cache_eviction": (lambda v: bool(v), "there is no KV cache eviction inside a sequence"),
    "use_sparse_attention": (lambda v: bool(v), "prefill attention is dense"),
    "num_linear_attention_blocks": (
        lambda v: bool(v),
        "linear-attention state slots grow as sequences need them, and as many checkpoints are "
        "kept as the KV holds intervals (num_kv_blocks / prefix_cache_tokens size that)",
    ),
    "cache_interval_multiplier": (
        lambda v: v == 0,
        "a hybrid model's preempted or prefix-sharing sequence starts again from a state "
        "checkpoint: give a multiplier > 0 (or leave it unset: one checkpoint per prefill chunk)",
    ),
}


def scheduler_settings(scheduler: Any, device: str, settings: Mapping[str, Any]) -> dict[str, Any]:
    """``settings`` with genai's ``SchedulerConfig`` mapped onto ours, on the paged path only:
    ``enable_prefix_caching`` -> ``prefix_reuse``, ``max_num_batched_tokens`` -> the prefill
    chunk (at most MAX_PROMPT_LEN), ``num_kv_blocks`` -> KV blocks of 32 tokens (the room
    beyond one sequence's becomes ``prefix_cache_tokens``, which then bounds the batch too;
    fewer blocks than one sequence needs lower the sequence's lengths: :func:`_small_pools`),
    ``max_num_seqs`` -> the sequences a batched step runs at most, ``cache_interval_multiplier``
    -> ``state_checkpoint_interval`` (that many 32-token blocks; ``cache_size``, in GB, is
    applied once the model's bytes per token are known: :func:`scheduler_cache_bytes`).
    Anything else set is refused, naming the field."""
    if not isinstance(scheduler, openvino_genai.SchedulerConfig):
        raise UsageError(
            f"scheduler_config must be an openvino_genai.SchedulerConfig, got {scheduler!r}"
        )
    base = user = PipelineConfig.from_kwargs(device, **settings)
    if base.attention_backend != scheduled_attention(base) and not base.paged:
        settings = {**settings, "attention_backend": scheduled_attention(base)}
        base = user = PipelineConfig.from_kwargs(device, **settings)
    for name, (is_set, why) in _UNSUPPORTED.items():
        value = getattr(scheduler, name)
        if is_set(value):
            raise UsageError(f"scheduler_config.{name}={value!r} is not supported: {why}")
    default = openvino_genai.SchedulerConfig()
    if not base.paged and scheduler.cache_interval_multiplier is not None:
        raise UsageError(
            "scheduler_config.cache_interval_multiplier checkpoints a hybrid model's states "
            "beside the paged KV blocks; the static-shape path runs no hybrid model: leave it "
            "unset"
        )
    if not base.paged and decide.packed_slots(base):
        return _merge(settings, user, _slot_settings(scheduler, default))
    if not base.paged:
        raise UsageError(
            "scheduler_config means batched steps: use device CPU with attention_backend='pa', "
            f"or NPU (here: device {base.device}, attention_backend {base.attention_backend!r})"
        )
    mapped: dict[str, tuple[str, Any]] = {
        "prefix_reuse": ("enable_prefix_caching", bool(scheduler.enable_prefix_caching))
    }
    if not scheduler.dynamic_split_fuse:
        mapped["split_fuse"] = ("dynamic_split_fuse", False)
    if scheduler.max_num_seqs != default.max_num_seqs:
        mapped["max_num_seqs"] = ("max_num_seqs", int(scheduler.max_num_seqs))
    multiplier = scheduler.cache_interval_multiplier
    if multiplier is not None:
        interval = int(multiplier) * PAGED_BLOCK_TOKENS
        mapped["state_checkpoint_interval"] = ("cache_interval_multiplier", interval)
    batched = scheduler.max_num_batched_tokens
    if batched != default.max_num_batched_tokens:
        chunk = min(batched, base.requested_max_prompt_len)
        mapped["prefill_chunk_size"] = ("max_num_batched_tokens", chunk)
        base = replace(base, prefill_chunk_size=chunk, max_prompt_len=base.requested_max_prompt_len)
    if scheduler.num_kv_blocks:
        tokens = scheduler.num_kv_blocks * PAGED_BLOCK_TOKENS
        room = tokens - base.total_len
        if room < 0:  # fewer blocks than one sequence of full length needs
            mapped.update(_small_pools(base, tokens))
            room = 0
        mapped["prefix_cache_tokens"] = ("num_kv_blocks", room)
    return _merge(settings, user, mapped)


def _slot_settings(scheduler: Any, default: Any) -> dict[str, tuple[str, Any]]:
    """The NPU path's share of a ``SchedulerConfig``: prefix caching and the sequences at
    once (its slots); the fields that size or split the paged path's blocks are refused by
    name, since a slot holds a whole sequence of MAX_PROMPT_LEN + MIN_RESPONSE_LEN."""
    paged_only = ("num_kv_blocks", "cache_size", "max_num_batched_tokens", "dynamic_split_fuse")
    for name in paged_only:
        value = getattr(scheduler, name)
        if value != getattr(default, name):
            raise UsageError(
                f"scheduler_config.{name}={value!r} sizes the paged path's KV blocks and steps; "
                "the NPU path holds max_num_seqs slots of max_prompt_len + min_response_len "
                "tokens each and reads a prompt in prefill_chunk_size chunks: set those instead"
            )
    mapped: dict[str, tuple[str, Any]] = {
        "prefix_reuse": ("enable_prefix_caching", bool(scheduler.enable_prefix_caching))
    }
    if scheduler.max_num_seqs != default.max_num_seqs:
        mapped["max_num_seqs"] = ("max_num_seqs", int(scheduler.max_num_seqs))
    return mapped


def _merge(
    settings: Mapping[str, Any], user: PipelineConfig, mapped: dict[str, tuple[str, Any]]
) -> dict[str, Any]:
    """``settings`` with the ``SchedulerConfig`` fields ``mapped`` (setting -> (field, value))
    in them; a setting also given with another value is refused, naming both."""
    given = {PipelineConfig.setting_name(key): key for key in settings}
    out = dict(settings)  # with attention_backend='pa' when it was auto
    for name, (source, value) in mapped.items():
        if name in given and getattr(user, name) != value:
            raise UsageError(
                f"scheduler_config.{source} and {given[name]}={settings[given[name]]!r} set "
                f"{name} to different values ({value!r} and {getattr(user, name)!r}); pass one"
            )
        out.pop(given.get(name, name), None)
        out[name] = value
    return out


def _small_pools(base: PipelineConfig, tokens: int) -> dict[str, tuple[str, Any]]:
    """Lengths for pools of ``tokens`` that hold less than one sequence of MAX_PROMPT_LEN +
    MIN_RESPONSE_LEN: a sequence may hold the whole pools (so each fits alone), its prompt
    all but one token of them (a chunk at most that long).  As in genai, requests that do
    not fit together are preempted at run time, and those that cannot go on end with what
    they generated (``Scheduler``'s ``OutOfRoom``)."""
    prompt = min(base.max_prompt_len, tokens - 1)
    chunk = min(base.prefill_chunk_size, prompt)
    prompt = prompt // chunk * chunk
    return {
        "max_prompt_len": ("num_kv_blocks", prompt),
        "prefill_chunk_size": ("num_kv_blocks", chunk),
        "min_response_len": ("num_kv_blocks", tokens - prompt),
    }


def scheduler_cache_bytes(scheduler: Any, settings: Mapping[str, Any]) -> int:
    """The paged cache's bytes ``scheduler.cache_size`` asks for (GB, as genai counts them),
    or 0: unset, or ``num_kv_blocks`` given (which wins, as in genai).  With
    ``prefix_cache_tokens`` also given, refused: two sizes for one cache."""
    if scheduler is None or not scheduler.cache_size or scheduler.num_kv_blocks:
        return 0
    given = [k for k in settings if PipelineConfig.setting_name(k) == "prefix_cache_tokens"]
    if given:
        raise UsageError(
            f"scheduler_config.cache_size and {given[0]} both size the paged KV cache; pass one"
        )
    return int(scheduler.cache_size) * 2**30
