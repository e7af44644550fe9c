"""Clients that hold a connection without finishing their request: a head or a body that never ends
(slow loris) is cut off in bounded time, and clients that keep to the rules are not."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from tidegate.engine.serve.connections import http_protocol
from tidegate.engine.serve.operator import BodyLimits
from tests.test_server import free_port

pytestmark = pytest.mark.timeout(60)

HEAD_S = 0.4
BODY_S = 0.4


@pytest.fixture(scope="module")
def server():
    app = FastAPI()

    @app.get("/ping")
    async def ping():
        return {"ok": True}

    @app.post("/echo")
    async def echo(http: Request):
        return {"bytes": len(await http.body())}

    @app.post("/stream")
    async def stream(http: Request):
        size = len(await http.body())

        async def chunks():
            for i in range(6):  # 1.2 s in all: three times the head's and the body's time
                yield f"{size}:{i};".encode()
                await asyncio.sleep(HEAD_S / 2)

        return StreamingResponse(chunks(), media_type="text/plain")

    app.add_middleware(BodyLimits, max_bytes=1 << 20, timeout_s=BODY_S)
    port = free_port()
    s = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error", timeout_keep_alive=5,
                                      http=http_protocol(HEAD_S)))
    threading.Thread(target=s.run, daemon=True).start()
    deadline = time.time() + 20
    while not s.started:
        assert time.time() < deadline, "server did not start"
        time.sleep(0.01)
    yield port
    s.should_exit = True


def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=5)


def _closed_within(c: socket.socket, seconds: float) -> bytes | None:
    """What the server sent before it closed the connection, or None if it was still open after ``seconds``."""
    c.settimeout(seconds)
    got = b""
    try:
        while True:
            chunk = c.recv(65536)
            if not chunk:
                return got
            got += chunk
    except TimeoutError:
        return None


def _answer(c: socket.socket) -> bytes:
    c.settimeout(5)
    got = b""
    while b"\r\n\r\n" not in got or not got.rstrip().endswith(b"}"):
        chunk = c.recv(65536)
        assert chunk, f"closed after {got!r}"
        got += chunk
    return got


GET = b"GET /ping HTTP/1.1\r\nHost: x\r\n\r\n"


def test_a_connection_that_sends_nothing_or_trickles_its_head_is_closed(server):
    silent = _connect(server)
    start = time.monotonic()
    assert _closed_within(silent, 5 * HEAD_S) == b""
    assert HEAD_S * 0.9 <= time.monotonic() - start < 3 * HEAD_S
    loris = _connect(server)
    start = time.monotonic()
    closed = None
    for byte in GET[:-2]:  # a byte at a time, each well inside the head's time: the head's whole time counts
        try:
            loris.sendall(bytes([byte]))
        except (BrokenPipeError, ConnectionResetError):
            closed = time.monotonic() - start
            break
        time.sleep(HEAD_S / 8)
    if closed is None:
        assert _closed_within(loris, 2 * HEAD_S) is not None
        closed = time.monotonic() - start
    assert HEAD_S * 0.9 <= closed < 3 * HEAD_S


def test_a_head_sent_in_pieces_in_time_and_an_idle_keep_alive_connection_are_served(server):
    c = _connect(server)
    for piece in (GET[:10], GET[10:20], GET[20:]):
        c.sendall(piece)
        time.sleep(HEAD_S / 5)
    assert b"200 OK" in _answer(c)
    time.sleep(2 * HEAD_S)  # idle between requests: uvicorn's keep-alive time (5 s here), not the head's
    c.sendall(GET)
    assert b"200 OK" in _answer(c)
    for piece in (GET[:10], GET[10:]):  # the next head is timed from its first byte
        c.sendall(piece)
        time.sleep(HEAD_S / 2)
    assert b"200 OK" in _answer(c)
    c.close()


def test_a_body_that_does_not_arrive_in_time_gets_408_and_one_that_does_is_read(server):
    c = _connect(server)
    c.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 10\r\n\r\n12345")
    start = time.monotonic()
    got = _closed_within(c, 5 * BODY_S)
    assert got is not None and got.startswith(b"HTTP/1.1 408"), got
    assert b"did not arrive whole within 0.4 s" in got and time.monotonic() - start < 3 * BODY_S
    c = _connect(server)
    c.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n12345")
    time.sleep(BODY_S / 4)
    c.sendall(b"67890")
    assert b'{"bytes":10}' in _answer(c)
    c.close()


def test_an_answer_that_streams_longer_than_both_times_runs_to_its_end(server):
    with httpx.Client(base_url=f"http://127.0.0.1:{server}", timeout=10) as c:
        for _ in range(2):  # and the kept-alive connection serves the next one
            r = c.post("/stream", content=b"abc")
            assert r.status_code == 200 and r.text == "".join(f"3:{i};" for i in range(6))
