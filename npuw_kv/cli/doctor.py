"""``npuw-kv doctor``'s arguments, and the command it runs (:mod:`npuw_kv.tools.doctor`).

Only argparse at import: ``npuw-kv --help`` builds this parser without loading OpenVINO.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import Any

SKIPPABLE = ("accuracy", "bench")  # the long sections (tools/doctor/run.py SECTIONS)
DEFAULT_OUT = "npuw-doctor.md"
DEFAULT_PROMPT_LENS = [1024, 4096]
DEFAULT_NEW_TOKENS = 32

DESCRIPTION = (
    "For an Intel NPU owner: gathers what an NPU issue needs into one Markdown report "
    "(progress on stderr): 1. the system and versions, 2. the NPU driver and compiler, "
    "3. the NPU path compiled (for the NPU alone; without an NPU, on NPUW's CPU stand-in), "
    "4. its accuracy at the device defaults against the exact f32 reference beside the CPU "
    "path, 5. its speed and memory beside NPUW's own pipeline and the CPU default, "
    "6. the bytes copied per step, 7. what to attach. Exit code 0 when every section ran, "
    "1 when one failed (the report says which and why). A few minutes on the default model."
)


def _prompt_lens(text: str) -> list[int]:
    try:
        lens = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        lens = []
    if not lens or min(lens) < 1:
        raise argparse.ArgumentTypeError(f"expected token counts >= 1 such as 1024,4096: {text!r}")
    return lens


def _skip(text: str) -> frozenset[str]:
    names = frozenset(x.strip() for x in text.split(",") if x.strip())
    unknown = sorted(names - set(SKIPPABLE))
    if unknown:
        raise argparse.ArgumentTypeError(
            f"can skip {', '.join(SKIPPABLE)}; got {', '.join(map(repr, unknown))}"
        )
    return names


def _new_tokens(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 2:
        raise argparse.ArgumentTypeError(f"must be at least 2 (a decode rate), got {value}")
    return value


def add_doctor_parser(sub: Any) -> argparse.ArgumentParser:
    """Add ``doctor`` to the ``npuw-kv`` sub-commands; the caller sets its ``func``."""
    doc: argparse.ArgumentParser = sub.add_parser(
        "doctor", help="a report for an Intel NPU issue", description=DESCRIPTION
    )
    doc.add_argument(
        "--model", "-m", default=None, help="IR dir, .gguf, 'smollm2' (the default) or 'gemma3'"
    )
    doc.add_argument("--out", default=DEFAULT_OUT, help=f"the report (default {DEFAULT_OUT})")
    doc.add_argument(
        "--prompt-lens",
        type=_prompt_lens,
        default=DEFAULT_PROMPT_LENS,
        help="accuracy prompt lengths (default 1024,4096); the bench and the copies take the "
        "shortest, at most 1000",
    )
    doc.add_argument(
        "--new-tokens",
        type=_new_tokens,
        default=DEFAULT_NEW_TOKENS,
        help=f"tokens generated per check (default {DEFAULT_NEW_TOKENS})",
    )
    doc.add_argument(
        "--skip",
        type=_skip,
        default=frozenset(),
        metavar="SECTION[,SECTION]",
        help=f"leave sections out: {', '.join(SKIPPABLE)} (each is marked skipped)",
    )
    return doc


def command_line(args: argparse.Namespace) -> str:
    """The command as typed when this process is ``npuw-kv doctor ...``; else (called from
    Python) the equivalent command with every option spelled out."""
    if sys.argv[1:2] == ["doctor"]:
        return shlex.join(["npuw-kv", *sys.argv[1:]])
    parts = ["npuw-kv", "doctor", "--model", args.model or "smollm2", "--out", str(args.out)]
    parts += ["--prompt-lens", ",".join(map(str, args.prompt_lens))]
    parts += ["--new-tokens", str(args.new_tokens)]
    if args.skip:
        parts += ["--skip", ",".join(sorted(args.skip))]
    return shlex.join(parts)


def run(args: argparse.Namespace) -> int:
    """``npuw-kv doctor``: run the sections, write the report, 0 or 1."""
    from ..tools.doctor.context import Options
    from ..tools.doctor.run import run_doctor

    options = Options(
        model=args.model,
        out=Path(args.out),
        prompt_lens=list(args.prompt_lens),
        new_tokens=args.new_tokens,
        skip=frozenset(args.skip),
        command=command_line(args),
    )
    return run_doctor(options)
