"""Side-by-side benchmark: npuw-kv vs openvino-genai (and NPUW's own LLM mode) on the same ids.

Each runtime runs in its own subprocess so its peak RSS (``VmHWM``: not ``ru_maxrss``, which
Linux carries over from the parent) is its own.  Every worker loads the model, warms up once,
then times ``--repeats`` generations of the same prompt ids and keeps the minimum TTFT and
ms/token; "loaded MB" is its resident set once loaded (the compiled models, before any
inference), and the static-shape path's rows are followed by what a prefill chunk took at each
past length.  Times on a shared 2-core machine are noisy:
compare the ratios printed from one run, not absolute numbers across runs.

``python -m npuw_kv.tools.bench --snippet-kernels`` measures one cost behind the static-shape path's
memory instead (:mod:`~npuw_kv.tools.snippets`).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ..cli.args import pipeline_kwargs
from ..config.pipeline_config import PipelineConfig
from .bench_batch import measure_batch, run_concurrency
from .bench_worker import RUNTIMES, genai_properties, measure, worker_result
from .snippets import snippet_kernels, snippet_probe

QUICK_PROMPT_LEN, QUICK_NEW_TOKENS = 1000, 64  # ``--quick``, and the lengths' defaults
BATCH_PROMPT_LEN = 190  # --concurrency's prompts (the batching issue's measurements)


def _run_worker(runtime: str, args: argparse.Namespace, extra: dict[str, Any]) -> dict[str, Any]:
    cmd = [
        sys.executable,
        "-m",
        "npuw_kv.tools.bench",
        "--worker",
        runtime,
        "--prompt-len",
        str(args.prompt_len),
        "--new-tokens",
        str(args.new_tokens),
        "--repeats",
        str(args.repeats),
        "--extra",
        json.dumps(extra),
    ]
    for flag, value in (
        ("--max-prompt-len", args.max_prompt_len),
        ("--min-response-len", args.min_response_len),
        ("--chunk", args.chunk),
    ):
        if value is not None:
            cmd += [flag, str(value)]
    if args.model:
        cmd += ["--model", str(args.model)]
    return worker_result(cmd, runtime)


def run_bench(args: argparse.Namespace) -> int:
    """Run every runtime, print the table; 1 when any runtime failed (its row says why), else 0."""
    if getattr(args, "repeats", None) is None:  # --quick: one timed run after the warm-up
        args.repeats = 1 if getattr(args, "quick", False) else 3
    if getattr(args, "concurrency", None):
        return _concurrency(args)
    if args.quick or args.prompt_len is None:
        args.prompt_len = QUICK_PROMPT_LEN
    if args.quick or args.new_tokens is None:
        args.new_tokens = QUICK_NEW_TOKENS
    extra = pipeline_kwargs(args)
    # the static shapes go to every worker as their own arguments (npuw-llm needs them too),
    # whichever name set them (--max-prompt-len, -p MAX_PROMPT_LEN=..., --chunk, ...)
    npuw_extra = {}
    for key, value in extra.items():
        name = PipelineConfig.setting_name(key)
        if name in ("max_prompt_len", "min_response_len"):
            setattr(args, name, int(value))
        elif name == "prefill_chunk_size":
            args.chunk = int(value)
        else:
            npuw_extra[key] = value
    genai_extra = genai_properties(npuw_extra)
    if args.exact:  # genai's CPU default KV cache is u8; exact means f32 there too
        genai_extra["KV_CACHE_PRECISION"] = "f32"
    runtimes = _runtimes(args.runtimes, args.device)
    print(
        f"prompt {args.prompt_len} tokens of stdlib docstrings, {args.new_tokens} new tokens, "
        f"min of {args.repeats} runs after 1 warm-up; settings {extra or 'defaults'}",
        flush=True,
    )
    results = []
    for runtime in runtimes:
        print(f"  running {runtime} ...", file=sys.stderr, flush=True)
        results.append(
            _run_worker(runtime, args, npuw_extra if runtime.startswith("npuw-kv") else genai_extra)
        )
    base = next((r for r in results if r["runtime"] == "genai-cpu" and "error" not in r), None)
    ours = next(
        (r for r in results if r["runtime"].startswith("npuw-kv") and "error" not in r), None
    )
    header = (
        f"{'runtime':<19}{'TTFT s':>9}{'ms/token':>10}{'peak RSS MB':>13}{'loaded MB':>11}"
        f"{'KV MB':>8}{'load s':>8}  same tokens"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        if "error" in r:
            print(f"{r['runtime']:<19} failed: {r['error']}")
            continue
        kv = f"{r['kv_bytes'] / 2**20:.1f}" if "kv_bytes" in r else "-"
        loaded = "-" if r.get("load_rss_mb") is None else f"{r['load_rss_mb']:.0f}"
        same = "-" if ours is None or r is ours else str(r.get("tokens") == ours.get("tokens"))
        print(
            f"{r['runtime']:<19}{r['ttft_s']:>9.3f}{r['ms_per_token']:>10.1f}{r['peak_rss_mb']:>13.0f}"
            f"{loaded:>11}{kv:>8}{r['load_s']:>8.1f}  {same}"
        )
    for r in results:
        if r.get("prefill_ms_by_past"):
            print(f"{r['runtime']} prefill chunk ms by past (chunks): {_by_past(r)}")
    if base and ours:
        print(
            f"{ours['runtime']} / genai-cpu: TTFT x{ours['ttft_s'] / base['ttft_s']:.2f}, decode "
            f"x{ours['ms_per_token'] / base['ms_per_token']:.2f}, peak RSS "
            f"x{ours['peak_rss_mb'] / base['peak_rss_mb']:.2f}; host bytes copied "
            f"{ours['host_copied']} (at the prefill->generate switch: {ours['switch_copied']})"
        )
    print(
        "(same tokens: greedy tokens equal to the first npuw-kv row's; they may differ where two "
        "graphs round differently, --exact compares at f32. loaded MB: RSS once compiled; KV MB: "
        "the KV cache allocated. host bytes copied: KV bytes npuw-kv copied on the host instead "
        "of binding them in place, 0 by design)"
    )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=2)
    failed = [r["runtime"] for r in results if "error" in r]
    if failed:
        print(f"npuw-kv bench: failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


def _concurrency(args: argparse.Namespace) -> int:
    """``--concurrency``: both pipelines cold (no prefix caching: every timed call repeats the
    same prompts), each with the settings given (genai: the OpenVINO properties among them)."""
    args.prompt_len = args.prompt_len or BATCH_PROMPT_LEN
    args.new_tokens = args.new_tokens or QUICK_NEW_TOKENS
    ours = {"prefix_reuse": False, **pipeline_kwargs(args)}
    theirs = genai_properties(ours)
    if args.exact:
        theirs["KV_CACHE_PRECISION"] = "f32"
    theirs["scheduler_config"] = "cold"  # the worker builds SchedulerConfig(prefix caching off)
    return run_concurrency(args, ours, theirs)


def _by_past(result: dict[str, Any]) -> str:
    """The last timed run's chunks as ``past: ms (n)``, e.g. "0: 201 (1), 2048: 362 (4)"."""
    return ", ".join(f"{past}: {ms:.0f} ({n})" for past, ms, n in result["prefill_ms_by_past"])


def _runtimes(listed: str | None, device: str | None) -> list[str]:
    """The runtimes to run: the list given, or our path for ``device`` next to genai-cpu."""
    if listed is not None and device is not None:
        raise ValueError(
            "bench: give either --device or --runtimes, not both (in --runtimes, npuw-kv is the "
            "CPU path, npuw-kv-sdpa the static-shape path on CPU and npuw-kv-npu the NPU path)"
        )
    if listed is None:
        dev = (device or "CPU").upper()
        if dev not in ("CPU", "NPU"):
            raise ValueError(f"bench: --device must be CPU or NPU, got {device!r}")
        listed = ("npuw-kv-npu" if dev == "NPU" else "npuw-kv") + ",genai-cpu"
    runtimes = [r.strip() for r in listed.split(",") if r.strip()]
    bad = [r for r in runtimes if r not in RUNTIMES]
    if bad or not runtimes:
        raise ValueError(f"unknown runtime(s) {bad}; choose from {', '.join(RUNTIMES)}")
    return runtimes


def _main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m npuw_kv.tools.bench",
        description="A bench worker (what `npuw-kv bench` runs per runtime), or "
        "--snippet-kernels: the compile-time memory of one decomposed attention op on CPU.",
    )
    task = parser.add_mutually_exclusive_group(required=True)
    task.add_argument("--worker", metavar="RUNTIME")
    task.add_argument(
        "--snippet-kernels",
        action="store_true",
        help="MB per decomposed SDPA op at compile time, for several head counts and sizes",
    )
    task.add_argument("--snippet-probe", nargs=3, type=int, help=argparse.SUPPRESS)
    parser.add_argument("--model", default=None)
    parser.add_argument("--prompt-len", type=int, default=QUICK_PROMPT_LEN)
    parser.add_argument("--new-tokens", type=int, default=QUICK_NEW_TOKENS)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--extra", default="{}")
    parser.add_argument("--max-prompt-len", type=int, default=None)
    parser.add_argument("--min-response-len", type=int, default=None)
    parser.add_argument("--chunk", type=int, default=None)
    parser.add_argument("--concurrency", type=int, default=None)
    a = parser.parse_args()
    if a.snippet_kernels:
        snippet_kernels()
        return 0
    if a.snippet_probe:
        print(f"{snippet_probe(*a.snippet_probe):.1f}")
        return 0
    if a.concurrency is not None:
        batch = measure_batch(
            a.worker, a.model, a.concurrency, a.prompt_len, a.new_tokens, a.repeats,
            json.loads(a.extra),
        )  # fmt: skip
        print(json.dumps(batch))
        return 0
    result = measure(
        a.worker,
        a.model,
        a.prompt_len,
        a.new_tokens,
        a.repeats,
        json.loads(a.extra),
        a.max_prompt_len,
        a.min_response_len,
        a.chunk,
    )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
