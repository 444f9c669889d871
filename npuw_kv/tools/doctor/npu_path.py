"""The NPU path itself: compile it (for the NPU alone where there is one, else on NPUW's CPU
stand-in under the double of the NPU plugin's I/O rules), then count what one request copies.

Only what ``kv_stats()`` reports is written: a key this npuw-kv does not have is named as
missing, never filled in.
"""

from __future__ import annotations

import time
import warnings
from typing import Any

from ...config.pipeline_config import PipelineConfig
from ..prompts import prompt_ids
from .context import DoctorContext, SectionFailed, error_text, md_table

# kv_stats() keys that say how the NPU path was compiled and laid out
LAYOUT_KEYS = (
    "kv_precision",
    "kv_binding",
    "v_layout",
    "prefill_variants",
    "generate_variants",
    "shared_weights",
    "kv_bytes_allocated",
)
DEVICES_KEY = "submodel_devices"
ESTIMATE_KEY = "npu_copied_bytes_estimate"
PREFILL_ESTIMATE_KEY = "npu_prefill_copied_bytes_estimate"
# what else the NPU path reports about its I/O, where this npuw-kv has it: who enforces the
# NPU's rules, how strided outputs are bound (strides chosen, given or none), where the KV
# lives, a refusal, the double's count
NPU_IO_KEYS = (
    "npu_io",
    "strided_outputs",
    "kv_strides",
    "npu_kv_memory",
    "strided_output_refused",
    "double_copied_bytes",
)


def npu_settings(ctx: DoctorContext) -> tuple[dict[str, Any], str]:
    """The pipeline settings of the NPU path here, and a sentence saying what they run."""
    shapes = {
        "max_prompt_len": ctx.prompt_len,
        "min_response_len": max(PipelineConfig().min_response_len, ctx.options.new_tokens),
    }
    if ctx.npu:
        how = '`LLMPipeline(model, "NPU", npuw_devices="NPU")`: every sub-model for the NPU alone'
        return {"npuw_devices": "NPU", **shapes}, how
    how = (
        "**no NPU here: ran NPUW on the CPU stand-in instead**: "
        '`LLMPipeline(model, "NPU", npu_io_double=True)` (NPUW_DEVICES=CPU, its sub-models '
        "run on the CPU under a double of the NPU plugin's I/O rules)"
    )
    return {"npu_io_double": True, **shapes}, how


def compile_npu_path(ctx: DoctorContext) -> list[str]:
    """Build the NPU-path pipeline, timing it and keeping every warning it raised."""
    from ...pipeline import LLMPipeline

    settings, how = npu_settings(ctx)
    shapes = f"max_prompt_len={settings['max_prompt_len']}"
    lines = [f"{how}; {shapes}, min_response_len={settings['min_response_len']}.", ""]
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            ctx.pipe = LLMPipeline(ctx.model_dir(), "NPU", **settings)
        except Exception as exc:
            ctx.pipe_error = error_text(exc)
            raise SectionFailed(ctx.pipe_error, lines + warning_lines(caught)) from exc
    lines += [f"Compiled in {time.perf_counter() - start:.1f} s.", "", *warning_lines(caught)]
    stats = ctx.pipe.kv_stats()
    return lines + ["", *device_lines(stats), "", *layout_lines(stats)]


def warning_lines(caught: list[warnings.WarningMessage]) -> list[str]:
    if not caught:
        return ["Warnings while compiling: none."]
    lines = [f"Warnings while compiling ({len(caught)}):", ""]
    return lines + [f"- {w.category.__name__}: {' '.join(str(w.message).split())}" for w in caught]


def device_lines(stats: dict[str, Any]) -> list[str]:
    """Where each sub-model runs, as ``kv_stats()["submodel_devices"]`` says."""
    devices = stats.get(DEVICES_KEY)
    if devices is None:
        return [f"Where each sub-model runs: `kv_stats()` has no `{DEVICES_KEY}` in this npuw-kv."]
    rows = ((f"`{name}`", f"`{device}`") for name, device in devices.items())
    return ["Where each sub-model runs (`kv_stats()`):", "", *md_table(("model", "device"), rows)]


def layout_lines(stats: dict[str, Any]) -> list[str]:
    keys = (*LAYOUT_KEYS, *NPU_IO_KEYS[:3])
    rows = ((f"`{key}`", f"`{stats[key]}`") for key in keys if key in stats)
    return md_table(("kv_stats() after compiling", "value"), rows)


def copies(ctx: DoctorContext) -> list[str]:
    """One request on the compiled NPU path: the bytes npuw-kv copied on the host, and the
    estimate of what NPUW and the NPU plugin copy by the plugin's rules."""
    pipe = ctx.built_pipe()
    ids = prompt_ids(pipe.get_tokenizer(), ctx.prompt_len)
    result = pipe.generate(ids, max_new_tokens=ctx.options.new_tokens, ignore_eos=True)
    stats, tokens = pipe.kv_stats(), len(result.tokens)
    return [
        f"One request: a {len(ids)}-token prompt, {tokens} tokens generated greedily "
        f"(TTFT {result.ttft_s:.3f} s, {result.ms_per_token:.1f} ms/token here).",
        "",
        *md_table(("copies (bytes)", "value"), copy_rows(stats, tokens)),
    ]


def copy_rows(stats: dict[str, Any], tokens: int) -> list[tuple[str, str]]:
    """npuw-kv's own host copies by phase, then the NPU estimate by phase (if reported), then
    what else the NPU path says about its I/O."""
    rows = phase_rows(
        "`host_bytes_copied` (npuw-kv's own copies)",
        int(stats["host_bytes_copied"]),
        int(stats.get("prefill_host_bytes_copied", 0)),
        int(stats.get("switch_host_bytes_copied", 0)),
        tokens,
    )
    rows.append(("`kv_binding`", f"`{stats.get('kv_binding')}`"))
    estimate = stats.get(ESTIMATE_KEY)
    if estimate is None:
        rows.append((f"`{ESTIMATE_KEY}`", "not reported by this npuw-kv"))
    else:
        what = f"`{ESTIMATE_KEY}` (NPUW / the NPU plugin, by its rules: an estimate)"
        rows += phase_rows(what, estimate, stats.get(PREFILL_ESTIMATE_KEY), None, tokens)
    return rows + [(f"`{key}`", f"`{stats[key]}`") for key in NPU_IO_KEYS if key in stats]


def phase_rows(
    what: str, total: Any, prefill: Any, switch: int | None, tokens: int
) -> list[tuple[str, str]]:
    """``total`` bytes of one request, split into the prompt's, the switch's and the
    generated tokens' where the parts are known, and per generated token."""
    rows = [(f"{what}, this request", _bytes(total))]
    if not isinstance(total, int):
        return rows
    if not isinstance(prefill, int):
        return rows + [
            (f"the above / {tokens} generated tokens (prompt included)", per_token(total, tokens))
        ]
    generating = total - prefill - (switch or 0)
    rows.append(("of which during the prompt", f"{prefill:,}"))
    if switch is not None:
        rows.append(("of which at the prefill -> generate switch", f"{switch:,}"))
    rows.append(("of which while generating", f"{generating:,}"))
    return rows + [
        (f"while generating, per generated token ({tokens})", per_token(generating, tokens))
    ]


def per_token(value: float, tokens: int) -> str:
    return f"{value / tokens:,.0f}" if tokens else "-"


def _bytes(value: Any) -> str:
    return f"{value:,}" if isinstance(value, (int, float)) else f"`{value}`"
