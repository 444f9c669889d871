"""``npuw-kv doctor`` on a tiny random Llama: every section filled or marked, the missing NPU
and its missing compiler named, a failed section marked while the others still run."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import make_tiny_gguf

from npuw_kv.cli.commands import main
from npuw_kv.model.source import resolve_model
from npuw_kv.tools.doctor.compare import bench_lines
from npuw_kv.tools.doctor.context import DoctorContext, Options, SectionFailed
from npuw_kv.tools.doctor.npu_path import copy_rows, device_lines, npu_settings

HEADINGS = (
    "## 1. System",
    "## 2. NPU driver and compiler",
    "## 3. Compile",
    "## 4. Accuracy",
    "## 5. Speed and memory",
    "## 6. Copies per step",
    "## 7. What to attach",
)


@pytest.fixture(scope="module")
def tiny_ir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The cheapest model the NPU path builds: a 2-layer GGUF Llama, converted once."""
    root = tmp_path_factory.mktemp("doctor")
    gguf = make_tiny_gguf(root / "tiny.gguf", std=0.2, seed=3, dtype="Q8_0")
    return resolve_model(gguf, cache_dir=root / "cache", log=lambda *a, **k: None)


def doctor(tiny_ir: Path, out: Path, *extra: str) -> int:
    argv = ["doctor", "-m", str(tiny_ir), "--out", str(out), "--prompt-lens", "64"]
    return main([*argv, "--new-tokens", "4", *extra])


def section(report: str, number: int) -> str:
    """The text of section ``number``, its heading included."""
    start = report.index(f"\n## {number}. ")
    end = report.find(f"\n## {number + 1}. ", start)
    return report[start : end if end >= 0 else None]


def test_the_report_fills_every_section_and_names_what_is_missing(tiny_ir, tmp_path, capsys):
    out = tmp_path / "report.md"
    assert doctor(tiny_ir, out, "--skip", "bench") == 0
    report = out.read_text()
    for heading in HEADINGS:
        assert heading in report, heading
    assert "Every section ran." in report
    # no NPU here: said at the top, in the driver section and in the compile section
    assert "**No NPU here**" in report
    npu = section(report, 2)
    assert "**no NPU here**" in npu
    assert "libopenvino_intel_npu_compiler_loader.so` (the compiler loader) | **no** |" in npu
    assert "**The compiler loader is missing**" in npu
    assert "Intel's NPU driver" in npu and "the PyPI `openvino` wheel does not" in npu
    assert "NPU_DRIVER_VERSION | error: No available backend" in npu
    compiled = section(report, 3)
    assert re.search(r"## 3\. Compile: done \(\d+\.\d s\)", compiled)
    assert "ran NPUW on the CPU stand-in instead" in compiled and "npu_io_double=True" in compiled
    assert re.search(r"Compiled in \d+\.\d s\.", compiled)
    assert "| `kv_binding` |" in compiled
    # the accuracy numbers of both paths at the prompt length asked for, and their verdicts
    acc = section(report, 4)
    for path in ("NPU", "CPU"):
        row = next(
            line for line in acc.splitlines() if f"| {path}/device-default/C256/64 |" in line
        )
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert re.fullmatch(r"\d+/4", cells[1]), row
        assert float(cells[3]) > 0 and float(cells[4]) >= 0, row  # max |dlogit|, mean KL
        assert cells[-2].endswith("(peer)") and cells[-1] == "pass", row
    assert "ir-default (peer)" in acc
    assert "## 5. Speed and memory: skipped (--skip)" in report
    copies = section(report, 6)
    assert "`host_bytes_copied` (npuw-kv's own copies), this request" in copies
    assert "per generated token (4)" in copies
    assert "The doctor took" in report
    command = f"npuw-kv doctor --model {tiny_ir} --out {out} --prompt-lens 64 --new-tokens 4"
    assert f"This report was produced by: `{command} --skip bench`" in report
    err = capsys.readouterr().err
    assert re.search(r"\[3/6\] Compile: done \(\d+\.\d s\)", err), err
    assert "[5/6] Speed and memory: skipped (--skip)" in err
    assert f"wrote {out}" in err


def test_a_failing_section_is_marked_and_the_others_still_run(
    tiny_ir, tmp_path, capsys, monkeypatch
):
    import npuw_kv.tools.accuracy.run as accuracy_run

    def broken(*args, **kwargs):
        raise RuntimeError("a C++ stack here\nthe accuracy matrix broke")

    monkeypatch.setattr(accuracy_run, "run_matrix", broken)
    out = tmp_path / "report.md"
    assert doctor(tiny_ir, out, "--skip", "bench") == 1
    report = out.read_text()
    assert "## 4. Accuracy: FAILED" in report
    assert "**Failed**: `RuntimeError: the accuracy matrix broke`" in report
    assert "a C++ stack here" not in report  # the last line only
    assert "Failed sections: Accuracy." in report
    assert re.search(r"## 6\. Copies per step: done", report)
    assert "`host_bytes_copied`" in section(report, 6)
    assert "## 7. What to attach" in report
    assert "[4/6] Accuracy: failed: RuntimeError: the accuracy matrix broke" in (
        capsys.readouterr().err
    )


def test_the_bench_section_runs_beside_npuws_pipeline_and_the_cpu_default(tiny_ir, tmp_path):
    """Three worker processes on the tiny model take seconds: the real bench, not a fake.
    NPUW's own pipeline cannot compile a GGUF conversion: its row says so, and the section
    (which gates only npuw-kv's runtimes) still passes."""
    out = tmp_path / "report.md"
    assert doctor(tiny_ir, out, "--skip", "accuracy") == 0
    bench = section(out.read_text(), 5)
    assert "One 64-token prompt, 4 new tokens" in bench
    for runtime in ("npuw-kv-npu", "npuw-kv"):
        row = next(line for line in bench.splitlines() if line.startswith(f"| {runtime} |"))
        ttft, decode, rss = row.strip("|").split("|")[2:5]
        assert float(ttft) > 0 and float(decode) > 0, row
        assert re.fullmatch(r" \d+ ", rss)  # the worker's own peak (test below)
    assert re.search(r"\| npuw-llm \| .* \| failed: .*Broadcast", bench)
    assert "an optimum-intel IR (`-m DIR`) gives the side-by-side" in bench
    assert re.search(r"npuw-kv-npu / npuw-kv: TTFT x\d+\.\d\d, decode x\d+\.\d\d", bench)
    assert "## 4. Accuracy: skipped (--skip)" in out.read_text()


def _context(npu: bool = False) -> DoctorContext:
    ctx = DoctorContext(Options(model=None, out=Path("r.md"), prompt_lens=[64], new_tokens=4))
    ctx.npu = npu  # a cached property: set, OpenVINO is not asked
    return ctx


@pytest.mark.unit
def test_the_bench_section_fails_when_the_npu_path_failed_fake_worker_rows():
    """Fake bench-worker rows: npuw-kv's NPU path failing fails the section, with the table."""
    rows = [
        {"runtime": "npuw-kv-npu", "error": "CompileError: no compiler"},
        {"runtime": "npuw-llm", "ttft_s": 0.5, "ms_per_token": 10.0, "peak_rss_mb": 400.0},
        {"runtime": "npuw-kv", "ttft_s": 0.25, "ms_per_token": 5.0, "peak_rss_mb": 200.0},
    ]
    for row in rows[1:]:
        row.update(load_s=1.0, load_rss_mb=300.0)
    with pytest.raises(SectionFailed, match="failed: npuw-kv-npu") as failed:
        bench_lines(_context(), rows)
    text = "\n".join(failed.value.lines)
    assert "| npuw-kv-npu | npuw-kv's NPU path" in text and "failed: CompileError" in text
    assert "| npuw-kv's CPU default (PagedAttention) | 0.250 | 5.0 | 200 | 300 | 1.0 |" in text
    assert "| 0.500 | 10.0 | 400 | 300 | 1.0 |" in text
    assert "optimum-intel IR" not in text  # npuw-llm ran
    assert "No ratios: the NPU path did not run." in text


@pytest.mark.unit
def test_a_real_npu_compiles_for_the_npu_alone_and_missing_keys_are_named():
    settings, how = npu_settings(_context(npu=True))
    assert settings["npuw_devices"] == "NPU" and "npu_io_double" not in settings
    assert "for the NPU alone" in how
    settings, how = npu_settings(_context(npu=False))
    assert settings["npu_io_double"] is True and "no NPU here" in how
    assert "has no `submodel_devices`" in device_lines({})[0]
    devices = device_lines({"submodel_devices": {"prefill": "NPU", "lm_head": "CPU"}})
    assert "| `lm_head` | `CPU` |" in devices
    stats = {"host_bytes_copied": 300, "prefill_host_bytes_copied": 100, "kv_binding": "roi"}
    rows = dict(copy_rows(stats, 4))
    assert rows["of which while generating"] == "200"
    assert rows["while generating, per generated token (4)"] == "50"
    assert rows["`npu_copied_bytes_estimate`"] == "not reported by this npuw-kv"


@pytest.mark.unit
def test_bad_options_are_usage_errors_before_any_work(tmp_path, capsys):
    for argv, message in (
        (["--skip", "compile"], "can skip accuracy, bench; got 'compile'"),
        (["--prompt-lens", "0"], "expected token counts >= 1"),
        (["--new-tokens", "1"], "must be at least 2"),
    ):
        with pytest.raises(SystemExit) as exc:
            main(["doctor", *argv])
        assert exc.value.code == 2
        assert message in capsys.readouterr().err
    assert main(["doctor", "--out", str(tmp_path / "no" / "such" / "r.md")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_a_bench_workers_peak_rss_is_its_own_not_its_parents():
    """Linux carries ru_maxrss over from the process that starts a worker; the bench reads the
    worker's own high-water mark (VmHWM) instead."""
    import subprocess
    import sys

    import numpy as np

    big = np.ones(400 * 2**20 // 8)  # this process: a peak of 400 MB more
    code = "from npuw_kv.tools.bench_worker import _peak_rss_mb; print(_peak_rss_mb())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert float(out.stdout) < 300 < big.nbytes / 2**20
