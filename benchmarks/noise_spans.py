"""How well the step noise's fitted correlation spreads the mean of a span of steps, as a
request's TPOT is: for each twin check's profiling steps, the measured variance of the mean of m
successive steps over the variance the fitted noise model gives it, for the shipped fit
(``noise_wander``: an AR(1) series plus fresh jitter) and for an AR(1) series alone fitted to the
first lags' autocorrelation (``lag_fitted_corr``, the fit profiles had before). 1.00 is exact;
below 1, the model spreads the mean wider than the machine did.

    python benchmarks/noise_spans.py --check DIR [--check DIR ...] [--out FILE]
    python benchmarks/noise_spans.py --synthetic [--out FILE]

``--synthetic`` fits both on seeded series of known correlation and fresh share instead (7,000
steps each, as many as a twin check's profile) and gives the spread (standard deviation) of the
mean of 32 steps each fitted model draws, over the true one's.

Each DIR is a ``tidegate twin-check --fit-around`` output folder (its ``profile_steps.csv``).
The residuals are those the fit sees: the log of real over predicted step time, less its run's
median, over its length's share of the noise, stalls clipped at 5 robust sigmas.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import numpy as np

from engine.core.profile import load_profile
from engine.sim.fit import fit_step_time, profile_fields
from engine.twin.fit import read_step_runs, read_steps_csv

from twin_noise import fitted_ratios, lag_fitted_corr  # benchmarks/ is on the path when run

SPANS = (2, 4, 8, 16, 32, 64, 128, 256)
#: the synthetic series of ``--synthetic``: (correlation, fresh share)
SYNTHETIC = ((0.9, 0.0), (0.95, 0.3), (0.98, 0.5), (0.98, 0.7), (0.99, 0.9))


def model_ratio(corr: float, white: float, span: int) -> float:
    """The variance of the mean of ``span`` steps over one step's, under the noise model."""
    k = np.arange(1, span)
    return float((1.0 + 2.0 * (1.0 - white) * np.sum((1.0 - k / span) * corr ** k)) / span)


def measured_ratio(logs: np.ndarray, span: int) -> float:
    sums = np.concatenate([[0.0], np.cumsum(logs)])
    return float(np.var((sums[span:] - sums[:-span]) / span) / np.var(logs))


def synthetic_table(steps: int = 7000, span: int = 32) -> str:
    """The ``--synthetic`` table: each fit's spread of the mean of ``span`` steps over the truth's."""
    from engine.sim.fit import noise_wander

    lines = [f"spread (standard deviation) of the mean of {span} steps, the fitted model's over the true one's; "
             f"{steps} steps a series, seeded", "",
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
        truth = model_ratio(corr, white, span)
        lines.append(f"| {corr} | {white} | {c:.3f}, fresh {w:.3f} | x{np.sqrt(model_ratio(c, w, span) / truth):.2f} "
                     f"| {lag:.3f} | x{np.sqrt(model_ratio(lag, 0.0, span) / truth):.2f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", type=Path, action="append", default=[], help="a twin-check output folder")
    ap.add_argument("--synthetic", action="store_true", help="Fit seeded series of known noise instead.")
    ap.add_argument("--base", default="tiny-cpu", help="profile whose capacity, block size and SLOs the fits keep")
    ap.add_argument("--out", type=Path, default=None, help="also write the table to this file")
    args = ap.parse_args()
    if args.synthetic or not args.check:
        if not args.synthetic:
            ap.error("give --check folders, or --synthetic")
        table = synthetic_table()
        print(table)
        if args.out:
            args.out.write_text(table + "\n")
        return
    for c in args.check:
        if not (c / "profile_steps.csv").exists():
            raise SystemExit(f"{c} has no profile_steps.csv: was it checked with --fit-around?")
    base = load_profile(args.base)
    head = "| check | steps | " + " | ".join(f"m={m}" for m in SPANS) + " |"
    lines = ["measured variance of the mean of m steps over the model's (shipped fit; AR(1) alone in brackets)",
             "", head, "|---|---|" + "---|" * len(SPANS)]
    shipped, alone = [], []
    for c in args.check:
        rows, runs = read_steps_csv(c / "profile_steps.csv"), read_step_runs(c / "profile_steps.csv")
        profile = dataclasses.replace(base, **profile_fields(fit_step_time(rows, loss="l1", runs=runs)))
        logs = np.log(fitted_ratios(rows, runs, profile))
        mad = 1.4826 * float(np.median(np.abs(logs)))
        logs = np.clip(logs, -5 * mad, 5 * mad)
        logs -= logs.mean()
        lag_corr = lag_fitted_corr(np.exp(logs))
        a = [measured_ratio(logs, m) / model_ratio(profile.noise_corr, profile.noise_white, m) for m in SPANS]
        b = [measured_ratio(logs, m) / model_ratio(lag_corr, 0.0, m) for m in SPANS]
        shipped.append(a)
        alone.append(b)
        lines.append(f"| {c} | {len(logs)} | " + " | ".join(f"{x:.2f} ({y:.2f})" for x, y in zip(a, b)) + " |")
        print(lines[-1], flush=True)
    med_a, med_b = np.median(shipped, axis=0), np.median(alone, axis=0)
    lines.append("| median | | " + " | ".join(f"{x:.2f} ({y:.2f})" for x, y in zip(med_a, med_b)) + " |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        args.out.write_text(table + "\n")


if __name__ == "__main__":
    main()
