"""``npuw-kv chat``: the interactive session, one turn at a time.

A turn that fails, or that Ctrl-C stops, costs only itself: the session and its history go on
(the terminal handling it shares with ``generate`` is in ``cli_io``).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from . import terminal as cli_io
from .args import sampling_kwargs

COMMANDS = {
    "/help": "this list",
    "/reset": "clear the history (the system prompt stays)",
    "/exit": "quit (also /quit, Ctrl-D)",
}


def chat_session(pipe: Any, args: argparse.Namespace) -> int:
    """Read messages from stdin until /exit or end of input; /reset starts the chat afresh.
    A line starting with ``/`` is a command of the session, never a message (``//`` sends
    a message that starts with ``/``)."""
    pipe.start_chat(args.system or "")
    cli_io.tolerate_stdin_bytes()
    banner = "/help lists the commands, /exit or Ctrl-D quits, Ctrl-C stops an answer"
    print(f"npuw-kv chat — {banner}", file=sys.stderr)
    while True:
        try:
            line = input("> ").strip()
        except EOFError:
            print()
            return 0
        except KeyboardInterrupt:  # Ctrl-C at the prompt quits: end its line, main says why
            print()
            raise
        if line in ("/exit", "/quit"):
            return 0
        if line == "/reset":
            pipe.start_chat(args.system or "")
            print("[history cleared]", file=sys.stderr)
        elif line == "/help":
            for name, what in COMMANDS.items():
                print(f"  {name:<7} {what}", file=sys.stderr)
        elif line.startswith("/") and not line.startswith("//"):
            cli_io.error(f"unknown command {line.split()[0]}: /help lists the commands")
        elif line.strip("\x00"):  # a line of NUL bytes (binary input) is no message
            _chat_turn(pipe, line[1:] if line.startswith("//") else line, args)
        elif line:
            cli_io.error("the line holds only NUL bytes, skipped")


def _chat_turn(pipe: Any, line: str, args: argparse.Namespace) -> None:
    """Answer one message.  A failure, or Ctrl-C, costs only this turn: the session and its
    history go on."""
    bad = cli_io.undecodable(line)
    if bad is not None:  # the tokenizer would refuse it
        cli_io.error(f"the message is not UTF-8 text, skipped: {bad}")
        return
    turn = cli_io.ChatTurn(cli_io.stdout)
    try:
        with turn.sigint_cancels():
            dropped = pipe.fit_chat_history(line)
            if dropped:
                note = f"{dropped} oldest exchange(s) dropped to fit MAX_PROMPT_LEN"
                print(f"[{note}]", file=sys.stderr)
            result = pipe.generate(
                line,
                max_new_tokens=args.max_new_tokens,
                streamer=turn.stream,
                **sampling_kwargs(args),
            )
        cancelled = result.finish_reason == "cancelled"
    except KeyboardInterrupt:
        cancelled = True
    except BrokenPipeError:  # stdout is gone: so is the session
        raise
    except Exception as exc:  # e.g. this message alone is longer than MAX_PROMPT_LEN
        cli_io.stdout.end_line()
        cli_io.error(cli_io.one_line(exc))
        return
    cli_io.stdout.write("\n")
    if not cancelled and result.finish_reason == "length":
        print(f"[answer cut at {len(result.tokens)} tokens: -n raises the limit]", file=sys.stderr)
    if cancelled:
        print("[answer cancelled]", file=sys.stderr)
