"""Reliability under overload: the tiny CPU model at a multiple of its capacity, many concurrent
streaming clients from ``tidegate loadgen``, one run per controller.

    python benchmarks/reliability.py [--load 3] [--duration 60] [--concurrency 256] \
        [--controllers watermark,greedy] [--out bench-out/reliability]

Checks, per controller: zero 5xx; every request accounted for (completed + 429 + 503 + stream
errors = sent); 429 answer latency p50/p99, as seen by an idle probe process sending one small
request every 50 ms (the loaded client's own figure is reported beside it); KV usage never above capacity (sampled from
/metrics every 100 ms); resident memory growth of the server over the run. Capacity is the
fluid bound lambda_max of the random workload on the shipped ``tiny-cpu`` profile.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import queue
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from tidegate.ctrl.theory import capacity
from tidegate.engine.bench.loadgen import plan_random, run, run_load, summarize
from tidegate.engine.core.profile import load_profile


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def scrape(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=5).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if not s.labels.get("le"):
                out[s.name] = s.value
    return out


def probe(url: str, stop, results, period_s: float = 0.05) -> None:
    """In its own process: one small request every ``period_s``; records (status, latency).

    The loaded client's own event loop lags behind hundreds of streams, so the latency of a 429
    is measured here, by a client with nothing else to do."""
    with httpx.Client(timeout=120) as client:
        while not stop.is_set():
            t = time.perf_counter()
            try:
                status = client.post(url + "/v1/completions",
                                     json={"model": "tiny", "prompt": "probe", "max_tokens": 1}).status_code
            except httpx.HTTPError:
                status = 0
            results.put((status, time.perf_counter() - t))
            stop.wait(period_s)


def wait_ready(proc: subprocess.Popen, url: str, controller: str, timeout_s: float = 120.0) -> None:
    """Poll /ready until the server answers 200; raise if it exits or takes longer than ``timeout_s``."""
    deadline = time.time() + timeout_s
    while True:
        try:
            if httpx.get(url + "/ready", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            raise RuntimeError(f"server for {controller} did not start")
        time.sleep(0.2)


def run_one(controller: str, args, rate: float) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "tidegate", "serve", "--port", str(port), "--controller",
                             controller, "--kv-capacity-tokens", str(args.kv_capacity_tokens),
                             "--max-in-flight", "100000", "--queue-timeout-s", str(args.queue_timeout_s)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        wait_ready(proc, url, controller)
        # warm up, then measure memory from here
        run(run_load(url, plan_random(20, 50.0, 1.0, args.input_len, args.output_len, 1), progress=False))
        rss_start = rss_mib(proc.pid)
        kv_samples, stop = [], threading.Event()

        def sampler():
            while not stop.is_set():
                try:
                    kv_samples.append(scrape(url).get("tidegate:kv_cache_usage_perc", 0.0))
                except Exception:
                    pass
                stop.wait(0.1)
        t = threading.Thread(target=sampler, daemon=True)
        t.start()
        probe_stop, probe_results = mp.Event(), mp.Queue()
        prober = mp.Process(target=probe, args=(url, probe_stop, probe_results), daemon=True)
        prober.start()
        plan = plan_random(10**9, rate, 1.0, args.input_len, args.output_len, args.seed, args.duration)
        outcomes, wall = run(run_load(url, plan, max_concurrency=args.concurrency, progress=False,
                                      timeout_s=args.duration + 120))
        stop.set()
        probe_stop.set()
        t.join()
        probes = []
        while prober.is_alive() or not probe_results.empty():
            try:
                probes.append(probe_results.get(timeout=1))
            except queue.Empty:
                if not prober.is_alive():
                    break
        prober.join(5)
        probe_429 = np.array([lat for status, lat in probes if status == 429]) * 1000
        rss_end = rss_mib(proc.pid)
        final = scrape(url)
        s = summarize(outcomes, wall, args.ttft_slo_ms / 1000, args.tpot_slo_ms / 1000)
        accounted = s["completed"] + s["rejected_429"] + s["unavailable_503"] + s["stream_errors"]
        return {"controller": controller, "offered_rps": rate, **s, "accounted": accounted,
                "probe_429": int(probe_429.size),
                "probe_429_p50_ms": float(np.percentile(probe_429, 50)) if probe_429.size else float("nan"),
                "probe_429_p99_ms": float(np.percentile(probe_429, 99)) if probe_429.size else float("nan"),
                "probe_5xx": sum(500 <= status < 600 for status, _ in probes),
                "all_accounted": accounted + s["server_errors_5xx"] + s["connection_errors"] == s["sent"],
                "kv_usage_max": max(kv_samples) if kv_samples else float("nan"),
                "kv_samples": len(kv_samples), "rss_start_mib": rss_start, "rss_end_mib": rss_end,
                "rss_growth": rss_end / rss_start - 1, "evictions": final.get("tidegate:num_preemptions_total", 0.0)}
    finally:
        stop_server(proc)


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM (the server drains), then SIGKILL after a minute."""
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--load", type=float, default=3.0, help="offered load as a multiple of lambda_max")
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--kv-capacity-tokens", type=int, default=16384)
    ap.add_argument("--queue-timeout-s", type=float, default=10.0)
    ap.add_argument("--ttft-slo-ms", type=float, default=1000)
    ap.add_argument("--tpot-slo-ms", type=float, default=100)
    ap.add_argument("--controllers", default="watermark,greedy")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench-out/reliability")
    args = ap.parse_args()
    profile = load_profile("tiny-cpu")
    lam = capacity([args.input_len + 1], [args.output_len], profile).lambda_max_rps
    rate = args.load * lam
    print(f"tiny-cpu lambda_max for {args.input_len}+{args.output_len} tokens: {lam:.1f} req/s; "
          f"offering {rate:.1f} req/s "
          f"for {args.duration:.0f} s with up to {args.concurrency} concurrent streams", flush=True)
    rows = [run_one(c, args, rate) for c in args.controllers.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "reliability.json").write_text(json.dumps(rows, indent=2))
    cols = ["controller", "sent", "completed", "rejected_429", "unavailable_503", "server_errors_5xx",
            "stream_errors", "connection_errors", "all_accounted", "probe_429", "probe_429_p50_ms", "probe_429_p99_ms",
            "probe_5xx", "reject_latency_p50_ms", "reject_latency_p99_ms",
            "ttft_p50_ms", "ttft_p99_ms", "tpot_p99_ms", "goodput_rps", "throughput_rps", "kv_usage_max",
            "evictions", "rss_start_mib", "rss_end_mib", "rss_growth"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(f"{r[c]:.3g}" if isinstance(r[c], float) else str(r[c]) for c in cols) + " |")


if __name__ == "__main__":
    main()
