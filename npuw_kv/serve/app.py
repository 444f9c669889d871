"""The HTTP side of ``npuw-kv serve``: OpenAI's ``/v1/chat/completions``, ``/v1/completions``
and ``/v1/models``, vLLM's ``/metrics``, ``/tokenize``, ``/detokenize``, ``/tokenizer_info`` and
``/version``, and ``/health``, as a Starlette application over one pipeline, behind :mod:`.guard`.

A request is checked whole (:mod:`.protocol`) and admitted (:class:`~.jobs.Worker`) before any
work; a streamed answer's headers go out with its first token, so an error found when the call
starts (a prompt over ``MAX_PROMPT_LEN``) is still an HTTP error rather than a broken stream.
A client that goes away cancels its request.  When the server stops, an answer it cut short
ends with finish reason ``abort``, and a stream with an error event the client raises on.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from .api_error import error_response, sse
from .guard import Guard, GuardSettings, prompt_bytes_check
from .jobs import Admission, Event, Run, Worker
from .metrics import CONTENT_TYPE, CountingPipe, ServeMetrics
from .protocol import ApiError, Job, chat_job, completion_job, read_body
from .replies import Reply
from .tokens import TokenRoutes
from .tools import ChatFormat

T = TypeVar("T")
DISCONNECT_POLL_S = 0.25  # how often a waiting non-streamed request checks its client


class ClientGone(Exception):
    """The client closed the connection before its answer was ready."""


class EventStream(StreamingResponse):
    """Server-sent events whose admission is closed when the stream ends, however it ends."""

    def __init__(self, events: AsyncIterator[str], admission: Admission) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})  # fmt: skip
        self.admission = admission

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.admission.close()


def make_app(
    pipe: Any,
    model_id: str,
    live: int,
    queue: int,
    api_key: str | None = None,
    *,
    guard: GuardSettings | None = None,
    tool_parser: str = "auto",
) -> Starlette:
    """The application serving ``pipe`` as model ``model_id``: ``live`` requests at once,
    ``queue`` more waiting; with ``api_key``, every route but ``/health``, ``/metrics`` and
    ``/version`` needs it as a Bearer token; ``guard``: the hosts, origins and body limits it
    takes (:mod:`.guard`)."""
    guard = guard or GuardSettings()
    metrics = ServeMetrics(pipe, model_id, lambda: len(worker.running),
                           lambda: max(worker.admitted - len(worker.running), 0))  # fmt: skip
    counting = CountingPipe(pipe, metrics)
    worker = Worker(counting, live, queue)
    models = (model_id,)
    created = int(time.time())
    tokenizer = pipe.get_tokenizer()
    chat_format = ChatFormat.of(tokenizer, tool_parser)  # what the template does with tools
    too_long = prompt_bytes_check(pipe)
    tokens = TokenRoutes(pipe, models)
    stopping = {"now": False}  # the server stopped what still ran (answers cut short)

    async def health(request: Request) -> Response:
        return JSONResponse(
            {"status": "ok", "running": len(worker.running), "admitted": worker.admitted,
             "requests": dict(worker.counts)}
        )  # fmt: skip

    async def list_models(request: Request) -> Response:
        model = {"id": model_id, "object": "model", "created": created, "owned_by": "npuw-kv"}
        return JSONResponse({"object": "list", "data": [model]})

    async def show_metrics(request: Request) -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    async def answer(request: Request, parse: Callable[[dict[str, Any], tuple[str, ...]], Job]):
        arrival = time.monotonic()
        try:
            raw = await request.body()
        except ClientDisconnect:  # gone before its body was whole: nobody reads an answer
            return Response(status_code=499)
        body = read_body(raw)
        job = parse(body, models)
        too_long(job)
        options = body.get("stream_options") or {}
        continuous = job.include_usage and bool(options.get("continuous_usage_stats"))
        reply = Reply(job, tokenizer)
        admission = worker.admit()
        counting.arrived(job.config, arrival, job.n)
        handed = False
        try:
            run = await _watch(request, admission.start(job))
            if stopping["now"]:
                run.cancel()  # started after the stop: it answers with what it has, nothing
            first = await _watch(request, run.events.get())
            if first[0] == "error":
                raise first[1]
            if job.stream:
                handed = True
                usage = _Usage(reply, counting, job, pipe) if continuous else None
                stream = _stream(reply, run, first, stopping, usage, counting)
                return EventStream(stream, admission)
            results = first[1] if first[0] == "done" else await _watch(request, run.results())
            whole = reply.whole(results)
            if stopping["now"]:
                for choice, result in zip(whole["choices"], results, strict=True):
                    if result.finish_reason == "cancelled":
                        choice["finish_reason"] = "abort"
            return JSONResponse(whole)
        except ClientGone:
            return Response(status_code=499)  # nobody reads it
        finally:
            if not handed:
                admission.close()
                counting.forget(job.config)

    async def chat(request: Request) -> Response:
        return await answer(request, lambda body, models: chat_job(body, models, chat_format))

    async def completions(request: Request) -> Response:
        return await answer(request, completion_job)

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/metrics", show_metrics, methods=["GET"]),
        Route("/version", tokens.version, methods=["GET"]),
        Route("/tokenizer_info", tokens.tokenizer_info, methods=["GET"]),
        Route("/tokenize", tokens.tokenize, methods=["POST"]),
        Route("/detokenize", tokens.detokenize, methods=["POST"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
    ]

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        worker.stop()  # the server stopped: cancel what still runs, wait for the threads

    def stop_requests() -> None:
        """End every running request at its next token, as cut short by the server."""
        stopping["now"] = True
        worker.cancel_all()

    app = Starlette(
        routes=routes,
        exception_handlers={
            ApiError: _api_error, HTTPException: _http_error, RecursionError: _too_deep,
        },
        lifespan=lifespan,
    )  # fmt: skip
    if api_key:
        app.add_middleware(_BearerAuth, api_key=api_key)
    origins = guard.origins()
    app.add_middleware(Guard, hosts=guard.hosts(), origins=origins, max_body=guard.max_body,
                       body_timeout_s=guard.body_timeout_s)  # fmt: skip
    if origins:  # outermost: preflights are answered, and errors carry CORS headers
        app.add_middleware(CORSMiddleware, allow_origins=sorted(origins),
                           allow_methods=["GET", "POST"], allow_headers=["*"],
                           expose_headers=["Retry-After"])  # fmt: skip
    app.state.worker = worker
    app.state.metrics = metrics
    app.state.stop_requests = stop_requests
    return app


class _Usage:
    """``stream_options.continuous_usage_stats``: the usage so far on every chunk (vLLM's
    extension): the prompt's tokens, and the tokens each answer was given until now."""

    def __init__(self, reply: Reply, counting: CountingPipe, job: Job, pipe: Any) -> None:
        self.reply, self.counting, self.job, self.pipe = reply, counting, job, pipe
        self.prompts: list[int] | None = None
        self.pieces = [0] * job.answers  # text pieces streamed so far, per answer

    async def start(self) -> None:
        self.prompts = await run_in_threadpool(prompt_tokens, self.pipe, self.job)

    def next_piece(self, answer: int) -> int:
        """The tokens answer ``answer`` had when its next piece of text left its streamer."""
        count = self.counting.tokens_at(self.job.config, answer, self.pieces[answer])
        self.pieces[answer] += 1
        return count or 0

    def so_far(self, index: int, generated: int, prompt: int | None = None) -> dict[str, int]:
        assert self.prompts is not None
        prompt = self.prompts[index // self.job.n] if prompt is None else prompt
        return {"prompt_tokens": prompt, "completion_tokens": generated,
                "total_tokens": prompt + generated}  # fmt: skip


def prompt_tokens(pipe: Any, job: Job) -> list[int]:
    """Each prompt's token count, as the pipeline will encode it."""
    mask = getattr(job.inputs, "attention_mask", None)
    if mask is not None:  # token-id prompts: one right-padded row each
        return [int(row.sum()) for row in mask.data.reshape(job.prompts, -1)]
    encoder = pipe.engine.encoder
    if job.chat:
        return [len(encoder.messages(job.inputs))]
    prompts = job.inputs if isinstance(job.inputs, list) else [job.inputs]
    return [len(encoder.text(p)) for p in prompts]


async def _stream(
    reply: Reply,
    run: Run,
    first: Event,
    stopping: dict[str, bool],
    usage: _Usage | None,
    counting: CountingPipe,
) -> AsyncIterator[str]:
    """The stream of one request: each chat answer's role, then text as it comes, then each
    answer's finish reason (with its log-probabilities when asked for), usage, ``[DONE]``.
    With ``usage``, every chunk carries the usage so far.  An answer the server's stop cut
    short ends with ``abort``, and the stream with an error event before ``[DONE]``."""
    job = reply.job
    try:
        async for piece in _events(reply, run, first, stopping, usage):
            yield piece
    finally:
        counting.forget(job.config)


async def _events(
    reply: Reply, run: Run, first: Event, stopping: dict[str, bool], usage: _Usage | None
) -> AsyncIterator[str]:
    job = reply.job
    if usage is not None:
        await usage.start()

    def chunk(index: int, generated: int | None = None, prompt: int | None = None,
              **fields: Any) -> str:  # fmt: skip
        data = reply.chunk(index, **fields)
        if usage is not None:
            data["usage"] = usage.so_far(index, generated or 0, prompt)
        return sse(data)

    if job.chat:
        for index in range(job.answers):
            yield chunk(index, 0, role=True)
    event = first
    while True:
        if event[0] == "text":
            counted = usage.next_piece(event[1]) if usage is not None else None
            for piece in reply.pieces(event[1], event[2]):
                yield chunk(event[1], counted, **piece)
        elif event[0] == "done":
            results = event[1]
            cut = False
            for index, result in enumerate(results):
                pieces, finish = reply.last_pieces(index, result)
                for piece in pieces:
                    yield chunk(index, len(result.tokens), **piece)
                if stopping["now"] and result.finish_reason == "cancelled":
                    finish, cut = "abort", True
                yield chunk(index, len(result.tokens), int(result.prompt_tokens), finish=finish,
                            logprobs=reply.logprobs(result))  # fmt: skip
            if job.include_usage:
                yield sse(reply.usage_chunk(results))
            if cut:
                yield sse(_STOPPED.body())
            break
        else:  # the call failed after its first token: the stream says so and ends
            yield sse(event[1].body())
            break
        event = await run.events.get()
    yield "data: [DONE]\n\n"


_STOPPED = ApiError(
    503, "the server stopped while this answer ran: it was cut short (finish_reason abort)",
    kind="server_error", code="server_shutdown",
)  # fmt: skip


async def _watch(request: Request, work: Awaitable[T]) -> T:
    """``work``'s result; :class:`ClientGone` (``work`` cancelled) if the client leaves first."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientGone()
    finally:
        if not task.done():
            task.cancel()


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return error_response(exc)


async def _too_deep(request: Request, exc: Exception) -> Response:
    """JSON nested deeper than Python's parser recurses (``[[[[...]]]]``)."""
    return error_response(ApiError(400, "the request body is nested too deeply"))


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    message = f"{request.method} {request.url.path}: {exc.detail}"
    return error_response(ApiError(exc.status_code, message, kind=kind))


_OPEN = ("/health", "/metrics", "/version")  # what a key never guards (as vLLM: monitoring)


class _BearerAuth:
    """Every route but those in ``_OPEN`` needs ``Authorization: Bearer <api_key>`` (401
    without)."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app, self.key = app, api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in _OPEN:
            headers = dict(scope["headers"])
            given = headers.get(b"authorization", b"")
            scheme, _, token = given.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                error = ApiError(401, "a valid API key is required: Authorization: Bearer <key>",
                                 kind="invalid_request_error", code="invalid_api_key")  # fmt: skip
                await error_response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)
