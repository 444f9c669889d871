"""The runtime's front door: from a read IR and the settings to a runner with its KV cache.

The graph is rewritten for the attention backend (:mod:`npuw_kv.model`), compiled
(:mod:`.compile`) and given a runner that binds the KV cache.  ``attention_backend="auto"``
falls back from PagedAttention to the static-shape path, with a warning, when the CPU plugin
cannot compile PagedAttention (a CPU it has no kernel for) but not when the settings are at
fault.  Failures come out as the documented errors naming the setting to change.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import openvino as ov

from ..config.decide import Decided, decide
from ..config.pipeline_config import PipelineConfig
from ..config.settings import MAX_NUM_SEQS, STORE_BLOCK_TOKENS, label
from ..errors import CompileError, UsageError, last_line
from ..kv.blocks import SHARES_ENV
from ..kv.blocks.shares import shares_setting
from ..kv.cache import KVSpec, SharedKVCache
from ..kv.memory import ensure_fits
from ..model.families import declared_window, npuw_unpartitioned, wide_activations
from ..model.layout import KVLayout
from ..model.lora import Adapter, LoraGraph, apply_lora
from ..model.paged_rewrite import (
    make_paged,
    positions_from_cache_length,
    split_block_tables,
    state_ops,
)
from ..model.source import read_ir
from ..model.states import (
    other_states,
    refuse_on_static_path,
    refuse_positions_from_cache_length,
    refuse_unpaged_states,
    refuse_unwritten_states,
)
from ..model.variants import prepare
from .compile import compile_paged, compile_requests
from .device import npu_io
from .npu_compile import compile_npu_first
from .npu_double import with_npu_io
from .npu_strides import kv_port_names, with_chosen_strides
from .paged.runner import PagedRunner
from .runner import Runner
from .shapes import static_shapes
from .static.packed import PackedSteps, slot_runners
from .static.runner import StaticRunner

T = TypeVar("T")
PAGED_ONLY = ("prefix_cache_host_tokens", "kv_window_shares")  # the block manager's tiers


@dataclass(kw_only=True)
class Built:
    runner: Runner
    config: PipelineConfig  # as run: as given, or changed by a fallback
    decided: Decided[PipelineConfig]  # its every ``auto`` decided (config/decide.py)
    vocab_size: int
    layout: KVLayout | None  # the static-shape path's KV layout (None on PagedAttention)
    lora: LoraGraph | None = None  # the LoRA adapters in the graph (model/lora.py)
    # every compiled request of the main model (the LoRA alpha input is bound on them)
    requests: tuple[ov.InferRequest, ...] = ()
    # the static path's slots and packed generate models (runtime/static/packed.py)
    packed: PackedSteps | None = None


def build_runner(
    core: ov.Core,
    model_dir: Path,
    ir: ov.Model,
    config: PipelineConfig,
    kv_capacity: int,
    settings: Mapping[str, Any],
    adapters: Sequence[Adapter] = (),
    tree_mask: bool = False,
) -> Built:
    """Rewrite ``ir`` (in place) for the attention backend, compile it, bind the KV cache.

    ``settings``: what the user passed, named in error messages.  ``adapters``: LoRA adapters
    put into the graph after the backend's rewrites (they cut the LM head, which the adapters
    then never see), switched by alpha at run time.  ``tree_mask``: the paged model takes a
    tree of candidates in one call (speculative decoding; not where linear-attention states
    would run the tree's branches as one sequence).
    """
    hybrid = other_states(ir)  # linear-attention state: the paged path holds it
    build = _Builder(core, config, settings)
    wide = wide_activations(model_dir)
    decided = decide(core, config, wide)  # every ``auto``, once
    if decided.paged:
        paged = make_paged(ir, config.full_prefill_logits, tree_mask and not hybrid)
        refuse_unpaged_states(paged)
        refuse_positions_from_cache_length(positions_from_cache_length(paged))
        lora = apply_lora(paged, adapters) if adapters else None
        windows = split_block_tables(paged, kv_capacity)
        try:
            request = build.compile(lambda: compile_paged(core, paged, decided))
        except CompileError as exc:
            if config.attention_backend != "auto" or build.refuses_properties() or hybrid:
                raise
            room = config.prefix_cache_tokens
            tiers = [n for n in PAGED_ONLY if getattr(config, n)]
            if config.max_num_seqs != MAX_NUM_SEQS:  # no batched steps there
                tiers.append("max_num_seqs")
            if not config.split_fuse:
                tiers.append("split_fuse")
            warnings.warn(
                f"PagedAttention did not compile ({exc}); running the static-shape path "
                "(attention_backend='sdpa')"
                + (", where prefix_cache_tokens is a host store" if room else "")
                + (f"; {' and '.join(tiers)} dropped (PagedAttention only)" if tiers else ""),
                RuntimeWarning,
                stacklevel=4,
            )
            ir = read_ir(core, model_dir)  # the rewrite above was in place
            # a room too small for one block of the host store is dropped, not refused
            config = replace(
                config,
                attention_backend="sdpa",
                prefix_cache_tokens=room if room >= STORE_BLOCK_TOKENS else 0,
                prefix_cache_host_tokens=0,
                kv_window_shares=None,
                max_num_seqs=MAX_NUM_SEQS,
                split_fuse=True,
            )
            decided = decide(core, config, wide)
        else:
            shares, source = shares_setting(
                config.kv_window_shares, os.environ, label("kv_window_shares")
            )
            paged_runner = build.allocate(
                kv_capacity + config.prefix_cache_tokens,
                lambda: PagedRunner(
                    request,
                    capacity=kv_capacity,
                    max_prompt_len=config.max_prompt_len,
                    chunk=config.prefill_chunk_size,
                    prefix_reuse=config.prefix_reuse,
                    prefix_cache_tokens=config.prefix_cache_tokens,
                    windows=windows,
                    host_tokens=config.prefix_cache_host_tokens,
                    state_interval=config.state_checkpoint_interval,
                    shares=shares,
                    shares_source=source,
                ),
            )
            if hybrid:
                refuse_unwritten_states(paged_runner.memory.unwritten_states(), state_ops(paged))
            vocab = _vocab(request.get_compiled_model().output("logits"))
            return Built(
                runner=paged_runner,
                config=config,
                decided=decided,
                vocab_size=vocab,
                layout=None,
                lora=lora,
                requests=(request,),
            )
    refuse_on_static_path(hybrid)
    if os.environ.get(SHARES_ENV, "").strip():
        warnings.warn(
            f"{SHARES_ENV} ignored: it applies to attention_backend='pa' (one block pool per "
            "window); the static-shape path has none",
            RuntimeWarning,
            stacklevel=3,
        )
    shapes = static_shapes(decided, kv_capacity)
    assert decided.kv_precision is not None  # the static path always names one
    prepared, layout = prepare(
        ir,
        decided.kv_precision,
        config.full_prefill_logits,
        declared_window(model_dir, kv_capacity),
        shapes,
    )
    lora = apply_lora(prepared, adapters) if adapters else None
    # before compiling: static shapes of an absurd length would cost the compiler first
    build.allocate(kv_capacity, lambda: _check_kv_fits(layout, shapes.generate_past))
    unpartitioned = npuw_unpartitioned(model_dir)
    decided = with_chosen_strides(core, decided, kv_port_names(prepared, layout))
    requests = build.compile(
        lambda: compile_npu_first(
            lambda d: compile_requests(core, prepared, layout, d, shapes, unpartitioned), decided
        )
    )
    requests = with_npu_io(requests, npu_io(core, decided, requests.device_properties))

    def make(memory: Callable[[str, int, int], np.ndarray] | None, first: bool) -> StaticRunner:
        return StaticRunner(
            requests,
            layout,
            shapes,
            kv_binding=config.kv_binding,
            full_rows=config.full_prefill_logits,
            prefix_reuse=config.prefix_reuse,
            prefix_cache_tokens=config.prefix_cache_tokens if first else 0,
            memory=memory,
        )

    runner, packed = build.allocate(
        kv_capacity, lambda: slot_runners(make, requests, layout, decided.kv_precision or "f32")
    )
    vocab = _vocab(requests.logits_output(layout.logits_output_index))
    every = (requests.prefill, requests.generate)
    every += tuple(v.request for v in (*requests.prefill_ladder, *requests.generate_ladder))
    every += tuple(v.request for v in requests.packed)
    # the layout is the generate models' (V transposed or not)
    return Built(
        runner=runner,
        config=config,
        decided=decided,
        vocab_size=vocab,
        layout=runner.layout,
        lora=lora,
        requests=every,
        packed=packed,
    )


def _check_kv_fits(layout: KVLayout, slots: int) -> None:
    specs = [
        KVSpec(p.input_name, p.num_heads, p.head_dim, ring=layout.ring_of(p.layer) or 0)
        for p in layout.ports
    ]
    ensure_fits(
        SharedKVCache.nbytes_for(specs, slots, layout.precision), f"a KV cache of {slots} tokens"
    )


def _vocab(logits: ov.Output) -> int:
    return int(logits.get_partial_shape()[-1].get_length())


class _Builder:
    """Turns the device's and the allocator's failures into errors naming the settings."""

    def __init__(self, core: ov.Core, config: PipelineConfig, settings: Mapping[str, Any]):
        self.core = core
        self.config = config
        self.settings = settings

    def refuses_properties(self) -> bool:
        """True when the device refuses the properties given even on a trivial model: the
        failure is the settings', and running another backend would only hide it."""
        properties = self.config.compile_properties
        if not properties:
            return False
        x = ov.opset13.parameter([1], np.float32)
        trivial = ov.Model([ov.opset13.relu(x)], [x])
        try:
            self.core.compile_model(trivial, self.config.device, properties)
        except RuntimeError:
            return True
        return False

    def compile(self, compile_: Callable[[], T]) -> T:
        try:
            return compile_()
        except UsageError:  # ours (also RuntimeErrors): already names the setting
            raise
        except RuntimeError as exc:
            given = ", ".join(f"{k}={v!r}" for k, v in self.settings.items())
            raise CompileError(
                f"{self.config.device} could not compile the model with "
                f"{'these settings: ' + given if given else 'the default settings'}: "
                f"{last_line(exc)}"
            ) from exc

    @staticmethod
    def allocate(kv_capacity: int, build: Callable[[], T]) -> T:
        """``build()``, with any failure to allocate (checked up front against the available
        memory, or numpy's / the plugin's own) as one error naming the settings to lower."""
        try:
            return build()
        except (MemoryError, RuntimeError) as exc:
            if isinstance(exc, RuntimeError) and "alloc" not in str(exc).lower():
                raise
            detail = (
                str(exc)  # ensure_fits says which buffer, its size and what is available
                if isinstance(exc, MemoryError) and str(exc)
                else f"a KV cache of {kv_capacity} tokens ({last_line(exc)})"
            )
            lower = (
                "prefix_cache_host_tokens (PREFIX_CACHE_HOST_TOKENS)"  # the host tier's own
                if "prefix_cache_host_tokens" in detail
                else "max_prompt_len (MAX_PROMPT_LEN), min_response_len (MIN_RESPONSE_LEN) or "
                "prefix_cache_tokens (PREFIX_CACHE_TOKENS)"
            )
            raise UsageError(f"cannot allocate {detail}; lower {lower}") from exc
