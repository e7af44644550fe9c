"""Steps per event: how many simulated engine steps pass between two things other than decoding.

    python benchmarks/steps_per_event.py [--requests 3000] [--profile a100-llama2-7b] [--seed 0]

Three synthetic workloads (Poisson arrivals, log-normal prompt and output lengths: chat-like,
reasoning-like and long generation) run through the simulator with ``greedy``. For each: the
steps, the steps holding a prefill, and the steps per event, an event being an arrival, a
completion or a step with a prefill (counted apart, so the figure is a lower bound on the mean
quiet stretch). A closed-form jump over the steps between events (item 3 of the twin issue) can
only save what those stretches hold; the wall time of the simulation is printed beside them.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from tidegate.ctrl import build_controller
from tidegate.engine.core.profile import load_profile
from tidegate.engine.sim.simulate import simulate
from tidegate.engine.workloads import Arrival

#: name -> (arrivals per second, mean prompt tokens, mean output tokens)
WORKLOADS = {"chat": (4.0, 800, 250), "reasoning": (1.0, 400, 2000), "long generation": (0.3, 200, 4000)}


def workload(rng: np.random.Generator, n: int, rate_rps: float, prompt_mean: float,
             output_mean: float) -> list[Arrival]:
    times = np.cumsum(rng.exponential(1.0 / rate_rps, n))
    prompts = np.maximum(1, rng.lognormal(np.log(prompt_mean), 0.6, n)).astype(int)
    outputs = np.maximum(1, rng.lognormal(np.log(output_mean), 0.8, n)).astype(int)
    return [Arrival(float(t), int(p), int(o), int(o)) for t, p, o in zip(times, prompts, outputs)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--profile", default="a100-llama2-7b")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    profile = load_profile(args.profile)
    print("| workload | requests | steps | steps with a prefill | steps per event (at least) | mean running "
          "| wall s |")
    print("|---|---|---|---|---|---|---|")
    for name, (rate, prompt_mean, output_mean) in WORKLOADS.items():
        arrivals = workload(np.random.default_rng(args.seed), args.requests, rate, prompt_mean, output_mean)
        t0 = time.perf_counter()
        metrics = simulate(arrivals, profile, build_controller("greedy", profile, arrivals)).core.metrics
        wall = time.perf_counter() - t0
        tokens = np.frombuffer(metrics.step_tokens, dtype=np.int64)
        running = np.frombuffer(metrics.step_running, dtype=np.int64)
        prefill = int((tokens > running).sum())  # a step with more tokens than running requests holds a prefill
        events = 2 * len(arrivals) + prefill
        print(f"| {name} | {len(arrivals):,} | {len(tokens):,} | {prefill:,} | {len(tokens) / events:.1f} "
              f"| {running.mean():.0f} | {wall:.2f} |", flush=True)


if __name__ == "__main__":
    main()
