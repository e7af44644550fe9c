"""The Gymnasium env over vLLM: episodes on a real vLLM server with an agent answering the learned
controller's policy calls, and what the round trip costs vLLM.

    python benchmarks/env_vllm.py [--episodes 3] [--steps 60] [--loads 0.7,1.5] [--out docs/bench/env_vllm]

For each agent (``prior``: action 0, slo-flow alone; ``policy``: the shipped policy, computing each
action from the features the env returns) and each load, ``--episodes`` episodes of ``--steps`` env
steps on splitwise_conv (lengths x 0.1, the tiny model, profile tiny-vllm-cpu). Reported per cell:
env steps/s, goodput (good requests / lambda_max / elapsed), refusals, the policy calls answered
too late for the controller's time budget, and the decision time inside vLLM (the wait for the
agent's answer included) as a share of vLLM's steps. Writes ``env_vllm.json`` and ``env_vllm.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from tidegate.ctrl.learned import DEFAULT_POLICY
from tidegate.ctrl.policy import load_policy
from tidegate.env.serving_env import ServingEnv


def run_cell(env: ServingEnv, agent, load: float, episodes: int, seed: int) -> dict:
    replica = env._replica
    before = replica.record()
    rows = []
    t0 = time.monotonic()
    steps = 0
    for ep in range(episodes):
        obs, info = env.reset(seed=seed + ep, options={"load": load})
        sent0, totals0 = replica.sent, dict(env.totals)
        start = time.monotonic()
        for _ in range(env.episode_steps):
            obs, _, _, _, info = env.step(agent(obs))
            steps += 1
        elapsed = time.monotonic() - start
        t = env.totals
        rows.append({"good": t["good"] - totals0.get("good", 0), "sent": replica.sent - sent0,
                     "rejected": t["rejected"], "elapsed_s": elapsed,
                     "goodput_frac": t["good"] / (env.lambda_max_rps * elapsed)})
    after = replica.record()
    wall = time.monotonic() - t0
    decisions = after.counters.decisions - before.counters.decisions
    decide_s = after.counters.decide_s_sum - before.counters.decide_s_sum
    late = sum(v for k, v in after.counters.fallbacks.items() if "late" in k) - \
        sum(v for k, v in before.counters.fallbacks.items() if "late" in k)
    return {"load": load, "episodes": rows, "env_steps_per_s": steps / wall,
            "goodput_frac": float(np.mean([r["goodput_frac"] for r in rows])),
            "rejected_share": sum(r["rejected"] for r in rows) / max(sum(r["sent"] for r in rows), 1),
            "policy_calls": steps, "late_answers": late, "vllm_steps": decisions,
            "decide_ms_mean": 1e3 * decide_s / max(decisions, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--episodes", type=int, default=3)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--loads", default="0.7,1.5")
    ap.add_argument("--out", type=Path, default=Path("docs/bench/env_vllm"))
    args = ap.parse_args(argv)
    loads = [float(x) for x in args.loads.split(",")]
    policy = load_policy(DEFAULT_POLICY)
    agents = {"prior": lambda obs: np.zeros(3, dtype=np.float32),
              "policy": lambda obs: np.asarray(policy(obs), dtype=np.float32)}
    t0 = time.monotonic()
    env = ServingEnv(backend="vllm", trace="splitwise_conv", length_scale=0.1, profile="tiny-vllm-cpu",
                     episode_steps=args.steps, seed=0,
                     vllm_options={"vllm_args": ("--enforce-eager",), "work_dir": "bench-out/env_vllm",
                                   "log": lambda line: print(line, file=sys.stderr)})
    started_s = time.monotonic() - t0
    cells = []
    try:
        for name, agent in agents.items():
            for load in loads:
                cell = {"agent": name, **run_cell(env, agent, load, args.episodes, seed=100)}
                cells.append(cell)
                print(f"{name} at {load}x: {cell['env_steps_per_s']:.1f} env steps/s, goodput "
                      f"{cell['goodput_frac']:.3f}, refused {cell['rejected_share']:.1%}, late answers "
                      f"{cell['late_answers']}/{cell['policy_calls']}, decision {cell['decide_ms_mean']:.2f} ms/step",
                      file=sys.stderr)
    finally:
        env.close()
    result = {"command": "python benchmarks/env_vllm.py " + " ".join(argv or sys.argv[1:]),
              "date": time.strftime("%Y-%m-%d"), "vllm_start_s": started_s, "episode_steps": args.steps,
              "episodes": args.episodes, "cells": cells}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "env_vllm.json").write_text(json.dumps(result, indent=2))
    lines = ["| agent | load | env steps/s | goodput / lambda_max | refused | late answers | decision ms / vLLM step |",
             "|---|---|---|---|---|---|---|"]
    for c in cells:
        lines.append(f"| {c['agent']} | {c['load']:g}x | {c['env_steps_per_s']:.1f} | {c['goodput_frac']:.3f} | "
                     f"{c['rejected_share']:.1%} | {c['late_answers']} of {c['policy_calls']} | "
                     f"{c['decide_ms_mean']:.2f} |")
    (args.out / "env_vllm.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
