"""Stop strings over generated tokens: when one completes, where the text ends, what to stream.

A stop string of ``b`` UTF-8 bytes overlaps at most ``b`` tokens (each token overlapping it
contributes at least one of its bytes).  So decoding the newest ``b + 2`` tokens after each
step sees it complete (one extra token for a decoder that drops a leading space), and holding
the newest ``b`` tokens back from the streamer keeps it out of the streamed text, as
openvino-genai does by default (``include_stop_str_in_output`` off).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import openvino_genai


class StopStrings:
    def __init__(self, tokenizer: Any, stops: Iterable[str]) -> None:
        self.tokenizer = tokenizer
        self.stops = tuple(stops)
        # tokens the streamer lags behind generation (0 without stop strings)
        self.hold = max((len(stop.encode("utf-8")) for stop in self.stops), default=0)

    def hit(self, tokens: list[int]) -> bool:
        """True when the newest token completes a stop string."""
        if not self.stops:
            return False
        tail = self.tokenizer.decode(tokens[-(self.hold + 2) :])
        return any(stop in tail for stop in self.stops)

    def cut(self, tokens: list[int]) -> tuple[str, int]:
        """The text before the first stop string, and how many tokens lie wholly before it."""
        text = self.tokenizer.decode(tokens) if tokens else ""
        found = [at for at in (text.find(stop) for stop in self.stops) if at >= 0]
        if not found:
            return text, len(tokens)
        end, kept = min(found), len(tokens)
        while kept and len(self.tokenizer.decode(tokens[:kept])) > end:
            kept -= 1
        return text[:end], kept


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
        status = self.callback(text)
        self.sent.append(text)
        if status is None or isinstance(status, (bool, openvino_genai.StreamingStatus)):
            return status
        raise ValueError(
            "a streamer must return None, a bool or an openvino_genai.StreamingStatus, "
            f"got {status!r}"
        )

    def finish(self, text: str) -> None:
        done = "".join(self.sent)
        if len(text) > len(done) and text.startswith(done):
            self(text[len(done) :])
