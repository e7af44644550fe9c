"""The idle probe: a process with nothing else to do, timing the server's answers under load.

The loaded clients' event loops lag behind hundreds of streams, so their own latencies say more about
the clients than about the server.
"""

from __future__ import annotations

import signal
import threading
import time

import httpx


#: probe requests in flight at once, at most: an admitted probe waits in the server's queue like any
#: other request, and the probe must not run out of threads while it does
_MAX_IN_FLIGHT = 64


def idle_probe(url: str, model: str, period_s: float, timeout_s: float, stop, results) -> None:
    """One small non-streamed completion and one ``GET /health`` every ``period_s``; puts
    ``{"completions": [...], "health": [...]}`` of ``(start_s, status, latency_s)`` on ``results``.

    Each completion goes out on the clock, on a thread of its own, whether or not the previous one
    has been answered. A probe that waited for its last answer would always arrive just after the
    step that ended it, the moment the engine has just freed a place, and a queue-limit controller
    would then admit it while it refuses the load: the 429s would go unmeasured.

    The probe keeps the niceness it starts with, the server's, unlike the load processes: it times the
    server's answers, so it must not wait behind the server for a CPU.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    body = {"model": model, "prompt": "probe", "max_tokens": 1}
    out: dict[str, list] = {"completions": [], "health": []}
    lock = threading.Lock()
    slots = threading.BoundedSemaphore(_MAX_IN_FLIGHT)

    def timed(client: httpx.Client, name: str, method: str, path: str, json_body: dict | None) -> None:
        t = time.monotonic()
        try:
            status = client.request(method, url + path, json=json_body).status_code
        except httpx.HTTPError:
            status = 0
        with lock:
            out[name].append((t, status, time.monotonic() - t))

    def one_completion(client: httpx.Client) -> None:
        try:
            timed(client, "completions", "POST", "/v1/completions", body)
        finally:
            slots.release()

    def completions() -> None:
        workers: list[threading.Thread] = []
        limits = httpx.Limits(max_connections=_MAX_IN_FLIGHT, max_keepalive_connections=_MAX_IN_FLIGHT)
        with httpx.Client(timeout=timeout_s, limits=limits) as client:
            next_s = time.monotonic()
            while not stop.is_set():
                if slots.acquire(timeout=period_s):
                    worker = threading.Thread(target=one_completion, args=(client,), daemon=True)
                    worker.start()
                    workers.append(worker)
                next_s = max(next_s + period_s, time.monotonic())
                stop.wait(max(0.0, next_s - time.monotonic()))
            for worker in workers:
                worker.join()

    def health() -> None:
        with httpx.Client(timeout=timeout_s) as client:
            next_s = time.monotonic()
            while not stop.is_set():
                timed(client, "health", "GET", "/health", None)
                next_s = max(next_s + period_s, time.monotonic())
                stop.wait(max(0.0, next_s - time.monotonic()))

    threads = [threading.Thread(target=completions), threading.Thread(target=health)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    results.put(out)
