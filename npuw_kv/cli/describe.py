"""What ``npuw-kv inspect`` prints: the KV layout and the static shapes a config would use."""

from __future__ import annotations

from typing import Any

import openvino as ov

from ..config.decide import decide
from ..config.pipeline_config import PipelineConfig
from ..config.settings import STORE_BLOCK_TOKENS
from ..model.families import declared_window, trained_context, wide_activations
from ..model.source import read_ir, resolve_model
from ..model.variants import prepare
from ..runtime.device import device_properties, npu_io
from ..runtime.npu_compile import placement_plan
from ..runtime.npu_strides import kv_port_names, with_chosen_strides
from ..runtime.shapes import static_shapes


def describe(model: str | None, device: str = "CPU", **config: Any) -> str:
    cfg = PipelineConfig.from_kwargs(device, **config)
    model_dir = resolve_model(model, zero_points=cfg.gguf_zero_points)
    context = trained_context(model_dir)
    core = ov.Core()
    decided = decide(core, cfg, wide_activations(model_dir))
    shapes = static_shapes(decided, cfg.kv_capacity(context))
    # PagedAttention takes any window form (OpenVINO's rewrite): check only the static path's
    window = None if decided.paged else declared_window(model_dir, shapes.total_len)
    precision = decided.kv_precision or decided.compute_precision  # for the bytes per token
    prepared, layout = prepare(read_ir(core, model_dir), precision, False, window)
    windows = sorted({w for w in layout.window}, key=lambda w: (w is not None, w or 0))
    per_token = layout.bytes_per_token()
    kv_slots = shapes.generate_past
    lines = [
        f"model            {model_dir}",
        "trained context  " + (f"{context[0]} positions ({context[1]})" if context else "unknown"),
        f"layers           {layout.num_layers}",
        f"kv heads         {layout.num_kv_heads}",
        f"head_dim         {layout.head_dim}",
        "attention window "
        + ", ".join("full" if w is None else str(w) for w in windows)
        + " (per layer: "
        + ", ".join("full" if w is None else str(w) for w in layout.window)
        + ")",
        *decided.lines(),
        "devices present  "
        + ", ".join(core.available_devices)
        + ("" if "NPU" in core.available_devices else " (no NPU: the NPU path runs NPUW on CPU)"),
    ]
    if decided.npuw_devices and decided.static_models:
        lines.append("sub-models       " + placement_plan(decided.npuw_devices))
    # what the static models would be compiled with: strides chosen on the KV ports, or not
    strided = with_chosen_strides(core, decided, kv_port_names(prepared, layout))
    io = npu_io(core, strided, device_properties(strided)[1])
    if io is not None:
        lines.append("NPU I/O          " + io.describe())
    if decided.paged:
        lines += [
            f"device           {cfg.device} (attention_backend pa: one model, PagedAttention)",
            f"prefill          chunks of {shapes.chunk} tokens, prompts up to "
            f"{shapes.max_prompt_len}",
            f"KV cache         {shapes.total_len} tokens in the device's blocks"
            + (
                f", + {cfg.prefix_cache_tokens} for cached prefixes"
                if cfg.prefix_cache_tokens
                else ""
            ),
        ]
        return "\n".join(lines)
    lines += [
        f"device           {cfg.device} "
        + ("(static models)" if decided.static_models else "(one model, both shapes)"),
        f"prefill          input_ids [1,{shapes.chunk}]  attention_mask [1,{shapes.max_prompt_len}]"
        f"  past [1,{layout.num_kv_heads},{shapes.prefill_past},{layout.head_dim}]",
        f"generate         input_ids [1,1]  attention_mask [1,{shapes.total_len}]"
        f"  past [1,{layout.num_kv_heads},{shapes.generate_past},{layout.head_dim}]",
        *(
            [
                "prefill pasts    "
                + ", ".join(map(str, shapes.prefill_pasts))
                + " (a model each; a chunk runs on the smallest holding its past)",
                "generate pasts   "
                + ", ".join(map(str, shapes.generate_pasts))
                + " (a model each, views of the same buffer)",
            ]
            if decided.static_models
            else []
        ),
        *(
            [
                "KV blocks        cut at slots "
                + ", ".join(map(str, shapes.block_edges))
                + " (each model's past is whole blocks: dense inputs)"
            ]
            if shapes.block_edges
            else []
        ),
        _kv_line(kv_slots, per_token, layout.window, dict(shapes.rings(layout.window))),
    ]
    if cfg.prefix_cache_tokens:
        stored = cfg.prefix_cache_tokens // STORE_BLOCK_TOKENS * STORE_BLOCK_TOKENS
        lines.append(
            f"prefix store     {stored} tokens of earlier prompts on the host"
            f" (+ {STORE_BLOCK_TOKENS} for restores) = "
            f"{(stored + STORE_BLOCK_TOKENS) * per_token / 2**20:.1f} MiB"
        )
    return "\n".join(lines)


def _kv_line(
    slots: int, per_token: int, windows: tuple[int | None, ...], rings: dict[int, int]
) -> str:
    """The static path's KV bytes: every layer's whole past, or rings for windowed layers."""
    whole = _size(slots * per_token)
    if not rings:
        return f"KV cache         {slots} slots x {per_token} B/token = {whole}"
    per_layer = per_token // len(windows)  # the same KV heads in every layer
    held = [rings.get(w, slots) if w is not None else slots for w in windows]
    parts = [f"{slots} slots in {sum(h == slots for h in held)} layers"] + [
        f"a ring of {ring} in {sum(w == window for w in windows)} (window {window})"
        for window, ring in sorted(rings.items())
    ]
    return (
        f"KV cache         {', '.join(parts)} x {per_layer} B/token/layer = "
        f"{_size(sum(held) * per_layer)} (every layer whole: {whole}; window_kv)"
    )


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"
