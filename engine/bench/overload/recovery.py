"""Part B after the engine is killed: the burst's streams starting, ``/ready`` coming back with a new
engine, and a new request completing."""

from __future__ import annotations

import queue
import time
from collections import Counter

import httpx

from tidegate.engine.bench.overload.clients import error_type
from tidegate.engine.bench.overload.server import Server


def wait_for_streams(progress, n: int, timeout_s: float) -> Counter:
    """The statuses of the burst's answers as they start, until all ``n`` have one or none has
    come for 3 s (the rest are waiting in the server's queue)."""
    statuses: Counter = Counter()
    deadline = time.monotonic() + timeout_s
    while sum(statuses.values()) < n and time.monotonic() < deadline:
        try:
            statuses[progress.get(timeout=3.0)] += 1
        except queue.Empty:
            if statuses:
                break
    return statuses


def watch_recovery(server: Server, killed_pid: int, t_kill: float, timeout_s: float) -> dict:
    """Poll ``/ready`` until it answers 200 with an engine other than the killed one."""
    out: dict = {"ready_down_after_kill_s": None, "ready_again_after_kill_s": None, "new_engine_pid": None}
    seen: Counter = Counter()
    while time.monotonic() - t_kill < timeout_s:
        status = server.ready_status()
        seen[status] += 1
        if status != 200 and out["ready_down_after_kill_s"] is None:
            out["ready_down_after_kill_s"] = time.monotonic() - t_kill
        if status == 200:
            pid = server.engine_pid()
            if pid is not None and pid != killed_pid:
                out["ready_again_after_kill_s"] = time.monotonic() - t_kill
                out["new_engine_pid"] = pid
                break
        if server.proc.poll() is not None:
            out["server_exit_code"] = server.proc.returncode
            break
        time.sleep(0.1)
    out["ready_statuses"] = {str(k): v for k, v in seen.items()}
    return out


def new_request(server: Server, model: str, t_kill: float, timeout_s: float) -> dict:
    """A new small request once ``/ready`` is back: the first try's answer, then tries every 0.5 s
    until one completes or ``timeout_s`` after the kill."""
    out: dict = {"new_request_tries": 0, "request_completes_after_kill_s": None}
    while time.monotonic() - t_kill < timeout_s:
        t = time.monotonic()
        try:
            resp = httpx.post(server.url + "/v1/completions", timeout=timeout_s,
                              json={"model": model, "prompt": "after the kill", "max_tokens": 8})
            status, error = resp.status_code, error_type(resp.content) if resp.status_code != 200 else None
        except httpx.HTTPError as exc:
            status, error = 0, type(exc).__name__
        out["new_request_tries"] += 1
        if out["new_request_tries"] == 1:
            out.update(new_request_status=status, new_request_error=error, new_request_completed=status == 200,
                       new_request_latency_s=time.monotonic() - t)
        if status == 200:
            out["request_completes_after_kill_s"] = time.monotonic() - t_kill
            break
        time.sleep(0.5)
    return out

