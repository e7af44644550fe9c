"""How far the step model misses each kind of step, fitted on a check's own steps (in sample).

    python benchmarks/step_kinds.py --check DIR [--check DIR ...] [--out FILE]

For each DIR (a ``tidegate twin-check`` output folder whose ``twin_steps.csv`` has the prefill
chunk column), the step model is fitted on its steps (``fit_step_time``, the median step) with
and without the cost of a step that prefills with no decodes beside (``per_prefill_alone_s``),
and each kind of step gets the median of log(real / predicted):

- ``prefill alone``: steps with prefill chunks and no decodes (at light load, nearly all the
  first step after the engine idled);
- ``prefill beside decodes``: steps with prefill chunks and decodes (a request arriving while
  others decode: the steps the slowest requests' TPOT is made of);
- ``decodes only``: the rest.

The table gives, per fit and kind, the median over the checks and the 25th and 75th percentiles,
and the median number of such steps in a check; below it, each fit's two prefill costs. A model
that is the median step of every kind has 0 everywhere; the fit's loss weighs every step alike,
so the kind with the fewest steps is the one a missing term leaves off.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from tidegate.engine.bench.report import emit
from tidegate.engine.core.profile import Profile
from tidegate.engine.sim.fit import fit_step_time, profile_fields
from tidegate.engine.twin.fit import read_steps_csv


KINDS = ("prefill alone", "prefill beside decodes", "decodes only")
FITS = {"with per_prefill_alone_s": True, "one cost per chunk (without it)": False}


def kind_residuals(rows: list[tuple], prefill_alone: bool) -> tuple[dict[str, tuple[float, int]], dict]:
    """The median log(real / predicted) of each of ``KINDS`` and its number of steps, for the fit
    on ``rows`` (``read_steps_csv`` rows with the prefill chunk column), and the fit."""
    fit = fit_step_time(rows, loss="l1", prefill_alone=prefill_alone)
    profile = Profile("fit", "", kv_capacity_tokens=16, **profile_fields(fit, noise=False))
    pred = np.array(profile.predict_steps((r[0], r[1]) + tuple(r[3:]) for r in rows))
    logs = np.log(np.array([r[2] for r in rows]) / pred)
    decodes, chunks = np.array([r[3] for r in rows]), np.array([r[4] for r in rows])
    masks = {"prefill alone": (chunks > 0) & (decodes == 0), "prefill beside decodes": (chunks > 0) & (decodes > 0),
             "decodes only": chunks == 0}
    return {k: (float(np.median(logs[m])) if m.any() else float("nan"), int(m.sum())) for k, m in masks.items()}, fit


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", type=Path, action="append", required=True, help="a twin-check output folder")
    ap.add_argument("--out", type=Path, default=None, help="also write the table to this file")
    args = ap.parse_args()
    steps = {}
    for c in args.check:
        if not (c / "twin_steps.csv").exists():
            raise SystemExit(f"{c} has no twin_steps.csv: give twin-check output folders.")
        rows = read_steps_csv(c / "twin_steps.csv")
        if len(rows[0]) < 5:
            raise SystemExit(f"{c}/twin_steps.csv has no prefill chunk column: rerun the check with this version.")
        steps[c] = rows
    found: dict[tuple[str, str], list[tuple[float, int]]] = {}
    costs: dict[str, list[tuple[float, float]]] = {}
    for n, (c, rows) in enumerate(steps.items(), 1):
        print(f"[{n}/{len(steps)}] {c}", flush=True)
        for name, alone in FITS.items():
            residuals, fit = kind_residuals(rows, alone)
            for kind, value in residuals.items():
                found.setdefault((name, kind), []).append(value)
            costs.setdefault(name, []).append((fit["per_prefill_s"], fit["per_prefill_alone_s"]))
    lines = [f"{len(steps)} checks, each fitted on its own steps: median log(real / predicted) of each kind of step, "
             "median over the checks [25th, 75th percentile] (steps in a check, median)", "",
             "| fit | " + " | ".join(KINDS) + " |", "|---|" + "---|" * len(KINDS)]
    for name in FITS:
        cells = []
        for kind in KINDS:
            a = np.array(found[(name, kind)])
            ok = a[~np.isnan(a[:, 0])]
            lo, mid, hi = np.percentile(ok[:, 0], [25, 50, 75]) if len(ok) else (np.nan,) * 3
            cells.append(f"{mid:+.3f} [{lo:+.3f}, {hi:+.3f}] ({int(np.median(a[:, 1]))})")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append("")
    for name in FITS:
        c = 1e3 * np.array(costs[name])
        lines.append(f"{name}: per_prefill_s {np.median(c[:, 0]):.2f} ms ({np.percentile(c[:, 0], 10):.2f}-"
                     f"{np.percentile(c[:, 0], 90):.2f}, 10th-90th percentile over the checks), per_prefill_alone_s "
                     f"{np.median(c[:, 1]):.2f} ms ({np.percentile(c[:, 1], 10):.2f}-{np.percentile(c[:, 1], 90):.2f})")
    emit(lines, args.out)


if __name__ == "__main__":
    main()
