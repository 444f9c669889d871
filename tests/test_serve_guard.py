"""``npuw-kv serve`` as a local server only its user drives: what a web page, a slow or huge
request, or a stop signal can do to it.  Each attack is answered with a 4xx (or its
connection closed by a timeout), never a 500 or a traceback in the log."""

from __future__ import annotations

import json
import select
import signal
import socket
from urllib.parse import urlsplit

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from npuw_kv.serve.child import ServeProcess
from npuw_kv.serve.guard import Guard, allowed_hosts, host_name

MODEL = "smollm2"
ORIGIN = "http://app.example"
JSON = {"Content-Type": "application/json"}


# -- the guard alone (no model) --------------------------------------------------------------
@pytest.mark.unit
def test_hosts_answered_follow_the_bound_address():
    loop = allowed_hosts("127.0.0.1")
    assert loop is not None and {"localhost", "127.0.0.1", "::1"} <= loop
    assert "evil.example" not in loop
    assert allowed_hosts("0.0.0.0") is None  # every address: any name, unless narrowed
    assert allowed_hosts("0.0.0.0", ["box.lan"]) == frozenset({"box.lan"})
    assert allowed_hosts("192.168.1.5") == frozenset({"192.168.1.5"})
    assert allowed_hosts("127.0.0.1", ["*"]) is None
    assert "my.host" in (allowed_hosts("::1", ["My.Host"]) or ())
    assert [host_name(h) for h in ("[::1]:80", "LocalHost:8000", "a.b", "[::1]")] == [
        "::1", "localhost", "a.b", "::1"
    ]  # fmt: skip


def _guarded(**settings) -> TestClient:
    async def echo(request: Request) -> JSONResponse:
        return JSONResponse({"got": len(await request.body())})

    app = Starlette(routes=[Route("/x", echo, methods=["GET", "POST"])])
    options = {"hosts": None, "origins": frozenset(), "max_body": 1000, **settings}
    return TestClient(Guard(app, **options))


@pytest.mark.unit
def test_only_json_bodies_within_the_limit_from_no_foreign_page():
    client = _guarded(hosts=frozenset({"testserver"}), origins=frozenset({ORIGIN}))
    assert client.post("/x", content=b"{}", headers=JSON).json() == {"got": 2}
    utf8 = {"Content-Type": "application/json; charset=utf-8"}
    assert client.post("/x", content=b"{}", headers=utf8).status_code == 200
    for kind in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data"):
        refused = client.post("/x", content=b"{}", headers={"Content-Type": kind})
        assert (
            refused.status_code == 415 and "application/json" in refused.json()["error"]["message"]
        )
    assert client.post("/x", content=b"{}").status_code == 415  # no type: a Blob from a page
    assert client.get("/x").status_code == 200  # a GET has no body to check
    big = client.post("/x", content=b"1" * 1001, headers=JSON)
    assert big.status_code == 413 and "--max-body-mb" in big.json()["error"]["message"]

    def chunks():
        yield b"[" * 600
        yield b"]" * 600

    streamed = client.post("/x", content=chunks(), headers=JSON)  # no Content-Length
    assert streamed.status_code == 413
    foreign = client.get("/x", headers={"Host": "evil.example"})
    assert foreign.status_code == 421 and "--allowed-hosts" in foreign.json()["error"]["message"]
    page = client.post("/x", content=b"{}", headers={**JSON, "Origin": "http://evil.example"})
    assert page.status_code == 403 and "--allowed-origins" in page.json()["error"]["message"]
    assert client.post("/x", content=b"{}", headers={**JSON, "Origin": ORIGIN}).status_code == 200


# -- a real server -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server():
    proc = ServeProcess(
        "--max-prompt-len", "256", "--min-response-len", "32", "-p", "max_num_seqs=2",
        "--header-timeout", "2", "--body-timeout", "2", "--keep-alive-timeout", "2",
        "--max-body-mb", "16", "--allowed-origins", ORIGIN, "--grace", "1",
    )  # fmt: skip
    yield proc
    proc.stop()
    log = proc.stderr()
    assert "Traceback" not in log and "Exception" not in log, log


def chat(text: str, **fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], **fields}


def _connect(server: ServeProcess) -> socket.socket:
    where = urlsplit(server.root)
    return socket.create_connection((where.hostname, where.port), timeout=30)


def _closed(conn: socket.socket) -> bytes:
    """What the server sent until it closed the connection (raises if it stays open 30 s)."""
    got = b""
    while True:
        part = conn.recv(65536)
        if not part:
            return got
        got += part


def test_a_page_cannot_drive_the_server(server):
    url = server.url + "/chat/completions"
    body = json.dumps(chat("Hi", max_tokens=2))
    plain = httpx.post(url, content=body, headers={"Content-Type": "text/plain"}, timeout=30)
    assert plain.status_code == 415
    rebound = httpx.post(url, content=body, headers={**JSON, "Host": "attacker.example"},
                         timeout=30)  # fmt: skip
    assert rebound.status_code == 421
    local = httpx.get(server.root + "/health", headers={"Host": "localhost"}, timeout=30)
    assert local.status_code == 200
    preflight = httpx.options(url, headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type,authorization",
    }, timeout=30)  # fmt: skip
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == ORIGIN
    allowed = httpx.post(url, content=body, headers={**JSON, "Origin": ORIGIN}, timeout=120)
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.post(url, content=body, headers={**JSON, "Origin": "http://evil.example"},
                       timeout=30)  # fmt: skip
    assert other.status_code == 403 and "access-control-allow-origin" not in other.headers


def test_bodies_too_big_deep_or_long_are_4xx(server):
    url = server.url + "/completions"
    deep = b'{"model": "smollm2", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    reply = httpx.post(url, content=deep, headers=JSON, timeout=30)
    assert reply.status_code == 400 and "nested" in reply.json()["error"]["message"]
    with _connect(server) as conn:  # a body over the limit, told by its Content-Length
        conn.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
            b"application/json\r\nContent-Length: 17825792\r\n\r\n" + b" " * 4096
        )
        assert _closed(conn).startswith(b"HTTP/1.1 413")
    # 10 MB of prompt under the body limit: refused by its bytes, before it is tokenized
    long = httpx.post(url, json={"model": MODEL, "prompt": "ab " * 3_500_000}, timeout=60)
    error = long.json()["error"]
    assert long.status_code == 400 and error["code"] == "context_length_exceeded"
    assert "bytes" in error["message"] and "--max-prompt-len" in error["message"]
    assert httpx.post(url, json={"model": MODEL, "prompt": "Hi", "max_tokens": 2},
                      timeout=120).status_code == 200  # fmt: skip


def test_slow_clients_are_cut_off(server):
    # headers that never end, a byte at a time: closed at the header timeout
    with _connect(server) as conn:
        conn.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        closed = False
        for _ in range(120):  # 30 s at most
            readable, _, _ = select.select([conn], [], [], 0.25)
            try:
                if readable and conn.recv(1) == b"":
                    closed = True
                    break
                conn.sendall(b"X-Slow: 1\r\n")
            except OSError:
                closed = True
                break
        assert closed
    # a connection that sends nothing: closed too
    with _connect(server) as conn:
        assert _closed(conn) == b""
    # a body that stops half-way: 408, then closed
    with _connect(server) as conn:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                     b"application/json\r\nContent-Length: 100\r\n\r\n{\"model\": ")  # fmt: skip
        answer = _closed(conn)
        assert answer.startswith(b"HTTP/1.1 408") and b"--body-timeout" in answer
    # an idle kept-alive connection: closed after its answer
    with _connect(server) as conn:
        conn.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert _closed(conn).startswith(b"HTTP/1.1 200")
    # a client that leaves mid-body: nothing in the log (checked when the server stops)
    with _connect(server) as conn:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                     b"application/json\r\nContent-Length: 100\r\n\r\n{\"mod")  # fmt: skip
    assert httpx.get(server.root + "/health", timeout=30).status_code == 200


def test_sigterm_ends_every_stream_with_abort_and_done(server):
    """Last in this file: it stops the server."""
    body = chat("Count to a thousand.", max_tokens=900, stream=True, ignore_eos=True)
    lines = []
    with httpx.stream("POST", server.url + "/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        stream = r.iter_lines()
        for line in stream:
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get(
                "content"
            ):
                break  # it generates
        assert server.stop(signal.SIGTERM) == 0
        lines = [line for line in stream if line]
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2][6:])["error"]
    assert error["code"] == "server_shutdown"
    finish = [json.loads(line[6:])["choices"] for line in lines[:-2]]
    assert finish[-1][0]["finish_reason"] == "abort"
