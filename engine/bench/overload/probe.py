"""The idle probe: a process with nothing else to do, timing the server's answers under load.

The loaded clients' event loops lag behind hundreds of streams, so their own latencies say more about
the clients than about the server.
"""

from __future__ import annotations

import signal
import threading
import time

import httpx


def idle_probe(url: str, model: str, period_s: float, timeout_s: float, stop, results) -> None:
    """One small non-streamed completion and one ``GET /health`` every ``period_s``, each on its own
    thread; puts ``{"completions": [...], "health": [...]}`` of ``(start_s, status, latency_s)`` on ``results``.

    The probe keeps the niceness it starts with, the server's, unlike the load processes: it times the
    server's answers, so it must not wait behind the server for a CPU.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    body = {"model": model, "prompt": "probe", "max_tokens": 1}
    out: dict[str, list] = {"completions": [], "health": []}

    def every_period(name: str, method: str, path: str, json_body: dict | None) -> None:
        with httpx.Client(timeout=timeout_s) as client:
            next_s = time.monotonic()
            while not stop.is_set():
                t = time.monotonic()
                try:
                    status = client.request(method, url + path, json=json_body).status_code
                except httpx.HTTPError:
                    status = 0
                out[name].append((t, status, time.monotonic() - t))
                next_s = max(next_s + period_s, time.monotonic())
                stop.wait(max(0.0, next_s - time.monotonic()))

    threads = [threading.Thread(target=every_period, args=("completions", "POST", "/v1/completions", body)),
               threading.Thread(target=every_period, args=("health", "GET", "/health", None))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    results.put(out)

