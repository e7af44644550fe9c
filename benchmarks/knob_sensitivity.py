"""How far one cell of the evaluation matrix moves by chance: slo-flow against itself with one knob
moved by a few percent.

    python benchmarks/knob_sensitivity.py [--families bursty,diurnal,conv-trace,chat] [--loads 1.2,2.5]
        [--draws 0,1,2] [--requests 1000] [--step 0.05] [--profile a100-llama2-7b] [--out docs/bench/sensitivity]

For each (family, load, draw) of the VALIDATION stream it simulates slo-flow (the learned
controller's prior, inside the shield) and the same controller with a constant residual action of
``--step`` on one knob (activation rate, token budget, admission threshold: each moved by
2^step, 3.5% at 0.05) and with ``-step`` on all three. The ratio of goodputs says how much a
controller that is "the same" can win or lose in one draw: a floor under which no comparison of
controllers on that many requests means anything. Writes ``sensitivity.md`` and
``sensitivity.png`` (the ratios per family) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from tidegate.ctrl.learned import make_learned_controller
from tidegate.engine.core.figures import save_png
from tidegate.engine.core.profile import load_profile
from tidegate.engine.sim.simulate import simulate
from tidegate.training.evaluate import VALIDATION, cell_arrivals, resolve_family


class Const:
    """A policy that always answers one action."""

    def __init__(self, action) -> None:
        self.action = np.asarray(action, dtype=np.float32)

    def __call__(self, obs):
        return self.action


def goodput(profile, arrivals, action) -> float:
    c = make_learned_controller("/nonexistent/policy.onnx", profile=profile)  # the prior, in the shield
    c.inner.policy = Const(action)
    c.reset()
    return simulate(arrivals, profile, c, record_steps=False).summary["goodput_rps"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default="bursty,diurnal,conv-trace,chat")
    ap.add_argument("--loads", default="1.2,2.5")
    ap.add_argument("--draws", default="0,1,2")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--step", type=float, default=0.05)
    ap.add_argument("--profile", default="a100-llama2-7b")
    ap.add_argument("--out", type=Path, default=Path("docs/bench/sensitivity"))
    args = ap.parse_args()
    profile = load_profile(args.profile)
    s = args.step
    moves = {"activation": (s, 0, 0), "token budget": (0, s, 0), "admission": (0, 0, s), "all three -": (-s, -s, -s)}
    ratios: dict[str, list[float]] = {}
    for family in args.families.split(","):
        for load in (float(x) for x in args.loads.split(",")):
            for draw in (int(x) for x in args.draws.split(",")):
                arrivals, _ = cell_arrivals(resolve_family(family), load, draw, args.requests, profile, VALIDATION)
                base = goodput(profile, arrivals, (0, 0, 0))
                if base <= 0:
                    print(f"{family} {load:g}x draw {draw}: slo-flow met no SLO, no ratio", flush=True)
                    continue
                got = [goodput(profile, arrivals, a) / base for a in moves.values()]
                ratios.setdefault(family, []).extend(got)
                print(f"{family} {load:g}x draw {draw}: " + ", ".join(f"{m} {r:.3f}" for m, r in zip(moves, got)),
                      flush=True)
    lines = [f"slo-flow with one knob moved by 2^{s:g} ({100 * (2 ** s - 1):.1f}%) over slo-flow, per draw of "
             f"{args.requests} requests (loads {args.loads}, draws {args.draws}, profile {profile.name})", "",
             "| family | runs | min | 10th pct | median | 90th pct | max |", "|---|---|---|---|---|---|---|"]
    for family, r in ratios.items():
        q = np.percentile(r, [0, 10, 50, 90, 100])
        lines.append(f"| {family} | {len(r)} | " + " | ".join(f"{x:.3f}" for x in q) + " |")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sensitivity.md").write_text("\n".join(lines) + "\n")
    (args.out / "sensitivity.json").write_text(json.dumps({"step": s, "ratios": ratios}, indent=1) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.boxplot(list(ratios.values()), tick_labels=list(ratios), whis=(0, 100))
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.axhline(0.97, color="red", lw=0.8, ls="--", label="the matrix's floor, 0.97")
    ax.set_ylabel("goodput / slo-flow's, one draw")
    ax.set_title(f"slo-flow against itself with one knob moved by {100 * (2 ** s - 1):.1f}%")
    ax.legend()
    fig.tight_layout()
    save_png(fig, args.out / "sensitivity.png", dpi=110)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
