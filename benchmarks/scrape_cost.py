"""What a gateway's scrapes cost a replica: ``tidegate serve``'s CPU per ``/metrics`` read, its whole page
against the few series the gateway asks for (``?name[]=...``, ``engine/gateway/replicas.py``).

    python benchmarks/scrape_cost.py [--scrapes 1000] [--out docs/bench/scrape_cost]

The gateway reads each replica's gauges every 0.1 s by default, so a replica serves ten of these a second to
each gateway in front of it. ``tidegate serve`` (the tiny model, its own engine process) serves a few requests
first so that every histogram holds samples, then ``--scrapes`` reads of each kind, one at a time, alternating
in blocks of 50. The figure is the server's processes' CPU time (user + system) over the reads: unlike a
read's latency, it does not move with what else runs on the machine. Parsing the answer is the gateway's side
(``parse_gauges``), timed here on the two answers. Writes ``scrape_cost.json`` and ``scrape_cost.md``.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import httpx

from tidegate.engine.bench.overload.server import Server
from tidegate.engine.gateway.replicas import METRICS_QUERY, parse_gauges

BLOCK = 50


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scrapes", type=int, default=1000, help="Reads of each kind.")
    ap.add_argument("--out", type=Path, default=Path("docs/bench/scrape_cost"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        server = Server(["--threads", "1"], Path(tmp) / "serve.log")
        server.start(180)
        try:
            with httpx.Client(base_url=server.url, timeout=30) as c:
                for _ in range(4):  # every histogram with samples, as on a serving replica
                    c.post("/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 8,
                                                    "stream": True})
                cpu = {"whole page": 0.0, "the gateway's series": 0.0}
                wall = dict.fromkeys(cpu, 0.0)
                text = {}
                done = 0
                while done < args.scrapes:
                    for kind, query in (("whole page", ""), ("the gateway's series", METRICS_QUERY)):
                        start_cpu, start = server.cpu_seconds(), time.perf_counter()
                        for _ in range(BLOCK):
                            text[kind] = c.get("/metrics" + query).text
                        wall[kind] += time.perf_counter() - start
                        cpu[kind] += server.cpu_seconds() - start_cpu
                    done += BLOCK
                    print(f"[{time.strftime('%H:%M:%S')}] {done} of {args.scrapes} reads of each", file=sys.stderr,
                          flush=True)
        finally:
            server.stop()
    rows = []
    for kind in cpu:
        start = time.perf_counter()
        for _ in range(200):
            gauges = parse_gauges(text[kind])
        parse_s = (time.perf_counter() - start) / 200
        rows.append({"read": kind, "bytes": len(text[kind].encode()), "server_cpu_ms": 1e3 * cpu[kind] / done,
                     "latency_ms": 1e3 * wall[kind] / done, "parse_ms": 1e3 * parse_s, "gauges": sorted(gauges)})
    result = {"scrapes": done, "machine": platform.processor() or platform.machine(), "date": time.strftime("%Y-%m-%d"),
              "rows": rows}
    (args.out / "scrape_cost.json").write_text(json.dumps(result, indent=1))
    lines = [f"`python benchmarks/scrape_cost.py --scrapes {args.scrapes}`, {result['date']}: `tidegate serve` "
             f"(tiny model) read {done} times each way.", "",
             "| read | bytes | server CPU a read | latency a read | the gateway's parse | gauges |",
             "|---|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['read']} | {r['bytes']:,} | {r['server_cpu_ms']:.2f} ms | {r['latency_ms']:.2f} ms | "
                     f"{r['parse_ms']:.3f} ms | {', '.join(r['gauges'])} |")
    (args.out / "scrape_cost.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
