"""Controller decision latency: p50 and p99 of ``decide`` (and ``admit``) in microseconds.

    python benchmarks/decision_latency.py [--first 3000] [--load 1.2]

Each controller runs inside a simulation of splitwise_conv (so it sees realistic observations);
every call is timed with perf_counter_ns.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from tidegate.ctrl import build_controller
from tidegate.engine.bench.bench import DEFAULT_CONTROLLERS, rate_scale_for_load
from tidegate.engine.core.profile import load_profile
from tidegate.engine.sim.simulate import simulate
from tidegate.engine.workloads import Arrival, read_trace, resolve_trace


def timed(controller):
    decide, admit = controller.decide, controller.admit
    decide_ns, admit_ns = [], []
    clock = time.perf_counter_ns

    def timed_decide(obs):
        t = clock()
        d = decide(obs)
        decide_ns.append(clock() - t)
        return d

    def timed_admit(obs, p, m):
        t = clock()
        r = admit(obs, p, m)
        admit_ns.append(clock() - t)
        return r

    controller.decide, controller.admit = timed_decide, timed_admit
    return decide_ns, admit_ns


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--first", type=int, default=3000)
    ap.add_argument("--load", type=float, default=1.2)
    ap.add_argument("--profile", default="a100-llama2-7b")
    args = ap.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    profile = load_profile(args.profile)
    arrivals = read_trace(resolve_trace("splitwise_conv"), first_n=args.first)
    scale, _ = rate_scale_for_load(arrivals, profile, args.load)
    arrivals = [Arrival(a.arrival_time_s / scale, a.prompt_tokens, a.output_tokens, a.max_tokens) for a in arrivals]
    print("| controller | decide calls | decide p50 us | decide p99 us | admit p50 us | admit p99 us |")
    print("|---|---|---|---|---|---|")
    for spec in DEFAULT_CONTROLLERS:
        controller = build_controller(spec, profile, arrivals)
        decide_ns, admit_ns = timed(controller)
        simulate(arrivals, profile, controller, record_steps=False)
        d = np.array(decide_ns) / 1000
        a = np.array(admit_ns) / 1000
        print(f"| {spec} | {len(d):,} | {np.percentile(d, 50):.2f} | {np.percentile(d, 99):.2f} "
              f"| {np.percentile(a, 50):.2f} | {np.percentile(a, 99):.2f} |")


if __name__ == "__main__":
    main()
