"""Where generated tokens go: stop strings, and the streamer held back behind them.

:class:`StopStrings` says when a stop string completes and where the text ends;
:class:`TokenOutput` feeds the streamer (text or token level) and remembers whether the
streamer itself stopped or cancelled the run.

A stop string of ``b`` UTF-8 bytes overlaps at most ``b`` tokens (each token overlapping it
contributes at least one of its bytes).  So decoding the newest ``b + 2`` tokens after each
step sees it complete (one extra token for a decoder that drops a leading space), and holding
the newest ``b`` tokens back from the streamer keeps it out of the streamed text, as
openvino-genai does by default (``include_stop_str_in_output`` off; on, the text ends with the
stop string's last token, as genai's).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import openvino_genai

from ..errors import UsageError


class StopStrings:
    def __init__(self, tokenizer: Any, stops: Iterable[str], include: bool = False) -> None:
        self.tokenizer = tokenizer
        self.stops = tuple(stops)
        self.include = include  # the output keeps the stop string (and its last token)
        # tokens the streamer lags behind generation (0 without stop strings)
        self.hold = max((len(stop.encode("utf-8")) for stop in self.stops), default=0)

    def hit(self, tokens: list[int]) -> bool:
        """True when the newest token completes a stop string."""
        if not self.stops:
            return False
        tail = self.tokenizer.decode(tokens[-(self.hold + 2) :])
        return any(stop in tail for stop in self.stops)

    def cut(self, tokens: list[int]) -> tuple[str, int]:
        """The text before the first stop string, and how many tokens lie wholly before it;
        with ``include``, the text of the tokens up to the one completing the stop string."""
        text = self.tokenizer.decode(tokens) if tokens else ""
        found = [(at, stop) for stop in self.stops if (at := text.find(stop)) >= 0]
        if not found:
            return text, len(tokens)
        at, stop = min(found)
        if self.include:
            end, kept = at + len(stop), 1  # the stop string is not empty
            while kept < len(tokens) and len(self.tokenizer.decode(tokens[:kept])) < end:
                kept += 1
            return self.tokenizer.decode(tokens[:kept]), kept
        kept = len(tokens)
        while kept and len(self.tokenizer.decode(tokens[:kept])) > at:
            kept -= 1
        return text[:at], kept


class TextSink:
    """A text streamer callable, checked, that remembers what it was sent.

    Tokens reach it through genai's ``TextStreamer``, so a token cut by a stop string never
    does; ``finish`` sends the part of it before the stop string, so the streamed text is
    exactly the result's ``text``.
    """

    def __init__(self, callback: Callable[[str], Any]) -> None:
        self.callback = callback
        self.sent: list[str] = []

    def __call__(self, text: str) -> Any:
        status = _called(self.callback, text)
        self.sent.append(text)
        return streamer_status(status)

    def finish(self, text: str) -> None:
        done = "".join(self.sent)
        if len(text) > len(done) and text.startswith(done):
            self(text[len(done) :])


def streamer_status(status: Any) -> Any:
    """What a streamer returned, if it is what a streamer may return (None, a bool or an
    ``openvino_genai.StreamingStatus``): one rule for callables and ``StreamerBase.write``."""
    if status is None or isinstance(status, (bool, openvino_genai.StreamingStatus)):
        return status
    raise UsageError(
        f"a streamer must return None, a bool or an openvino_genai.StreamingStatus, got {status!r}"
    )


def _write(streamer: Any, token: int) -> Any:
    """Hand one token to a token-level streamer; what it returned, checked."""
    if isinstance(streamer, openvino_genai.TextParserStreamer):
        # its Python ``write`` takes the parsed message: tokens go in through ``_write``, which
        # decodes them and runs its parsers first (what genai's pipeline calls)
        return streamer_status(_called(streamer._write, [token]))
    return streamer_status(_called(streamer.write, token))


def _called(call: Callable[..., Any], *args: Any) -> Any:
    """``call(*args)`` of a streamer: its StopIteration would end the token loop's generator
    as Python's "generator raised StopIteration", so it is named as the streamer's instead."""
    try:
        return call(*args)
    except StopIteration:
        raise UsageError(
            "the streamer raised StopIteration: to end generation, return "
            "openvino_genai.StreamingStatus.STOP (or True)"
        ) from None


# what a streamer may return to end generation early (``CANCEL`` also drops the chat turn;
# ``TOOL_CALL_STOP``, a parser's, ends it with the finish reason "tool_call", as genai's)
_STOPS = (openvino_genai.StreamingStatus.STOP, True)


class TokenOutput:
    """Generated tokens on their way to the streamer, ``stops.hold`` tokens behind generation.

    ``streamer``: None, a callable taking text (wrapped in genai's ``TextStreamer``) or a
    token-level ``openvino_genai.StreamerBase``; either may return None, a bool or a
    ``StreamingStatus``.  ``halted`` becomes "stop" or "cancelled" when the streamer says so;
    it then gets nothing more.  ``echo``: prompt tokens streamed first (genai's ``echo``).
    """

    def __init__(
        self, tokenizer: Any, streamer: Any, stops: StopStrings, echo: Iterable[int] = ()
    ) -> None:
        self.stops = stops
        self.echo = [int(t) for t in echo]
        self.sink: TextSink | None = None
        if streamer is None or isinstance(streamer, openvino_genai.StreamerBase):
            self.streamer = streamer
        elif callable(streamer):
            self.sink = TextSink(streamer)
            self.streamer = openvino_genai.TextStreamer(tokenizer, self.sink)
        else:
            raise UsageError(
                "streamer must be a callable taking text or an openvino_genai.StreamerBase, "
                f"got {type(streamer).__name__}"
            )
        self.streamed = 0  # tokens handed to the streamer
        self.halted: str | None = None

    def push(self, tokens: list[int]) -> str | None:
        """Stream what the stop strings no longer hold back; "stop"/"cancelled" if the
        streamer ended the run."""
        return self._stream(tokens, len(tokens) - self.stops.hold)

    def _stream(self, tokens: list[int], upto: int) -> str | None:
        if self.echo:
            tokens, upto = self.echo + tokens, upto + len(self.echo)
        while self.streamer is not None and self.halted is None and self.streamed < upto:
            status = _write(self.streamer, tokens[self.streamed])
            self.streamed += 1
            if status == openvino_genai.StreamingStatus.CANCEL:
                self.halted = "cancelled"
            elif status == openvino_genai.StreamingStatus.TOOL_CALL_STOP:
                self.halted = "tool_call"
            elif status in _STOPS:
                self.halted = "stop"
        return self.halted

    def close(self, tokens: list[int], kept: int, text: str, finish: str) -> str:
        """Stream the tokens kept after the hold-back, flush, and return the finish reason."""
        if self.halted is None and self._stream(tokens, kept) == "cancelled":
            finish = "cancelled"
        if self.streamer is not None and finish != "cancelled":
            _called(self.streamer.end)  # flush held-back text; a cancelled run wants no more
            if self.sink is not None and self.halted is None:  # a stopped streamer: no more
                self.sink.finish(text)  # a token's text before a stop string inside it
        return finish
