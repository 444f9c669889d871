"""``npuw-kv bench --concurrency N``: N prompts submitted together, npuw-kv's paged path beside
openvino-genai's CPU pipeline (its continuous-batching scheduler, defaults as a user gets them):
npuw-kv as one ``generate(list_of_prompts)`` and as N threads calling ``generate(prompt)`` at
once (``npuw-kv-threads``: they join one batch).  With ``-d NPU``: the NPU path (its packed
generate models) beside NPUW's own LLM pipeline, which runs batch 1 and so serves the prompts
one after another.

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

from .bench_worker import _peak_rss_mb, genai_pipeline, progress, worker_result

# what --concurrency runs on each device: ours, then the peer the ratios are taken against
CONCURRENCY_RUNTIMES = {
    "CPU": ("npuw-kv", "npuw-kv-threads", "genai-cpu"),
    # the NPU path's packed generate models, beside NPUW's own LLM pipeline (batch 1: it serves
    # the prompts one after another, each request's time to first token counted from the start)
    "NPU": ("npuw-kv-npu", "npuw-llm"),
}
BATCH_RUNTIMES = tuple(r for runtimes in CONCURRENCY_RUNTIMES.values() for r in runtimes)


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


def _one_after_another(
    pipe: Any, prompts: list[str], config: Any
) -> tuple[list[str], int, list[float]]:
    """A batch-1 pipeline serving the prompts in turn: the texts, the tokens generated and
    each request's time to first token from the start of the first (µs): its wait included."""
    start = time.perf_counter()
    texts, generated, ttfts = [], 0, []
    for prompt in prompts:
        began = (time.perf_counter() - start) * 1e6
        out = pipe.generate([prompt], config)
        texts.append(out.texts[0])
        generated += out.perf_metrics.get_num_generated_tokens()
        ttfts.append(began + out.perf_metrics.get_ttft().mean * 1e3)  # ms -> µs
    return texts, generated, ttfts


def concurrency_runtimes(listed: str | None, device: str | None) -> list[str]:
    """The runtimes ``--concurrency`` runs: those listed, else the device's own and its peer."""
    if listed is None:
        dev = (device or "CPU").upper()
        if dev not in CONCURRENCY_RUNTIMES:
            raise ValueError(f"bench: --device must be CPU or NPU, got {device!r}")
        return list(CONCURRENCY_RUNTIMES[dev])
    runtimes = [r.strip() for r in listed.split(",") if r.strip()]
    bad = [r for r in runtimes if r not in BATCH_RUNTIMES]
    if bad or not runtimes:
        raise ValueError(f"--concurrency runs {', '.join(BATCH_RUNTIMES)}, not {bad}")
    return runtimes


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
        device = "NPU" if runtime == "npuw-kv-npu" else "CPU"
        pipe: Any = LLMPipeline(model_dir, device, **extra)
    elif runtime == "npuw-llm":
        room = max(1024, -(-prompt_len // 256) * 256)
        props = {k: v for k, v in extra.items() if k != "scheduler_config"}  # not paged
        pipe = genai_pipeline(runtime, model_dir, props, room, max(128, new_tokens))
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
        elif runtime == "npuw-llm":
            texts, generated, ttfts = _one_after_another(pipe, prompts, config)
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
    runtimes = concurrency_runtimes(getattr(args, "runtimes", None), getattr(args, "device", None))
    alone: dict[str, float] = {}  # each runtime's tokens/s at the first N (N = 1: one request)
    for n in levels:
        rows = []
        for runtime in runtimes:
            print(f"  running {runtime} at N={n} ...", file=sys.stderr, flush=True)
            extra = ours if runtime.startswith("npuw-kv") else theirs
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
        if all("error" not in r for r in rows) and len(rows) > 1:
            peer = rows[-1]["tok_s"]
            ratios = ", ".join(f"{r['runtime']} x{r['tok_s'] / peer:.2f}" for r in rows[:-1])
            print(f"{n:>3}  throughput against {rows[-1]['runtime']}: {ratios}", flush=True)
        for r in rows:
            if "error" not in r:
                alone.setdefault(r["runtime"], r["tok_s"])
        if n != levels[0]:
            scaled = ", ".join(
                f"{r['runtime']} x{r['tok_s'] / alone[r['runtime']]:.2f}"
                for r in rows
                if "error" not in r and r["runtime"] in alone
            )
            print(f"{n:>3}  throughput against N={levels[0]}: {scaled}", flush=True)
    return 1 if failed else 0
