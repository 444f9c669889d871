"""``npuw-kv`` at the terminal's edges: Ctrl-C, a reader that stops reading, bytes that are not
text.  Each ends in one line or silently (never a traceback), and a chat session survives a bad
turn.  The real cases run the CLI in a subprocess on the default model (a few seconds each)."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

import npuw_kv.cli.commands as cli
from npuw_kv.cli.commands import main

CLI = [sys.executable, "-m", "npuw_kv.cli"]
COUNTING = "Count from 1 to 300, separated by commas."  # a long answer, to interrupt
RECALL = "What did I just ask you?"  # answered differently when the history holds a turn


@pytest.fixture(autouse=True)
def _children_get_sigint() -> Iterator[None]:
    """A child inherits an ignored SIGINT (a background job of a shell script) and keeps
    ignoring it; a handled one reaches the child as the default, which Python turns into
    KeyboardInterrupt."""
    previous = signal.getsignal(signal.SIGINT)
    if previous == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@contextmanager
def _cli(*args: str | bytes, **popen: Any) -> Iterator[subprocess.Popen[bytes]]:
    """``npuw-kv ARGS`` with piped stdout/stderr, killed if a test waits on it too long."""
    popen = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, **popen}
    proc = subprocess.Popen([*CLI, *args], **popen)
    watchdog = threading.Timer(240, proc.kill)
    watchdog.start()
    try:
        yield proc
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def _c_locale() -> dict[str, str]:
    """The environment with LANG=C and nothing that overrides it."""
    overrides = ("LC_ALL", "LC_CTYPE", "PYTHONIOENCODING", "PYTHONUTF8")
    env = {key: value for key, value in os.environ.items() if key not in overrides}
    return {**env, "LANG": "C"}


def _answers(stdout: bytes) -> list[str]:
    """The chat answers, in order (each follows a ``> `` prompt)."""
    return [a.strip() for a in stdout.decode().split("> ")[1:] if a.strip()]


def _chat(*lines: str, n: int = 200) -> list[str]:
    proc = subprocess.run(
        [*CLI, "chat", "-n", str(n)],
        input="".join(f"{line}\n" for line in lines).encode(),
        capture_output=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr
    return _answers(proc.stdout)


def test_ctrl_c_in_generate_exits_130_in_one_line():
    with _cli("generate", "-n", "400", "--no-chat-template", "1, 2, 3, 4, 5,") as proc:
        assert proc.stdout is not None and proc.stdout.read(1)  # it streams
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130
    assert err.decode() == "npuw-kv: interrupted\n"


def test_ctrl_c_in_chat_cancels_the_answer_and_drops_the_turn():
    """The interrupted turn leaves no trace: the next answer is a fresh session's."""
    with _cli("chat", "-n", "200", stdin=subprocess.PIPE) as proc:
        assert proc.stdin is not None and proc.stdout is not None
        assert proc.stdout.read(2) == b"> "
        proc.stdin.write(f"{COUNTING}\n".encode())
        proc.stdin.flush()
        started = proc.stdout.read(3)  # the answer streams
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(f"{RECALL}\n/exit\n".encode(), timeout=180)
    assert proc.returncode == 0, err
    assert b"Traceback" not in err and b"[answer cancelled]" in err
    cancelled, recalled = _answers(b"> " + started + out)
    assert len(cancelled) < 100  # 200 tokens of counting would be far longer
    assert recalled == _chat(RECALL)[0]
    assert not recalled.startswith(_chat(COUNTING, RECALL, n=20)[1])  # it tells a kept turn


def test_ctrl_c_at_the_chat_prompt_quits_130():
    with _cli("chat", stdin=subprocess.PIPE) as proc:
        assert proc.stdout is not None and proc.stdout.read(2) == b"> "
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert err.decode().splitlines()[-1] == "npuw-kv: interrupted" and b"Traceback" not in err


def test_a_reader_that_stops_reading_ends_generate_quietly():
    """``npuw-kv generate ... | head -c 5``: exit 141, as for any program ``head`` cut off, and
    nothing on stderr (not even Python's "Exception ignored" at exit)."""
    with _cli("generate", "-n", "400", "--no-chat-template", "1, 2, 3, 4, 5,") as proc:
        assert proc.stdout is not None and len(proc.stdout.read(5)) == 5
        proc.stdout.close()
        assert proc.stderr is not None
        err = proc.stderr.read()
        proc.wait(timeout=60)
    assert proc.returncode == 141
    assert err == b""


def test_a_reader_gone_before_the_output_is_flushed_is_quiet_too():
    """``inspect``'s few lines are written at exit, when the reader has long gone."""
    with _cli("inspect") as proc:
        assert proc.stdout is not None and proc.stderr is not None
        proc.stdout.close()
        err = proc.stderr.read()
        proc.wait(timeout=60)
    assert proc.returncode == 141
    assert err == b""


def test_a_stdout_closed_from_the_start_is_quiet_too():
    """``npuw-kv generate ... >&-``: no stdout at all is a reader gone before the first write:
    exit 141, nothing on stderr, no work done."""
    proc = subprocess.run(
        ["sh", "-c", 'exec "$0" "$@" >&-', *CLI, "generate", "-n", "2", "hi"],
        stderr=subprocess.PIPE,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 141 and proc.stderr == b""


@pytest.mark.parametrize("lang", ["C", "C.UTF-8"])  # stdin: surrogateescape / strict by default
def test_chat_skips_a_line_that_is_not_utf8(lang):
    proc = subprocess.run(
        [*CLI, "chat", "-n", "8"],
        input=b"caf\xe9\nSay hi.\n/exit\n",
        capture_output=True,
        env={**_c_locale(), "LANG": lang},
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr
    errors = [line for line in proc.stderr.decode().splitlines() if "error" in line]
    assert errors == ["npuw-kv: error: the message is not UTF-8 text, skipped: b'caf\\xe9'"]
    assert len(_answers(proc.stdout)) == 1  # "Say hi." was answered


def test_an_argument_that_is_not_utf8_is_a_usage_error():
    proc = subprocess.run(
        [*CLI, "generate", b"caf\xe9"], capture_output=True, env=_c_locale(), timeout=120
    )
    assert proc.returncode == 2
    assert proc.stderr.decode() == "npuw-kv: error: argument b'caf\\xe9' is not UTF-8 text\n"
    assert proc.stdout == b""


class _FlakyPipe:
    """A chat pipeline whose tokenizer fails on some messages, as openvino-genai's does."""

    def __init__(self, failures: dict[str, BaseException]) -> None:
        self.failures = failures
        self.history: list[str] = []

    def start_chat(self, system: str = "") -> None:
        self.history = []

    def fit_chat_history(self, prompt: str) -> int:
        if prompt == "fit":
            raise self.failures[prompt]
        return 0

    def generate(self, prompt: str, streamer: Any, **kwargs: Any) -> Any:
        if prompt in self.failures:
            raise self.failures[prompt]
        streamer(f"re: {prompt}")
        self.history.append(prompt)
        return type("Result", (), {"finish_reason": "stop"})()


def test_a_failed_chat_turn_is_one_line_and_the_session_goes_on(capsys, monkeypatch):
    failures = {
        "json": RuntimeError(
            "Exception from src/cpp/src/json_container.cpp:97:\nFailed to construct JsonContainer"
        ),
        "type": TypeError("incompatible function arguments"),
        "fit": ValueError("the message is too long"),
    }
    pipe = _FlakyPipe(failures)
    monkeypatch.setattr(cli, "_load", lambda args: pipe)
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\njson\ntype\nfit\nagain\n/exit\n"))
    assert main(["chat"]) == 0
    captured = capsys.readouterr()
    assert captured.err.splitlines()[1:] == [
        "npuw-kv: error: Failed to construct JsonContainer",
        "npuw-kv: error: incompatible function arguments",
        "npuw-kv: error: the message is too long",
    ]
    assert pipe.history == ["hello", "again"]
    assert "re: again" in captured.out


@pytest.mark.parametrize("command", ["inspect", "bench"])
def test_ctrl_c_and_a_closed_stdout_elsewhere(capsys, monkeypatch, command):
    """Any command: Ctrl-C is exit 130 in one line, a closed stdout 141 in silence."""
    import npuw_kv.cli.describe
    import npuw_kv.tools.bench

    cases = ((KeyboardInterrupt, 130, "npuw-kv: interrupted\n"), (BrokenPipeError, 141, ""))
    for exc, code, err in cases:

        def fail(*args: Any, exc: type[BaseException] = exc, **kwargs: Any) -> None:
            raise exc

        monkeypatch.setattr(npuw_kv.cli.describe, "describe", fail)
        monkeypatch.setattr(npuw_kv.tools.bench, "run_bench", fail)
        assert main([command]) == code
        assert capsys.readouterr().err == err
