"""An HTTP request carried from the endpoint to a replica, and the replica's ASGI application
run on it in-process.

A replica runs the very application ``npuw-kv serve`` runs (:func:`~npuw_kv.serve.app.make_app`:
request checks, admission, errors, streaming, metrics), so a request answered through Ray is
answered as one sent to a single server.  The endpoint reads the request's body whole and sends
it with the request's line and headers; the replica answers with the application's ASGI
messages, which the endpoint relays.  When the endpoint stops reading (its client left), the
application is told the client disconnected, as uvicorn would tell it, and given a moment to
cancel its work before it is cancelled itself.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

GONE_S = 5.0  # for the application to wind a request down after its client left


@dataclass(frozen=True)
class Forwarded:
    """One HTTP request, as the endpoint received it; ``key``: the text the router matches
    prefixes on (:func:`~.affinity.prompt_text`)."""

    method: str
    path: str
    query: bytes
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes
    client: tuple[str, int] | None = None
    key: str = ""

    def scope(self) -> dict[str, Any]:
        return {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": self.method,
            "scheme": "http",
            "path": self.path,
            "raw_path": self.path.encode(),
            "query_string": self.query,
            "root_path": "",
            "headers": [list(pair) for pair in self.headers],
            "client": self.client,
            "server": None,
        }


async def drive(app: Any, request: Forwarded) -> AsyncIterator[dict[str, Any]]:
    """The ASGI messages ``app`` sends in answer to ``request``: ``http.response.start``,
    then its ``http.response.body`` pieces.  An error the application raised is raised here
    after what it sent."""
    out: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
    gone = asyncio.Event()
    body_sent = False

    async def receive() -> dict[str, Any]:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        await out.put(message)

    task = asyncio.ensure_future(app(request.scope(), receive, send))
    task.add_done_callback(lambda _: out.put_nowait(None))
    try:
        while (message := await out.get()) is not None:
            if message["type"].startswith("http.response."):
                yield message
        task.result()
    finally:
        if not task.done():  # the reader left: the client is gone, as far as the app knows
            gone.set()
            try:
                await asyncio.wait_for(asyncio.shield(task), GONE_S)
            except BaseException:  # noqa: BLE001 - late, cancelled or failed: it ends here
                task.cancel()
