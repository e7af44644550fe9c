"""The figures of one arm at one load, from the clients' records, and the ratios between arms.

Goodput is DistServe's: requests per second of the arrival window that completed within both SLOs
(TTFT and TPOT). TTFT runs from when the client sent the request to the first chunk carrying a
token; TPOT is ``(last token - first token) / (tokens - 1)``. Every planned request lands in exactly
one bucket of :data:`BUCKETS`.
"""

from __future__ import annotations

from collections import Counter

from tidegate.engine.bench.overload.stats import pct

#: the outcome buckets, in table order: every planned request is in exactly one
BUCKETS = ("served", "short", "rejected_429", "unavailable_503", "other_4xx", "server_5xx", "stream_error_events",
           "streams_closed_early", "transport_errors", "cut_at_drain", "unrecorded")


def bucket(r: dict, max_tokens: int) -> str:
    """The bucket of one record."""
    if r["outcome"] == "completed":
        return "served" if r["tokens"] == max_tokens else "short"
    if r["outcome"] == "http":
        s = r["status"]
        return ("rejected_429" if s == 429 else "unavailable_503" if s == 503 else
                "server_5xx" if s >= 500 else "other_4xx")
    return {"error_event": "stream_error_events", "closed": "streams_closed_early", "transport_error":
            "transport_errors", "cut": "cut_at_drain"}[r["outcome"]]


def record_tpot_s(r: dict) -> float:
    """Seconds per output token after the first (0 for a one-token answer)."""
    return (r["last_token_s"] - r["first_token_s"]) / (r["tokens"] - 1) if r["tokens"] > 1 else 0.0


def _ms(x: float | None) -> float | None:
    return None if x is None else x * 1000.0


def request_stats(records: list[dict], planned: int, *, duration_s: float, max_tokens: int, ttft_slo_s: float,
                  tpot_slo_s: float) -> dict:
    """Outcomes, goodput and latencies of one load."""
    counts = Counter(bucket(r, max_tokens) for r in records)
    out: dict = {"planned": planned, **{b: counts[b] for b in BUCKETS[:-1]}, "unrecorded": planned - len(records)}
    out["accounted"] = sum(out[b] for b in BUCKETS) == planned and out["unrecorded"] == 0
    served = [r for r in records if bucket(r, max_tokens) == "served"]
    ttft = [r["first_token_s"] - r["start_s"] for r in served]
    tpot = [record_tpot_s(r) for r in served]
    good = sum(t <= ttft_slo_s and p <= tpot_slo_s for t, p in zip(ttft, tpot))
    refused = [r for r in records if r["outcome"] == "http"]
    r429 = [r["answer_s"] - r["start_s"] for r in refused if r["status"] == 429]
    retry_after = [r["retry_after"] for r in refused if r["status"] in (429, 503)]
    lag = [r["start_s"] - r["scheduled_s"] for r in records if r["scheduled_s"] is not None]
    out.update({
        "goodput_rps": good / duration_s, "slo_attainment": good / planned if planned else None,
        "served_rps": len(served) / duration_s,
        "ttft_p50_ms": _ms(pct(ttft, 50)), "ttft_p99_ms": _ms(pct(ttft, 99)),
        "tpot_p50_ms": _ms(pct(tpot, 50)) if max_tokens > 1 else None,
        "tpot_p99_ms": _ms(pct(tpot, 99)) if max_tokens > 1 else None,
        "e2e_p99_ms": _ms(pct([r["end_s"] - r["start_s"] for r in served], 99)),
        "http_429_p50_ms": _ms(pct(r429, 50)), "http_429_p99_ms": _ms(pct(r429, 99)),
        "refusal_p99_ms": _ms(pct([r["answer_s"] - r["start_s"] for r in refused], 99)),
        "refusals_with_retry_after": sum(v is not None for v in retry_after),
        "retry_after_values": dict(Counter(str(v) for v in retry_after if v is not None).most_common(5)),
        "client_start_lag_p99_ms": _ms(pct(lag, 99)),
        "error_types": dict(Counter(r["error"] for r in records if r["error"]).most_common(6)),
    })
    return out


def probe_stats(probes: dict, t0: float, duration_s: float) -> dict:
    """The idle probe's answers during the arrivals: statuses and 429 latency."""
    comp = [p for p in probes.get("completions", []) if t0 <= p[0] <= t0 + duration_s]
    lat429 = [lat for _, s, lat in comp if s == 429]
    return {"probe_requests": len(comp), "probe_statuses": dict(Counter(str(s) for _, s, _ in comp)),
            "probe_429_p99_ms": _ms(pct(lat429, 99)),
            "probe_answer_p99_ms": _ms(pct([lat for _, s, lat in comp if s != 200], 99))}


def queue_stats(samples: list[tuple[float, float, float, float]], t0: float) -> dict:
    """vLLM's own queue while the load ran (from ``/metrics``)."""
    return {"waiting_max": max((w for _, _, w, _ in samples), default=None),
            "running_max": max((r for _, r, _, _ in samples), default=None),
            "kv_usage_max": max((k for *_, k in samples), default=None),
            "queue_series": [(round(t - t0, 1), r, w) for t, r, w, _ in samples[::5]]}


def add_ratios(rows: list[dict]) -> None:
    """Each row's goodput and TTFT p50 against vanilla vLLM at its load, and its goodput against the
    ``vllm-queued-N`` arm with the best goodput at that load (best in hindsight)."""
    for load in sorted({r["load"] for r in rows if "goodput_rps" in r}):
        at = [r for r in rows if r["load"] == load and "goodput_rps" in r]
        vanilla = next((r for r in at if r["arm"] == "vllm"), None)
        queued = [r for r in at if r.get("queued_reqs") is not None]
        best = max(queued, key=lambda r: r["goodput_rps"], default=None)
        for r in at:
            r["goodput_vs_vllm"] = _ratio(r["goodput_rps"], vanilla and vanilla["goodput_rps"])
            r["ttft_p50_vs_vllm"] = _ratio(r["ttft_p50_ms"], vanilla and vanilla["ttft_p50_ms"])
            r["best_queued_arm"] = best["arm"] if best else None
            r["goodput_vs_best_queued"] = _ratio(r["goodput_rps"], best and best["goodput_rps"])


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None
