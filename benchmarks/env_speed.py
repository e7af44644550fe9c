"""Env speed: ``tidegate/Serving-v0`` steps per wall second on the sim backend, random actions.

    python benchmarks/env_speed.py [--steps 20000] [--control-interval 10] [--profile a100-llama2-7b] [--compiled]

One process, pinned to one core where the OS allows it; episodes reset as they end (reset time,
and the drain at each episode's end, included). Targets: >= 1,000 env steps per second (first
round), >= 10,000 (issue 12). ``--compiled`` runs on the copy ``tidegate compile`` built.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from tidegate.engine.sim.compiled import script_core


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20_000)
    ap.add_argument("--control-interval", type=int, default=10)
    ap.add_argument("--episode-steps", type=int, default=256)
    ap.add_argument("--profile", default="a100-llama2-7b")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compiled", action="store_true", help="run on the compiled core (tidegate compile)")
    args = ap.parse_args()
    core = script_core()
    from tidegate.env.serving_env import ServingEnv

    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    env = ServingEnv(profile=args.profile, control_interval=args.control_interval,
                     episode_steps=args.episode_steps)
    env.action_space.seed(args.seed)
    actions = np.stack([env.action_space.sample() for _ in range(4096)])
    env.reset(seed=args.seed)
    engine_steps = 0
    t0 = time.perf_counter()
    for i in range(args.steps):
        _, _, terminated, truncated, _ = env.step(actions[i % len(actions)])
        if terminated or truncated:
            engine_steps += env.core.step_index
            env.reset()
    wall = time.perf_counter() - t0
    engine_steps += env.core.step_index
    print("| core | profile | control interval (engine steps) | env steps | wall s | env steps / s "
          "| engine steps / s |")
    print("|---|---|---|---|---|---|---|")
    print(f"| {core} | {args.profile} | {args.control_interval} | {args.steps:,} | {wall:.2f} "
          f"| {args.steps / wall:,.0f} | {engine_steps / wall:,.0f} |")


if __name__ == "__main__":
    main()
