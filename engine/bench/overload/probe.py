"""The idle probe: a process with nothing else to do, timing the server's answers under load.

The loaded clients' event loops lag behind hundreds of streams, so their own latencies say more about
the clients than about the server.
"""

from __future__ import annotations

import asyncio
import signal
import time

import httpx


#: probe requests in flight at once, at most: an admitted probe waits in the server's queue like any
#: other request
_MAX_IN_FLIGHT = 64


def idle_probe(url: str, model: str, period_s: float, timeout_s: float, stop, results) -> None:
    """One small non-streamed completion and one ``GET /health`` every ``period_s``; puts
    ``{"completions": [...], "health": [...]}`` of ``(start_s, status, latency_s)`` on ``results``.

    Each completion goes out on the clock, whether or not the previous one has been answered. A
    probe that waited for its last answer would always arrive just after the step that ended it,
    the moment the engine has just freed a place, and a queue-limit controller would then admit it
    while it refuses the load: the 429s would go unmeasured. The requests are tasks of one event
    loop (no thread to start or to wake per request), and ``/health`` has a connection of its own.

    The probe keeps the niceness it starts with, the server's, unlike the load processes: it times the
    server's answers, so it must not wait behind the server for a CPU.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    out = asyncio.run(_probe(url, {"model": model, "prompt": "probe", "max_tokens": 1}, period_s, timeout_s, stop))
    results.put(out)


async def _probe(url: str, body: dict, period_s: float, timeout_s: float, stop) -> dict[str, list]:
    out: dict[str, list] = {"completions": [], "health": []}
    slots = asyncio.Semaphore(_MAX_IN_FLIGHT)

    async def timed(client: httpx.AsyncClient, name: str, method: str, path: str, json_body: dict | None) -> None:
        t = time.monotonic()
        try:
            status = (await client.request(method, url + path, json=json_body)).status_code
        except httpx.HTTPError:
            status = 0
        out[name].append((t, status, time.monotonic() - t))

    async def one_completion(client: httpx.AsyncClient) -> None:
        try:
            await timed(client, "completions", "POST", "/v1/completions", body)
        finally:
            slots.release()

    async def on_the_clock(send) -> None:
        next_s = time.monotonic()
        while not stop.is_set():
            await send()
            next_s = max(next_s + period_s, time.monotonic())
            await asyncio.sleep(max(0.0, next_s - time.monotonic()))

    limits = httpx.Limits(max_connections=_MAX_IN_FLIGHT, max_keepalive_connections=_MAX_IN_FLIGHT)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as completions, \
            httpx.AsyncClient(timeout=timeout_s) as health:
        tasks: set[asyncio.Task] = set()

        async def send_completion() -> None:
            try:
                await asyncio.wait_for(slots.acquire(), period_s)
            except asyncio.TimeoutError:
                return
            task = asyncio.create_task(one_completion(completions))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

        async def send_health() -> None:
            await timed(health, "health", "GET", "/health", None)

        await asyncio.gather(on_the_clock(send_completion), on_the_clock(send_health))
        if tasks:
            await asyncio.gather(*tasks)
    return out
