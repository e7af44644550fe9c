"""Controllers x load levels on traces: a table, a CSV and plots."""

from __future__ import annotations

import csv
import math
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from tidegate.ctrl import build_controller
from tidegate.ctrl.theory import capacity
from tidegate.engine.core.figures import save_png
from tidegate.engine.core.request import RequestState
from tidegate.engine.core.slo import time_to_first_token_s
from tidegate.engine.sim.simulate import simulate
from tidegate.engine.workloads import Arrival, read_trace, resolve_trace

DEFAULT_CONTROLLERS = ("greedy", "no-evict", "sglang", "watermark", "class-budgets", "flow:adaptive=true")
DEFAULT_LOADS = (0.8, 1.0, 1.5, 2.0)
TABLE_COLUMNS = ("trace", "load", "controller", "completed", "rejected", "evictions", "goodput_rps",
                 "throughput_frac", "ttft_p50_s", "ttft_p99_s", "tpot_p99_s", "kv_usage_mean",
                 "mean_waiting", "wall_time_s")


@dataclass(frozen=True)
class BenchRun:
    trace: str
    load: float
    controller: str
    rate_scale: float
    lambda_max_rps: float


def rate_scale_for_load(arrivals: list[Arrival], profile, load: float) -> tuple[float, float]:
    """The replay speed that makes the trace arrive at ``load`` x lambda_max; and lambda_max."""
    cap = capacity([a.prompt_tokens for a in arrivals], [a.output_tokens for a in arrivals], profile)
    span = arrivals[-1].arrival_time_s - arrivals[0].arrival_time_s
    rate = (len(arrivals) - 1) / span if span > 0 else float(len(arrivals))
    return load * cap.lambda_max_rps / rate, cap.lambda_max_rps


def _run_one(args) -> dict:
    run, arrivals, profile, seed, points = args
    scaled = [replace(a, arrival_time_s=a.arrival_time_s / run.rate_scale) for a in arrivals]
    controller = build_controller(run.controller, profile, scaled)
    if hasattr(controller, "seed"):
        controller.seed = seed  # simulate() resets the controller, which reseeds its draws
    result = simulate(scaled, profile, controller)
    s = dict(result.summary)
    s.update(trace=run.trace, load=run.load, controller=run.controller, rate_scale=run.rate_scale,
             lambda_max_rps=run.lambda_max_rps, throughput_frac=s["throughput_rps"] / run.lambda_max_rps,
             seed=seed)
    m = result.core.metrics
    t = np.frombuffer(m.step_time_s, dtype=float)
    kv = np.frombuffer(m.step_kv_tokens, dtype=np.int64) / result.core.pool.capacity_tokens
    idx = np.linspace(0, len(t) - 1, min(points, len(t))).astype(int) if len(t) else np.array([], int)
    ttft = sorted(time_to_first_token_s(r) for r in m.terminal if r.state is RequestState.FINISHED)
    return {"summary": s, "kv_t": t[idx].tolist(), "kv": kv[idx].tolist(), "ttft": ttft}


def run_bench(traces, controllers, loads, profile, out_dir: Path, *, first_n=None, start_s=None,
              end_s=None, length_scale=1.0, max_tokens_cap=None, seed=0, jobs=None, progress=True) -> list[dict]:
    """Every controller at every load on every trace; writes results.csv, a Markdown table and plots."""
    from tqdm import tqdm

    out_dir.mkdir(parents=True, exist_ok=True)
    tasks = []
    for trace in traces:
        arrivals = read_trace(resolve_trace(trace), first_n=first_n, start_s=start_s, end_s=end_s,
                              length_scale=length_scale, max_tokens_cap=max_tokens_cap)
        name = Path(str(trace)).stem
        for load in loads:
            scale, lam = rate_scale_for_load(arrivals, profile, load)
            for spec in controllers:
                build_controller(spec, profile, arrivals)  # fail fast on a bad spec
                tasks.append((BenchRun(name, load, spec, scale, lam), arrivals, profile, seed, 1500))
    jobs = jobs or min(len(tasks), os.cpu_count() or 1)
    results = []
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        for r in tqdm(pool.map(_run_one, tasks), total=len(tasks), desc="bench", unit="run",
                      disable=not progress):
            results.append(r)
    rows = [r["summary"] for r in results]
    write_csv(rows, out_dir / "results.csv")
    (out_dir / "results.md").write_text(markdown_table(rows, TABLE_COLUMNS) + "\n")
    plot_results(results, out_dir)
    return rows


def write_csv(rows: list[dict], path: Path) -> None:
    keys = list(rows[0]) if rows else []
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)


def _fmt(v) -> str:
    if isinstance(v, float):
        if math.isnan(v):
            return "-"
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
    return str(v)


def markdown_table(rows: list[dict], columns) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        lines.append("| " + " | ".join(_fmt(r.get(c, "")) for c in columns) + " |")
    return "\n".join(lines)


def plot_results(results: list[dict], out_dir: Path) -> list[Path]:
    """Per trace: KV usage over time and TTFT CDF (a panel per load), goodput against load."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for trace in sorted({r["summary"]["trace"] for r in results}):
        mine = [r for r in results if r["summary"]["trace"] == trace]
        loads = sorted({r["summary"]["load"] for r in mine})
        controllers = list(dict.fromkeys(r["summary"]["controller"] for r in mine))
        for kind in ("kv_usage", "ttft_cdf"):
            fig, axes = plt.subplots(1, len(loads), figsize=(4.2 * len(loads), 3.4), squeeze=False)
            for ax, load in zip(axes[0], loads):
                for r in mine:
                    s = r["summary"]
                    if s["load"] != load:
                        continue
                    if kind == "kv_usage":
                        ax.plot(r["kv_t"], r["kv"], lw=0.7, label=s["controller"])
                        ax.set_xlabel("time (s)")
                        ax.set_ylabel("KV usage")
                        ax.set_ylim(0, 1.05)
                    elif r["ttft"]:
                        y = np.arange(1, len(r["ttft"]) + 1) / len(r["ttft"])
                        ax.plot(r["ttft"], y, lw=1.0, label=s["controller"])
                        ax.set_xscale("log")
                        ax.set_xlabel("TTFT (s)")
                        ax.set_ylabel("fraction of requests")
                ax.set_title(f"{trace} at {load}x lambda_max")
            axes[0][0].legend(fontsize=7)
            fig.tight_layout()
            path = out_dir / f"{kind}_{trace}.png"
            save_png(fig, path, dpi=110)
            plt.close(fig)
            written.append(path)
        fig, ax = plt.subplots(figsize=(5.5, 3.8))
        for c in controllers:
            pts = sorted((r["summary"]["load"], r["summary"]["goodput_rps"] / r["summary"]["lambda_max_rps"])
                         for r in mine if r["summary"]["controller"] == c)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=c)
        ax.set_xlabel("offered load (x lambda_max)")
        ax.set_ylabel("goodput / lambda_max")
        ax.set_title(f"{trace}: goodput")
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = out_dir / f"goodput_{trace}.png"
        save_png(fig, path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written
