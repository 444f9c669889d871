"""What keeps ``npuw-kv serve`` a server only its user drives, before a request reaches a route.

- **Host**: a web page can point a name it controls at 127.0.0.1 (DNS rebinding) and then
  read from the server as its own origin; the browser still sends that name in ``Host``.  So
  a server bound to a loopback address answers only ``localhost``, ``127.0.0.1`` and ``[::1]``,
  one bound to another address only that address, one bound to every address (``0.0.0.0``,
  ``::``) any name; ``--allowed-hosts`` adds names (``*``: any).  Refused: 421.
- **Origin**: a request a browser sends on a page's behalf carries ``Origin``; one from an
  origin not in ``--allowed-origins`` is refused (403) whatever it asks, and CORS headers (with
  preflights answered) are given only to the allowed ones.
- **Content type**: a POST body must be ``application/json``.  A page may send ``text/plain``
  (or a body with no type) to any address without asking first; refused: 415.
- **Body**: at most ``max_body`` bytes (413, from ``Content-Length`` or while it arrives),
  whole within ``body_timeout_s`` seconds (408); a client that leaves mid-body is dropped
  quietly.  The body is read here and handed to the route whole.
- **Prompt length by bytes** (:func:`prompt_bytes_check`): a prompt with more bytes than
  ``MAX_PROMPT_LEN`` tokens of the vocabulary's longest token can hold is refused before it is
  tokenized (tokenizing 10 MB takes seconds).
"""

from __future__ import annotations

import asyncio
import ipaddress
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .protocol import ApiError, Job

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
ANY_ADDRESS = ("0.0.0.0", "::", "")
MAX_BODY_MB = 4
BODY_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class GuardSettings:
    """``npuw-kv serve``'s settings of this module: the address it is bound to, the
    ``--allowed-hosts`` and ``--allowed-origins`` it adds, and the body's limits."""

    host: str = "127.0.0.1"
    allowed_hosts: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()
    max_body_mb: float = MAX_BODY_MB
    body_timeout_s: float = BODY_TIMEOUT_S

    @property
    def max_body(self) -> int:
        return int(self.max_body_mb * 2**20)

    def hosts(self) -> frozenset[str] | None:
        return allowed_hosts(self.host, self.allowed_hosts)

    def origins(self) -> frozenset[str]:
        return frozenset(o.strip().lower().rstrip("/") for o in self.allowed_origins if o.strip())


class Refused(Exception):
    """A request answered with an error before any route ran; ``close``: end the
    connection after it (the rest of its body is not read)."""

    def __init__(self, error: ApiError, close: bool = False) -> None:
        super().__init__(error.message)
        self.error, self.close = error, close


def allowed_hosts(bound: str, extra: Iterable[str] = ()) -> frozenset[str] | None:
    """The ``Host`` names a server bound to ``bound`` answers (lower case, no port); None:
    any."""
    extra = [h.strip().lower().strip("[]") for h in extra if h.strip()]
    if "*" in extra:
        return None
    host = bound.strip("[]").lower()
    if host in ANY_ADDRESS and not extra:
        return None
    names = set(extra)
    if host not in ANY_ADDRESS:
        names.add(host)
    if _is_loopback(host):
        names.update(LOOPBACK_NAMES)
    return frozenset(names)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_name(value: str) -> str:
    """``Host``'s name without its port: ``[::1]:8000`` -> ``::1``."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1 : value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


class Guard:
    """ASGI middleware: the checks of this module, then the route with the body read."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        hosts: frozenset[str] | None,
        origins: frozenset[str],
        max_body: int = MAX_BODY_MB * 2**20,
        body_timeout_s: float = BODY_TIMEOUT_S,
    ) -> None:
        self.app, self.hosts, self.origins = app, hosts, origins
        self.max_body, self.body_timeout_s = max_body, body_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        try:
            self.check_host(headers)
            self.check_origin(headers)
            if scope["method"] not in ("POST", "PUT", "PATCH"):
                await self.app(scope, receive, send)
                return
            self.check_type(headers)
            body = await self.read_body(headers, receive)
        except Refused as refused:
            await _respond(refused, scope, receive, send)
            return
        except _Gone:
            return  # nobody is there to answer
        await self.app(scope, _replay(body, receive), send)

    def check_host(self, headers: Headers) -> None:
        given = headers.get("host")
        if self.hosts is None or given is None:  # HTTP/1.0 may send none: not a browser
            return
        if host_name(given) not in self.hosts:
            raise Refused(ApiError(421, f"Host {given!r} is not served here (a name pointed at "
                                   "this server from elsewhere?); allow it with "
                                   "npuw-kv serve --allowed-hosts"))  # fmt: skip

    def check_origin(self, headers: Headers) -> None:
        origin = headers.get("origin")
        if origin is None or "*" in self.origins or origin.lower() in self.origins:
            return
        raise Refused(ApiError(403, f"requests from web pages of origin {origin!r} are refused; "
                               "allow them with npuw-kv serve --allowed-origins"))  # fmt: skip

    def check_type(self, headers: Headers) -> None:
        kind = headers.get("content-type", "")
        if kind.split(";")[0].strip().lower() != "application/json":
            raise Refused(ApiError(415, f"the request body must be JSON sent with Content-Type: "
                                   f"application/json (got {kind or 'none'!r})"))  # fmt: skip

    async def read_body(self, headers: Headers, receive: Receive) -> bytes:
        declared = headers.get("content-length")
        if declared is not None:
            if not declared.strip().isdigit():
                raise Refused(ApiError(400, f"Content-Length {declared!r} is not a number"), True)
            if int(declared) > self.max_body:
                raise Refused(self.too_large(int(declared)), True)
        try:
            return await asyncio.wait_for(self._read(receive), self.body_timeout_s)
        except asyncio.TimeoutError:
            raise Refused(ApiError(408, f"the request body did not arrive whole within "
                                   f"{self.body_timeout_s:g} s (npuw-kv serve --body-timeout)",
                                   kind="timeout"), True) from None  # fmt: skip

    async def _read(self, receive: Receive) -> bytes:
        parts: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _Gone()
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                raise Refused(self.too_large(size, "at least "), True)
            parts.append(chunk)
            if not message.get("more_body", False):
                return b"".join(parts)

    def too_large(self, size: int, bound: str = "") -> ApiError:
        limit = self.max_body / 2**20
        return ApiError(413, f"the request body is {bound}{size} bytes: more than "
                        f"{limit:g} MiB (npuw-kv serve --max-body-mb)")  # fmt: skip


class _Gone(Exception):
    """The client disconnected before its body was whole."""


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that gives the body read already, then waits as the original does (for
    the client's disconnect)."""
    given = False

    async def replay() -> Message:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _respond(refused: Refused, scope: Scope, receive: Receive, send: Send) -> None:
    error = refused.error
    headers = {**error.headers, **({"Connection": "close"} if refused.close else {})}
    response = JSONResponse(error.body(), status_code=error.status, headers=headers)
    await response(scope, receive, send)


def prompt_bytes_check(pipe: Any) -> Callable[[Job], None]:
    """A check that refuses a job whose prompt text certainly has more tokens than
    ``MAX_PROMPT_LEN``: more UTF-8 bytes than that many of the vocabulary's longest token.
    Without a vocabulary to read, it checks nothing (the tokenized length still is)."""
    limit = int(pipe.config.max_prompt_len)
    try:
        longest = max(len(piece) for piece in pipe.get_tokenizer().get_vocab())
    except (AttributeError, RuntimeError, TypeError, ValueError):
        return lambda job: None
    most = limit * max(longest, 1)

    def check(job: Job) -> None:
        size = sum(len(text.encode("utf-8", "surrogatepass")) for text in _texts(job.inputs))
        if size > most:
            raise ApiError(400, f"the prompt is {size} bytes: more than MAX_PROMPT_LEN "
                           f"({limit} tokens of at most {longest} bytes) can hold; shorten it "
                           "or raise npuw-kv serve --max-prompt-len",
                           "messages" if job.chat else "prompt",
                           code="context_length_exceeded")  # fmt: skip

    return check


def _texts(value: Any) -> Iterable[str]:
    """The strings of a job's inputs: prompts, messages' contents (any nesting)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            yield item
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
