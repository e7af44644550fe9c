"""Streaming completions from asyncio clients, in load processes of their own.

A record per request says when it was scheduled, started, answered and ended, and how it ended:
``completed`` (``[DONE]``), ``error_event``, ``closed`` (the stream ended early), ``http`` (a status
other than 200), ``transport_error`` or ``hang`` (no answer or stream end within the timeout).
"""

from __future__ import annotations

import asyncio
import json
import os
import queue
import random
import signal
import string
import time
from collections.abc import AsyncIterable

import httpx


def _record(scheduled_s: float | None) -> dict:
    return {"scheduled_s": scheduled_s, "start_s": time.monotonic(), "status": 0, "first_byte_s": None,
            "end_s": None, "outcome": "", "error": None, "done": False, "chunks": 0}


def error_type(payload: bytes | str) -> str | None:
    """The ``type`` (else ``code``) of an OpenAI-style error body, or None if ``payload`` is not one."""
    try:
        err = json.loads(payload)["error"]
        return err.get("type") or err.get("code") or "error"
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


async def sse_data(chunks: AsyncIterable[bytes]):
    """The ``data:`` payloads of a stream of server-sent events read as byte ``chunks`` (httpx's
    ``aiter_bytes()``, aiohttp's ``content.iter_any()``), decoded (the last one ``[DONE]`` when the server
    ended the stream with it).

    Events are split on ``\n`` alone: httpx's ``aiter_lines`` and ``str.splitlines`` also split on U+0085
    and U+2028, which a random model's text holds inside one JSON event."""
    pending = b""
    async for part in chunks:
        pending += part
        *lines, pending = pending.split(b"\n")
        for raw in lines:
            if raw.startswith(b"data:"):
                yield raw[5:].strip().decode(errors="replace")


async def _read_stream(resp: httpx.Response, rec: dict) -> None:
    rec["status"] = resp.status_code
    rec["first_byte_s"] = time.monotonic()
    if resp.status_code != 200:
        rec["outcome"] = "http"
        rec["error"] = error_type(await resp.aread())
        return
    async for data in sse_data(resp.aiter_bytes()):
        if data == "[DONE]":
            rec["done"] = True
            break
        rec["chunks"] += 1
        if '"error"' in data:
            rec["error"] = error_type(data) or rec["error"]
    rec["outcome"] = "error_event" if rec["error"] else ("completed" if rec["done"] else "closed")


async def send(client: httpx.AsyncClient, url: str, body: dict, timeout_s: float,
               scheduled_s: float | None = None, on_status=None) -> dict:
    """One streamed completion; the record says when it started, answered and ended, and how it ended.

    :param on_status: called with the HTTP status as soon as the answer starts (0: no answer)
    """
    rec = _record(scheduled_s)

    async def exchange() -> None:
        async with client.stream("POST", url + "/v1/completions", json=body) as resp:
            if on_status is not None:
                on_status(resp.status_code)
            await _read_stream(resp, rec)

    try:
        await asyncio.wait_for(exchange(), timeout_s)
    except asyncio.TimeoutError:
        rec["outcome"] = "hang"
    except httpx.HTTPError as exc:
        if rec["status"] != 200:
            rec["outcome"] = "transport_error"
        elif not rec["error"]:  # no error event came before the connection closed
            rec["outcome"] = "closed"
        else:
            rec["outcome"] = "error_event"
        rec["error"] = rec["error"] or type(exc).__name__
    if rec["status"] == 0 and on_status is not None:
        on_status(0)
    rec["end_s"] = time.monotonic()
    return rec


def _body(spec: dict, rng: random.Random) -> dict:
    # the tiny model's tokenizer is byte-level: one ASCII character is one token
    prompt = "".join(rng.choice(string.ascii_letters) for _ in range(spec["prompt_tokens"]))
    return {"model": spec["model"], "prompt": prompt, "max_tokens": spec["max_tokens"], "stream": True,
            "ignore_eos": True, "temperature": 0.0}


def _client(n: int) -> httpx.AsyncClient:
    # Idle connections are dropped well before uvicorn's 5 s keep-alive: a connection the server
    # closes just as the client reuses it would count as a transport error the server did not cause.
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n, keepalive_expiry=2.0)
    return httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits)


async def open_loop(url: str, spec: dict) -> tuple[int, list[dict]]:
    """Poisson arrivals at ``spec['rate']`` for ``spec['duration_s']``, at most ``spec['clients']`` at once."""
    rng = random.Random(spec["seed"])
    arrivals, t = [], rng.expovariate(spec["rate"])
    while t < spec["duration_s"]:
        arrivals.append(t)
        t += rng.expovariate(spec["rate"])
    sem = asyncio.Semaphore(spec["clients"])
    async with _client(spec["clients"]) as client:
        async def one(scheduled_s: float, body: dict) -> dict:
            async with sem:
                return await send(client, url, body, spec["timeout_s"], scheduled_s)

        t0, tasks = time.monotonic(), []
        for at in arrivals:
            await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
            tasks.append(asyncio.create_task(one(t0 + at, _body(spec, rng))))
        return len(arrivals), list(await asyncio.gather(*tasks))


async def closed_loop(url: str, spec: dict) -> tuple[int, list[dict]]:
    """``spec['clients']`` clients each sending the next request as soon as the last one ended."""
    rng = random.Random(spec["seed"])
    deadline = time.monotonic() + spec["duration_s"]
    records: list[dict] = []
    async with _client(spec["clients"]) as client:
        async def loop() -> None:
            while time.monotonic() < deadline:
                rec = await send(client, url, _body(spec, rng), spec["timeout_s"])
                records.append(rec)
                if rec["outcome"] != "completed":
                    await asyncio.sleep(0.05)  # a refused client retries soon, without spinning

        await asyncio.gather(*(loop() for _ in range(spec["clients"])))
    return len(records), records


async def burst(url: str, spec: dict, progress) -> tuple[int, list[dict]]:
    """``spec['clients']`` requests at once; each answer's status is put on ``progress`` as it starts."""
    rng = random.Random(spec["seed"])
    async with _client(spec["clients"]) as client:
        records = await asyncio.gather(*(
            send(client, url, _body(spec, rng), spec["timeout_s"], on_status=lambda code: progress.put(code))
            for _ in range(spec["clients"])))
    return len(records), list(records)


def load_worker(mode: str, url: str, spec: dict, go, results, progress=None, nice: int = 0) -> None:
    """A load process: lower its priority by ``nice``, wait for ``go``, run ``mode`` (open, closed or
    burst), then put ``("records", planned, records)`` on ``results`` (or ``("failed", sentence)``)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent process decides when the load stops
    if nice:
        os.nice(nice)
    results.put(("ready", os.getpid()))
    go.wait()
    try:
        if mode == "open":
            planned, records = asyncio.run(open_loop(url, spec))
        elif mode == "closed":
            planned, records = asyncio.run(closed_loop(url, spec))
        else:
            planned, records = asyncio.run(burst(url, spec, progress))
        results.put(("records", planned, records))
    except Exception as exc:  # reported by the parent; the run goes on
        results.put(("failed", f"{type(exc).__name__}: {exc}"))


class LoadProcesses:
    """``processes`` load processes sharing ``spec['clients']`` and ``spec['rate']`` between them.

    :param mode: ``open``, ``closed`` or ``burst`` (see :func:`load_worker`)
    :param progress: a queue for the burst's answer statuses as they start
    :param nice: added to each load process's niceness as it starts (0 or more)
    """

    def __init__(self, ctx, mode: str, url: str, spec: dict, processes: int, progress=None, nice: int = 0) -> None:
        processes = max(1, min(processes, spec["clients"]))
        self.results, self.go = ctx.Queue(), ctx.Event()
        self.procs = []
        for k in range(processes):
            share = {**spec, "seed": spec["seed"] * 1000 + k, "rate": spec.get("rate", 0.0) / processes,
                     "clients": spec["clients"] // processes + (k < spec["clients"] % processes)}
            worker_args = (mode, url, share, self.go, self.results, progress, nice)
            self.procs.append(ctx.Process(target=load_worker, args=worker_args, daemon=True))

    def start(self, timeout_s: float = 120.0) -> float:
        """Start the processes, wait until each is ready, and let them go together; the start time."""
        for p in self.procs:
            p.start()
        for _ in self.procs:
            self.results.get(timeout=timeout_s)  # ("ready", pid)
        self.go.set()
        return time.monotonic()

    def collect(self, timeout_s: float, on_wait=None) -> tuple[int, list[dict], list[str]]:
        """(requests planned, records, failures) once every process has reported or ``timeout_s`` passed.

        :param on_wait: called about every 5 s while waiting
        """
        deadline = time.monotonic() + timeout_s
        planned, records, failures, pending = 0, [], [], len(self.procs)
        while pending and time.monotonic() < deadline:
            try:
                msg = self.results.get(timeout=min(5.0, max(0.1, deadline - time.monotonic())))
            except queue.Empty:
                if on_wait is not None:
                    on_wait()
                continue
            pending -= 1
            if msg[0] == "records":
                planned += msg[1]
                records += msg[2]
            else:
                failures.append(msg[1])
        if pending:
            failures.append(f"{pending} load process(es) did not report within {timeout_s:.0f} s")
        return planned, records, failures

    def close(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.terminate()
            p.join(5)

