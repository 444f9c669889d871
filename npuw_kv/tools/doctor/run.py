"""The doctor's sections in order, the report's head and closing, and the exit code: 0 when
every section ran (or was skipped), 1 when one failed."""

from __future__ import annotations

import time
from datetime import datetime, timezone

from .compare import accuracy, bench
from .context import DoctorContext, Options, error_text
from .npu_path import compile_npu_path, copies
from .report import FAILED, Section, SectionFn, progress, render, run_section
from .system import npu_driver, system

# (title, function, the --skip name that leaves it out)
SECTIONS: tuple[tuple[str, SectionFn, str | None], ...] = (
    ("System", system, None),
    ("NPU driver and compiler", npu_driver, None),
    ("Compile", compile_npu_path, None),
    ("Accuracy", accuracy, "accuracy"),
    ("Speed and memory", bench, "bench"),
    ("Copies per step", copies, None),
)


def run_doctor(options: Options) -> int:
    """Run every section, write the report to ``options.out``; the exit code."""
    if not options.out.parent.is_dir():  # before minutes of work, not after
        raise ValueError(f"--out {options.out}: the folder {options.out.parent} does not exist")
    start = time.perf_counter()
    ctx = DoctorContext(options)
    ctx.notes = head_notes(ctx)
    sections: list[Section] = []
    for index, (title, fn, skip) in enumerate(SECTIONS):
        skipped = skip is not None and skip in options.skip
        sections.append(run_section(ctx, index + 1, len(SECTIONS), title, fn, skipped))
    seconds = time.perf_counter() - start
    ctx.notes.append(f"The doctor took {seconds:.0f} s.")
    options.out.write_text(render(ctx, sections, closing(options)))
    failed = [s.title for s in sections if s.status == FAILED]
    outcome = f"failed: {', '.join(failed)}" if failed else "every section ran"
    progress(f"wrote {options.out} ({seconds:.0f} s; {outcome})")
    return 1 if failed else 0


def head_notes(ctx: DoctorContext) -> list[str]:
    """When, and the one fact that colours every figure below: is there an NPU?"""
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    try:
        found = ctx.npu
    except Exception as exc:  # OpenVINO itself would not start: every section will say so
        return [f"Written {when}. OpenVINO could not list its devices: {error_text(exc)}"]
    if found:
        return [f"Written {when}. **An NPU is here**: the NPU path ran on it."]
    return [
        f"Written {when}. **No NPU here**: OpenVINO lists no NPU, so the NPU path ran as NPUW "
        "with its sub-models on the CPU stand-in instead; its figures show npuw-kv's NPU path, "
        "not an NPU's speed."
    ]


def closing(options: Options) -> list[str]:
    return [
        f"Attach `{options.out}` to the issue as it is. It holds package versions, the CPU "
        "model, the OS, the model's path and figures measured on Python's own docstrings: "
        "no text of yours.",
        "",
        "If section 2 shows errors, the NPU plugin's own log says why its driver or compiler "
        "did not load: also attach the output of "
        "`OV_NPU_LOG_LEVEL=LOG_INFO npuw-kv doctor --skip accuracy,bench --out npu-log.md "
        "2> npu-log.txt` (the log is npu-log.txt).",
        "",
        f"This report was produced by: `{options.command}`",
    ]
