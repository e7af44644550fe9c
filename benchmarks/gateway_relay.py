"""The gateway's own cost of relaying streams: CPU per streamed chunk, against the streams open at once.

    python benchmarks/gateway_relay.py [--concurrency 16,64,256] [--out docs/bench/gateway_relay] [--before DIR]

A gateway in front of a fleet relays every token of every stream: at a few thousand tokens a second per
replica, its CPU per chunk decides how many replicas one gateway process can front. Two stand-in replicas
(processes of this script, ``replica``) stream ``--output-len`` vLLM-shaped chunks per completion,
``--gap-ms`` apart, and export vLLM's gauges; ``tidegate gateway`` (a process of its own, ``--no-admission``
so that every request goes straight through) relays them to a client that keeps ``--concurrency`` streams
open, for ``--requests-per-stream`` completions a stream at each level. The figure is the gateway process's
CPU time (user + system) over the chunks it relayed, from the level's first request to its last byte. Before
the levels, ``--one-by-one`` one-token completions go one at a time to a replica and through the gateway in turn: the
difference of their first bytes' medians is the latency the gateway adds to a request.

Writes ``gateway_relay.json``, ``gateway_relay.md`` and ``gateway_relay.png`` into ``--out``; ``--before
DIR`` adds the run in DIR (its ``gateway_relay.json``, for example of an earlier tree run with
``PYTHONPATH``) to the table and the plot.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from tidegate.engine.bench.overload.server import Server
from tidegate.engine.cli.support import fail
from tidegate.engine.core.figures import save_png


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------- the stand-in replica
def serve_replica(port: int, output_len: int, gap_s: float) -> None:
    """A replica that streams ``output_len`` chunks shaped as vLLM's, ``gap_s`` apart, and exports its gauges."""
    import uvicorn
    from fastapi import FastAPI
    from fastapi.responses import PlainTextResponse, StreamingResponse

    app = FastAPI()
    running = [0]

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse("# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting 0\n"
                                 f"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running {running[0]}\n"
                                 "# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc 0.1\n")

    @app.get("/health")
    @app.get("/ready")
    async def health():
        return {}

    async def stream(n: int):
        running[0] += 1
        try:
            for i in range(n):
                chunk = {"id": "cmpl-relay", "object": "text_completion", "created": 0, "model": "m",
                         "choices": [{"index": 0, "text": " tok", "logprobs": None,
                                      "finish_reason": "length" if i == n - 1 else None}]}
                yield f"data: {json.dumps(chunk)}\n\n".encode()
                await asyncio.sleep(gap_s)
            yield b"data: [DONE]\n\n"
        finally:
            running[0] -= 1

    @app.post("/v1/completions")
    async def complete(body: dict):
        n = body.get("max_tokens")
        return StreamingResponse(stream(n if isinstance(n, int) and n > 0 else output_len),
                                 media_type="text/event-stream")

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="error", access_log=False)


class _Process(Server):
    """A process under test (a stand-in replica, the gateway), started and stopped as ``tidegate serve`` is."""

    def __init__(self, cmd: list[str], log_path: Path) -> None:
        super().__init__([], log_path)
        self.cmd = [*cmd, "--port", str(self.port)]


# ------------------------------------------------------------------------------- the client
async def _drive(url: str, concurrency: int, requests: int, output_len: int) -> dict:
    import aiohttp

    chunks = ok = 0
    ttfb: list[float] = []
    body = {"model": "m", "prompt": "relay " * 16, "max_tokens": output_len, "stream": True}

    async def stream(session: aiohttp.ClientSession, n: int) -> None:
        nonlocal chunks, ok
        for _ in range(n):
            start = time.perf_counter()
            first = True
            async with session.post(url + "/v1/completions", json=body) as r:
                async for line in r.content:
                    if first:
                        ttfb.append(time.perf_counter() - start)
                        first = False
                    if line.startswith(b"data: {"):
                        chunks += 1
                ok += r.status == 200

    per = [requests // concurrency + (i < requests % concurrency) for i in range(concurrency)]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=600)) as session:
        await asyncio.gather(*(stream(session, n) for n in per if n))
    return {"chunks": chunks, "completed": ok, "ttfb_p50_ms": 1e3 * statistics.median(ttfb) if ttfb else None}


async def _one_by_one(urls: list[str], n: int) -> list[list[float]]:
    """``n`` one-token completions to each of ``urls``, one at a time, the urls taking turns (so that a drift of
    the machine falls on each alike): each one's seconds to its first byte."""
    import aiohttp

    body = {"model": "m", "prompt": "relay " * 16, "max_tokens": 1, "stream": True}
    times: list[list[float]] = [[] for _ in urls]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        for _ in range(n):
            for i, url in enumerate(urls):
                start = time.perf_counter()
                async with session.post(url + "/v1/completions", json=body) as r:
                    await r.content.readany()
                    times[i].append(time.perf_counter() - start)
                    await r.read()
    return times


def measure(args) -> dict:
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    logs = Path(tempfile.mkdtemp(prefix="tidegate-gateway-relay-"))  # the processes' logs, beside no summary
    procs = [_Process([sys.executable, __file__, "replica", "--output-len", str(args.output_len), "--gap-ms",
                       str(args.gap_ms)], logs / f"replica_{i}.log") for i in range(2)]
    try:
        for p in procs:
            p.start(60)
        urls = [p.url for p in procs]
        gateway = _Process([sys.executable, "-m", "tidegate", "gateway", "--log-level", "warning", "--no-admission",
                            *[a for u in urls for a in ("--replica", u)]], logs / "gateway.log")
        procs.append(gateway)
        gateway.start(60)
        gurl = gateway.url
        asyncio.run(_drive(gurl, 4, 8, args.output_len))  # warm: connections made, code paths run
        log(f"{args.one_by_one} one-token completions one at a time, to a replica and through the gateway in turn")
        direct, through = asyncio.run(_one_by_one([urls[0], gurl], args.one_by_one))
        overhead = {"completions": args.one_by_one, "direct_p50_ms": 1e3 * statistics.median(direct),
                    "gateway_p50_ms": 1e3 * statistics.median(through),
                    "added_p50_ms": 1e3 * (statistics.median(through) - statistics.median(direct))}
        log(f"  first byte p50 {overhead['direct_p50_ms']:.2f} ms direct, {overhead['gateway_p50_ms']:.2f} ms through "
            "the gateway")
        levels = []
        for c in args.concurrency:
            n = c * args.requests_per_stream
            log(f"{c} streams at once, {n} completions of {args.output_len} chunks")
            cpu0, t0 = gateway.cpu_seconds(), time.perf_counter()
            got = asyncio.run(_drive(gurl, c, n, args.output_len))
            wall, cpu = time.perf_counter() - t0, gateway.cpu_seconds() - cpu0
            row = {"concurrency": c, "requests": n, **got, "wall_s": wall, "gateway_cpu_s": cpu,
                   "us_per_chunk": 1e6 * cpu / max(got["chunks"], 1), "chunks_per_s": got["chunks"] / wall,
                   "gateway_core_share": cpu / wall}
            log(f"  {row['us_per_chunk']:.0f} us of gateway CPU a chunk, {row['chunks_per_s']:.0f} chunks/s, "
                f"{got['completed']} of {n} completed")
            levels.append(row)
    finally:
        for p in procs:
            p.stop()
    return {"label": args.label, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "output_len": args.output_len,
            "gap_ms": args.gap_ms, "one_by_one": overhead, "levels": levels}


def report(runs: list[dict], out: Path) -> None:
    lines = ["# The gateway's CPU per relayed chunk", "",
             "`python benchmarks/gateway_relay.py`; two stand-in replicas, `tidegate gateway --no-admission`.", "",
             "| run | streams at once | completions | chunks | gateway CPU us / chunk | chunks / s "
             "| gateway's share of a core | TTFB p50 ms |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for run in runs:
        for r in run["levels"]:
            ttfb = "" if r["ttfb_p50_ms"] is None else f"{r['ttfb_p50_ms']:.1f}"
            lines.append(f"| {run['label']} ({run['date']}) | {r['concurrency']} | {r['completed']} / {r['requests']} "
                         f"| {r['chunks']:,} | {r['us_per_chunk']:.0f} | {r['chunks_per_s']:,.0f} | "
                         f"{r['gateway_core_share']:.2f} | {ttfb} |")
    lines += ["", "Completions one at a time, to a replica directly and through the gateway in turn (first byte):", "",
              "| run | completions | direct p50 ms | through the gateway p50 ms | added ms |",
              "|---|---:|---:|---:|---:|"]
    for run in runs:
        o = run.get("one_by_one")
        if o:
            lines.append(f"| {run['label']} | {o['completions']} | {o['direct_p50_ms']:.2f} "
                         f"| {o['gateway_p50_ms']:.2f} | {o['added_p50_ms']:+.2f} |")
    (out / "gateway_relay.md").write_text("\n".join(lines) + "\n")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for run in runs:
        xs = [r["concurrency"] for r in run["levels"]]
        ax.plot(xs, [r["us_per_chunk"] for r in run["levels"]], marker="o", label=run["label"])
    ax.set_xscale("log", base=2)
    ax.set_xlabel("streams open at once")
    ax.set_ylabel("gateway CPU per relayed chunk (us)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    save_png(fig, out / "gateway_relay.png", dpi=120)
    plt.close(fig)


def _levels(text: str) -> list[int]:
    """The --concurrency levels; one sentence and exit code 2 when they are not positive integers."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        fail(f"--concurrency {text!r} is not valid: give positive integers separated by commas, as 16,64,256")
    return values


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["replica"]:
        p = argparse.ArgumentParser(prog="gateway_relay.py replica")
        p.add_argument("--port", type=int, required=True)
        p.add_argument("--output-len", type=int, required=True)
        p.add_argument("--gap-ms", type=float, required=True)
        a = p.parse_args(argv[1:])
        serve_replica(a.port, a.output_len, a.gap_ms / 1e3)
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", default="16,64,256", help="streams open at once, each level")
    p.add_argument("--requests-per-stream", type=int, default=8, help="completions each stream sends, one by one")
    p.add_argument("--output-len", type=int, default=64, help="chunks per completion")
    p.add_argument("--gap-ms", type=float, default=20.0, help="the stand-in replicas' time between chunks")
    p.add_argument("--one-by-one", type=int, default=200,
                   help="completions sent one at a time, directly and through the gateway (its added latency)")
    p.add_argument("--label", default="this tree", help="the run's name in the table and the plot")
    p.add_argument("--before", type=Path, default=None, help="a folder with an earlier run's gateway_relay.json")
    p.add_argument("--out", type=Path, default=Path("docs/bench/gateway_relay"))
    args = p.parse_args(argv)
    args.concurrency = _levels(args.concurrency)
    if min(args.requests_per_stream, args.output_len, args.one_by_one) < 1 or not args.gap_ms >= 0:
        fail("--requests-per-stream, --output-len and --one-by-one must be at least 1, and --gap-ms at least 0")
    before = None
    if args.before is not None:
        path = args.before / "gateway_relay.json"
        try:
            before = json.loads(path.read_text())
            before["levels"][0]["us_per_chunk"]
        except (OSError, ValueError, LookupError, TypeError):
            fail(f"{path} is not a run of this script (no readable gateway_relay.json)")
    run = measure(args)
    (args.out / "gateway_relay.json").write_text(json.dumps(run, indent=1))
    report([before, run] if before else [run], args.out)
    log(f"wrote {args.out}/gateway_relay.md and .png")


if __name__ == "__main__":
    main()
