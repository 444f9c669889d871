"""``npuw-kv serve``: the application on uvicorn, bound before the model's URL is printed, and
stopped by Ctrl-C or SIGTERM with exit code 0.

On a stop signal the server takes no new connections, lets running requests finish for up to
``grace_s`` seconds, then cancels what remains (each answer ends at its next token and goes out
whole, finish reason "stop") and waits for the worker threads.  A second Ctrl-C stops at once.
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

from .app import make_app
from .jobs import Worker

CANCEL_S = 10  # for a cancelled request to answer: its step ends, then its reply goes out


class _Server(uvicorn.Server):
    """uvicorn's server, minus re-raising the stop signal after a clean shutdown (which would
    turn a requested stop into exit code 130 or a kill by SIGTERM), announcing its URL once it
    listens."""

    url = ""
    grace_s = 10.0
    worker: Worker | None = None
    loop: asyncio.AbstractEventLoop | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        elif not self.should_exit and self.loop is not None and self.worker is not None:
            # at the end of the grace the running requests are cancelled: each answers, whole,
            # with what it has (uvicorn's own deadline, later, would cut them off with errors)
            self.loop.call_soon_threadsafe(self.loop.call_later, self.grace_s,
                                           self.worker.cancel_all)  # fmt: skip
        self.should_exit = True

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().startup(sockets)
        if self.started:
            print(f"npuw-kv serve: listening on {self.url} (Ctrl-C stops)", flush=True)


def serve(
    pipe: Any,
    model_id: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    live: int = 1,
    queue: int = 64,
    api_key: str | None = None,
    grace_s: float = 10.0,  # whole seconds, at least 1 (uvicorn counts seconds)
    access_log: bool = False,
) -> int:
    """Serve ``pipe`` until stopped; the exit code (0 after a stop signal)."""
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("npuw-kv serve runs on the main thread (it handles stop signals)")
    app = make_app(pipe, model_id, live, queue, api_key)
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
    )
    server = _Server(config)
    server.grace_s, server.worker = grace_s, app.state.worker
    shown = f"[{host}]" if family == socket.AF_INET6 else host
    server.url = f"http://{shown}:{bound}/v1"
    server.run(sockets=[sock])
    return 0
