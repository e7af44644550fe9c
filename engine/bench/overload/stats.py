"""The figures of a run, from the clients' records, the idle probe and the sampler."""

from __future__ import annotations

from collections import Counter

import numpy as np

from tidegate.engine.bench.overload.server import Sampler


def pct(values, q: float) -> float | None:
    """The q-th percentile, or None for no values."""
    return float(np.percentile(values, q)) if len(values) else None


def outcome_counts(records: list[dict], planned: int) -> dict:
    """Every request in exactly one bucket; ``unaccounted`` are planned requests with no record."""
    status = Counter(r["status"] for r in records)
    outcome = Counter(r["outcome"] for r in records)
    return {"sent": len(records), "ok_2xx": sum(n for s, n in status.items() if 200 <= s < 300),
            "completed": outcome["completed"], "stream_error_events": outcome["error_event"],
            "streams_closed_early": outcome["closed"], "rejected_429": status[429], "unavailable_503": status[503],
            "other_4xx": sum(n for s, n in status.items() if 400 <= s < 500 and s != 429),
            "server_5xx": sum(n for s, n in status.items() if 500 <= s < 600 and s != 503),
            "transport_errors": outcome["transport_error"], "hangs": outcome["hang"],
            "unaccounted": planned - len(records),
            "error_types": dict(Counter(r["error"] for r in records if r["error"]).most_common(8))}


def latency_stats(records: list[dict], t0: float) -> dict:
    """Goodput (completions per second from the start of the load to the last completion) and the
    loaded clients' own latencies."""
    done = [r for r in records if r["outcome"] == "completed"]
    span_s = max((r["end_s"] for r in done), default=t0) - t0
    ttft = [r["first_byte_s"] - r["start_s"] for r in done]
    e2e = [r["end_s"] - r["start_s"] for r in done]
    r429 = [r["end_s"] - r["start_s"] for r in records if r["status"] == 429]
    lag = [r["start_s"] - r["scheduled_s"] for r in records if r["scheduled_s"] is not None]
    sending_s = max((r["start_s"] for r in records), default=t0) - t0
    ms = 1000.0
    # below offered_rps when every client was busy and arrivals waited for one (start lag)
    return {"sent_rps": len(records) / sending_s if sending_s > 0 else None,
            "goodput_rps": len(done) / span_s if done else 0.0,
            "ttft_p50_ms": _scale(pct(ttft, 50), ms), "ttft_p99_ms": _scale(pct(ttft, 99), ms),
            "e2e_p50_ms": _scale(pct(e2e, 50), ms), "e2e_p99_ms": _scale(pct(e2e, 99), ms),
            "client_429_p50_ms": _scale(pct(r429, 50), ms), "client_429_p99_ms": _scale(pct(r429, 99), ms),
            "client_start_lag_p99_ms": _scale(pct(lag, 99), ms)}


def _scale(x: float | None, k: float) -> float | None:
    return None if x is None else x * k


def probe_stats(probes: dict, window: tuple[float, float]) -> dict:
    """The idle probe's view while the load was offered."""
    comp = [p for p in probes.get("completions", []) if window[0] <= p[0] <= window[1]]
    health = [p for p in probes.get("health", []) if window[0] <= p[0] <= window[1]]
    lat429 = [lat * 1000 for _, s, lat in comp if s == 429]
    latall = [lat * 1000 for _, _, lat in comp]
    lath = [lat * 1000 for _, _, lat in health]
    statuses = Counter(str(s) for _, s, _ in comp)
    return {"probe_requests": len(comp), "probe_statuses": dict(statuses),
            "probe_429_p50_ms": pct(lat429, 50), "probe_429_p99_ms": pct(lat429, 99),
            "probe_429_max_ms": max(lat429) if lat429 else None, "probe_p99_ms": pct(latall, 99),
            "health_probes": len(health), "health_not_200": sum(s != 200 for _, s, _ in health),
            "health_p50_ms": pct(lath, 50), "health_p99_ms": pct(lath, 99)}


def memory_stats(sampler: Sampler, rss_start: float, rss_end: float, t0: float) -> dict:
    """KV usage and resident memory; ``kv_series`` is (seconds since the load started, usage)."""
    kv = [k for _, k, _ in sampler.samples if k is not None]
    return {"kv_usage_max": max(kv) if kv else None, "kv_samples": len(kv), "metrics_failures": sampler.failures,
            "rss_start_mib": rss_start, "rss_end_mib": rss_end,
            "rss_max_mib": max((r for *_, r in sampler.samples), default=None),
            "rss_growth_pct": (rss_end / rss_start - 1) * 100 if rss_start else None,
            "kv_series": [(round(t - t0, 2), k) for t, k, _ in sampler.samples]}


def end_kind(r: dict) -> str:
    """How a stream that was open at the kill ended."""
    if r["outcome"] == "error_event":
        return "error event then [DONE]" if r["done"] else "error event, no [DONE]"
    if r["outcome"] == "closed":
        return "connection closed"
    if r["outcome"] == "http":
        return f"HTTP {r['status']}"
    return r["outcome"].replace("_", " ")


def kill_summary(records: list[dict], planned: int, failures: list[str], t_kill: float) -> dict:
    """Part B's streams: how those open at the kill ended, and how long after it the last one did."""
    open_at_kill = [r for r in records if r["end_s"] > t_kill]
    ended = [r["end_s"] - t_kill for r in open_at_kill if r["outcome"] != "hang"]
    hung = sum(r["outcome"] == "hang" for r in open_at_kill)
    return {"streams_sent": len(records), "streams_streaming_at_kill": sum(
                r["status"] == 200 and r["first_byte_s"] < t_kill for r in open_at_kill),
            "requests_open_at_kill": len(open_at_kill),
            "ended_before_kill": {str(k): v for k, v in Counter(end_kind(r) for r in records
                                                                if r["end_s"] <= t_kill).items()},
            "end_kinds": dict(Counter(end_kind(r) for r in open_at_kill)),
            "streams_ended_after_kill_s": max(ended) if ended and not hung else None,
            "streams_ended_p50_after_kill_s": pct(ended, 50), "hung_streams": hung,
            "all_clients_finished": not failures and len(records) == planned and not hung,
            "load_failures": failures}

