"""Running the doctor's sections one after another and writing them as one Markdown report.

A section that raises is written as failed with its error's last line and the next one still
runs: a report with one broken section is worth more to an issue than a traceback.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .context import DoctorContext, SectionFailed, error_text, md_table

SectionFn = Callable[[DoctorContext], list[str]]
DONE, FAILED, SKIPPED = "done", "failed", "skipped (--skip)"


@dataclass
class Section:
    title: str
    status: str = DONE
    seconds: float = 0.0
    body: list[str] = field(default_factory=list)
    error: str | None = None


def progress(message: str) -> None:
    print(f"npuw-kv doctor: {message}", file=sys.stderr, flush=True)


def run_section(
    ctx: DoctorContext, number: int, total: int, title: str, fn: SectionFn, skip: bool
) -> Section:
    """Run ``fn`` (or mark it skipped), timing it; any error becomes the section's status."""
    section = Section(title)
    if skip:
        section.status = SKIPPED
        section.body = [f"Skipped (--skip): `{ctx.options.command}` left this section out."]
        progress(f"[{number}/{total}] {title}: {SKIPPED}")
        return section
    progress(f"[{number}/{total}] {title} ...")
    start = time.perf_counter()
    try:
        section.body = fn(ctx)
    except SectionFailed as exc:
        section.status, section.error, section.body = FAILED, str(exc), exc.lines
    except Exception as exc:  # written into the report; the doctor goes on
        section.status, section.error = FAILED, error_text(exc)
    section.seconds = time.perf_counter() - start
    shown = section.status if section.error is None else f"{FAILED}: {section.error}"
    progress(f"[{number}/{total}] {title}: {shown} ({section.seconds:.1f} s)")
    return section


def heading(number: int, section: Section) -> str:
    status = section.status.upper() if section.status == FAILED else section.status
    timing = "" if section.status == SKIPPED else f" ({section.seconds:.1f} s)"
    return f"## {number}. {section.title}: {status}{timing}"


def render(ctx: DoctorContext, sections: list[Section], closing: list[str]) -> str:
    """The whole report: a head with the summary, each section, the closing section."""
    failed = [s.title for s in sections if s.status == FAILED]
    lines = [
        "# npuw-kv doctor report",
        "",
        f"Command: `{ctx.options.command}`",
        "",
        *ctx.notes,
        "",
        *md_table(
            ("section", "status", "seconds"),
            ((s.title, s.status, f"{s.seconds:.1f}") for s in sections),
        ),
        "",
        f"Failed sections: {', '.join(failed)}." if failed else "Every section ran.",
    ]
    for number, section in enumerate(sections, 1):
        lines += ["", heading(number, section), ""]
        if section.error is not None:
            lines += [f"**Failed**: `{section.error}`", ""]
        lines += section.body
    lines += ["", f"## {len(sections) + 1}. What to attach", "", *closing]
    return "\n".join(lines).rstrip() + "\n"
