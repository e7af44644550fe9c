"""Paired comparison of two controllers (or one controller at two commits) in overload, cell by cell.

    python benchmarks/controller_ab.py run --spec slo-flow --spec watermark --out DIR [--draws 6]
    python benchmarks/controller_ab.py compare DIR_A SPEC_A DIR_B SPEC_B [--ref watermark] [--out DIR]
        [--name-a NAME] [--name-b NAME]

``run`` simulates every spec on the same arrivals: every shipped family on the A100 preset and tiny-cpu (or
``--profile``, repeatable) at each ``--loads`` multiple of the profile's fluid bound, ``--draws`` draws of
``--requests`` requests, and writes each cell's goodput per draw and spec to ``DIR/cells.json``. Simulations are
pure functions of their inputs, so a run at one commit and a run at another are paired draw by draw:
``compare`` reads two such files and writes ``compare.md`` (per cell: the goodput of SPEC_B over SPEC_A summed
over the draws, and each against ``--ref`` where both runs have it) and ``compare.png`` beside it.
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from tqdm import tqdm

from tidegate.ctrl import build_controller
from tidegate.engine.bench.report import usage_error
from tidegate.engine.core.figures import save_png
from tidegate.engine.core.profile import load_profile
from tidegate.engine.sim.simulate import simulate
from tidegate.engine.workloads.families import load_family, shipped_families
from tidegate.training.evaluate import cell_arrivals

PROG = "controller_ab"


def run_cell(job: tuple[str, str, float, int, int, tuple[str, ...]]) -> tuple[str, dict[str, float]]:
    profile_name, family, load, draw, requests, specs = job
    profile = load_profile(profile_name)
    arrivals = cell_arrivals(load_family(family), load, draw, requests, profile)[0]
    goodput = {s: simulate(arrivals, profile, build_controller(s, profile), record_steps=False).summary["goodput_rps"]
               for s in specs}
    return f"{profile_name}|{family}|{load}|{draw}", goodput


def run(args: argparse.Namespace) -> None:
    specs = tuple(args.spec)
    profiles = args.profile or ("a100-llama2-7b", "tiny-cpu")
    try:
        loads = [float(x) for x in args.loads.split(",")]
        for p in profiles:  # a bad spec or profile is told before any cell runs
            for spec in specs:
                build_controller(spec, load_profile(p))
    except (ValueError, OSError) as exc:
        usage_error(str(exc), PROG)
    jobs = [(p, f, load, d, args.requests, specs) for p in profiles
            for f in shipped_families() for load in loads for d in range(args.draws)]
    cells: dict[str, dict[str, float]] = {}
    with ProcessPoolExecutor(args.workers) as pool:
        for key, goodput in tqdm(pool.map(run_cell, jobs), total=len(jobs), desc="cells", unit="cell"):
            cells[key] = goodput
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cells.json").write_text(json.dumps({"specs": list(specs), "cells": cells}, indent=1))
    print(f"wrote {args.out / 'cells.json'} ({len(cells)} cell draws)")


def load_run(folder: Path, spec: str) -> dict[str, dict[str, float]]:
    """The cells of a ``run`` in ``folder``, which must hold ``spec`` (one sentence and exit status 2 otherwise)."""
    path = folder / "cells.json"
    try:
        run_ = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        usage_error(f"cannot read {path} ({exc}); make it with `controller_ab.py run`", PROG)
    if spec not in run_["specs"]:
        usage_error(f"{path} has no spec {spec!r}; it has {', '.join(run_['specs'])}", PROG)
    return run_["cells"]


def compare(args: argparse.Namespace) -> None:
    name_a, name_b = args.name_a or args.spec_a, args.name_b or args.spec_b
    a = load_run(args.dir_a, args.spec_a)
    b = load_run(args.dir_b, args.spec_b)
    sums: dict[tuple[str, str, str], list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0, 0.0])
    keys = sorted(set(a) & set(b))
    # the reference's columns only where both runs simulated it
    ref = all(args.ref in a[key] and args.ref in b[key] for key in keys)
    for key in keys:
        profile, family, load, _ = key.split("|")
        s = sums[(profile, family, load)]
        s[0] += a[key][args.spec_a]
        s[1] += b[key][args.spec_b]
        if ref:
            s[2] += a[key][args.ref]
            s[3] += b[key][args.ref]
    lines = [f"# B, {name_b} (`{args.spec_b}`), against A, {name_a} (`{args.spec_a}`)", "",
             "Goodput summed over the paired draws" + (f"; `{args.ref}` from each run." if ref else "."), "",
             "| profile | family | load | B / A |" + (f" A / {args.ref} | B / {args.ref} |" if ref else ""),
             "|---|---|---:|---:|" + ("---:|---:|" if ref else "")]
    logs, labels = [], []
    for (profile, family, load), (ga, gb, ra, rb) in sums.items():
        ratio = gb / ga if ga > 0 else math.nan
        if ratio > 0:
            logs.append(math.log(ratio))
            labels.append(f"{profile} {family} {load}")
        row = f"| {profile} | {family} | {load} | {ratio:.3f} |"
        lines.append(row + (f" {ga / ra:.3f} | {gb / rb:.3f} |" if ref else ""))
    if logs:
        lines += ["", f"B / A over {len(logs)} cells: geometric mean {math.exp(sum(logs) / len(logs)):.3f}, "
                      f"worst {math.exp(min(logs)):.3f}, best {math.exp(max(logs)):.3f}."]
    out = args.out or args.dir_b
    out.mkdir(parents=True, exist_ok=True)
    (out / "compare.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    if logs:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 0.18 * len(logs) + 1.2))
        ax.barh(range(len(logs)), [math.exp(x) for x in logs], left=0, color=["tab:green" if x >= 0 else "tab:red"
                                                                             for x in logs])
        ax.axvline(1.0, color="black", lw=0.8)
        ax.set_yticks(range(len(logs)), labels, fontsize=6)
        ax.set_xlim(min(0.8, math.exp(min(logs)) - 0.05), max(1.2, math.exp(max(logs)) + 0.05))
        ax.invert_yaxis()
        ax.set_xlabel(f"goodput, {name_b} / {name_a}")
        fig.tight_layout()
        save_png(fig, out / "compare.png", dpi=80)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="simulate the specs on every cell")
    r.add_argument("--spec", action="append", required=True, help="a controller spec (repeatable)")
    r.add_argument("--profile", action="append", help="a profile name or file (repeatable; default: a100, tiny-cpu)")
    r.add_argument("--loads", default="1.2,2.0,3.0")
    r.add_argument("--draws", type=int, default=6)
    r.add_argument("--requests", type=int, default=1000)
    r.add_argument("--workers", type=int, default=2)
    r.add_argument("--out", type=Path, required=True)
    c = sub.add_parser("compare", help="compare a spec of one run with a spec of another")
    c.add_argument("dir_a", type=Path)
    c.add_argument("spec_a")
    c.add_argument("dir_b", type=Path)
    c.add_argument("spec_b")
    c.add_argument("--ref", default="watermark")
    c.add_argument("--name-a", help="what to call arm A in the table and plot (default: SPEC_A)")
    c.add_argument("--name-b", help="what to call arm B (default: SPEC_B)")
    c.add_argument("--out", type=Path)
    args = ap.parse_args()
    run(args) if args.command == "run" else compare(args)


if __name__ == "__main__":
    main()
