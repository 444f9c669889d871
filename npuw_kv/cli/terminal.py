"""The terminal's edges for ``npuw-kv``: Ctrl-C, a reader that stops reading, bytes that are
not text.  A command line tool ends these in one line (or silently), never in a traceback."""

from __future__ import annotations

import io
import os
import re
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

# what a shell reports for a job that a signal ended: Ctrl-C, and a write to a closed pipe
# (`seq 1e9 | head` leaves seq with 141 too, so `set -o pipefail` scripts treat us alike)
EXIT_INTERRUPTED = 128 + signal.SIGINT
EXIT_BROKEN_PIPE = 128 + signal.SIGPIPE

# bytes that did not decode arrive as lone surrogates (Python reads argv, and our stdin, with
# errors="surrogateescape"); the tokenizer refuses them with a RuntimeError
_SURROGATE = re.compile("[\ud800-\udfff]")


def error(message: str) -> None:
    print(f"npuw-kv: error: {message}", file=sys.stderr)


def one_line(exc: BaseException) -> str:
    """``exc``'s message on one line, without OpenVINO's first line naming its C++ source
    (``Exception from src/...cpp:97:``), which says nothing to the user."""
    lines = (line.strip() for line in str(exc).splitlines())
    kept = [line for line in lines if line and not line.startswith("Exception from ")]
    return " ".join(kept) or type(exc).__name__


def undecodable(text: str) -> str | None:
    """``text``'s bytes, shown, if some of them did not decode; else None."""
    if not _SURROGATE.search(text):
        return None
    try:
        return repr(text.encode("utf-8", "surrogateescape"))
    except UnicodeEncodeError:  # a surrogate that stands for no byte
        return ascii(text)


def tolerate_stdin_bytes() -> None:
    """Read stdin with ``surrogateescape``: a line that does not decode then reaches the chat
    loop, which skips it, rather than raising a UnicodeDecodeError that would end the session
    (the default in a UTF-8 locale)."""
    if isinstance(sys.stdin, io.TextIOWrapper):
        sys.stdin.reconfigure(errors="surrogateescape")


class Output:
    """Streamed text on stdout, remembering whether its last line is unfinished, so that what
    follows an interrupted answer starts on a line of its own."""

    def __init__(self) -> None:
        self.mid_line = False

    def write(self, text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()  # shown as it is generated
        if text:
            self.mid_line = not text.endswith("\n")

    def end_line(self) -> None:
        if self.mid_line:
            self.write("\n")


stdout = Output()


class ChatTurn:
    """One chat answer that Ctrl-C cancels, leaving the session running.

    Once the answer streams, Ctrl-C makes the streamer return ``CANCEL``: the pipeline ends the
    run at the next token and leaves the turn out of the history.  While the prompt is still
    being read there is no streamer call to wait for, and a second Ctrl-C means "now": both
    raise KeyboardInterrupt, after which the pipeline's cache stays consistent and the turn is
    left out of the history just the same.
    """

    def __init__(self, out: Output) -> None:
        import openvino_genai

        self._out = out
        self._cancel = openvino_genai.StreamingStatus.CANCEL
        self._streaming = False
        self.cancelled = False

    def stream(self, text: str) -> Any:
        if self.cancelled:
            return self._cancel
        self._streaming = True
        self._out.write(text)
        return None

    def _on_sigint(self, signum: int, frame: FrameType | None) -> None:
        first = not self.cancelled
        self.cancelled = True
        if not (first and self._streaming):
            raise KeyboardInterrupt

    @contextmanager
    def sigint_cancels(self) -> Iterator[None]:
        """Ctrl-C cancels this turn; not where SIGINT is ignored, nor where no handler can be
        set (off the main thread) or put back (one set outside Python)."""
        previous = signal.getsignal(signal.SIGINT)
        main_thread = threading.current_thread() is threading.main_thread()
        if previous in (signal.SIG_IGN, None) or not main_thread:
            yield
            return
        signal.signal(signal.SIGINT, self._on_sigint)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous)


def _flush_or_silence(stream: Any) -> None:
    """Flush ``stream``; if its reader is gone, point it at /dev/null, so that the flush at
    interpreter exit does not print "Exception ignored ... BrokenPipeError"."""
    try:
        stream.flush()
    except OSError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())
        os.close(devnull)


def run(command: Callable[[], int]) -> int:
    """``command()``'s exit code; Ctrl-C and a closed stdout end it as a shell expects (a
    stdout closed before the start, ``>&-``, is the reader gone before the first write)."""
    if sys.stdout is None:
        return EXIT_BROKEN_PIPE
    try:
        code = command()
        sys.stdout.flush()  # a reader gone before the last write shows here, not at exit
        return code
    except KeyboardInterrupt:
        try:
            stdout.end_line()
            print("npuw-kv: interrupted", file=sys.stderr)
        except OSError:
            _flush_or_silence(sys.stdout)
            _flush_or_silence(sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # the reader stopped reading (`| head`): nothing to say
        _flush_or_silence(sys.stdout)
        _flush_or_silence(sys.stderr)
        return EXIT_BROKEN_PIPE
