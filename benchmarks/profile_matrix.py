"""The evaluation matrix with a profile axis: the shipped policy, its prior and the heuristics on every
shipped profile and on perturbed ones.

    python benchmarks/profile_matrix.py [--draws 2] [--requests 1000] [--out docs/bench/profiles]
        [--policy NAME=FILE ...]

Profiles: ``a100-llama2-7b`` and ``h200-llama3-8b`` (the roofline presets), ``tiny-cpu`` (the tiny
model on this CPU), ``tiny-vllm-cpu`` (fitted from vLLM's steps), and two perturbations of the A100
preset: its step-time coefficients and KV capacity each scaled by up to +-30% (``--perturbed``, fixed
seeds; the policy trained on up to 30% around its two presets). Every shipped family at loads 0.5,
0.8, 1.2, 2 and 3 x lambda_max (``--loads``). Writes ``matrix.md``, ``matrix.json``, the heatmaps and
``profiles.md`` (one line per profile: the worst and mean cells of learned and of slo-flow against the best
heuristic) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path

import numpy as np

from tidegate.ctrl.learned import DEFAULT_POLICY
from tidegate.engine.core.profile import load_profile
from tidegate.engine.workloads.families import perturbed_profile
from tidegate.training.evaluate import PRIOR, evaluate, summarize, write_report

#: the slot model is not among them: on the families' real token lengths no controller meets an SLO there
#: (its own workload is benchmarks/slot_prior.py's)
SHIPPED = ("a100-llama2-7b", "h200-llama3-8b", "tiny-cpu", "tiny-vllm-cpu")


def profile_rows(summary: list[dict], names: list[str]) -> list[str]:
    """One table row a profile: the worst and mean cells of learned and slo-flow against the best heuristic (cells
    where no heuristic met an SLO have no ratio and are counted apart)."""
    out = []
    for name in names:
        cells = [r for r in summary if r["family"].endswith(f" @ {name}")]
        vb = [r["vs_best"] for r in cells if math.isfinite(r.get("vs_best", math.nan))]
        pb = [r["prior_vs_best"] for r in cells if math.isfinite(r.get("prior_vs_best", math.nan))]

        def worst_mean(xs: list[float]) -> str:
            return f"{min(xs):.3f}, {np.mean(xs):.3f}" if xs else "no ratio"

        out.append(f"| {name} | {len(cells)} ({len(cells) - len(vb)} without a ratio) | {worst_mean(vb)} | "
                   f"{worst_mean(pb)} | {sum(x < 0.97 for x in vb)}, {sum(x < 0.97 for x in pb)} |")
    return out


def policy_table(summary: list[dict], names: list[str]) -> str:
    """Each policy against its prior: the geometric mean of the cells at loads >= 1.2 and below, the worst cell,
    and the cells below 0.97 x the best heuristic (its spread over policies is the spread over training seeds)."""
    lines = ["| policy | / prior, loads >= 1.2 (geometric mean) | / prior, loads < 1.2 | worst cell / prior | "
             "cells below 0.97 x the best heuristic |", "|---|---:|---:|---:|---:|"]
    def gm(rows: list[dict], name: str) -> float:
        r = [x[name] / x[PRIOR] for x in rows if x.get(PRIOR, 0) > 0 and x.get(name, 0) > 0]
        return float(np.exp(np.mean(np.log(r)))) if r else math.nan

    for name in names:
        high, low = [x for x in summary if x["load"] >= 1.2], [x for x in summary if x["load"] < 1.2]
        worst = min((x[name] / x[PRIOR] for x in summary if x.get(PRIOR, 0) > 0 and name in x), default=math.nan)
        below = sum(1 for x in summary if x.get("best_heuristic") and x[x["best_heuristic"]] > 0
                    and x[name] / x[x["best_heuristic"]] < 0.97)
        lines.append(f"| {name} | {gm(high, name):.4f} | {gm(low, name):.4f} | {worst:.3f} | {below} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draws", type=int, default=2)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--loads", default="0.5,0.8,1.2,2,3")
    ap.add_argument("--perturbed", type=int, default=2, help="perturbations of the A100 preset")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("docs/bench/profiles"))
    ap.add_argument("--policy", action="append", default=[], metavar="NAME=FILE",
                    help="A learned policy to run, under NAME (repeatable; several are averaged in the tables and "
                         "reported one by one in policies.md) [default: learned=the shipped policy].")
    args = ap.parse_args()
    policies = {"learned": str(DEFAULT_POLICY)}
    if args.policy:
        policies = {}
        for given in args.policy:
            name, _, path = given.partition("=")
            if not name or not Path(path).is_file():
                ap.error(f"--policy {given!r}: give NAME=FILE, FILE an exported policy (.onnx) that exists")
            policies[name] = path
    folder = Path(tempfile.mkdtemp(prefix="tidegate-profiles-"))
    profiles = list(SHIPPED)
    for i in range(args.perturbed):
        p = perturbed_profile(load_profile("a100-llama2-7b"), np.random.default_rng([7, i]), 0.3)
        path = folder / f"a100-perturbed-{i}.json"
        p.save(path)
        profiles.append(str(path))
    start = time.monotonic()
    rows = evaluate({name: Path(path) for name, path in policies.items()},
                    loads=[float(x) for x in args.loads.split(",")], seeds=tuple(range(args.draws)),
                    requests=args.requests, profile=profiles, workers=args.workers)
    wall = time.monotonic() - start
    held_out = ("long-context", "flash-crowd", "code-trace")
    write_report(rows, list(policies), args.out, held_out=held_out)
    summary = summarize(rows, list(policies), held_out=held_out)
    if len(policies) > 1:
        (args.out / "policies.md").write_text(policy_table(summary, list(policies)))
    lines = [f"# The matrix on {len(profiles)} profiles ({time.strftime('%Y-%m-%d')}, {wall / 60:.1f} min)", "",
             "| profile | cells | learned / best: worst, mean | slo-flow / best: worst, mean | cells below 0.97 "
             "(learned, slo-flow) |", "|---|---:|---|---|---|"]
    lines += profile_rows(summary, [Path(p).stem for p in profiles])
    (args.out / "profiles.md").write_text("\n".join(lines) + "\n")
    (args.out / "profiles.json").write_text(json.dumps({"profiles": profiles, "wall_s": wall}, indent=2))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
