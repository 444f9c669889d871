"""``npuw-kv serve``: the application on uvicorn, bound before the model's URL is printed, and
stopped by Ctrl-C or SIGTERM with exit code 0.

On a stop signal the server takes no new connections, lets running requests finish for up to
``grace_s`` seconds, then cancels what remains (each answer ends at its next token, finish
reason "abort"; a stream then sends an error event and ``[DONE]``) and waits for the worker
threads.  A second Ctrl-C stops at once.

Read timeouts: a connection must send a request's headers within ``header_timeout_s`` of
opening (or of its previous response) — uvicorn itself waits forever, so a client trickling
headers held a socket for good — and stay idle at most ``keep_alive_s`` between requests; the
body's own limit is :mod:`.guard`'s.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import sys
import threading
from types import FrameType
from typing import Any

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from .app import make_app
from .guard import GuardSettings

CANCEL_S = 10  # for a cancelled request to answer: its step ends, then its reply goes out


class _Server(uvicorn.Server):
    """uvicorn's server, minus re-raising the stop signal after a clean shutdown (which would
    turn a requested stop into exit code 130 or a kill by SIGTERM), announcing its URL once it
    listens."""

    url = ""
    grace_s = 10.0
    stop_requests: Any = None
    loop: asyncio.AbstractEventLoop | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        elif not self.should_exit and self.loop is not None and self.stop_requests is not None:
            # at the end of the grace the running requests are cancelled: each answers with
            # what it has, marked cut short (uvicorn's own deadline, later, would cut them off)
            self.loop.call_soon_threadsafe(self.loop.call_later, self.grace_s,
                                           self.stop_requests)  # fmt: skip
        self.should_exit = True

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().startup(sockets)
        if self.started:
            print(f"npuw-kv serve: listening on {self.url} (Ctrl-C stops)", flush=True)


class HeaderTimeout(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, closing a connection whose request headers are not whole
    ``header_timeout_s`` seconds after it opened or its last response went out."""

    header_timeout_s = 10.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.header_timer: asyncio.TimerHandle | None = None
        self._arm()

    def _arm(self) -> None:
        if self.header_timer is None:
            self.header_timer = self.loop.call_later(self.header_timeout_s, self._expired)

    def _disarm(self) -> None:
        if self.header_timer is not None:
            self.header_timer.cancel()
            self.header_timer = None

    def data_received(self, data: bytes) -> None:
        before = self.cycle
        super().data_received(data)
        if self.cycle is not before:  # a request's headers are whole
            self._disarm()
        elif self.cycle is None or self.cycle.response_complete:
            self._arm()  # between requests: bytes of the next one's headers, not yet whole

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._disarm()  # idle now: the keep-alive timeout holds (re-armed by new bytes)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _expired(self) -> None:
        self.header_timer = None
        if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
            self.transport.close()


def serve(
    pipe: Any,
    model_id: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    live: int = 1,
    queue: int = 64,
    api_key: str | None = None,
    *,
    grace_s: float = 10.0,  # whole seconds, at least 1 (uvicorn counts seconds)
    access_log: bool = False,
    guard: GuardSettings | None = None,
    header_timeout_s: float = 10.0,
    keep_alive_s: int = 5,
    tool_parser: str = "auto",
) -> int:
    """Serve ``pipe`` until stopped; the exit code (0 after a stop signal)."""
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("npuw-kv serve runs on the main thread (it handles stop signals)")
    guard = guard or GuardSettings(host=host)
    app = make_app(pipe, model_id, live, queue, api_key, guard=guard, tool_parser=tool_parser)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        print(f"npuw-kv: error: cannot listen on {host}:{port}: {exc.strerror} "
              "(choose another with --port / --host)", file=sys.stderr)  # fmt: skip
        return 2
    bound = sock.getsockname()[1]
    config = uvicorn.Config(
        app,
        log_level="info" if access_log else "warning",
        access_log=access_log,
        # the requests still running are cancelled at grace_s (handle_exit); this deadline,
        # later, only ends what a cancel could not (uvicorn counts whole seconds)
        timeout_graceful_shutdown=max(1, round(grace_s)) + CANCEL_S,
        lifespan="on",
        http=type("Protocol", (HeaderTimeout,), {"header_timeout_s": header_timeout_s}),
        timeout_keep_alive=keep_alive_s,
    )
    server = _Server(config)
    server.grace_s, server.stop_requests = grace_s, app.state.stop_requests
    shown = f"[{host}]" if family == socket.AF_INET6 else host
    server.url = f"http://{shown}:{bound}/v1"
    server.run(sockets=[sock])
    return 0
