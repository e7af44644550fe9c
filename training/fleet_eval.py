"""The fleet admission policy against fixed admission budgets, on the fleet env's whole episodes.

Each cell is a (family, load, seed) draw of ``FleetEnv`` at the plain reward (no shadow); every arm
serves the same arrivals with the same step noise: the gateway's own rule (action 0), fixed budgets
(``fixed``) and the exported policy (an ONNX file of ``tidegate export``, run as the gateway runs it).
Goodput counts the requests that met both SLOs, over the episode's span, drain included.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from tidegate.ctrl.policy import load_policy
from tidegate.engine.core.figures import save_png
from tidegate.engine.core.request import Request
from tidegate.env.fleet_env import FleetEnv

#: test draws: seeds far from training's (``make_vec_env`` seeds from 0) and validation's (10,000 on)
TEST_SEED_BASE = 20_000


#: the fleet env's options the evaluations take from the config (the rest are training's)
EVAL_ENV_KEYS = ("replicas", "profile", "replica_controller", "router", "episode_requests", "episode_steps")


def fleet_config(families: str | None) -> tuple[dict, list[str], list[str]]:
    """The config's fleet env options for evaluation, the families to evaluate (``families``, comma-separated,
    or the config's training and held-out ones) and the held-out ones.

    :raises WorkloadError: a family is neither shipped nor a readable family YAML (one sentence naming it).
    """
    from tidegate.engine.workloads.families import load_family
    from tidegate.env import FLEET_ENV_ID
    from tidegate.training.train import load_config

    cfg = load_config(None, FLEET_ENV_ID)
    env_kwargs = {k: v for k, v in cfg["env_kwargs"].items() if k in EVAL_ENV_KEYS}
    held_out = list(cfg.get("held_out", []))
    chosen = families.split(",") if families else list(cfg["env_kwargs"]["families"]) + held_out
    for family in chosen:
        load_family(family)  # before any episode runs: a typo fails in one line, not after minutes
    return env_kwargs, chosen, held_out


def run_episode(env: FleetEnv, act: Callable[[np.ndarray], float], seed: int, options: dict,
                on_end: Callable[[Request], None] | None = None) -> dict:
    """One whole episode with ``act`` choosing each interval's action from the observation: goodput and counts.

    :param on_end: also called with every request as it ends (before the env counts it)
    """
    obs, info = env.reset(seed=seed, options=options)
    if on_end is not None:
        counts = env.fleet.on_end

        def both(request: Request) -> None:
            on_end(request)
            counts(request)

        env.fleet.on_end = both
    actions = []
    while True:
        a = float(act(obs))
        actions.append(a)
        obs, _, terminated, truncated, _ = env.step(np.array([a], dtype=np.float32))
        if terminated or truncated:
            break
    span = env.interval_s * env.episode_steps
    t = env.totals
    return {"requests": info["requests"], "good": t["good"], "missed": t["missed"], "rejected": t["rejected"],
            "goodput_rps": t["good"] / span, "goodput_frac": t["good"] / (env.lambda_max_rps * span),
            "mean_action": float(np.mean(actions))}


def evaluate_fleet(policy: str | None, families: Sequence[str], loads: Sequence[float], seeds: Sequence[int], *,
                   fixed: Sequence[float] = (0.0, -1.0), env_kwargs: dict | None = None,
                   on_cell: Callable[[dict], None] | None = None) -> list[dict]:
    """Every (family, load, seed) cell for every arm: ``fixed:<a>`` for each fixed action and ``learned``.

    :param policy: an exported fleet policy (ONNX), or None for the fixed arms alone.
    :param seeds: draw indices; the env is reset with ``TEST_SEED_BASE + seed``.
    :param env_kwargs: ``FleetEnv`` options besides the families (replicas, profile, router, ...).
    """
    kwargs = {**(env_kwargs or {}), "baseline": "none", "drain": True}
    arms: dict[str, Callable[[np.ndarray], float]] = {f"fixed:{a:g}": (lambda _o, a=a: a) for a in fixed}
    if policy is not None:
        run = load_policy(policy)
        arms["learned"] = lambda o: float(np.asarray(run(o[None, :].astype(np.float32))).reshape(-1)[0])
    rows = []
    for family in families:
        env = FleetEnv(families=[family], **kwargs)
        for load in loads:
            for seed in seeds:
                for arm, act in arms.items():
                    row = {"family": family, "load": float(load), "seed": int(seed), "arm": arm,
                           **run_episode(env, act, TEST_SEED_BASE + int(seed), {"load": float(load)})}
                    rows.append(row)
                    if on_cell is not None:
                        on_cell(row)
    return rows


def geomean_ratio(rows: list[dict], arm: str, base: str, min_loads: float = 0.0) -> tuple[float, float, int]:
    """The geometric mean and the worst of ``arm``'s goodput over ``base``'s, cell by cell (cells at
    ``min_loads`` and above where ``base`` served something), and how many cells."""
    by = {(r["family"], r["load"], r["seed"], r["arm"]): r["goodput_rps"] for r in rows}
    ratios = [by[(f, ld, s, arm)] / g for (f, ld, s, a), g in by.items()
              if a == base and ld >= min_loads and g > 0 and (f, ld, s, arm) in by]
    if not ratios:
        return math.nan, math.nan, 0
    return float(np.exp(np.mean(np.log(np.maximum(ratios, 1e-9))))), float(min(ratios)), len(ratios)


def plot_ratios(curves: dict[str, list[float]], loads: Sequence[float], ylabel: str, title: str, path: Path) -> None:
    """One line per family: a goodput ratio at each load (1 drawn grey), written to ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for family, ys in curves.items():
        ax.plot(loads, ys, marker="o", label=family)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("load (x the fleet's fluid bound)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    save_png(fig, path, dpi=120)
    plt.close(fig)
