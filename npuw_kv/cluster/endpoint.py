"""The HTTP side of ``npuw-kv serve --ray``: one deployment that relays each request to the
model deployment its ``model`` field names (a replica chosen by that deployment's router) and
relays the answer back, streamed as it comes.

Everything a request is checked for (API key, hosts, body, fields) is checked by the replica's
own server application; the endpoint only reads which model a request is for.  Its own answers
(a model no deployment serves, a route that needs a ``model`` when several are served) are
given only after a replica let the same headers through ``GET /v1/models``."""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import parse_qs

from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.exceptions import ReplicaUnavailableError
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from ..serve.api_error import ApiError, error_response, sse
from .affinity import prompt_of, read_json
from .board import STALE_S, board
from .forward import Forwarded
from .metrics_merge import merge_metrics

RETRIES = 1  # a request whose replica died before it answered is sent once more
REPLICA_GONE = (RayActorError, ActorUnavailableError, ReplicaUnavailableError)
# routes whose answer depends on the model (the others are the same on every replica)
_PER_MODEL = ("/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize",
              "/tokenizer_info")  # fmt: skip


class Endpoint:
    """Requests relayed to the model deployments (``models``: served name -> handle, the
    first the one routes without a model go to); ``/v1/models``, ``/health`` and ``/metrics``
    answered for all of them."""

    def __init__(self, models: dict[str, Any], boards: list[str]) -> None:
        if not models:
            raise ValueError("an endpoint needs at least one model deployment")
        self.models, self.boards = models, boards

    async def __call__(self, request: Request) -> Response:
        path = request.url.path
        if path == "/metrics" and request.method == "GET":
            return await self._metrics()
        client = request.scope.get("client")
        body = await request.body()
        data = read_json(body)  # read once: for the router's key and for the model named
        forwarded = Forwarded(
            method=request.method,
            path=path,
            query=request.scope.get("query_string", b""),
            headers=tuple((k, v) for k, v in request.scope["headers"]),
            body=body,
            client=tuple(client) if client else None,
            key=prompt_of(path, data),
        )
        if len(self.models) > 1 and path in ("/v1/models", "/health"):
            return await self._all(forwarded)
        name = requested_model(data, forwarded.query)
        if name in self.models:
            return await relay(self.models[name], forwarded)
        first = next(iter(self.models.values()))
        if len(self.models) == 1 or path not in _PER_MODEL or (name is None and "/v1/" in path):
            return await relay(first, forwarded)  # a replica answers (or refuses) it as ever
        # several models and none of them named: ours to say, once a replica let the headers in
        allowed = await ask(first, _listing(forwarded))
        if allowed[0] != 200:
            return Response(allowed[2], status_code=allowed[0], headers=allowed[1])
        served = ", ".join(self.models)
        if name is None:
            return error_response(ApiError(400, f"model is required here: this endpoint serves "
                                           f"several models ({served}); name one in the body, "
                                           "or as ?model= on a GET", "model"))  # fmt: skip
        return error_response(ApiError(404, f"model {name!r} is not served here; serving "
                                       f"{served}", "model", code="model_not_found"))  # fmt: skip

    async def _metrics(self) -> Response:
        from ..serve.metrics import CONTENT_TYPE  # with its package: only when asked

        texts: dict[str, str] = {}
        for name in self.boards:
            texts.update(await board(name).read.remote(STALE_S))
        return Response(merge_metrics(texts), media_type=CONTENT_TYPE)

    async def _all(self, forwarded: Forwarded) -> Response:
        """``/v1/models``: every deployment's models; ``/health``: every deployment's health
        under its model's name, 200 when all are (else the first other status)."""
        answers = {name: await ask(handle, forwarded) for name, handle in self.models.items()}
        failed = [a for a in answers.values() if a[0] != 200]
        if forwarded.path == "/v1/models" and failed:
            status, headers, body = failed[0]
            return Response(body, status_code=status, headers=headers)
        if forwarded.path == "/v1/models":
            data = [m for a in answers.values() for m in json.loads(a[2])["data"]]
            merged: dict[str, Any] = {"object": "list", "data": data}
        else:
            healths = {name: _json_or_text(a[2]) for name, a in answers.items()}
            merged = {"status": "unavailable" if failed else "ok", "models": healths}
        status = failed[0][0] if failed else 200
        return Response(json.dumps(merged), status_code=status, media_type="application/json")


def requested_model(data: Any, query: bytes) -> str | None:
    """The ``model`` a request names: its JSON body's (``data``), else its query string's
    (for the ``GET`` routes); None when it names none."""
    if isinstance(data, dict) and isinstance(data.get("model"), str):
        return str(data["model"])
    given = parse_qs(query.decode("latin-1")).get("model")
    return given[0] if given else None


def _listing(forwarded: Forwarded) -> Forwarded:
    """``GET /v1/models`` with ``forwarded``'s headers: what a replica lets in."""
    return Forwarded("GET", "/v1/models", b"", forwarded.headers, b"", forwarded.client)


def _json_or_text(body: bytes) -> Any:
    try:
        return json.loads(body)
    except ValueError:
        return body.decode(errors="replace")


async def ask(model: Any, forwarded: Forwarded) -> tuple[int, dict[str, str], bytes]:
    """A replica's whole answer: (status, headers, body)."""
    answer = await relay(model, forwarded)
    if isinstance(answer, _Whole):
        parts = [m.get("body", b"") for m in answer.body_messages]
        headers = {k.decode(): v.decode() for k, v in answer.start.get("headers", ())
                   if k.lower() != b"content-length"}  # fmt: skip
        return int(answer.start["status"]), headers, b"".join(parts)
    return answer.status_code, {}, bytes(answer.body)


async def relay(model: Any, forwarded: Forwarded) -> Response:
    """The replica's answer to ``forwarded``: a stream relayed as it comes, any other answer
    whole.  A replica that dies before the answer left is replaced by another (once)."""
    for attempt in range(RETRIES + 1):
        stream = model.options(stream=True).forward.remote(forwarded)
        try:
            start = await stream.__anext__()
            if _is_event_stream(start):
                return _Relay(start, stream)
            return _Whole(start, [m async for m in stream])
        except REPLICA_GONE:
            stream.cancel()
            if attempt == RETRIES:
                break
    return error_response(_GONE_BEFORE)


def _is_event_stream(start: dict[str, Any]) -> bool:
    headers = dict(start.get("headers", ()))
    return headers.get(b"content-type", b"").startswith(b"text/event-stream")


class _Whole(Response):
    """ASGI messages sent as they were received (the answer already whole)."""

    def __init__(self, start: dict[str, Any], body: list[dict[str, Any]]) -> None:
        self.start, self.body_messages = start, body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send(self.start)
        for message in self.body_messages:
            await send(message)
        if not self.body_messages or self.body_messages[-1].get("more_body"):
            await send({"type": "http.response.body", "body": b"", "more_body": False})


class _Relay(Response):
    """A server-sent-event stream relayed piece by piece; if its replica dies mid-stream the
    stream ends with an error event and ``[DONE]`` (the client raises: nothing is cut
    silently); if the client leaves, the replica's request is cancelled."""

    def __init__(self, start: dict[str, Any], stream: Any) -> None:
        self.start, self.stream = start, stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        finished = False
        try:
            await send(self.start)
            async for message in self.stream:
                await send(message)
            finished = True
        except REPLICA_GONE:
            await send({"type": "http.response.body", "body": _CUT_EVENTS, "more_body": False})
            finished = True
        finally:
            if not finished:
                self.stream.cancel()


_GONE_BEFORE = ApiError(
    503, "the replica serving this request stopped before it answered, and so did its retry; "
    "try again", kind="server_error", code="replica_unavailable",
)  # fmt: skip
_CUT = ApiError(
    503, "the replica serving this answer stopped mid-stream: the answer is cut short",
    kind="server_error", code="replica_died",
)  # fmt: skip
_CUT_EVENTS = (sse(_CUT.body()) + "data: [DONE]\n\n").encode()
