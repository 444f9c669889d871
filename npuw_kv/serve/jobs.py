"""Requests run on one pipeline from worker threads, their tokens handed to the event loop.

At most ``live`` requests run at once (the batch's ``max_num_seqs`` on the paged path, where
their sequences share every step; one on the static path, which runs a sequence at a time);
``queue`` more wait for a turn, and a request beyond that is refused with HTTP 429 at once.
Each answer has its own token-level streamer: it carries text to the event loop when the
request streams, and it ends the answer (``StreamingStatus.CANCEL``: the sequence leaves the
batch and its KV blocks return to the pool) at the next token once the request is cancelled
(the client went away, or the server stops).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openvino_genai

from ..errors import CapacityError
from .protocol import ApiError, Job

Event = tuple[Any, ...]  # ("text", answer, text) | ("done", results) | ("error", ApiError)
_RUNNING = openvino_genai.StreamingStatus.RUNNING
_CANCEL = openvino_genai.StreamingStatus.CANCEL


class AnswerStreamer(openvino_genai.StreamerBase):
    """One answer's tokens: decoded to text for ``on_text`` (when given), and refused with
    ``CANCEL`` once ``cancelled`` is set."""

    def __init__(
        self, tokenizer: Any, cancelled: threading.Event, on_text: Callable[[str], None] | None
    ) -> None:
        super().__init__()
        self.cancelled = cancelled
        self.on_text = on_text
        self.sent: list[str] = []
        self._text = openvino_genai.TextStreamer(tokenizer, self._emit) if on_text else None

    def write(self, token: Any) -> Any:
        if self.cancelled.is_set():
            return _CANCEL
        if self._text is not None:
            self._text.write(token)
        return _RUNNING

    def end(self) -> None:
        if self._text is not None:
            self._text.end()

    def _emit(self, text: str) -> Any:
        assert self.on_text is not None
        self.sent.append(text)
        self.on_text(text)
        return _RUNNING

    def rest(self, text: str) -> str:
        """What the answer's final ``text`` has beyond what was streamed: the part of a token
        before a stop string inside it, which the token-level stream held back."""
        done = "".join(self.sent)
        return text[len(done) :] if len(text) > len(done) and text.startswith(done) else ""


def answers_of(output: Any) -> list[Any]:
    """A ``generate`` call's per-answer results (a lone text answer is its own)."""
    results = getattr(output, "results", None)
    return list(results) if results is not None else [output]


def api_error(exc: BaseException, job: Job) -> ApiError:
    """The HTTP error a failed call answers with."""
    if isinstance(exc, ApiError):
        return exc
    message = str(exc).strip() or type(exc).__name__
    if isinstance(exc, CapacityError):
        if "MAX_PROMPT_LEN" in message:
            message += " (npuw-kv serve --max-prompt-len)"
        return ApiError(400, message, "messages" if job.chat else "prompt",
                        code="context_length_exceeded")  # fmt: skip
    if isinstance(exc, (ValueError, ModuleNotFoundError)):  # UsageError is a ValueError
        return ApiError(400, message)
    return ApiError(500, f"{type(exc).__name__}: {message}", kind="server_error")


class Run:
    """One request's ``generate`` call on a worker thread; its events are read on the loop."""

    def __init__(self, worker: Worker, job: Job) -> None:
        self.job = job
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.cancelled = threading.Event()
        tokenizer = worker.pipe.get_tokenizer()
        self.streamers = [
            AnswerStreamer(tokenizer, self.cancelled, self._text_of(i) if job.stream else None)
            for i in range(job.answers)
        ]
        worker.running.add(self)
        self.done = self.loop.run_in_executor(worker.executor, self._call, worker)

    def _text_of(self, answer: int) -> Callable[[str], None]:
        return lambda text: self._post(("text", answer, text))

    def _call(self, worker: Worker) -> None:
        try:
            output = worker.pipe.generate(self.job.inputs, self.job.config, streamer=self.streamers)
            results = answers_of(output)
            worker.count("cancelled" if self.cancelled.is_set() else "completed")
            for i, (streamer, result) in enumerate(zip(self.streamers, results, strict=True)):
                rest = streamer.rest(result.text) if self.job.stream else ""
                if rest:
                    self._post(("text", i, rest))
            self._post(("done", results))
        except BaseException as exc:  # the request fails alone; the worker thread goes on
            worker.count("failed")
            self._post(("error", api_error(exc, self.job)))
        finally:
            worker.running.discard(self)

    def _post(self, event: Event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is closed: the server stopped, nobody reads
            self.cancelled.set()

    def cancel(self) -> None:
        """End every answer at its next token (its KV blocks go back to the pool)."""
        self.cancelled.set()

    async def __aiter__(self) -> AsyncIterator[Event]:
        while True:
            event = await self.events.get()
            yield event
            if event[0] != "text":
                return

    async def results(self) -> list[Any]:
        """The answers, once the call is done; its error raised as an :class:`ApiError`."""
        async for event in self:
            if event[0] == "done":
                return list(event[1])
            if event[0] == "error":
                raise event[1]
        raise AssertionError("a run ends with done or error")


class Worker:
    """The pipeline, its worker threads, and the admission of requests to them."""

    def __init__(self, pipe: Any, live: int, queue: int) -> None:
        self.pipe = pipe
        self.live, self.queue = live, queue
        self.executor = ThreadPoolExecutor(max_workers=live, thread_name_prefix="npuw-kv-serve")
        self.running: set[Run] = set()
        self.admitted = 0  # running or waiting for a turn
        self._turns: asyncio.Semaphore | None = None
        self.counts = {"completed": 0, "cancelled": 0, "failed": 0}  # calls, by how they ended
        self._lock = threading.Lock()

    def count(self, outcome: str) -> None:
        with self._lock:
            self.counts[outcome] += 1

    def admit(self) -> Admission:
        """Count a request in (running or waiting for a turn), or refuse it with 429 when the
        queue is full; the caller closes the admission when the response is over."""
        if self.admitted >= self.live + self.queue:
            raise ApiError(
                429,
                f"the server is busy: {self.live} requests running and {self.queue} waiting "
                "(npuw-kv serve --queue); retry shortly",
                kind="rate_limit_error",
                code="rate_limit_exceeded",
                headers={"Retry-After": "1"},
            )
        self.admitted += 1
        if self._turns is None:
            self._turns = asyncio.Semaphore(self.live)
        return Admission(self, self._turns)

    def cancel_all(self) -> None:
        """End every running request at its next token: each answers with what it has."""
        for run in list(self.running):
            run.cancel()

    def stop(self) -> None:
        """Cancel every running request and wait for the worker threads."""
        self.cancel_all()
        self.executor.shutdown(wait=True)


class Admission:
    """An admitted request: it waits for a turn (:meth:`start`), and :meth:`close` (once the
    response is over or its client went away) cancels what still runs and gives the turn and
    the admission back.  The pool has ``live`` threads, so a turn given while a cancelled call
    still finishes its step waits for that thread."""

    def __init__(self, worker: Worker, turns: asyncio.Semaphore) -> None:
        self.worker: Worker | None = worker
        self.turns = turns
        self.run: Run | None = None
        self._turn = False

    async def start(self, job: Job) -> Run:
        assert self.worker is not None and self.run is None, "an admission runs one job"
        await self.turns.acquire()
        self._turn = True
        self.run = Run(self.worker, job)
        return self.run

    def close(self) -> None:
        if self.run is not None:
            self.run.cancel()
        if self._turn:
            self.turns.release()
            self._turn = False
        if self.worker is not None:
            self.worker.admitted -= 1
            self.worker = None
