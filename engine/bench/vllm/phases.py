"""The runs against a started vLLM server: a warm-up, the capacity run, and one load of Poisson arrivals."""

from __future__ import annotations

import queue
import time
from pathlib import Path

import httpx

from tidegate.engine.bench.overload import log
from tidegate.engine.bench.overload.probe import idle_probe
from tidegate.engine.bench.overload.server import Poller, ServerError, metric
from tidegate.engine.bench.vllm.clients import LoadProcesses
from tidegate.engine.bench.vllm.server import VllmServer
from tidegate.engine.bench.vllm.stats import request_stats


class QueueSampler(Poller):
    """Polls vLLM's ``/metrics`` every ``period_s``: (time, running, waiting, KV usage)."""

    def __init__(self, server: VllmServer, period_s: float) -> None:
        super().__init__(period_s)
        self.server = server

    def sample(self, t: float) -> None:
        try:
            m = self.server.metrics()
            self.samples.append((t, metric(m, "vllm:num_requests_running"), metric(m, "vllm:num_requests_waiting"),
                                 metric(m, "vllm:kv_cache_usage_perc")))
        except (httpx.HTTPError, ValueError):
            self.failures += 1


def closed_run(ctx, server: VllmServer, spec: dict, *, clients: int, duration_s: float, processes: int,
               nice: int, drain_s: float) -> tuple[float, list[dict], list[str]]:
    """``clients`` closed-loop clients for ``duration_s``: (start time, records, failures)."""
    load = LoadProcesses(ctx, "closed", server.url, {**spec, "clients": clients, "duration_s": duration_s,
                                                     "drain_s": drain_s}, min(processes, clients), nice)
    try:
        t0 = load.start()
        _, records, failures = load.collect(duration_s + drain_s + 60)
    finally:
        load.close()
    return t0, records, failures


def window_tokens(records: list[dict], start_s: float, end_s: float) -> float:
    """Output tokens streamed between ``start_s`` and ``end_s``, each request's tokens spread evenly from
    its first to its last: a closed loop's requests end in waves, so counting whole completions in a
    window of a few seconds would count 0 or 64 of them at a time."""
    total = 0.0
    for r in records:
        first, last = r["first_token_s"], r["last_token_s"]
        if first is None or r["tokens"] < 1:
            continue
        if last <= first:
            total += r["tokens"] * (start_s <= first <= end_s)
            continue
        overlap = max(0.0, min(last, end_s) - max(first, start_s))
        total += r["tokens"] * overlap / (last - first)
    return total


def measure_capacity(ctx, server: VllmServer, spec: dict, *, levels: list[int], duration_s: float,
                     warmup_s: float, processes: int, nice: int, drain_s: float, ttft_slo_s: float,
                     tpot_slo_s: float) -> dict:
    """Vanilla vLLM's capacity for the request shape: closed loops of ``levels`` clients in turn, each for
    ``duration_s``, counting output tokens per second from ``warmup_s`` to ``duration_s`` (steady state),
    divided by the tokens of one request.
    The capacity is the highest rate of a level whose served requests' TTFT and TPOT medians are within
    the SLOs (more clients only queue longer); without such a level, the highest rate of any. The ramp
    stops at the first level that is slower than the one before it or misses the SLOs' medians.

    :raises ServerError: no request completed, or a load process failed.
    """
    ramp = []
    for clients in levels:
        t0, records, failures = closed_run(ctx, server, spec, clients=clients, duration_s=duration_s,
                                           processes=processes, nice=nice, drain_s=drain_s)
        if failures:
            raise ServerError("capacity run: " + "; ".join(failures))
        span_s = duration_s - warmup_s
        tokens = window_tokens(records, t0 + warmup_s, t0 + duration_s)
        stats = request_stats(records, len(records), duration_s=duration_s, max_tokens=spec["max_tokens"],
                              ttft_slo_s=ttft_slo_s, tpot_slo_s=tpot_slo_s)
        level = {"clients": clients, "rps": tokens / spec["max_tokens"] / span_s, "output_tok_s": tokens / span_s,
                 "ttft_p50_ms": stats["ttft_p50_ms"], "tpot_p50_ms": stats["tpot_p50_ms"],
                 "not_completed": len(records) - stats["served"]}
        level["within_slo"] = (level["ttft_p50_ms"] or 1e18) <= ttft_slo_s * 1000 and (
            level["tpot_p50_ms"] or 0) <= tpot_slo_s * 1000
        log(f"  capacity ramp: {clients} clients {level['rps']:.2f} req/s, TTFT p50 {level['ttft_p50_ms'] or 0:.0f} "
            f"ms, TPOT p50 {level['tpot_p50_ms'] or 0:.0f} ms")
        slower = bool(ramp) and level["rps"] < ramp[-1]["rps"]
        ramp.append(level)
        server.wait_idle(drain_s + 60)
        if slower or not level["within_slo"]:
            break
    ok = [lv for lv in ramp if lv["within_slo"]] or ramp
    best = max(ok, key=lambda lv: lv["rps"])
    if best["rps"] <= 0:
        raise ServerError("capacity run: no request completed in its steady-state window")
    return {"capacity_rps": best["rps"], "capacity_output_tok_s": best["output_tok_s"],
            "capacity_clients": best["clients"], "capacity_window_s": duration_s - warmup_s,
            "capacity_within_slo": best["within_slo"], "ramp": ramp}


def step_log_lines(path: Path | None) -> int:
    """Rows in the step log so far (0 when there is none yet)."""
    if path is None or not path.exists():
        return 0
    with open(path, "rb") as f:
        return max(0, sum(1 for _ in f) - 1)


def load_run(ctx, server: VllmServer, spec: dict, rate: float, *, duration_s: float, drain_s: float, processes: int,
             nice: int, probe_period_s: float, metrics_period_s: float, label: str) -> dict:
    """Poisson arrivals at ``rate`` for ``duration_s`` with the idle probe and the queue sampler running;
    the raw measurements: ``t0``, ``planned``, ``records``, ``failures``, ``probes``, ``samples``."""
    probe = probe_out = probe_stop = None
    if probe_period_s > 0:
        probe_stop, probe_out = ctx.Event(), ctx.Queue()
        probe = ctx.Process(target=idle_probe, args=(server.url, spec["model"], probe_period_s, drain_s,
                                                     probe_stop, probe_out), daemon=True)
    sampler = QueueSampler(server, metrics_period_s)
    load = LoadProcesses(ctx, "open", server.url, {**spec, "rate": rate, "duration_s": duration_s,
                                                   "drain_s": drain_s}, processes, nice)

    def progress() -> None:
        last = sampler.samples[-1] if sampler.samples else None
        state = f"running {last[1]:.0f}, waiting {last[2]:.0f}, KV {last[3]:.0%}" if last else "no /metrics yet"
        log(f"  [{label}] {time.monotonic() - t0:5.0f} s of {duration_s + drain_s:.0f}: {state}")

    t0 = time.monotonic()
    if probe is not None:
        probe.start()
    sampler.start()
    try:
        t0 = load.start()
        planned, records, failures = load.collect(duration_s + drain_s + 60, on_wait=progress)
    finally:
        load.close()
        if probe_stop is not None:
            probe_stop.set()
        sampler.stop()
    probes: dict = {}
    if probe is not None:
        try:
            probes = probe_out.get(timeout=drain_s + 10)
        except queue.Empty:
            pass
        probe.join(5)
        if probe.is_alive():
            probe.terminate()
    return {"t0": t0, "planned": planned, "records": records, "failures": failures, "probes": probes,
            "samples": sampler.samples, "metrics_failures": sampler.failures}
