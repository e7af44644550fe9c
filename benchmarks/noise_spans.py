"""How well the step noise's fitted correlation spreads the mean of a span of steps, as a
request's TPOT is: for each twin check's profiling steps, the measured variance of the mean of m
successive steps over the variance the fitted noise model gives it, for the shipped fit
(``noise_wander``: an AR(1) series plus fresh jitter) and for an AR(1) series alone fitted to the
first lags' autocorrelation (``lag_fitted_corr``, the fit profiles had before). 1.00 is exact;
below 1, the model spreads the mean wider than the machine did. The shipped fit minimises the
misfit of this very curve on these steps, so its column shows how well the model's shape can
follow the curve, not how it does on other steps; ``twin_noise.py`` judges that on requests.

    python benchmarks/noise_spans.py --check DIR [--check DIR ...] [--out FILE]
    python benchmarks/noise_spans.py --synthetic [--out FILE]

Each DIR is a ``tidegate twin-check --fit-around`` output folder (its ``profile_steps.csv``).
The residuals are those the fit sees (``noise_residuals``): the log of real over predicted step
time, over its run's median, over its length's share of the noise, stalls clipped. The table
also gives the residuals' autocorrelation at lags 1, 10 and 40 and the fitted fresh share.

``--synthetic`` fits both on seeded series of known correlation and fresh share instead (7,000
steps each, as many as a twin check's profile; one series each) and gives the spread (standard
deviation) of the mean of 32 steps each fitted model draws, over the true one's.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import numpy as np

from tidegate.engine.bench.report import emit
from tidegate.engine.core.profile import load_profile
from tidegate.engine.sim.fit import (fit_step_time, noise_residuals, noise_wander, profile_fields, span_variance_model,
                            span_variances)
from tidegate.engine.twin.fit import read_step_runs, read_steps_csv

from twin_noise import fitted_ratios, lag_fitted_corr  # benchmarks/ is on the path when run

SPANS = (2, 4, 8, 16, 32, 64, 128, 256)
#: the synthetic series of ``--synthetic``: (correlation, fresh share)
SYNTHETIC = ((0.9, 0.0), (0.95, 0.3), (0.98, 0.5), (0.98, 0.7), (0.99, 0.9))
#: the lags whose autocorrelation the table gives
ACF_LAGS = (1, 10, 40)


def synthetic_table(steps: int = 7000, span: int = 32) -> str:
    """The ``--synthetic`` table: each fit's spread of the mean of ``span`` steps over the truth's."""
    lines = [f"spread (standard deviation) of the mean of {span} steps, the fitted model's over the true one's; "
             f"{steps} steps a series, seeded, one series each", "",
             "| true correlation | true fresh share | shipped fit | its spread | AR(1) alone | its spread |",
             "|---|---|---|---|---|---|"]
    for seed, (corr, white) in enumerate(SYNTHETIC):
        rng = np.random.default_rng(seed)
        a = np.empty(steps)
        a[0] = rng.standard_normal()
        for i in range(1, steps):
            a[i] = corr * a[i - 1] + np.sqrt(1 - corr * corr) * rng.standard_normal()
        ratios = np.exp(0.2 * (np.sqrt(1 - white) * a + np.sqrt(white) * rng.standard_normal(steps)))
        (c, w), lag = noise_wander(ratios), lag_fitted_corr(ratios)
        truth = span_variance_model(corr, white, [span])[0]
        lines.append(f"| {corr} | {white} | {c:.3f}, fresh {w:.3f} "
                     f"| x{np.sqrt(span_variance_model(c, w, [span])[0] / truth):.2f} "
                     f"| {lag:.3f} | x{np.sqrt(span_variance_model(lag, 0.0, [span])[0] / truth):.2f} |")
    return "\n".join(lines)


def checks_table(checks: list[Path], base_name: str) -> str:
    """The measured variance-time curve of each check's profiling steps over each model's."""
    base = load_profile(base_name)
    lines = ["measured variance of the mean of m steps over the model's (shipped fit; AR(1) alone in brackets)",
             "", "| check | steps | " + " | ".join(f"acf {k}" for k in ACF_LAGS) + " | fresh share | "
             + " | ".join(f"m={m}" for m in SPANS) + " |", "|---|---|" + "---|" * (len(ACF_LAGS) + 1 + len(SPANS))]
    shipped, alone, acfs, whites = [], [], [], []
    for c in checks:
        rows, runs = read_steps_csv(c / "profile_steps.csv"), read_step_runs(c / "profile_steps.csv")
        profile = dataclasses.replace(base, **profile_fields(fit_step_time(rows, loss="l1", runs=runs)))
        ratios = fitted_ratios(rows, runs, profile)
        x = noise_residuals(ratios)
        measured = span_variances(x, SPANS)
        a = measured / span_variance_model(profile.noise_corr, profile.noise_white, SPANS)
        b = measured / span_variance_model(lag_fitted_corr(ratios), 0.0, SPANS)
        acf = [float(np.dot(x[:-k], x[k:]) / np.dot(x, x)) for k in ACF_LAGS]
        shipped.append(a)
        alone.append(b)
        acfs.append(acf)
        whites.append(profile.noise_white)
        lines.append(f"| {c} | {len(x)} | " + " | ".join(f"{v:.2f}" for v in acf) + f" | {profile.noise_white:.3f} | "
                     + " | ".join(f"{p:.2f} ({q:.2f})" for p, q in zip(a, b)) + " |")
        print(lines[-1], flush=True)
    lines.append("| median | | " + " | ".join(f"{v:.2f}" for v in np.median(acfs, axis=0))
                 + f" | {np.median(whites):.3f} | "
                 + " | ".join(f"{p:.2f} ({q:.2f})" for p, q in zip(np.median(shipped, axis=0),
                                                                    np.median(alone, axis=0))) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", type=Path, action="append", default=[], help="a twin-check output folder")
    ap.add_argument("--synthetic", action="store_true", help="Fit seeded series of known noise instead.")
    ap.add_argument("--base", default="tiny-cpu", help="profile whose capacity, block size and SLOs the fits keep")
    ap.add_argument("--out", type=Path, default=None, help="also write the table to this file")
    args = ap.parse_args()
    if not args.synthetic and not args.check:
        ap.error("give --check folders, or --synthetic")
    for c in args.check:
        if not (c / "profile_steps.csv").exists():
            raise SystemExit(f"{c} has no profile_steps.csv: was it checked with --fit-around?")
    table = synthetic_table() if args.synthetic else checks_table(args.check, args.base)
    emit(table, args.out)


if __name__ == "__main__":
    main()
