"""The HTTP side of ``npuw-kv serve``: OpenAI's ``/v1/chat/completions``, ``/v1/completions``
and ``/v1/models``, and ``/health``, as a Starlette application over one pipeline.

A request is checked whole (:mod:`.protocol`) and admitted (:class:`~.jobs.Worker`) before any
work; a streamed answer's headers go out with its first token, so an error found when the call
starts (a prompt over ``MAX_PROMPT_LEN``) is still an HTTP error rather than a broken stream.
A client that goes away cancels its request.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from .jobs import Admission, Event, Run, Worker
from .protocol import ApiError, Job, chat_job, completion_job, read_body
from .replies import FINISH, Reply

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


def sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def make_app(pipe: Any, model_id: str, live: int, queue: int, api_key: str | None = None):
    """The application serving ``pipe`` as model ``model_id``: ``live`` requests at once,
    ``queue`` more waiting; with ``api_key``, every ``/v1`` route needs it as a Bearer token."""
    worker = Worker(pipe, live, queue)
    models = (model_id,)
    created = int(time.time())
    tokenizer = pipe.get_tokenizer()

    async def health(request: Request) -> Response:
        return JSONResponse(
            {"status": "ok", "running": len(worker.running), "admitted": worker.admitted,
             "requests": dict(worker.counts)}
        )  # fmt: skip

    async def list_models(request: Request) -> Response:
        model = {"id": model_id, "object": "model", "created": created, "owned_by": "npuw-kv"}
        return JSONResponse({"object": "list", "data": [model]})

    async def answer(request: Request, parse: Callable[[dict[str, Any], tuple[str, ...]], Job]):
        try:
            raw = await request.body()
        except ClientDisconnect:  # gone before its body was whole: nobody reads an answer
            return Response(status_code=499)
        job = parse(read_body(raw), models)
        reply = Reply(job, tokenizer)
        admission = worker.admit()
        handed = False
        try:
            run = await _watch(request, admission.start(job))
            first = await _watch(request, run.events.get())
            if first[0] == "error":
                raise first[1]
            if job.stream:
                handed = True
                return EventStream(_stream(reply, run, first), admission)
            results = first[1] if first[0] == "done" else await _watch(request, run.results())
            return JSONResponse(reply.whole(results))
        except ClientGone:
            return Response(status_code=499)  # nobody reads it
        finally:
            if not handed:
                admission.close()

    async def chat(request: Request) -> Response:
        return await answer(request, chat_job)

    async def completions(request: Request) -> Response:
        return await answer(request, completion_job)

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
    ]

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        worker.stop()  # the server stopped: cancel what still runs, wait for the threads

    app = Starlette(
        routes=routes,
        exception_handlers={ApiError: _api_error, HTTPException: _http_error},
        lifespan=lifespan,
    )
    if api_key:
        app.add_middleware(_BearerAuth, api_key=api_key)
    app.state.worker = worker
    return app


async def _stream(reply: Reply, run: Run, first: Event) -> AsyncIterator[str]:
    """The stream of one request: each chat answer's role, then text as it comes, then each
    answer's finish reason (with its log-probabilities when asked for), usage, ``[DONE]``."""
    job = reply.job
    if job.chat:
        for index in range(job.answers):
            yield sse(reply.chunk(index, role=True))
    event = first
    while True:
        if event[0] == "text":
            yield sse(reply.chunk(event[1], text=event[2]))
        elif event[0] == "done":
            results = event[1]
            for index, result in enumerate(results):
                finish = FINISH.get(result.finish_reason, "stop")
                yield sse(reply.chunk(index, finish=finish, logprobs=reply.logprobs(result)))
            if job.include_usage:
                yield sse(reply.usage_chunk(results))
            break
        else:  # the call failed after its first token: the stream says so and ends
            yield sse(event[1].body())
            break
        event = await run.events.get()
    yield "data: [DONE]\n\n"


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


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    message = f"{request.method} {request.url.path}: {exc.detail}"
    return error_response(ApiError(exc.status_code, message, kind=kind))


class _BearerAuth:
    """Every route but ``/health`` needs ``Authorization: Bearer <api_key>`` (401 without)."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app, self.key = app, api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] != "/health":
            headers = dict(scope["headers"])
            given = headers.get(b"authorization", b"")
            scheme, _, token = given.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                error = ApiError(401, "a valid API key is required: Authorization: Bearer <key>",
                                 kind="invalid_request_error", code="invalid_api_key")  # fmt: skip
                await error_response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)
