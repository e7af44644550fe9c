"""Issue 32's targets, checked on each tidegate arm's row (vanilla and ``vllm-queued-N`` arms are the references)."""

from __future__ import annotations

#: the targets as they read in the issue, by load
TARGETS = {
    "<= 0.7x": "goodput >= 0.99x vanilla vLLM; zero refusals; TTFT p50 within 10%",
    "any load": "the plugin's added time per step <= 2% of the step",
    ">= 1.5x": "goodput >= 1.5x vanilla vLLM and >= 0.97x the best --max-num-queued-reqs arm; "
               "TTFT p99 of served requests <= the SLO; 429 p99 <= 50 ms",
    "every load": "zero 5xx; every request accounted for (served, 429, or a client-visible error)",
}


def misses(row: dict, ttft_slo_ms: float) -> list[str]:
    """The targets a tidegate arm's row missed, each in a few words; figures not measured are not misses
    but are said as ``no ...``."""
    out: list[str] = []

    def below(key: str, bound: float, what: str) -> None:
        v = row.get(key)
        if v is None:
            out.append(f"no {what}")
        elif v < bound:
            out.append(f"{what} {v:.2f} < {bound}")

    load = row["load"]
    if row["server_5xx"] or row["unavailable_503"]:
        out.append(f"{row['server_5xx'] + row['unavailable_503']} 5xx")
    if not row["accounted"] or row.get("load_failures"):
        out.append("requests unaccounted")
    share = (row.get("step_overhead") or {}).get("plugin_share")
    if share is not None and share > 0.02:
        out.append(f"plugin {share:.1%} of step time")
    if load <= 0.7 + 1e-9:
        below("goodput_vs_vllm", 0.99, "goodput vs vLLM")
        if row["rejected_429"]:
            out.append(f"{row['rejected_429']} refusals")
        r = row.get("ttft_p50_vs_vllm")
        if r is not None and r > 1.10:  # within 10% of vanilla's or shorter
            out.append(f"TTFT p50 {r:.2f}x vLLM's")
    if load >= 1.5 - 1e-9:
        below("goodput_vs_vllm", 1.5, "goodput vs vLLM")
        below("goodput_vs_best_queued", 0.97, "goodput vs best queued")
        if (row.get("ttft_p99_ms") or 0) > ttft_slo_ms:
            out.append(f"TTFT p99 {row['ttft_p99_ms']:.0f} ms > SLO")
        p99 = row.get("probe_429_p99_ms") if row.get("probe_429_p99_ms") is not None else row.get("http_429_p99_ms")
        if p99 is not None and p99 > 50:
            out.append(f"429 p99 {p99:.0f} ms")
    return out
