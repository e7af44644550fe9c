"""Streaming completions against vLLM's ``/v1/completions``, from asyncio clients in load processes.

Prompts are lists of token ids (vLLM takes them as they are, no BOS added), so each prompt has exactly
the requested length; ``ignore_eos`` and ``min_tokens`` fix the output length. A record per request:

- ``scheduled_s``, ``start_s``: when the Poisson schedule wanted it sent, and when it was;
- ``status``, ``answer_s``: the HTTP status and when the answer's headers came; ``retry_after`` its header;
- ``first_token_s``, ``last_token_s``: the first and last chunk carrying a choice;
- ``tokens``: completion tokens from the final usage chunk (else the choice chunks counted);
- ``end_s`` and ``outcome``: ``completed`` (``[DONE]``), ``error_event``, ``closed`` (the stream ended
  early), ``http`` (a status other than 200), ``transport_error``, or ``cut`` (still open when the client
  stopped waiting: the end of arrivals plus the drain).

The clients are aiohttp's (:func:`session`). Arrivals are those of
:func:`tidegate.engine.bench.overload.clients.open_loop`; events and error types are read the same way
(``sse_data``, which splits events on ``\n`` alone).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time

import aiohttp

from tidegate.engine.bench.overload import clients as overload_clients
from tidegate.engine.bench.overload.clients import error_type, sse_data
from tidegate.engine.bench.vllm.model import random_prompt


def _record(scheduled_s: float | None) -> dict:
    return {"scheduled_s": scheduled_s, "start_s": time.monotonic(), "status": 0, "answer_s": None,
            "retry_after": None, "first_token_s": None, "last_token_s": None, "tokens": 0, "usage_tokens": None,
            "end_s": None, "outcome": "", "error": None, "done": False}


def dropped_record() -> dict:
    """The record of an arrival a client never sent (every connection of its pool held a stream): outcome
    ``dropped``, at once."""
    rec = _record(None)
    rec["outcome"], rec["end_s"] = "dropped", rec["start_s"]
    return rec


def _chunk(rec: dict, data: str) -> None:
    # Substring tests, not a JSON parse per token: the load processes share the CPUs with the server.
    # Only an error event and the final usage chunk are parsed.
    if data.startswith('{"error"') or '"object":"error"' in data:
        rec["error"] = error_type(data) or "error"
        return
    if '"choices":[{' in data or '"choices": [{' in data:
        now = time.monotonic()
        rec["first_token_s"] = rec["first_token_s"] or now
        rec["last_token_s"] = now
        rec["tokens"] += 1
    if '"completion_tokens"' in data:
        try:
            rec["usage_tokens"] = int(json.loads(data)["usage"]["completion_tokens"])
        except (ValueError, KeyError, TypeError):
            rec["error"] = rec["error"] or "bad_usage_chunk"


def session(connections: int) -> aiohttp.ClientSession:
    """An aiohttp session of at most ``connections`` connections, no timeout of its own (``send`` gives up
    at its deadline). Idle connections are dropped after 2 s, well before the servers' keep-alive: a
    connection the server closes just as the client reuses it would count as a transport error the server
    did not cause. aiohttp reads a stream's chunk for a fraction of httpx's CPU (the gateway's relay
    benchmark: 68-115 us against 233-405 us a chunk), and the load processes share the CPUs with the
    server they time: a starved load process reads first tokens late and counts its own lag as TTFT."""
    connector = aiohttp.TCPConnector(limit=connections, keepalive_timeout=2.0)
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None))


async def _read(resp: aiohttp.ClientResponse, rec: dict) -> None:
    rec["status"], rec["answer_s"] = resp.status, time.monotonic()
    rec["retry_after"] = resp.headers.get("retry-after")
    if resp.status != 200:
        rec["outcome"] = "http"
        rec["error"] = error_type(await resp.read())
        return
    async for data in sse_data(resp.content.iter_any()):
        if data == "[DONE]":
            rec["done"] = True
            break
        _chunk(rec, data)
    rec["outcome"] = "error_event" if rec["error"] else ("completed" if rec["done"] else "closed")


async def send(client: aiohttp.ClientSession, url: str, body: dict, deadline_s: float,
               scheduled_s: float | None = None) -> dict:
    """One streamed completion, given up (outcome ``cut``) at the monotonic time ``deadline_s``."""
    rec = _record(scheduled_s)

    async def exchange() -> None:
        async with client.post(url + "/v1/completions", json=body) as resp:
            await _read(resp, rec)

    try:
        await asyncio.wait_for(exchange(), max(0.0, deadline_s - time.monotonic()))
    except asyncio.TimeoutError:
        rec["outcome"] = "cut"
    except aiohttp.ClientError as exc:
        if rec["status"] != 200:
            rec["outcome"] = "transport_error"
        elif not rec["error"]:
            rec["outcome"] = "closed"
        else:
            rec["outcome"] = "error_event"
        rec["error"] = rec["error"] or type(exc).__name__
    rec["end_s"] = time.monotonic()
    if rec["usage_tokens"] is not None:
        rec["tokens"] = rec["usage_tokens"]
    return rec


def body(spec: dict, rng: random.Random) -> dict:
    """A streamed completion of ``spec['prompt_tokens']`` random ids and exactly ``spec['max_tokens']`` tokens."""
    n = spec["max_tokens"]
    return {"model": spec["model"], "prompt": random_prompt(rng, spec["token_ids"], spec["prompt_tokens"]),
            "max_tokens": n, "min_tokens": n, "ignore_eos": True, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}


async def open_loop(url: str, spec: dict) -> tuple[int, list[dict]]:
    """Poisson arrivals at ``spec['rate']`` for ``spec['duration_s']``; every request is given up at the
    end of arrivals plus ``spec['drain_s']``."""
    rng = random.Random(spec["seed"])
    arrivals, t = [], rng.expovariate(spec["rate"])
    while t < spec["duration_s"]:
        arrivals.append(t)
        t += rng.expovariate(spec["rate"])
    async with session(spec["connections"]) as client:
        t0, tasks = time.monotonic(), []
        deadline_s = t0 + spec["duration_s"] + spec["drain_s"]
        for at in arrivals:
            await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
            tasks.append(asyncio.create_task(send(client, url, body(spec, rng), deadline_s, t0 + at)))
        return len(arrivals), list(await asyncio.gather(*tasks))


async def closed_loop(url: str, spec: dict) -> tuple[int, list[dict]]:
    """``spec['clients']`` clients, each sending its next request as its last one ends, for ``duration_s``."""
    rng = random.Random(spec["seed"])
    t0 = time.monotonic()
    stop_s, deadline_s = t0 + spec["duration_s"], t0 + spec["duration_s"] + spec["drain_s"]
    records: list[dict] = []
    async with session(spec["clients"]) as client:
        async def loop() -> None:
            while time.monotonic() < stop_s:
                rec = await send(client, url, body(spec, rng), deadline_s)
                records.append(rec)
                if rec["outcome"] != "completed":
                    await asyncio.sleep(0.05)

        await asyncio.gather(*(loop() for _ in range(spec["clients"])))
    return len(records), records


def load_worker(mode: str, url: str, spec: dict, go, results, nice: int) -> None:
    """A load process: wait for ``go``, run ``open_loop`` or ``closed_loop``, put ``("records", planned,
    records)`` (or ``("failed", sentence)``) on ``results``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if nice:
        os.nice(nice)
    results.put(("ready", os.getpid()))
    go.wait()
    try:
        planned, records = asyncio.run((open_loop if mode == "open" else closed_loop)(url, spec))
        results.put(("records", planned, records))
    except Exception as exc:  # reported by the parent; the run goes on
        results.put(("failed", f"{type(exc).__name__}: {exc}"))


class LoadProcesses(overload_clients.LoadProcesses):
    """``processes`` load processes sharing the rate (open loop) or the clients (closed loop) of ``spec``;
    started, collected and closed as the overload benchmark's are.

    :param mode: ``open`` or ``closed`` (see :func:`load_worker`)
    :param nice: added to each load process's niceness as it starts (0 or more)
    """

    def __init__(self, ctx, mode: str, url: str, spec: dict, processes: int, nice: int = 0) -> None:
        self.results, self.go = ctx.Queue(), ctx.Event()
        self.procs = []
        clients = spec.get("clients", 0)
        for k in range(processes):
            share = {**spec, "seed": spec["seed"] * 1000 + k, "rate": spec.get("rate", 0.0) / processes,
                     "clients": clients // processes + (k < clients % processes)}
            self.procs.append(ctx.Process(target=load_worker, args=(mode, url, share, self.go, self.results, nice),
                                          daemon=True))
