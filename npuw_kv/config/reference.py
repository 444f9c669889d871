"""The settings reference (``docs/settings.md``), written from the tables that check settings.

Names, aliases, choices and minimums come from :mod:`.settings`, defaults from
:class:`~.pipeline_config.PipelineConfig`; only what each setting means is written here.  A
test compares the committed page with :func:`settings_markdown`, so the page cannot drift from
the code.  ``python -m npuw_kv.config.reference`` writes it again.
"""

from __future__ import annotations

import sys
from dataclasses import MISSING, fields
from pathlib import Path

from .pipeline_config import PipelineConfig
from .settings import ALIASES, CHOICES, EXACT_F32, MINIMUMS, PASSTHROUGH, PASSTHROUGH_PREFIXES

PAGE = Path(__file__).resolve().parents[2] / "docs" / "settings.md"
NOT_SETTINGS = ("device", "compile_properties")  # the device argument; OpenVINO properties

# field -> (default as a user reads it, when the field's own default does not say; meaning)
MEANINGS: dict[str, tuple[str | None, str]] = {
    "max_prompt_len": (
        None,
        (
            "longest prompt, rounded up to a multiple of the chunk; at most the model's "
            "trained context"
        ),
    ),
    "min_response_len": (
        None,
        "tokens guaranteed after the longest prompt; one sequence's KV room is the sum",
    ),
    "prefill_chunk_size": (
        None,
        "tokens per prefill chunk; on `pa` also the tokens one batched step runs",
    ),
    "attention_backend": (
        None,
        (
            "`pa` (PagedAttention, CPU only) or `sdpa` (static shapes, always on NPU); "
            "`auto`: `pa` on CPU unless a setting only `sdpa` honours is given"
        ),
    ),
    "kv_precision": (
        None,
        (
            "KV storage. `pa`: `u8` or the compute precision (`auto`: the plugin's choice, u8"
            " on most CPUs, f32 under `EXACT_F32`); `sdpa`: `f32`/`f16`/`bf16` (`auto`: the "
            'compute precision); NPU: `f16` (`auto`) or `f32`. `kv_stats()["kv_precision"]` '
            "says which"
        ),
    ),
    "max_num_seqs": (
        None,
        (
            "sequences that run at once; the others wait. `pa`: one batched step's at most; "
            "NPU: slots of the KV pool, stepped together by packed generate models (of 4, 16, "
            "64 below it and of it; 1: one sequence at a time; the default, as many as 16 x "
            "2048 tokens of `max_prompt_len + min_response_len` hold: 16 up to 2k, 2 at 16k)"
        ),
    ),
    "split_fuse": (
        None,
        (
            "`pa`: a step runs decode tokens and prompt chunks together; NO: prompts are read"
            " in steps of their own"
        ),
    ),
    "prefix_reuse": (
        None,
        'run only what follows the longest cached prefix (`kv_stats()["reused_tokens"]`)',
    ),
    "prefix_cache_tokens": (
        None,
        (
            "KV room kept for earlier prompts: `pa` extra blocks (a batch is then preempted "
            "in them rather than grow); `sdpa` a host store of 32-token blocks"
        ),
    ),
    "prefix_cache_host_tokens": (
        None,
        "`pa`: a host tier the evicted blocks move to and come back from on a hit",
    ),
    "state_checkpoint_interval": (
        None,
        (
            "`pa`, hybrid models: tokens between checkpoints of the linear-attention states, "
            "whole 32-token blocks (genai's `cache_interval_multiplier` x 32); 0: the prefill "
            "chunk rounded up to blocks"
        ),
    ),
    "kv_window_shares": (
        "even",
        (
            "`pa`: how the prefix-cache room splits between a sliding-window model's pools, "
            'e.g. `"0.25,0.75"` (ascending windows, full last) or `"8:0.25,full:0.75"`'
        ),
    ),
    "window_kv": (
        None,
        (
            "`sdpa`: a sliding-window layer's KV in a ring of window + chunk slots (`ring`), "
            "or whole (`full`); `auto`: the ring unless the host prefix store needs every "
            "layer's whole past"
        ),
    ),
    "kv_binding": (
        None,
        (
            "`sdpa`: the buffer bound in place (`roi`), strided views staged (`contiguous`), "
            "or everything staged (`copy`)"
        ),
    ),
    "static_models": (
        "CPU NO, NPU YES",
        "`sdpa`: two static models, or (CPU) one with dynamic sequence dims",
    ),
    "prefill_attention": (
        None,
        (
            "static models: `pyramid` (a prefill model per past length), `static` (one over "
            "the whole past); `auto` keeps one or two below the whole"
        ),
    ),
    "generate_pyramid": (
        "auto",
        "static models: generate models by context length; `auto` one below the whole",
    ),
    "shared_head": (
        "auto",
        "static models: the embedding and LM head compiled once, outside the body models",
    ),
    "optimize_v_tensors": (
        "YES on a real NPU with `max_num_seqs` 1",
        (
            "static models: V stored `[1, H, D, S]`, as NPUW does (packed generate models read "
            "`[1, H, S, D]`: YES then runs one sequence at a time)"
        ),
    ),
    "npuw_devices": (
        "`CPU` (`NPU,CPU` with an NPU)",
        "where NPUW runs its sub-models",
    ),
    "npu_io_double": (
        None,
        (
            "NPU path on NPUW's CPU stand-in: the requests run under a double of the NPU "
            "plugin's I/O rules (strided outputs refused, host inputs counted as copies); "
            "for tests and `npuw-kv doctor`"
        ),
    ),
    "num_threads": (
        "0 (all)",
        "CPU threads",
    ),
    "gguf_zero_points": (
        None,
        (
            "GGUF input: openvino-genai's conversion (`genai`), or `exact` Q4_1 zero points "
            "([accuracy](accuracy.md))"
        ),
    ),
    "full_prefill_logits": (
        None,
        "the LM head on every prompt row (perplexity checks only)",
    ),
}


def setting_names() -> list[str]:
    """Every setting :class:`PipelineConfig` takes by name, in its order."""
    return [f.name for f in fields(PipelineConfig) if f.init and f.name not in NOT_SETTINGS]


def _default(name: str) -> str:
    shown = MEANINGS[name][0]
    if shown is not None:
        return shown
    field = next(f for f in fields(PipelineConfig) if f.name == name)
    value = field.default if field.default is not MISSING else None
    if isinstance(value, bool):
        return "YES" if value else "NO"
    return f"`{value}`" if isinstance(value, str) else str(value)


def _takes(name: str) -> str:
    if name in CHOICES:
        return ", ".join(f"`{c}`" for c in CHOICES[name])
    if name in MINIMUMS:
        return f"an integer >= {MINIMUMS[name]}"
    field = next(f for f in fields(PipelineConfig) if f.name == name)
    kind = str(field.type)
    if "bool" in kind:
        return "YES / NO" + (" / `auto`" if "None" in kind else "")
    return "text"


def settings_markdown() -> str:
    """The whole of ``docs/settings.md``."""
    lines = [
        "# Settings",
        "",
        "<!-- written by `python -m npuw_kv.config.reference` from npuw_kv/config: "
        "edit the code, not this page -->",
        "",
        "Pass them to `LLMPipeline(model, device, **settings)`, to `ContinuousBatchingPipeline` "
        "the same way, or on the command line as `-p NAME=VALUE`. Names are case-insensitive; "
        "the aliases (NPUW's and openvino-genai's property names) set the same setting, and "
        "values may be written as openvino-genai accepts them (`ov.Type`, hint enums, YES/NO). "
        "`pa` is the PagedAttention path (the CPU default), `sdpa` the static-shape path "
        "(always on NPU). A setting that does not apply to the chosen path is refused by name, "
        "or warned about once where it changes nothing.",
        "",
        "| setting | aliases | takes | default | meaning |",
        "|---|---|---|---|---|",
    ]
    for name in setting_names():
        aliases = ", ".join(f"`{a}`" for a, f in ALIASES.items() if f == name) or "-"
        lines.append(
            f"| `{name}` | {aliases} | {_takes(name)} | {_default(name)} | {MEANINGS[name][1]} |"
        )
    exact = ", ".join(f"`{k}={v}`" for k, v in EXACT_F32.items())
    lines += [
        "",
        "## OpenVINO properties",
        "",
        "Passed to `compile_model` unchanged (the plugin checks their values): "
        + ", ".join(f"`{p}`" for p in PASSTHROUGH)
        + ", and every name starting with "
        + " or ".join(f"`{p}`" for p in PASSTHROUGH_PREFIXES)
        + " that is not an alias above. Any other name is refused. On NPU, `SNIPPETS_MODE` "
        "goes to the CPU plugin of the pipeline's core, where NPUW compiles its CPU sub-models "
        "(by default `DISABLE` where they compute in bf16 with f32 tensors between sub-graphs: "
        "[npuw-notes](npuw-notes.md#npuw-on-the-cpu-bf16-attention-on-f32-inputs)).",
        "",
        f"`npuw_kv.config.EXACT_F32` ({exact}; `--exact` on the command line) turns off the "
        "CPU's bf16 compute and int8 dynamic quantization, for bit-for-bit comparisons against "
        "an f32 reference.",
        "",
        "`INFERENCE_PRECISION_HINT` unset, the CPU plugin computes in bf16 on CPUs that have it "
        "(AMX), except in a process allowed one CPU (`taskset -c 0`, a container's cpuset, a "
        "Kubernetes pod with one exclusive CPU): there the plugin dies with SIGFPE compiling LLM "
        "graphs in bf16 (openvino-genai's pipeline too: openvinotoolkit/openvino#33300), so "
        "npuw-kv computes in f32 and warns. A hint given is honoured.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    PAGE.write_text(settings_markdown())
    print(f"wrote {PAGE}", file=sys.stderr)
