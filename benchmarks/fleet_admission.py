"""A learned fleet admission policy against the gateway's own rule and fixed budgets, in the fleet twin.

    python benchmarks/fleet_admission.py --run runs/fleet [--workers 2] [--out docs/bench/fleet_admission]

``--run`` is the folder of ``tidegate train --env fleet --seeds ...`` (a ``seed<N>/model.zip`` per training seed)
or of one run (``model.zip``). Each run's final model is exported (``policy.onnx`` beside it) and evaluated,
run by numpy as the gateway runs it, on whole episodes of the fleet env (4 replicas of the A100 preset that
schedule as vLLM does, behind the predicted-delay router, 128 s of arrivals, then the drain): every family of
the config (the training ones and the held-out ones) at each load (a multiple of the fleet's fluid bound), on
``--draws`` test draws that neither training nor validation saw. Each draw is served by every arm on the same
arrivals and step noise: the gateway's own rule (action 0), fixed budgets (``--fixed``) and each seed's policy.

Writes ``fleet_admission.json`` (every episode), ``fleet_admission.md`` (goodput per cell, ratios, the
geometric means at loads >= 1.2 with their spread over training seeds) and ``fleet_admission.png``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import defaultdict
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

from tidegate.engine.cli.support import fail
from tidegate.engine.workloads.arrivals import WorkloadError
from tidegate.training.cli import OptionError, parse_list
from tidegate.training.export import export
from tidegate.training.fleet_eval import evaluate_fleet, fleet_config, geomean_ratio, plot_ratios

RULE = "fixed:0"


def runs_of(folder: Path) -> dict[str, Path]:
    """The final model of each training seed under ``folder`` (or ``folder``'s own)."""
    if (folder / "model.zip").is_file():
        return {"seed0": folder / "model.zip"}
    found = {p.parent.name: p for p in sorted(folder.glob("seed*/model.zip"))}
    if not found:
        fail(f"{folder}: no model.zip in it or in its seed*/ folders")
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", type=Path, required=True)
    ap.add_argument("--loads", default="0.5,0.8,1.2,2,3")
    ap.add_argument("--draws", default="0,1,2", help="test draws per (family, load)")
    ap.add_argument("--fixed", default="0,-0.5,0.5", help="fixed actions to compare (0: the gateway's own rule)")
    ap.add_argument("--families", default=None, help="default: the config's training and held-out families")
    ap.add_argument("--out", type=Path, default=Path("docs/bench/fleet_admission"))
    ap.add_argument("--workers", type=int, default=2, help="processes evaluating (family, arm) tasks at once")
    args = ap.parse_args()

    try:
        env_kwargs, families, held_out = fleet_config(args.families)
        loads = parse_list(args.loads, "--loads", float, "numbers like 0.5,1.2")
        draws = parse_list(args.draws, "--draws", int, "integers like 0,1,2")
        fixed = parse_list(args.fixed, "--fixed", float, "actions like 0,-0.5,0.5")
    except (OptionError, WorkloadError) as e:
        fail(str(e))
    runs = runs_of(args.run)
    args.out.mkdir(parents=True, exist_ok=True)

    t0 = time.perf_counter()
    policies = {name: str(export(model, model.with_name("policy.onnx"))) for name, model in runs.items()}
    # one task per family and arm: each seed's policy, and the fixed budgets once
    tasks = [(None, f, fixed) for f in families] + [(name, f, ()) for name in policies for f in families]
    rows: list[dict] = []
    with ProcessPoolExecutor(args.workers) as pool:
        futures = [pool.submit(evaluate_fleet, policies[name] if name else None, [f], loads, draws, fixed=fx,
                               env_kwargs=env_kwargs) for name, f, fx in tasks]
        for i, ((name, _, _), future) in enumerate(zip(tasks, futures)):
            for r in future.result():
                if r["arm"] == "learned":
                    r["arm"] = f"learned:{name}"
                rows.append(r)
            print(f"\r{i + 1}/{len(tasks)} tasks, {time.perf_counter() - t0:.0f} s", end="", file=sys.stderr)
    print(file=sys.stderr)
    (args.out / "fleet_admission.json").write_text(json.dumps(rows, indent=1))
    report = tabulate(rows, families, held_out, loads, fixed, list(runs), time.perf_counter() - t0)
    (args.out / "fleet_admission.md").write_text(report)
    plot(rows, families, loads, list(runs), args.out / "fleet_admission.png")
    print(report)


def tabulate(rows, families, held_out, loads, fixed, seeds, wall_s) -> str:
    mean = defaultdict(list)
    for r in rows:
        mean[(r["family"], r["load"], r["arm"])].append(r["goodput_rps"])
    arms = [f"fixed:{a:g}" for a in fixed] + [f"learned:{s}" for s in seeds]
    lines = ["| family | load | " + " | ".join(arms) + " | learned / rule |", "|---|---:|" + "---:|" * (len(arms) + 1)]
    for f in families:
        for ld in loads:
            g = {a: float(np.mean(mean[(f, ld, a)])) for a in arms if mean[(f, ld, a)]}
            learned = [g[a] for a in arms if a.startswith("learned") and a in g]
            ratio = float(np.mean(learned)) / g[RULE] if learned and g.get(RULE) else math.nan
            lines.append(f"| {f}{' (held out)' if f in held_out else ''} | {ld:g} | "
                         + " | ".join(f"{g.get(a, math.nan):.2f}" for a in arms) + f" | {ratio:.3f} |")
    lines += ["", "Geometric mean of goodput over the gateway's own rule, cell by cell (draws paired), and the worst "
              "cell:", "", "| arm | all loads | loads >= 1.2 | worst | held out, loads >= 1.2 |",
              "|---|---:|---:|---:|---:|"]
    held_rows = [r for r in rows if r["family"] in held_out]
    seed_means = []
    for a in arms:
        if a == RULE:
            continue
        g_all, worst, n = geomean_ratio(rows, a, RULE)
        g_high, _, _ = geomean_ratio(rows, a, RULE, min_loads=1.2)
        g_held, _, _ = geomean_ratio(held_rows, a, RULE, min_loads=1.2)
        if a.startswith("learned"):
            seed_means.append(g_high)
        lines.append(f"| {a} | {g_all:.3f} | {g_high:.3f} | {worst:.3f} | {g_held:.3f} |")
    if seed_means:
        lines += ["", f"Learned at loads >= 1.2 over {len(seed_means)} training seed(s): mean "
                      f"{np.mean(seed_means):.3f}, range {min(seed_means):.3f}-{max(seed_means):.3f}."]
    lines += ["", f"Goodput in requests per second that met both SLOs (TTFT 2 s, TPOT 0.1 s), each the mean of its "
                  f"draws; wall time {wall_s:.0f} s."]
    return "\n".join(lines) + "\n"


def plot(rows, families, loads, seeds, path: Path) -> None:
    by = {(r["family"], r["load"], r["seed"], r["arm"]): r["goodput_rps"] for r in rows}
    curves = {}
    for f in families:
        ys = []
        for ld in loads:
            ratios = [by[(f, ld, d, f"learned:{s}")] / by[(f, ld, d, RULE)]
                      for (ff, ll, d, a) in by if ff == f and ll == ld and a == RULE and by[(f, ld, d, RULE)] > 0
                      for s in seeds if (f, ld, d, f"learned:{s}") in by]
            ys.append(float(np.exp(np.mean(np.log(ratios)))) if ratios else math.nan)
        curves[f] = ys
    plot_ratios(curves, loads, "goodput, learned / the gateway's rule",
                "Fleet admission: the learned budget against the gateway's own rule", path)


if __name__ == "__main__":
    main()
