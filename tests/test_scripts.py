"""Every script in ``scripts/`` (and the measurements folded into the tools) still runs.

Each runs in a subprocess at the smallest size that still does real work: the scripts are not
imported by anything else, so without this they would break unnoticed.  Asserts exit code 0
and the lines that show the work was done, not the figures themselves.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
# scripts this file runs; a new script must be added here (test_every_script_is_smoked)
SMOKED = {
    "bench_blocks.py",
    "bench_host_tier.py",
    "bench_lora.py",
    "bench_prefix_reuse.py",
    "bench_ray.py",
    "bench_static_beams.py",
    "bench_serve.py",
    "bench_speculative.py",
    "demo_documents.py",
    "demo_serve_chat.py",
    "draw_kv_buffer.py",
    "kv_buffer_scenarios.py",
    "memory_stages.py",
    "module_map.py",  # tests/test_module_map.py
    "model_fixed_cost.py",
    "soak.py",
    "strided_view_cost.py",
}


def run(*args: str, timeout: float = 120) -> str:
    """Run ``python *args`` from the repository root; its stdout, after checking exit code 0."""
    proc = subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, f"exit code {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def script(name: str, *args: str, timeout: float = 120) -> str:
    return run(str(SCRIPTS / name), *args, timeout=timeout)


def test_every_script_is_smoked() -> None:
    assert {p.name for p in SCRIPTS.glob("*.py")} == SMOKED


def test_bench_blocks() -> None:
    out = script("bench_blocks.py", "--quick")
    assert "hit rate" in out


def test_bench_lora() -> None:
    out = script("bench_lora.py", "--new-tokens", "4", "--repeats", "1", "--rank", "2")
    for line in ("base ", "alpha 1 ", "alpha 0 ", "switch "):
        assert line in out, out


def test_bench_speculative() -> None:
    out = script("bench_speculative.py", "--new-tokens", "6", "--runs", "1", "--trees", "2x2x3")
    for line in ("plain ", "chain 4 ", "tree 2x2x3 "):
        assert line in out, out


def test_bench_ray() -> None:
    out = script(
        "bench_ray.py", "--nodes", "1", "--replicas", "1", "--chats", "2", "--turns", "2",
        "--max-tokens", "8", "--think", "0", "--routers", "prefix", "--runs", "1",
        "--new-tokens", "8", timeout=600,
    )  # fmt: skip
    for line in ("npuw-kv serve: TTFT", "--ray, 1 replica: TTFT", "prefix: prefix-cache hits"):
        assert line in out, out


def test_bench_serve() -> None:
    out = script("bench_serve.py", "--quick")
    for line in ("throughput, 2 clients", "time to first token", "RSS growth", "exit code 0"):
        assert line in out, out


def test_demo_serve_chat() -> None:
    out = script("demo_serve_chat.py", "--max-tokens", "8")
    assert out.count("you> ") == 3 and out.count("assistant> ") == 3, out


def test_draw_kv_buffer(tmp_path: Path) -> None:
    for name in ("static", "pyramid", "ring"):
        svg = tmp_path / f"{name}.svg"
        script("draw_kv_buffer.py", "--scenario", name, "--out", str(svg))
        assert "<svg" in svg.read_text()[:500]


def test_kv_buffer_scenarios_follow_the_runtime() -> None:
    """The figures' views are the runtime's: each pyramid chunk on the model ``pick`` chooses,
    each ring write where ``ring_segments`` puts it; and the check refuses a span outside."""
    out = script("kv_buffer_scenarios.py")
    assert re.findall(r"^(\w+): .* checked$", out, re.M) == ["static", "pyramid", "ring"], out
    sys.path.insert(0, str(SCRIPTS))
    import kv_buffer_scenarios as kb

    from npuw_kv.kv.shapes import StaticShapes
    from npuw_kv.kv.slots import ring_segments

    pyramid = kb.pyramid_prefill()
    chunks = [r for r in pyramid.rows if isinstance(r, kb.Row) and r.title.startswith("prefill")]
    pasts = StaticShapes(4, 24, 28, pyramid=True).prefill_pasts
    assert [int(r.note.split()[2].rstrip(":")) for r in chunks] == [
        next(p for p in pasts if p >= 4 * k) for k in range(len(chunks))
    ]
    ring = kb.ring_window()
    writes = [r for r in ring.rows if isinstance(r, kb.Row)]
    assert len(writes) == 6 and ring.slots == 8
    for row in writes:
        start, stop = map(int, re.findall(r"\d+", row.note)[:2])
        (first, last, _), *_ = ring_segments(start, stop, ring.slots)
        assert (min(s.start for s in row.present), max(s.stop for s in row.present)) == (
            first,
            last,
        )
    bad = kb.Scenario("bad", 4, [kb.Span(2, 5, "past")], [], [])
    with pytest.raises(ValueError, match="outside the buffer"):
        kb.check(bad)


def test_memory_stages() -> None:
    out = script(
        "memory_stages.py", "npuw-kv", "genai-cpu", "--prompt-len", "300", "--new-tokens", "4"
    )
    stages = re.findall(r"^  (\w[\w ]*?) +anon +\d+ MB", out, re.MULTILINE)
    ours = ["imports", "load", "first chunk", "prefill", "decode"]
    assert stages == [*ours, "imports", "load", "generate"], out


def test_bench_prefix_reuse() -> None:
    out = script(
        "bench_prefix_reuse.py", "--doc-tokens", "64", "--question-tokens", "16", "--rounds", "1"
    )
    assert "backend paged" in out
    reused = dict(re.findall(r"^(chat turn|A after B): (\d+) tokens reused; TTFT", out, re.M))
    assert set(reused) == {"chat turn", "A after B"}, out
    assert all(int(n) > 0 for n in reused.values()), out  # the paged cache keeps document A


def test_bench_static_beams() -> None:
    out = script(
        "bench_static_beams.py", "--beams", "2", "--new-tokens", "6", "--prompt-len", "40",
        "--rounds", "1", "--exact",
    )  # fmt: skip
    stepped = re.search(r"^steps    round 0: .* s, (\d+) truncates$", out, re.M)
    assert stepped and int(stepped.group(1)) > 0, out  # beams parting in their last token
    assert re.search(r"^prompts  round 0: .* s, 0 truncates$", out, re.M), out
    assert "same answers: True" in out, out  # exact f32: either way, the same beams


def test_bench_host_tier() -> None:
    args = ["--doc-tokens", "64", "--chunk", "32", "--rounds", "1", "--new-tokens", "4"]
    out = script("bench_host_tier.py", *args)
    reused = re.findall(r"^round 1: .* (\d+) of 64 tokens reused, .* identical: True$", out, re.M)
    assert reused and int(reused[0]) == 32, out  # document A's whole blocks, from host memory
    assert re.search(r"ratio \d+\.\d+ .*tokens identical: True", out), out


def test_demo_documents() -> None:
    out = script("demo_documents.py", "--max-new-tokens", "4")
    assert "attention backend: paged" in out
    reused = [int(n) for n in re.findall(r"-> (\d+) of \d+ prompt tokens from the cache", out)]
    assert len(reused) == 5, out
    assert reused[0] == 0 and reused[2] > 0, out  # json again: its document from the cache


def test_soak() -> None:
    # varied mode: a few calls have no goals to miss (the peak-RSS goal starts at call 20),
    # so this checks that the loop and its accounting run
    out = script("soak.py", "--mode", "varied", "--calls", "3", "--every", "1")
    assert len(re.findall(r"^call +\d+ +rss", out, re.MULTILINE)) == 3, out
    assert "summary (varied" in out


def test_bench_snippet_kernels() -> None:
    """What used to be scripts/snippet_kernel_memory.py (docs/measurements.md)."""
    out = run("-m", "npuw_kv.tools.bench", "--snippet-kernels")
    rows = re.findall(r"^ +\d+ +\d+ +[\d.]+ +[\d.]+ +([\d.]+)$", out, re.MULTILINE)
    assert len(rows) == 4 and all(float(mb) > 0 for mb in rows), out


def test_accuracy_default_parts(tmp_path: Path) -> None:
    """What used to be scripts/accuracy_variants.py: one part of the CPU defaults, reported."""
    mode = "u8-kv"
    out = run(
        "-m",
        "npuw_kv.cli.commands",
        "accuracy",
        "--prompt-lens",
        "64",
        "--new-tokens",
        "4",
        "--devices",
        "CPU,NPU",
        "--modes",
        mode,
        "--no-peer",
        "--out",
        str(tmp_path),
    )
    assert re.search(rf"^CPU/{mode}/C256/64 +\d/4 .* report +yes *$", out, re.MULTILINE), out
    assert f"NPU/{mode}/C256/64" in out and "n/a: one part of the CPU's defaults" in out


def test_strided_view_cost_times_both_bindings() -> None:
    out = script(
        "strided_view_cost.py", "--max-prompt-len", "2048", "--calls", "2", "--rounds", "1"
    )
    assert "generate model, past 1151 of a 2175-slot buffer" in out, out
    assert re.search(r"round 1: dense [\d.]+ ms, strided [\d.]+ ms a call", out), out
    # at 1k the smallest prefill rung has no past: nothing strided to time, said so
    args = ("--phase", "prefill", "--max-prompt-len", "1024", "--calls", "2", "--rounds", "1")
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / "strided_view_cost.py"), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1 and "reads no past" in proc.stderr, proc.stderr


def test_model_fixed_cost_measures_both_parts() -> None:
    out = script("model_fixed_cost.py", "cpu", "--layers", "1", "--compiles", "2")
    assert re.search(r"^1 MLP layers, f16 weight inputs [\d.]+ MB", out, re.M), out
    assert len(re.findall(r"^compile \d: \+[\d.]+ MB, first call \+[\d.]+ MB$", out, re.M)) == 2
    out = script("model_fixed_cost.py", "npuw", "--max-prompt-len", "512", "--models", "1")
    rows = re.findall(r"^(prefill|generate) past \d+: compile \+[\d.]+ request", out, re.M)
    assert rows == ["prefill", "generate"], out
