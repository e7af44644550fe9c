"""The overload benchmark's streaming client reads server-sent events as the server sends them."""

from __future__ import annotations

import asyncio
import json
import time

import httpx

from tidegate.engine.bench.overload.clients import send
from tidegate.engine.bench.vllm.clients import send as vllm_send, session


def _events(texts: list[str]) -> bytes:
    chunks = [json.dumps({"choices": [{"text": t, "index": 0}]}, ensure_ascii=False) for t in texts]
    return "".join(f"data: {c}\n\n" for c in chunks).encode() + b"data: [DONE]\n\n"


def _run(body: bytes, status: int = 200) -> dict:
    transport = httpx.MockTransport(lambda request: httpx.Response(status, content=body))

    async def go() -> dict:
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await send(client, "http://test", {"prompt": "x"}, timeout_s=5.0)
    return asyncio.run(go())


def test_a_line_separator_inside_an_event_does_not_split_it():
    rec = _run(_events(["a\u2028b", "c\u0085d", "e"]))
    assert rec["outcome"] == "completed" and rec["done"]
    assert rec["chunks"] == 3 and rec["error"] is None


def test_an_error_event_and_an_http_error_are_told_apart():
    rec = _run(b'data: {"error": {"type": "overloaded"}}\n\ndata: [DONE]\n\n')
    assert rec["outcome"] == "error_event" and rec["error"] == "overloaded"
    rec = _run(b'{"error": {"type": "rate_limited"}}', status=429)
    assert rec["outcome"] == "http" and rec["status"] == 429 and rec["error"] == "rate_limited"


def _vllm_send(status: int, parts: list[bytes], headers: dict | None = None, deadline_s: float = 5.0) -> dict:
    """The vLLM benchmark's client against a server that answers ``status`` and writes ``parts`` one by one."""
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    async def handler(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(status=status, headers=headers or {})
        await resp.prepare(request)
        for part in parts:
            await resp.write(part)
            await asyncio.sleep(0.01)
        await resp.write_eof()
        return resp

    async def go() -> dict:
        app = web.Application()
        app.router.add_post("/v1/completions", handler)
        server = TestServer(app)
        await server.start_server()
        try:
            async with session(1) as client:
                url = str(server.make_url("")).rstrip("/")
                return await vllm_send(client, url, {"prompt": [1, 2]}, time.monotonic() + deadline_s)
        finally:
            await server.close()
    return asyncio.run(go())


def test_the_vllm_benchmark_client_times_tokens_and_reads_retry_after():
    body = _events(["a\u2028b", "c", "d"]).replace(
        b"data: [DONE]", b'data: {"choices": [], "usage": {"completion_tokens": 3}}\n\ndata: [DONE]')
    # the events cut anywhere, a line separator inside one of them: three tokens, their times, the usage
    rec = _vllm_send(200, [body[i:i + 7] for i in range(0, len(body), 7)])
    assert rec["outcome"] == "completed" and rec["done"] and rec["tokens"] == 3 and rec["usage_tokens"] == 3
    assert rec["start_s"] < rec["answer_s"] <= rec["first_token_s"] < rec["last_token_s"] <= rec["end_s"]
    rec = _vllm_send(429, [b'{"error": {"type": "rate_limited"}}'], {"Retry-After": "2"})
    assert rec["outcome"] == "http" and rec["status"] == 429 and rec["retry_after"] == "2"
    assert rec["error"] == "rate_limited" and rec["first_token_s"] is None
    # a stream that ends without [DONE], one that carries an error event, and one still open at the deadline
    assert _vllm_send(200, [body[:40]])["outcome"] == "closed"
    assert _vllm_send(200, [b'data: {"error": {"type": "overloaded"}}\n\ndata: [DONE]\n\n'])["outcome"] == "error_event"
    slow = [b'data: {"choices": [{"text": "a", "index": 0}]}\n\n'] * 100  # 10 ms apart: a second
    rec = _vllm_send(200, slow, deadline_s=0.3)
    assert rec["outcome"] == "cut" and rec["first_token_s"] is not None and rec["end_s"] - rec["start_s"] < 0.6
