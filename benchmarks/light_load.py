"""Refusals at light load: the server with its default controller at a small fraction of its
capacity, with busy co-tenant processes on the machine slowing every step.

    python benchmarks/light_load.py [--fraction 0.1] [--duration 60] [--cotenants 1] [--out bench-out/light_load]

A server that refuses when it is not overloaded fails its users for nothing. Counts, per run: requests
sent, completed, 429 and 503 answers (the target is zero of either) and the latencies. Capacity is the
fluid bound lambda_max of the random workload on the shipped ``tiny-cpu`` profile; the co-tenants
are processes spinning on a core each.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import subprocess
import sys
import time
from pathlib import Path

from tidegate.ctrl.theory import capacity
from tidegate.engine.bench.loadgen import plan_random, run, run_load, summarize
from tidegate.engine.core.profile import load_profile
from reliability import free_port, scrape, stop_server, wait_ready  # beside this script


def spin(stop) -> None:
    x = 0
    while not stop.is_set():
        for _ in range(100_000):
            x += 1


def run_once(args, rate: float) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "tidegate", "serve", "--port", str(port)]
    if args.controller:
        cmd += ["--controller", args.controller]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    stop = mp.Event()
    hogs = [mp.Process(target=spin, args=(stop,), daemon=True) for _ in range(args.cotenants)]
    try:
        wait_ready(proc, url, args.controller or "default")
        for h in hogs:
            h.start()
        time.sleep(2.0)
        plan = plan_random(10**9, rate, 1.0, args.input_len, args.output_len, args.seed, args.duration)
        outcomes, wall = run(run_load(url, plan, progress=False, timeout_s=args.duration + 120))
        final = scrape(url)
        s = summarize(outcomes, wall, args.ttft_slo_ms / 1000, args.tpot_slo_ms / 1000)
        return {"controller": args.controller or "default", "offered_rps": rate, "cotenants": args.cotenants, **s,
                "server_rejections": sum(v for k, v in final.items() if k.startswith("tidegate:request_rejections"))}
    finally:
        stop.set()
        for h in hogs:
            h.join(5)
        stop_server(proc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fraction", type=float, default=0.1, help="offered load as a fraction of lambda_max")
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--cotenants", type=int, default=1)
    ap.add_argument("--controller", default=None, help="default: the server's default controller")
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--ttft-slo-ms", type=float, default=1000)
    ap.add_argument("--tpot-slo-ms", type=float, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench-out/light_load")
    args = ap.parse_args()
    lam = capacity([args.input_len + 1], [args.output_len], load_profile("tiny-cpu")).lambda_max_rps
    rate = args.fraction * lam
    print(f"tiny-cpu lambda_max for {args.input_len}+{args.output_len} tokens: {lam:.1f} req/s; offering "
          f"{rate:.2f} req/s for {args.duration:.0f} s with {args.cotenants} busy co-tenant process(es)", flush=True)
    row = run_once(args, rate)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "light_load.json").write_text(json.dumps(row, indent=2))
    cols = ["controller", "offered_rps", "cotenants", "sent", "completed", "rejected_429", "unavailable_503",
            "server_errors_5xx", "ttft_p50_ms", "ttft_p99_ms", "goodput_rps"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    print("| " + " | ".join(f"{row[c]:.3g}" if isinstance(row[c], float) else str(row[c]) for c in cols) + " |")


if __name__ == "__main__":
    main()
