"""One runtime measured in its own process: load, warm up, time ``repeats`` generations of
the same prompt ids, and report the minimum TTFT and ms/token with the process's resident set
once loaded and at its peak; on the static-shape path also the prefill chunks' time by the
past length each ran with.

``npuw-kv bench`` (:mod:`.bench`) starts one such process per runtime, as
``python -m npuw_kv.tools.bench --worker RUNTIME``.
"""

from __future__ import annotations

import contextlib
import json
import resource
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any, cast

from ..config.pipeline_config import PipelineConfig
from . import children

RUNTIMES = (
    "npuw-kv",
    "npuw-kv-sdpa",
    "npuw-kv-npu",
    "npuw-kv-npu-static",
    "genai-cpu",
    "genai-sdpa",
    "npuw-llm",
    "npuw-llm-pyramid",
    "npuw-llm-static",
)
# our runtimes' settings beyond the device (a setting given with -p wins)
_OUR_PRESETS: dict[str, dict[str, Any]] = {
    "npuw-kv-sdpa": {"attention_backend": "sdpa"},  # the static-shape path on CPU
    # the NPU path without its variants: one prefill model over the whole past, one generate
    "npuw-kv-npu-static": {"prefill_attention": "static", "generate_pyramid": False},
}
DEFAULT_CHUNK = PipelineConfig().prefill_chunk_size  # ours, and what npuw-llm is given
# NPUW's own LLM pipeline: its defaults (in OpenVINO 2026.4.1 already pyramid prefill and
# generate variants), those two by name, or its static path (npuw-kv-npu-static's counterpart)
_NPUW_PRESETS: dict[str, dict[str, str]] = {
    "npuw-llm": {},
    "npuw-llm-pyramid": {
        "NPUW_LLM_PREFILL_ATTENTION_HINT": "PYRAMID",
        "NPUW_LLM_GENERATE_PYRAMID": "YES",
    },
    "npuw-llm-static": {
        "NPUW_LLM_PREFILL_ATTENTION_HINT": "STATIC",
        "NPUW_LLM_GENERATE_PYRAMID": "NO",
    },
}


PROGRESS = "[progress] "


def progress(run: int, repeats: int) -> None:
    """A worker's line for the parent to show (run 0 is the warm-up, after loading)."""
    what = "warm-up (the model is loaded)" if run == 0 else f"run {run} of {repeats}"
    print(f"{PROGRESS}{what}", file=sys.stderr, flush=True)


def worker_result(cmd: list[str], runtime: str, **row: Any) -> dict[str, Any]:
    """Run one bench worker process (``cmd``), showing its progress lines on stderr with the
    time since it started; the JSON row it printed last, or a row with ``row``'s fields saying
    why it failed (its last other line of stderr)."""
    start = time.perf_counter()
    with sigterm_exits():
        proc = children.start(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert proc.stderr is not None and proc.stdout is not None
        other: list[str] = []
        try:
            for line in proc.stderr:  # the worker prints its JSON row to stdout only at the end
                if line.startswith(PROGRESS):
                    elapsed = time.perf_counter() - start
                    text = line[len(PROGRESS) :].strip()
                    print(f"    {runtime}: {text}, {elapsed:.0f} s", file=sys.stderr, flush=True)
                elif line.strip():
                    other.append(line.strip())
        except BaseException:  # Ctrl-C or SIGTERM to the bench: its worker ends with it
            proc.kill()
            proc.wait()
            raise
    lines = [line for line in proc.stdout.read().splitlines() if line.startswith("{")]
    if proc.wait() != 0 or not lines:
        reason = (other or ["no output"])[-1]
        return {"runtime": runtime, **row, "error": reason[:300]}
    return cast(dict[str, Any], json.loads(lines[-1]))


@contextlib.contextmanager
def sigterm_exits() -> Iterator[None]:
    """While a worker runs, SIGTERM to this process raises ``SystemExit`` (in the main thread)
    instead of ending it at once, so the worker is killed on the way out, not orphaned."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def leave(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, leave)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _peak_rss_mb() -> float:
    """This worker's own peak resident set: ``VmHWM`` (Linux), not ``ru_maxrss``, which Linux
    carries over from the process that started the worker (through fork and exec), so a worker
    started by a large process would report that process's peak."""
    own = status_mb("VmHWM")
    return own if own is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def status_mb(field: str = "VmRSS") -> float | None:
    """A memory field of /proc/self/status in MB (Linux; None elsewhere), e.g. the resident set
    once a runtime has loaded: what its compiled models hold before any inference, where each
    extra static model shape shows."""
    try:
        with open("/proc/self/status") as fh:
            kb = next(int(line.split()[1]) for line in fh if line.startswith(field + ":"))
    except (OSError, StopIteration, ValueError):
        return None
    return kb / 1024.0


def chunk_ms_by_past(pasts: list[int], ms: list[float]) -> list[list[float]]:
    """``[past, mean ms, chunks]`` per past length the prefill chunks ran with, ascending: what
    a chunk costs as its attention reads more past (the pyramid's case)."""
    if len(pasts) != len(ms):
        raise ValueError(f"{len(pasts)} chunk pasts but {len(ms)} chunk times")
    by_past: dict[int, list[float]] = {}
    for past, t in zip(pasts, ms, strict=True):
        by_past.setdefault(past, []).append(t)
    return [[past, sum(ts) / len(ts), len(ts)] for past, ts in sorted(by_past.items())]


def genai_properties(settings: dict[str, Any]) -> dict[str, Any]:
    """What of our settings openvino-genai's pipelines are given: OpenVINO properties, and the
    KV precision and NPUW's LLM options (``NPUW_LLM_*``, which ours alias) under the names genai
    reads too.  Our own settings are not genai's (it reads ATTENTION_BACKEND itself, with other
    values)."""
    return {
        key: value
        for key, value in settings.items()
        if PipelineConfig.setting_name(key) is None
        or key.upper() == "KV_CACHE_PRECISION"
        or key.upper().startswith("NPUW_LLM_")
    }


def genai_pipeline(
    runtime: str,
    model_dir: Any,
    props: dict[str, Any],
    max_prompt: int,
    min_response: int,
    chunk: int = DEFAULT_CHUNK,
) -> Any:
    """openvino-genai's pipeline as the peer ``runtime`` runs it (cold: no prefix caching).

    NPUW's LLM pipeline prefills in chunks of ``chunk`` tokens, ours by default (its own
    default is 1024), so that a side-by-side run compares the same chunk size."""
    import openvino_genai

    if runtime == "genai-cpu":
        scheduler = openvino_genai.SchedulerConfig()
        scheduler.enable_prefix_caching = False
        return openvino_genai.LLMPipeline(
            str(model_dir), "CPU", scheduler_config=scheduler, **props
        )
    if runtime == "genai-sdpa":
        return openvino_genai.LLMPipeline(str(model_dir), "CPU", ATTENTION_BACKEND="SDPA", **props)
    if runtime in _NPUW_PRESETS:
        props = {**_NPUW_PRESETS[runtime], **props}
        return openvino_genai.LLMPipeline(
            str(model_dir),
            "NPU",
            NPUW_DEVICES="CPU",
            MAX_PROMPT_LEN=max_prompt,
            MIN_RESPONSE_LEN=min_response,
            NPUW_LLM_PREFILL_CHUNK_SIZE=chunk,
            **props,
        )
    raise ValueError(f"unknown runtime {runtime!r}; choose from {RUNTIMES}")


def measure(
    runtime: str,
    model: str | None,
    prompt_len: int,
    new_tokens: int,
    repeats: int,
    extra: dict[str, Any],
    max_prompt: int | None = None,
    min_response: int | None = None,
    chunk: int | None = None,
) -> dict[str, Any]:
    import numpy as np
    import openvino as ov
    import openvino_genai

    from ..model.source import resolve_model
    from .prompts import prompt_ids

    if runtime.startswith("npuw-kv"):
        # before the tokenizer builds oneDNN's first primitive: the pipeline's module sizes
        # oneDNN's cache then (runtime/heap.py), and the run measures what a user gets
        from ..pipeline import LLMPipeline
    model_dir = resolve_model(model, log=lambda *a, **k: None)
    ids = prompt_ids(openvino_genai.Tokenizer(str(model_dir)), prompt_len)
    if max_prompt is None:
        max_prompt = max(1024, -(-prompt_len // 256) * 256)
    if min_response is None:
        min_response = max(128, new_tokens)
    load_start = time.perf_counter()
    ttfts: list[float] = []
    tpots: list[float] = []
    info: dict[str, Any] = {}
    if runtime.startswith("npuw-kv"):
        device = "NPU" if runtime.startswith("npuw-kv-npu") else "CPU"
        # every timed run repeats the prompt: reusing its cached KV would time one chunk, so the
        # runs are cold, as genai-cpu's (prefix caching off); -p PREFIX_REUSE=YES overrides
        settings = dict(extra)
        if chunk is not None:
            settings["prefill_chunk_size"] = chunk
        named = {PipelineConfig.setting_name(key) for key in settings}
        if "prefix_reuse" not in named:
            settings["prefix_reuse"] = False
        for name, value in _OUR_PRESETS.get(runtime, {}).items():
            if name not in named:
                settings[name] = value
        pipe = LLMPipeline(
            model_dir,
            device,
            max_prompt_len=max_prompt,
            min_response_len=min_response,
            **settings,
        )
        load_s = time.perf_counter() - load_start
        load_rss = status_mb()
        for i in range(repeats + 1):
            progress(i, repeats)
            r = pipe.generate(ids, max_new_tokens=new_tokens, ignore_eos=True)
            if i:
                ttfts.append(r.ttft_s)
                tpots.append(r.ms_per_token)
        stats = pipe.kv_stats()
        info = {
            "kv_bytes": stats["kv_bytes_allocated"],
            "host_copied": stats["host_bytes_copied"],
            "switch_copied": stats["switch_host_bytes_copied"],
            "reused_tokens": stats["reused_tokens"],  # 0: every timed run was a cold prefill
            "tokens": r.tokens,
        }
        if "prefill_chunk_ms" in stats:  # the static-shape path: the last run's chunks
            info["prefill_ms_by_past"] = chunk_ms_by_past(
                stats["prefill_pasts_used"], stats["prefill_chunk_ms"]
            )
    else:
        pipe = genai_pipeline(
            runtime, model_dir, extra, max_prompt, min_response, chunk or DEFAULT_CHUNK
        )
        load_s = time.perf_counter() - load_start
        load_rss = status_mb()
        config = openvino_genai.GenerationConfig()
        config.max_new_tokens = new_tokens
        config.ignore_eos = True
        for i in range(repeats + 1):
            progress(i, repeats)
            res = pipe.generate(ov.Tensor(np.asarray(ids)[None]), config)
            if i:
                ttfts.append(res.perf_metrics.get_ttft().mean / 1000.0)
                tpots.append(res.perf_metrics.get_tpot().mean)
        info = {"tokens": [int(t) for t in res.tokens[0]]}
    return {
        "runtime": runtime,
        "ttft_s": min(ttfts),
        "ms_per_token": min(tpots),
        "load_s": load_s,
        "load_rss_mb": load_rss,
        "peak_rss_mb": _peak_rss_mb(),
        **info,
    }
