"""Simulator scaling: wall time and peak memory against trace size, on a steady synthetic trace.

    python benchmarks/sim_scaling.py [--sizes 10000,100000,1000000] [--controller greedy]
        [--profile a100-llama2-7b] [--load 0.8] [--keep-requests] [--out docs/bench/scaling] [--compiled]

The trace is Poisson at ``--load`` x the fluid bound lambda_max of the profile, with lognormal
prompt and output lengths from a fixed seed (a smaller trace is the start of a larger one). Each
size runs in a fresh process pinned to one core, so its peak RSS is its own. Writes
``scaling.md`` (the table) and ``scaling.png`` (wall time and peak RSS against requests, log-log,
with a line of slope 1) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from tidegate.engine.core.figures import save_png
from tidegate.engine.sim.compiled import script_core

PROMPT_MEDIAN_TOKENS, PROMPT_SIGMA, PROMPT_MAX_TOKENS = 512, 1.0, 8192
OUTPUT_MEDIAN_TOKENS, OUTPUT_SIGMA, MAX_TOKENS = 128, 1.0, 2048
RATE_SAMPLE = 100_000  # requests whose lengths set the arrival rate, the same for every size
SEED = 0


def lognormal_tokens(rng: np.random.Generator, n: int, median: int, sigma: float, most: int) -> np.ndarray:
    """``n`` lengths in tokens, lognormal around ``median``, within [1, ``most``]."""
    return np.clip(np.rint(median * np.exp(sigma * rng.standard_normal(n))), 1, most).astype(np.int64)


def synthetic_trace(n: int, profile, load: float) -> list:
    """``n`` arrivals: Poisson at ``load`` x lambda_max of ``profile`` for this length distribution."""
    from tidegate.ctrl.theory import capacity
    from tidegate.engine.workloads import Arrival

    gaps_rng, prompt_rng, output_rng = (np.random.default_rng(s) for s in np.random.SeedSequence(SEED).spawn(3))
    drawn = max(n, RATE_SAMPLE)
    prompts = lognormal_tokens(prompt_rng, drawn, PROMPT_MEDIAN_TOKENS, PROMPT_SIGMA, PROMPT_MAX_TOKENS)
    outputs = lognormal_tokens(output_rng, drawn, OUTPUT_MEDIAN_TOKENS, OUTPUT_SIGMA, MAX_TOKENS)
    rate_rps = load * capacity(prompts[:RATE_SAMPLE], outputs[:RATE_SAMPLE], profile).lambda_max_rps
    times = np.cumsum(gaps_rng.exponential(1.0 / rate_rps, n))
    return [Arrival(t, p, o, MAX_TOKENS) for t, p, o in zip(times.tolist(), prompts[:n].tolist(),
                                                           outputs[:n].tolist())]


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def run_one(n: int, args: argparse.Namespace) -> dict:
    """Simulate one trace of ``n`` requests in this process; the figures of the run."""
    from tidegate.ctrl import build_controller
    from tidegate.engine.core.profile import load_profile
    from tidegate.engine.sim.simulate import simulate

    profile = load_profile(args.profile)
    t0 = time.perf_counter()
    arrivals = synthetic_trace(n, profile, args.load)
    trace_s = time.perf_counter() - t0
    rss_before_mib = peak_rss_mib()
    print(f"  {n:,} requests generated in {trace_s:.1f} s; simulating", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    summary = simulate(arrivals, profile, build_controller(args.controller, profile), record_steps=False,
                       keep_requests=args.keep_requests).summary
    wall_s = time.perf_counter() - t0
    return {"requests": n, "steps": summary["steps"], "simulated_s": summary["sim_time_s"],
            "completed": summary["completed"], "evictions": summary["evictions"], "trace_s": trace_s,
            "wall_s": wall_s, "peak_rss_mib": peak_rss_mib(), "peak_rss_before_simulate_mib": rss_before_mib}


def run_in_fresh_process(n: int, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--one", str(n), "--controller", args.controller, "--profile", args.profile,
           "--load", str(args.load)] + (["--keep-requests"] if args.keep_requests else [])
    done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(rows: list[dict]) -> str:
    lines = ["| requests | steps | simulated s | wall s | s per 1k requests | peak RSS MiB "
             "| peak RSS before simulate MiB | trace generation s |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['requests']:,} | {r['steps']:,} | {r['simulated_s']:,.0f} | {r['wall_s']:.2f} "
                     f"| {1000 * r['wall_s'] / r['requests']:.3f} | {r['peak_rss_mib']:,.0f} "
                     f"| {r['peak_rss_before_simulate_mib']:,.0f} | {r['trace_s']:.2f} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = np.array([r["requests"] for r in rows], dtype=float)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, label in ((axes[0], "wall_s", "wall time (s)"), (axes[1], "peak_rss_mib", "peak RSS (MiB)")):
        y = np.array([r[key] for r in rows], dtype=float)
        ax.loglog(n, y, "o-", label="measured")
        ax.loglog(n, y[0] * n / n[0], "--", color="grey", label="linear from the smallest")
        ax.set_xlabel("requests in the trace")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    save_png(fig, path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="10000,100000,1000000", help="trace sizes in requests, comma-separated")
    ap.add_argument("--controller", default="greedy")
    ap.add_argument("--profile", default="a100-llama2-7b")
    ap.add_argument("--load", type=float, default=0.8, help="arrival rate as a multiple of lambda_max")
    ap.add_argument("--keep-requests", action="store_true",
                    help="keep every ended Request in the metrics (as callers that read them do)")
    ap.add_argument("--out", type=Path, default=Path("docs/bench/scaling"))
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)  # a child: run one size, print JSON
    ap.add_argument("--compiled", action="store_true",
                    help="run on the compiled core (tidegate compile); the children inherit it")
    args = ap.parse_args()
    core = script_core()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    if args.one is not None:
        print(json.dumps(run_one(args.one, args)))
        return
    sizes = [int(s) for s in args.sizes.split(",")]
    rows = []
    for i, n in enumerate(sizes, 1):
        print(f"[{i}/{len(sizes)}] {n:,} requests, {args.controller}, fresh process", file=sys.stderr, flush=True)
        rows.append(run_in_fresh_process(n, args))
        r = rows[-1]
        print(f"  {r['wall_s']:.2f} s wall, {r['steps']:,} steps, peak RSS {r['peak_rss_mib']:,.0f} MiB",
              file=sys.stderr, flush=True)
    command = "python benchmarks/sim_scaling.py " + " ".join(sys.argv[1:])
    text = (f"Simulator scaling, {core} core, {args.controller} on {args.profile}, "
            f"Poisson at {args.load:g} x lambda_max, record_steps=False, keep_requests={args.keep_requests}."
            f"\n\n    {command.strip()}\n\n{table(rows)}\n")
    if len(rows) > 1:
        a, b = rows[0], rows[-1]
        slope = math.log(b["wall_s"] / a["wall_s"]) / math.log(b["requests"] / a["requests"])
        text += (f"\nWall time grows as requests^{slope:.2f} from {a['requests']:,} to {b['requests']:,} "
                 "(1 is linear).\n")
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "scaling.md").write_text(text)
    plot(rows, args.out / "scaling.png", f"{command.strip()}")
    print(f"wrote {args.out / 'scaling.md'} and {args.out / 'scaling.png'}", file=sys.stderr)


if __name__ == "__main__":
    main()
