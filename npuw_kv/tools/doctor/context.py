"""What the doctor's sections share: the options, the model (resolved once), whether an NPU is
here, and the NPU-path pipeline the compile section built for the copies section to reuse."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...errors import last_line

if TYPE_CHECKING:
    from ...pipeline import LLMPipeline

MODEST_PROMPT = 1000  # the bench's and the copies section's prompt, at most (tokens)
ERROR_CHARS = 500  # an error's last line is cut here: some carry whole library paths twice


@dataclass
class Options:
    """The command line's choices (``npuw-kv doctor --help``)."""

    model: str | None
    out: Path
    prompt_lens: list[int]
    new_tokens: int
    skip: frozenset[str] = frozenset()
    command: str = "npuw-kv doctor"


@dataclass
class DoctorContext:
    """State passed from section to section; a section that needs what an earlier one failed
    to make raises, and is marked failed with that reason."""

    options: Options
    pipe: LLMPipeline | None = None
    pipe_error: str | None = None  # why the compile section left no pipeline
    notes: list[str] = field(default_factory=list)  # lines for the report's head
    _model_dir: Path | None = None

    @cached_property
    def npu(self) -> bool:
        """Whether OpenVINO lists a real NPU (else NPUW runs on the CPU stand-in)."""
        from ...runtime.device import npu_present

        return npu_present()

    @property
    def prompt_len(self) -> int:
        """One modest prompt for the bench and the copies: short enough that the whole doctor
        stays within minutes, never longer than the shortest accuracy prompt."""
        return min(MODEST_PROMPT, min(self.options.prompt_lens))

    def model_dir(self) -> Path:
        """The model's IR directory (a GGUF is converted once, into the cache)."""
        if self._model_dir is None:
            from ...model.source import resolve_model

            self._model_dir = resolve_model(self.options.model)
        return self._model_dir

    def built_pipe(self) -> LLMPipeline:
        """The NPU-path pipeline of the compile section, or why there is none."""
        if self.pipe is None:
            raise SectionFailed(f"no NPU-path pipeline: {self.pipe_error or 'not compiled'}")
        return self.pipe


class SectionFailed(Exception):
    """A section that ran far enough to report something, then failed: ``lines`` are written
    above the failure, so what it found is kept."""

    def __init__(self, reason: str, lines: Sequence[str] = ()) -> None:
        super().__init__(reason)
        self.lines = list(lines)


def error_text(exc: BaseException) -> str:
    """``Type: last line`` of an error (OpenVINO's carry their C++ stack before it), cut."""
    text = f"{type(exc).__name__}: {last_line(exc)}"
    return text if len(text) <= ERROR_CHARS else text[: ERROR_CHARS - 3] + "..."


def md_table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> list[str]:
    """A Markdown table, ``|`` in cells escaped."""

    def line(cells: Sequence[Any]) -> str:
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"

    return [line(header), "|" + "---|" * len(header), *(line(r) for r in rows)]


def mb(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def num(value: float | None, fmt: str) -> str:
    """``value`` formatted, or ``-`` for none / NaN."""
    if value is None or value != value:
        return "-"
    return format(value, fmt)
