"""The results as ``overload.json``, ``overload.md`` and ``overload.png``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tidegate.engine.bench.overload.targets import TARGETS
from tidegate.engine.core.figures import save_png


def fmt(x) -> str:
    """A figure for a table: three significant digits, ``-`` for one not measured."""
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.3g}"
    return str(x)


def markdown(result: dict) -> str:
    """``overload.md``: the command, the machine, the targets, then a section per part that ran."""
    m = result["machine"]
    lines = ["# Overload and engine-kill benchmark", "", f"Command: `{result['command']}`", "",
             f"Machine: {m['platform']}, {m['cpu_count']} CPUs, Python {m['python']}; {result['started']}.", ""]
    nice = result.get("niceness")
    if nice:
        engines = sorted({r["engine_nice"] for r in result["overload"] if r.get("engine_nice") is not None})
        engine = f", its engine process {'/'.join(map(str, engines))}" if engines else ""
        lines += [f"Niceness: server {nice['server']}{engine}, idle probe {nice['idle_probe']}, load processes "
                  f"{nice['load_processes']} (the load stands in for remote clients, so it yields the CPU to the "
                  "server; the probe times the server, so it does not).", ""]
    lines += ["Targets: " + "; ".join(f"{k} {v}" for k, v in TARGETS.items()) + ".", ""]
    rows = result["overload"]
    if rows:
        lines += ["## A. Overload", "", f"{result['settings']['load']} x the measured capacity for "
                  f"{result['settings']['duration']} s, {result['settings']['clients']} concurrent streaming clients "
                  f"in {result['settings']['load_processes']} processes; prompt {result['settings']['prompt_tokens']} "
                  f"tokens, max_tokens {result['settings']['max_tokens']} (ignore_eos).", ""]
        cols = [("controller", "controller"), ("capacity_rps", "capacity req/s"), ("offered_rps", "offered req/s"),
                ("sent_rps", "sent req/s"), ("sent", "sent"), ("completed", "completed"), ("rejected_429", "429"),
                ("unavailable_503", "503"), ("other_4xx", "other 4xx"), ("server_5xx", "5xx"),
                ("stream_error_events", "stream error events"), ("streams_closed_early", "closed early"),
                ("transport_errors", "transport errors"), ("hangs", "hangs"), ("unaccounted", "unaccounted"),
                ("probe_429_p50_ms", "probe 429 p50 ms"), ("probe_429_p99_ms", "probe 429 p99 ms"),
                ("probe_p99_ms", "probe p99 ms, any answer"), ("health_p99_ms", "/health p99 ms"),
                ("kv_usage_max", "max KV usage"), ("rss_growth_pct", "RSS growth %"), ("goodput_rps", "goodput req/s")]
        lines += table(rows, cols, errors=True)
        lines += ["", "Sent req/s below offered req/s: every client was busy and arrivals waited for one (the "
                  "client start lag below). Goodput: completed requests per second, from the start of the load to "
                  "the last completion. Probe figures: the idle probe while the load was offered."]
        lines += ["", "Client-side figures (the loaded clients' own view, slowed by their event loops):", ""]
        lines += table(rows, [("controller", "controller"), ("ttft_p50_ms", "TTFT p50 ms"),
                              ("ttft_p99_ms", "TTFT p99 ms"), ("e2e_p99_ms", "E2E p99 ms"),
                              ("client_429_p99_ms", "client 429 p99 ms"),
                              ("client_start_lag_p99_ms", "client start lag p99 ms"), ("evictions", "evictions"),
                              ("in_flight_after", "in flight after"), ("rss_start_mib", "RSS start MiB"),
                              ("rss_end_mib", "RSS end MiB"), ("server_log_errors", "server log errors")])
        lines += ["", "![overload](overload.png)", ""]
    kill = result.get("engine_kill")
    if kill:
        lines += ["## B. Engine killed mid-stream", ""]
        keys = ["controller", "skipped", "error", "max_tokens", "statuses_before_kill", "killed_engine_pid",
                "requests_open_at_kill", "streams_streaming_at_kill", "end_kinds", "streams_ended_after_kill_s",
                "streams_ended_p50_after_kill_s", "hung_streams", "ready_down_after_kill_s",
                "ready_again_after_kill_s", "new_engine_pid", "ready_statuses", "new_request_status",
                "new_request_error", "new_request_latency_s", "new_request_tries", "request_completes_after_kill_s",
                "all_clients_finished", "targets_missed"]
        lines += [f"- {k}: {fmt(kill[k])}" for k in keys if k in kill]
        lines += [f"- server log errors: {kill['server_log_errors']['count']}", ""]
    return "\n".join(lines) + "\n"


def table(rows: list[dict], cols: list[tuple[str, str]], errors: bool = False) -> list[str]:
    """Markdown table lines of ``rows`` in the columns ``(key, title)``; ``errors`` adds the targets missed."""
    head = [title for _, title in cols] + (["targets missed"] if errors else [])
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = []
        for key, _ in cols:
            v = r.get(key)
            cells.append(str(v["count"]) if isinstance(v, dict) and "count" in v else fmt(v))
        if errors:
            cells.append(r["error"] if "error" in r else ", ".join(r.get("targets_missed", [])) or "none")
        out.append("| " + " | ".join(cells) + " |")
    return out


def plot(result: dict, path: Path) -> None:
    """Part A's four panels: how requests ended, the probe's latency, the rates, and KV usage over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["overload"] if "sent" in r]
    if not rows:
        return
    names = [r["controller"] for r in rows]
    x = np.arange(len(rows))
    fig, ax = plt.subplots(2, 2, figsize=(13, 8.5))
    bottom = np.zeros(len(rows))
    for key, label in (("completed", "completed"), ("rejected_429", "429"), ("unavailable_503", "503"),
                       ("server_5xx", "5xx"), ("stream_error_events", "stream error event"),
                       ("streams_closed_early", "closed early"), ("transport_errors", "transport error"),
                       ("hangs", "hang")):
        share = np.array([r[key] / max(r["sent"], 1) for r in rows])
        ax[0, 0].bar(x, share, bottom=bottom, label=label)
        bottom += share
    ax[0, 0].set(title="How each request ended", ylabel="share of requests sent", xticks=x, xticklabels=names,
                 ylim=(0, 1.3))
    ax[0, 0].legend(fontsize=7, ncol=4, loc="upper center")
    for i, (key, label) in enumerate((("probe_429_p50_ms", "429 p50 (probe)"), ("probe_429_p99_ms", "429 p99 (probe)"),
                                      ("health_p99_ms", "/health p99 (probe)"))):
        ax[0, 1].bar(x + (i - 1) * 0.27, [r[key] or 0 for r in rows], 0.27, label=label)
    ax[0, 1].axhline(50, color="k", ls="--", lw=1, label="target 50 ms")
    ax[0, 1].set(title="Idle probe latency under overload", ylabel="ms", xticks=x, xticklabels=names, yscale="log")
    ax[0, 1].legend(fontsize=7)
    for i, (key, label) in enumerate((("capacity_rps", "capacity"), ("offered_rps", "offered"),
                                      ("sent_rps", "sent"), ("goodput_rps", "completed (goodput)"))):
        ax[1, 0].bar(x + (i - 1.5) * 0.2, [r[key] or 0 for r in rows], 0.2, label=label)
    ax[1, 0].set(title="Request rates", ylabel="requests / s", xticks=x, xticklabels=names)
    ax[1, 0].legend(fontsize=7)
    for r in rows:
        series = [(t, k) for t, k in r["kv_series"] if k is not None]
        ax[1, 1].plot([t for t, _ in series], [k for _, k in series],
                      label=f"{r['controller']} (RSS {fmt(r['rss_growth_pct'])}%)")
    ax[1, 1].axhline(1.0, color="k", ls="--", lw=1)
    ax[1, 1].set(title="KV cache usage (from /metrics)", xlabel="seconds since the load started",
                 ylabel="usage (1 = full)")
    ax[1, 1].legend(fontsize=7)
    for a in ax.flat:
        a.tick_params(axis="x", labelsize=8)
    fig.suptitle(f"{result['command']}\n{result['machine']['cpu_count']} CPUs, {result['machine']['platform']}",
                 fontsize=8)
    fig.tight_layout()
    save_png(fig, path, dpi=110)
    plt.close(fig)


def write_outputs(result: dict, out: Path) -> None:
    """``overload.json``, ``overload.md`` and ``overload.png`` in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "overload.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "overload.md").write_text(markdown(result))
    plot(result, out / "overload.png")

