"""The results as ``vllm_overload.json``, ``vllm_overload.md`` and ``vllm_overload.png``."""

from __future__ import annotations

import json
from pathlib import Path

from tidegate.engine.bench.vllm.targets import TARGETS
from tidegate.engine.core.figures import save_png

FIGURES = [("arm", "arm"), ("load", "load x capacity"), ("offered_rps", "offered req/s"),
           ("goodput_rps", "goodput req/s"), ("goodput_vs_vllm", "vs vLLM"),
           ("goodput_vs_best_queued", "vs best queued"), ("slo_attainment", "SLO attainment"),
           ("ttft_p50_ms", "TTFT p50 ms"), ("ttft_p99_ms", "TTFT p99 ms"), ("tpot_p50_ms", "TPOT p50 ms"),
           ("tpot_p99_ms", "TPOT p99 ms"), ("rejected_429", "429"), ("http_429_p99_ms", "429 p99 ms (client)"),
           ("probe_429_p99_ms", "429 p99 ms (idle probe)"), ("unavailable_503", "503"), ("server_5xx", "other 5xx"),
           ("plugin_share", "plugin % of step")]
OUTCOMES = [("arm", "arm"), ("load", "load"), ("planned", "planned"), ("served", "served"),
            ("short", "completed short"), ("rejected_429", "429"), ("unavailable_503", "503"),
            ("other_4xx", "other 4xx"), ("server_5xx", "other 5xx"), ("stream_error_events", "stream errors"),
            ("streams_closed_early", "closed early"), ("transport_errors", "transport errors"),
            ("cut_at_drain", "open at cut-off"), ("unrecorded", "unrecorded"), ("accounted", "all accounted"),
            ("refusals_with_retry_after", "refusals with Retry-After"), ("waiting_max", "vLLM waiting max"),
            ("client_start_lag_p99_ms", "client start lag p99 ms")]


def fmt(x) -> str:
    """A figure for a table: whole numbers from 100 up, three significant digits below, ``-`` if not measured."""
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        return f"{x:.0f}" if abs(x) >= 100 else f"{x:.3g}"
    return str(x)


def table(rows: list[dict], cols: list[tuple[str, str]]) -> list[str]:
    """Markdown table lines of ``rows`` in the columns ``(key, title)``."""
    out = ["| " + " | ".join(title for _, title in cols) + " |", "|" + "---|" * len(cols)]
    out += ["| " + " | ".join(fmt(r.get(key)) for key, _ in cols) + " |" for r in rows]
    return out


def _flat(row: dict) -> dict:
    share = (row.get("step_overhead") or {}).get("plugin_share")
    return {**row, "plugin_share": None if share is None else share * 100}


def markdown(result: dict) -> str:
    """The command, machine, model and capacity, then the figures, the outcomes and the targets."""
    s, m, cap = result["settings"], result["machine"], result.get("capacity") or {}
    model = result.get("model") or {}
    lines = ["# vLLM with tidegate's plugin against vanilla vLLM", "", f"Command: `{result['command']}`", "",
             f"Machine: {m['platform']}, {m['cpu_count']} CPUs, Python {m['python']}; {result['started']}.", "",
             f"Model: {model.get('architecture')} of {(model.get('parameters') or 0) / 1e6:.1f}M parameters "
             f"({model.get('layers')} layers, hidden {model.get('hidden')}, {model.get('kv_heads')} KV heads), "
             f"random weights; vLLM {result.get('vllm_version')}, common server args "
             f"`{' '.join(s['common_args'])}`, env `{' '.join(f'{k}={v}' for k, v in s['env'].items())}`.", "",
             f"Requests: {s['prompt_tokens']} prompt tokens (random ids) and exactly {s['max_tokens']} output "
             f"tokens (ignore_eos, min_tokens), streamed. Poisson arrivals for {s['duration_s']:.0f} s per load, "
             f"clients cut off {s['drain_s']:.0f} s after the last arrival. SLO: TTFT <= {s['ttft_slo_s']} s, "
             f"TPOT <= {s['tpot_slo_s'] * 1000:.0f} ms; goodput = requests within both SLOs per second of the "
             "arrival window (DistServe).", "",
             f"Vanilla vLLM's capacity: {fmt(cap.get('capacity_rps'))} req/s "
             f"({fmt(cap.get('capacity_output_tok_s'))} output tok/s), closed loop of {cap.get('capacity_clients')} "
             f"clients counted over {fmt(cap.get('capacity_window_s'))} s.", ""]
    if cap.get("ramp"):
        lines += ["Capacity ramp (closed loops; the capacity is the fastest level with TTFT and TPOT medians within "
                  "the SLOs):", ""] + table(cap["ramp"], [
                      ("clients", "clients"), ("rps", "req/s"), ("output_tok_s", "output tok/s"),
                      ("ttft_p50_ms", "TTFT p50 ms"), ("tpot_p50_ms", "TPOT p50 ms"), ("within_slo", "medians in SLO"),
                      ("not_completed", "not completed")]) + [""]
    reused = [r for r in result["rows"] if r.get("reused_from")]
    if reused:
        arms = ", ".join(f"{a} at {', '.join(fmt(r['load']) + 'x' for r in reused if r['arm'] == a)}"
                         for a in dict.fromkeys(r["arm"] for r in reused))
        lines += [f"Reused from the earlier run {reused[0]['reused_from']} (the same arrivals, model and servers; "
                  f"its capacity): {arms}.", ""]
    rows = [_flat(r) for r in result["rows"] if "goodput_rps" in r]
    lines += ["## Figures", ""] + table(rows, FIGURES) + [""]
    lines += ["## How every request ended", ""] + table(rows, OUTCOMES) + [""]
    lagging = [r for r in rows if (r.get("client_start_lag_p99_ms") or 0) > 100]
    if lagging:
        worst = max(r["client_start_lag_p99_ms"] for r in lagging)
        lines += [f"Warning: the load processes sent requests late (start lag p99 up to {worst:.0f} ms in "
                  f"{len(lagging)} of {len(rows)} runs): "
                  "the machine was short of CPU for the clients, so arrivals were not Poisson on time and the clients' "
                  "timings include their own delays. Run on an otherwise idle machine.", ""]
    lines += ["Open at cut-off: the client stopped waiting at the end of the drain (vLLM still held them, queued "
              "or streaming); they could not have met the SLOs.", ""]
    tide = [r for r in rows if "targets_missed" in r]
    if tide:
        lines += ["## Issue 32's targets", ""] + [f"- {k}: {v}" for k, v in TARGETS.items()] + [""]
        lines += [f"- {r['arm']} at {fmt(r['load'])}x: missed {', '.join(r['targets_missed']) or 'none'}"
                  for r in tide] + [""]
    steps = [r for r in rows if r.get("step_overhead")]
    if steps:
        lines += ["## The plugin's step log", ""] + table(
            [{"arm": r["arm"], "load": r["load"], **r["step_overhead"]} for r in steps],
            [("arm", "arm"), ("load", "load"), ("steps", "steps"), ("step_p50_ms", "step p50 ms"),
             ("plugin_p50_ms", "plugin p50 ms"), ("plugin_p99_ms", "plugin p99 ms"),
             ("decide_p99_ms", "decide p99 ms"), ("plugin_share", "plugin share of step time"),
             ("plugin_share_p99", "per-step share p99"), ("fallback_steps", "fallback steps")]) + [""]
    lines += [f"- {r['arm']} at {fmt(r.get('load'))}x failed: {r['error']}" for r in result["rows"] if "error" in r]
    lines += [f"- {r['arm']} at {fmt(r['load'])}x: load processes failed: {'; '.join(r['load_failures'])}"
              for r in result["rows"] if r.get("load_failures")]
    lines += ["", "![goodput and TTFT p99 against load](vllm_overload.png)", ""]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    """Goodput against load per arm, and TTFT p99 against load per arm (log scale, the SLO dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    rows = [r for r in result["rows"] if "goodput_rps" in r]
    if not rows:
        return
    fig, ax = plt.subplots(1, 2, figsize=(12, 4.8))
    for arm in dict.fromkeys(r["arm"] for r in rows):
        mine = sorted((r for r in rows if r["arm"] == arm), key=lambda r: r["load"])
        style = {"lw": 2.5} if arm == "tidegate" else {"lw": 1.2, "ls": "--" if "queued" in arm else "-"}
        ax[0].plot([r["load"] for r in mine], [r["goodput_rps"] for r in mine], marker="o", label=arm, **style)
        ax[1].plot([r["load"] for r in mine], [(r["ttft_p99_ms"] or float("nan")) / 1000 for r in mine], marker="o",
                   label=arm, **style)
    cap = (result.get("capacity") or {}).get("capacity_rps")
    if cap:
        ax[0].axhline(cap, color="k", ls=":", lw=1, label=f"vLLM capacity {cap:.3g} req/s")
    ax[0].set(title="Goodput (TTFT and TPOT within SLO)", xlabel="offered load (x vanilla vLLM's capacity)",
              ylabel="requests / s")
    ax[1].axhline(result["settings"]["ttft_slo_s"], color="k", ls=":", lw=1, label="TTFT SLO")
    ax[1].set(title="TTFT p99 of served requests", xlabel="offered load (x vanilla vLLM's capacity)",
              ylabel="seconds", yscale="log")
    ax[1].yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax[0].set_ylim(bottom=0)
    for a in ax:
        a.legend(fontsize=7)
        a.grid(alpha=0.3)
    fig.suptitle(f"{result['command']}\n{result['machine']['cpu_count']} CPUs, {result['machine']['platform']}",
                 fontsize=7)
    fig.tight_layout()
    save_png(fig, path, dpi=110)
    plt.close(fig)


def write_outputs(result: dict, out: Path) -> None:
    """``vllm_overload.json``, ``.md`` and ``.png`` in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "vllm_overload.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "vllm_overload.md").write_text(markdown(result))
    plot(result, out / "vllm_overload.png")
