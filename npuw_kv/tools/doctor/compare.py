"""The NPU path beside the others: accuracy against the exact f32 reference with the CPU path
next to it (``npuw-kv accuracy``'s matrix), and speed and memory beside NPUW's own LLM pipeline
and the CPU default (``npuw-kv bench``'s workers, one process each)."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from ...config.pipeline_config import PipelineConfig
from ..accuracy.modes import PEER_SLACK
from ..accuracy.result import Result
from .context import DoctorContext, SectionFailed, mb, md_table, num
from .report import progress

MODE = "device-default"  # each device at its own defaults, as a user runs it
TORCH_PEER = "torch (peer)"  # not run here: `npuw-kv accuracy` has it
BENCH_RUNTIMES = ("npuw-kv-npu", "npuw-llm", "npuw-kv")


def accuracy(ctx: DoctorContext) -> list[str]:
    """The NPU and the CPU path at their defaults against the f32 reference, at each prompt
    length; failed when either errs or leaves the tolerance ``npuw-kv accuracy`` holds it to."""
    from ..accuracy.run import run_matrix

    start = time.perf_counter()

    def done(name: str) -> None:
        progress(f"  accuracy: {name} done ({time.perf_counter() - start:.0f} s)")

    options = ctx.options
    results = run_matrix(
        ctx.model_dir(),
        options.prompt_lens,
        options.new_tokens,
        ["NPU", "CPU"],
        [MODE],
        [PipelineConfig().prefill_chunk_size],
        done,
        peer=True,
        torch_source=None,
    )
    shown = [r for r in results if r.mode != TORCH_PEER]
    lines = [*accuracy_intro(ctx), "", *md_table(ACCURACY_COLUMNS, map(accuracy_row, shown))]
    # the NPU path is what the doctor checks; the CPU path's verdict is shown beside it
    bad = [r.name for r in shown if r.device == "NPU" and "(peer)" not in r.mode and not r.passed]
    if bad:
        raise SectionFailed(f"outside tolerance or not run: {', '.join(bad)}", lines)
    return lines


def accuracy_intro(ctx: DoctorContext) -> list[str]:
    npu = "the NPU at its defaults" if ctx.npu else "no NPU here: NPUW on the CPU stand-in"
    lengths = ", ".join(map(str, ctx.options.prompt_lens))
    return [
        f"`{MODE}` on the NPU path ({npu}) and on the CPU path, at prompt lengths {lengths} "
        f"(stdlib docstrings), {ctx.options.new_tokens} new tokens. Both are teacher-forced on "
        "the greedy continuation of the exact f32 reference (openvino-genai's CPU pipeline and "
        "the stateful IR, f32 compute and KV): `tokens` counts greedy tokens equal before the "
        "first divergence. Each is held, as `npuw-kv accuracy` holds this mode, to the "
        f"`ir-default` peer (the untouched IR at the CPU's defaults): max |dlogit| at most "
        f"{PEER_SLACK['max_abs_dlogit']}x and mean KL at most {PEER_SLACK['mean_kl']}x the "
        "peer's on the same prompt. The section fails when an NPU-path row does; the CPU "
        "path's verdict is reported beside it. Peers are reported, never gated (the PyTorch "
        "peer is left to `npuw-kv accuracy`)."
    ]


ACCURACY_COLUMNS = (
    "configuration",
    "tokens",
    "1st div",
    "max abs dlogit",
    "mean KL",
    "ppl (ref)",
    "recall",
    "limit",
    "verdict",
)


def accuracy_row(r: Result) -> list[str]:
    if r.error is not None:
        return [r.name] + ["-"] * (len(ACCURACY_COLUMNS) - 2) + [f"error: {r.error[:200]}"]
    peer = "(peer)" in r.mode
    limit = "-" if r.tolerance is None else f"{r.tolerance:.3g}"
    if r.extra.get("gate") == "peer":  # held to the ir-default peer: |dlogit| and mean KL
        limit += f", KL {r.extra['kl_limit']:.2e} (peer)"
    ppl = "-" if r.ppl != r.ppl else f"{num(r.ppl, '.3f')} ({num(r.ppl_ref, '.3f')})"
    verdict = "reported" if peer else ("pass" if r.passed else "**FAIL**")
    return [
        r.name,
        f"{r.matched}/{r.new_tokens}",
        "-" if r.first_divergence is None else str(r.first_divergence),
        num(r.max_abs_dlogit, ".2e"),
        num(r.mean_kl, ".2e"),
        ppl,
        "-" if r.retrieval_found is None else ("yes" if r.retrieval_found else "no"),
        limit,
        verdict,
    ]


def bench(ctx: DoctorContext) -> list[str]:
    """``npuw-kv bench`` of the three runtimes on one modest prompt, one timed run each."""
    from ..bench import run_bench

    with tempfile.TemporaryDirectory(prefix="npuw-doctor-") as tmp:
        out = Path(tmp) / "bench.json"
        with contextlib.redirect_stdout(io.StringIO()):  # its table: ours goes in the report
            run_bench(bench_args(ctx, out))
        rows = json.loads(out.read_text())
    return bench_lines(ctx, rows)


def bench_args(ctx: DoctorContext, out: Path) -> argparse.Namespace:
    """What ``npuw-kv bench --runtimes ... --repeats 1 --json OUT`` parses: through the
    command's own parser, so every option it has keeps its default."""
    from ...cli.commands import build_parser

    given = ["bench", "-m", str(ctx.model_dir()), "--runtimes", ",".join(BENCH_RUNTIMES)]
    given += ["--prompt-len", str(ctx.prompt_len), "--new-tokens", str(ctx.options.new_tokens)]
    return build_parser().parse_args([*given, "--repeats", "1", "--json", str(out)])


def runtime_meaning(runtime: str, npu: bool) -> str:
    where = "at its defaults" if npu else "NPUW on the CPU stand-in, without the I/O double"
    return {
        "npuw-kv-npu": f"npuw-kv's NPU path ({where})",
        "npuw-llm": "NPUW's own LLM pipeline via openvino-genai (NPUW_DEVICES=CPU, as the bench "
        "runs it)",
        "npuw-kv": "npuw-kv's CPU default (PagedAttention)",
    }.get(runtime, runtime)


def bench_lines(ctx: DoctorContext, rows: list[dict[str, Any]]) -> list[str]:
    """The bench's rows as a table; failed when one of npuw-kv's runtimes failed (a peer that
    cannot run the model is reported: NPUW's own pipeline refuses some IRs).
    """
    header = ("runtime", "what it runs", "TTFT s", "ms/token", "peak RSS MB", "loaded MB", "load s")
    table = []
    for r in rows:
        meaning = runtime_meaning(r["runtime"], ctx.npu)
        if "error" in r:
            table.append((r["runtime"], meaning, f"failed: {r['error']}", "-", "-", "-", "-"))
            continue
        ttft, decode = f"{r['ttft_s']:.3f}", f"{r['ms_per_token']:.1f}"
        rss, loaded, load = mb(r["peak_rss_mb"]), mb(r.get("load_rss_mb")), f"{r['load_s']:.1f}"
        table.append((r["runtime"], meaning, ttft, decode, rss, loaded, load))
    lines = [
        f"One {ctx.prompt_len}-token prompt, {ctx.options.new_tokens} new tokens, one timed run "
        "after a warm-up, each runtime in its own process (the peak RSS is the worker's own).",
        "",
        *md_table(header, table),
        "",
        *ratio_lines(rows),
        *npuw_llm_note(rows),
    ]
    failed = [r["runtime"] for r in rows if "error" in r and r["runtime"].startswith("npuw-kv")]
    if failed:
        raise SectionFailed(f"failed: {', '.join(failed)}", lines)
    return lines


def npuw_llm_note(rows: list[dict[str, Any]]) -> list[str]:
    if not any(r["runtime"] == "npuw-llm" and "error" in r for r in rows):
        return []
    return [
        "",
        "NPUW's own pipeline could not run this model (it cannot compile openvino-genai's GGUF "
        "conversion, for one); an optimum-intel IR (`-m DIR`) gives the side-by-side.",
    ]


def ratio_lines(rows: list[dict[str, Any]]) -> list[str]:
    ran = {r["runtime"]: r for r in rows if "error" not in r}
    ours = ran.get("npuw-kv-npu")
    if ours is None:
        return ["No ratios: the NPU path did not run."]
    lines = []
    for other in ("npuw-llm", "npuw-kv"):
        if other not in ran:
            lines.append(f"- npuw-kv-npu / {other}: - ({other} did not run)")
            continue
        ratios = (
            ours[key] / ran[other][key] if ran[other][key] else float("nan")
            for key in ("ttft_s", "ms_per_token", "peak_rss_mb")
        )
        ttft, decode, rss = (num(x, ".2f") for x in ratios)
        lines.append(f"- npuw-kv-npu / {other}: TTFT x{ttft}, decode x{decode}, peak RSS x{rss}")
    return lines
