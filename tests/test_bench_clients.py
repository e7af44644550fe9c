"""The overload benchmark's streaming client reads server-sent events as the server sends them."""

from __future__ import annotations

import asyncio
import json
import time

import httpx

from tidegate.engine.bench.overload.clients import send
from tidegate.engine.bench.vllm.clients import send as vllm_send


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


def test_the_vllm_benchmark_client_times_tokens_and_reads_retry_after():
    body = _events(["a\u2028b", "c", "d"]).replace(
        b"data: [DONE]", b'data: {"choices": [], "usage": {"completion_tokens": 3}}\n\ndata: [DONE]')

    async def go(status: int, content: bytes, headers: dict) -> dict:
        transport = httpx.MockTransport(lambda request: httpx.Response(status, content=content, headers=headers))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await vllm_send(client, "http://test", {"prompt": [1, 2]}, time.monotonic() + 5.0)

    rec = asyncio.run(go(200, body, {}))
    assert rec["outcome"] == "completed" and rec["tokens"] == 3 and rec["usage_tokens"] == 3
    rec = asyncio.run(go(429, b'{"error": {"type": "rate_limited"}}', {"Retry-After": "2"}))
    assert rec["outcome"] == "http" and rec["status"] == 429 and rec["retry_after"] == "2"
