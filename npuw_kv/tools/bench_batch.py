"""``npuw-kv bench --concurrency N``: N prompts submitted together, npuw-kv's paged path beside
openvino-genai's CPU pipeline (its continuous-batching scheduler, defaults as a user gets them):
npuw-kv as one ``generate(list_of_prompts)`` and as N threads calling ``generate(prompt)`` at
once (``npuw-kv-threads``: they join one batch).

Each runtime and N runs in its own process (its peak RSS is its own), warms up once with the
same batch, then times ``repeats`` calls of ``generate(list_of_prompts)`` (greedy,
``ignore_eos``) and keeps the fastest: tokens/s over the whole batch, and the per-request time
to first token (p50 / p95, as each pipeline's raw metrics report it) and a request's time per
output token once all have their first (the call's time after the last first token, over the
remaining tokens).  The prompts are
distinct cuts of the stdlib-docstring text, ``prompt_len`` tokens each.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import numpy as np

from .bench_worker import _peak_rss_mb, progress, worker_result

BATCH_RUNTIMES = ("npuw-kv", "npuw-kv-threads", "genai-cpu")


def _threaded(pipe: Any, prompts: list[str], config: Any) -> tuple[list[str], int, list[float]]:
    """Each prompt from its own thread, all started at once (they join one batch): the
    texts, the tokens generated and each request's time to first token (µs)."""
    import threading

    start = threading.Barrier(len(prompts))
    out: list[Any] = [None] * len(prompts)

    def call(i: int) -> None:
        start.wait()
        out[i] = pipe.generate(prompts[i], config)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    generated = sum(r.perf_metrics.get_num_generated_tokens() for r in out)
    ttfts = [t for r in out for t in r.perf_metrics.raw_metrics.m_times_to_first_token]
    return [str(r) for r in out], generated, ttfts


def batch_prompts(tokenizer: Any, n: int, prompt_len: int) -> list[str]:
    """``n`` distinct prompts of about ``prompt_len`` tokens (text, so both pipelines read
    the same strings)."""
    from .prompts import prompt_ids

    ids = prompt_ids(tokenizer, n * (prompt_len + 13))
    step = prompt_len + 13
    return [
        tokenizer.decode([int(t) for t in ids[i * step : i * step + prompt_len]]) for i in range(n)
    ]


def measure_batch(
    runtime: str,
    model: str | None,
    n: int,
    prompt_len: int,
    new_tokens: int,
    repeats: int,
    extra: dict[str, Any],
) -> dict[str, Any]:
    """One runtime at concurrency ``n`` in this process (see the module's docstring)."""
    import openvino_genai

    from ..model.source import resolve_model

    if runtime.startswith("npuw-kv"):
        from ..pipeline import LLMPipeline  # before the tokenizer: see bench_worker.measure
    model_dir = resolve_model(model, log=lambda *a, **k: None)
    prompts = batch_prompts(openvino_genai.Tokenizer(str(model_dir)), n, prompt_len)
    if runtime.startswith("npuw-kv"):
        pipe: Any = LLMPipeline(model_dir, "CPU", **extra)
    elif runtime == "genai-cpu":
        props = dict(extra)
        if props.pop("scheduler_config", None) == "cold":
            scheduler = openvino_genai.SchedulerConfig()
            scheduler.enable_prefix_caching = False
            props["scheduler_config"] = scheduler
        pipe = openvino_genai.LLMPipeline(str(model_dir), "CPU", **props)
    else:
        raise ValueError(f"--concurrency runs {', '.join(BATCH_RUNTIMES)}, not {runtime!r}")
    config = openvino_genai.GenerationConfig()
    config.max_new_tokens, config.ignore_eos, config.apply_chat_template = new_tokens, True, False
    best: dict[str, Any] = {}
    for i in range(repeats + 1):
        progress(i, repeats)
        start = time.perf_counter()
        if runtime == "npuw-kv-threads":
            texts, generated, ttfts = _threaded(pipe, prompts, config)
        else:
            out = pipe.generate(prompts, config)
            texts, generated = list(out.texts), out.perf_metrics.get_num_generated_tokens()
            ttfts = list(out.perf_metrics.raw_metrics.m_times_to_first_token)  # µs, per request
        seconds = time.perf_counter() - start
        if i == 0:
            continue  # the warm-up
        if not best or seconds < best["seconds"]:
            first = max(ttfts) / 1e6 if ttfts else 0.0
            best = {
                "seconds": seconds,
                "tok_s": generated / seconds,
                "generated": generated,
                "ttft_p50_s": float(np.percentile(ttfts, 50)) / 1e6 if ttfts else None,
                "ttft_p95_s": float(np.percentile(ttfts, 95)) / 1e6 if ttfts else None,
                # a request's time per output token once every request has its first one
                "tpot_ms": 1000 * (seconds - first) / max(new_tokens - 1, 1),
                "texts": texts,
            }
    return {"runtime": runtime, "n": n, **best, "peak_rss_mb": _peak_rss_mb()}


def _worker(runtime: str, n: int, args: Any, extra: dict[str, Any]) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "npuw_kv.tools.bench", "--worker", runtime]
    cmd += ["--concurrency", str(n), "--prompt-len", str(args.prompt_len)]
    cmd += ["--new-tokens", str(args.new_tokens), "--repeats", str(args.repeats)]
    cmd += ["--extra", json.dumps(extra)]
    if args.model:
        cmd += ["--model", str(args.model)]
    return worker_result(cmd, runtime, n=n)


def run_concurrency(args: Any, ours: dict[str, Any], theirs: dict[str, Any]) -> int:
    """Each N of ``args.concurrency`` for npuw-kv and genai-cpu; prints one table."""
    levels = [int(n) for n in str(args.concurrency).split(",") if n.strip()]
    print(
        f"{args.prompt_len}-token prompts of stdlib docstrings, {args.new_tokens} new tokens each "
        f"(greedy, ignore_eos), best of {args.repeats} calls after 1 warm-up",
        flush=True,
    )
    header = (
        f"{'N':>3}  {'runtime':<16}{'tok/s':>8}{'TTFT p50 s':>12}{'TTFT p95 s':>12}"
        f"{'ms/token':>10}{'peak RSS MB':>13}  same texts"
    )
    print(header)
    print("-" * len(header))
    failed = False
    for n in levels:
        rows = []
        for runtime in BATCH_RUNTIMES:
            print(f"  running {runtime} at N={n} ...", file=sys.stderr, flush=True)
            extra = theirs if runtime == "genai-cpu" else ours
            rows.append(_worker(runtime, n, args, extra))
        texts = rows[0].get("texts")
        for r in rows:
            if "error" in r:
                failed = True
                print(f"{n:>3}  {r['runtime']:<16} failed: {r['error']}")
                continue
            p50 = "-" if r["ttft_p50_s"] is None else f"{r['ttft_p50_s']:.3f}"
            p95 = "-" if r["ttft_p95_s"] is None else f"{r['ttft_p95_s']:.3f}"
            same = "-" if r is rows[0] else str(r.get("texts") == texts)
            print(
                f"{n:>3}  {r['runtime']:<16}{r['tok_s']:>8.1f}{p50:>12}{p95:>12}"
                f"{r['tpot_ms']:>10.1f}{r['peak_rss_mb']:>13.0f}  {same}"
            )
        if all("error" not in r for r in rows):
            genai = rows[-1]["tok_s"]
            ratios = ", ".join(f"{r['runtime']} x{r['tok_s'] / genai:.2f}" for r in rows[:-1])
            print(f"{n:>3}  throughput against genai-cpu: {ratios}", flush=True)
    return 1 if failed else 0
