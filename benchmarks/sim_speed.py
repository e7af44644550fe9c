"""Simulator speed: the whole splitwise_conv trace at 1x with greedy on the A100 preset.

    python benchmarks/sim_speed.py [--repeats 3] [--controller greedy] [--profile a100-llama2-7b] [--compiled]

Runs pinned to one core where the OS allows it. Prints wall time, simulated requests per wall
second, the speed-up over real time and the process's peak RSS. Targets: <= 1.0 s wall on one
core, <= 300 MB RSS. ``--compiled`` runs on the copy ``tidegate compile`` built.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time

from tidegate.engine.sim.compiled import script_core


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default="splitwise_conv")
    ap.add_argument("--profile", default="a100-llama2-7b")
    ap.add_argument("--controller", default="greedy")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--compiled", action="store_true", help="run on the compiled core (tidegate compile)")
    args = ap.parse_args()
    core = script_core()
    from tidegate.ctrl import build_controller
    from tidegate.engine.core.profile import load_profile
    from tidegate.engine.sim.simulate import simulate
    from tidegate.engine.workloads import read_trace, resolve_trace

    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    profile = load_profile(args.profile)
    t0 = time.perf_counter()
    arrivals = read_trace(resolve_trace(args.trace))
    read_s = time.perf_counter() - t0
    walls, summary = [], None
    for _ in range(args.repeats):
        controller = build_controller(args.controller, profile)
        t0 = time.perf_counter()
        summary = simulate(arrivals, profile, controller, record_steps=True).summary
        walls.append(time.perf_counter() - t0)
    wall = statistics.median(walls)
    print(f"| core | trace | requests | controller | profile | steps | simulated s | wall s (median of {args.repeats}) "
          f"| requests / wall s | speed-up over real time |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    print(f"| {core} | {args.trace} | {summary['requests']:,} | {args.controller} | {profile.name} "
          f"| {summary['steps']:,} "
          f"| {summary['sim_time_s']:,.0f} | {wall:.2f} | {summary['requests'] / wall:,.0f} "
          f"| {summary['sim_time_s'] / wall:,.0f}x |")
    rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    print(f"\ntrace read: {read_s:.3f} s; all runs: {', '.join(f'{w:.2f}' for w in walls)} s; "
          f"peak RSS {rss_mib:.0f} MiB")


if __name__ == "__main__":
    main()
