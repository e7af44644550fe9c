"""Part A's two runs against a started server: its capacity, then a rate above it."""

from __future__ import annotations

import queue
import time

from tidegate.engine.bench.overload import log
from tidegate.engine.bench.overload.clients import LoadProcesses
from tidegate.engine.bench.overload.probe import idle_probe
from tidegate.engine.bench.overload.server import Sampler, Server, ServerError, metric
from tidegate.engine.bench.overload.stats import latency_stats, memory_stats, outcome_counts, probe_stats


def measure_capacity(ctx, server: Server, spec: dict, *, clients: int, duration_s: float, processes: int,
                     nice: int, request_timeout_s: float) -> float:
    """Completions per second of a closed-loop run: ``clients`` clients in ``processes`` load processes
    send for ``duration_s`` seconds; every request they started counts, up to the end of the last one
    (a request can take longer than the run itself on a slow machine).

    :param spec: the requests (:func:`engine.bench.overload.clients.load_worker`), without clients and duration
    :param nice: added to the load processes' niceness
    """
    warm = LoadProcesses(ctx, "closed", server.url, {**spec, "clients": clients, "duration_s": 0.01},
                         processes, nice=nice)  # one request per client: the first batch of a new server is slow
    try:
        warm.start()
        warm.collect(request_timeout_s + 30)
    finally:
        warm.close()
    load = LoadProcesses(ctx, "closed", server.url, {**spec, "clients": clients, "duration_s": duration_s},
                         processes, nice=nice)
    try:
        t0 = load.start()
        _, records, failures = load.collect(duration_s + request_timeout_s + 30)
    finally:
        load.close()
    if failures:
        raise ServerError("capacity run: " + "; ".join(failures))
    done = [r["end_s"] for r in records if r["outcome"] == "completed"]
    lost_requests = sum(r["outcome"] in ("hang", "transport_error") for r in records)
    if lost_requests:
        log(f"  capacity run: {lost_requests} request(s) hung or failed in transport")
    return len(done) / (max(done) - t0) if done else 0.0


def overload_phase(ctx, server: Server, spec: dict, rate: float, *, clients: int, duration_s: float,
                   processes: int, nice: int, probe_period_s: float, metrics_period_s: float,
                   request_timeout_s: float) -> dict:
    """Offer ``rate`` requests per second for ``duration_s`` seconds as Poisson arrivals from ``clients``
    streaming clients in ``processes`` load processes, with the idle probe and the sampler running;
    the measurements.

    :param nice: added to the load processes' niceness (the probe keeps this process's)
    """
    probe_stop, probe_out = ctx.Event(), ctx.Queue()
    probe = ctx.Process(target=idle_probe, args=(server.url, spec["model"], probe_period_s,
                                                 request_timeout_s, probe_stop, probe_out), daemon=True)
    sampler = Sampler(server, metrics_period_s)
    load = LoadProcesses(ctx, "open", server.url, {**spec, "rate": rate, "clients": clients,
                                                    "duration_s": duration_s}, processes, nice=nice)
    rss_start = server.rss_mib()
    probe.start()
    sampler.start()

    def report() -> None:
        kv = next((k for _, k, _ in reversed(sampler.samples) if k is not None), None)
        log(f"  {time.monotonic() - t0:5.0f} s  kv usage {kv}  server rss {server.rss_mib():.0f} MiB")

    try:
        t0 = load.start()
        planned, records, failures = load.collect(duration_s + request_timeout_s + 60, on_wait=report)
    finally:
        load.close()
        probe_stop.set()
        sampler.stop()
    try:
        probes = probe_out.get(timeout=request_timeout_s + 10)
    except queue.Empty:
        probes = {}
    probe.join(5)
    if probe.is_alive():
        probe.terminate()
    rss_end = server.rss_mib()
    final = server.metrics()
    return {"planned": planned, **outcome_counts(records, planned), "load_failures": failures,
            **latency_stats(records, t0), **probe_stats(probes, (t0, t0 + duration_s)),
            **memory_stats(sampler, rss_start, rss_end, t0),
            "in_flight_after": metric(final, "tidegate:num_requests_in_flight"),
            "evictions": metric(final, "tidegate:num_preemptions_total")}

