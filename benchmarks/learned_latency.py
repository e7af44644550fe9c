"""Learned-controller decision latency: the policy call alone (numpy and onnxruntime) and a whole
shielded ``decide`` at a policy step, inline (a simulation) and on a wall clock (the policy on its
worker thread, as in the real engine), p50/p99 in microseconds.

    python benchmarks/learned_latency.py [--policy checkpoints/policy.onnx] [--n 20000]

Pinned to one core where the OS allows it. Target: p99 <= 100 us.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from tidegate.ctrl.base import Observation
from tidegate.ctrl.learned import OBS_DIM, load_policy, make_learned_controller
from tidegate.engine.core.profile import load_profile


def _percentiles(samples_s: list[float]) -> tuple[float, float]:
    a = np.array(samples_s) * 1e6
    return float(np.percentile(a, 50)), float(np.percentile(a, 99))


def _decide_samples(policy: str, runtime: str, n: int, wall_clock: bool) -> list[float]:
    """Seconds of ``n`` shielded decides, each calling the policy (a budget of 1 s: never late)."""
    ctrl = make_learned_controller(policy, profile=load_profile("a100-llama2-7b"), runtime=runtime,
                                   control_interval=1, time_budget_s=1.0)
    if wall_clock:
        ctrl.use_wall_clock()
    obs = Observation(107520, 16)
    obs.num_waiting, obs.num_running, obs.kv_used_tokens = 40, 100, 50_000
    obs.last_step_time_s = obs.mean_step_time_s = 0.03
    samples = []
    for i in range(n):
        obs.step_index = i
        t0 = time.perf_counter()
        ctrl.decide(obs)
        samples.append(time.perf_counter() - t0)
    assert ctrl.inner.fallback_total == 0, ctrl.inner.fallbacks
    assert ctrl.inner.policy_worker.started == wall_clock
    return samples


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policy", default="checkpoints/policy.onnx")
    ap.add_argument("--n", type=int, default=20_000)
    args = ap.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    rng = np.random.default_rng(0)
    xs = rng.uniform(-3, 3, size=(args.n, OBS_DIM)).astype(np.float32)
    rows = []
    for runtime in ("numpy", "onnxruntime"):
        policy = load_policy(args.policy, runtime)
        for x in xs[:200]:
            policy(x)
        samples = []
        for x in xs:
            t0 = time.perf_counter()
            policy(x)
            samples.append(time.perf_counter() - t0)
        rows.append((f"policy call ({runtime})", *_percentiles(samples)))
        for wall_clock in (False, True):
            where = "on a wall clock, " if wall_clock else ""
            rows.append((f"shielded decide, policy every step ({where}{runtime})",
                         *_percentiles(_decide_samples(args.policy, runtime, args.n, wall_clock))))
    print("| what | p50 us | p99 us |")
    print("|---|---|---|")
    for name, p50, p99 in rows:
        print(f"| {name} | {p50:.1f} | {p99:.1f} |")


if __name__ == "__main__":
    main()
