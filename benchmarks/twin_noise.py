"""Step-model variants judged across twin checks: fit on one check's real steps, simulate its
requests, compare with another check's real requests.

    python benchmarks/twin_noise.py --check DIR [--check DIR ...] [--seeds 3] [--in-sample | --around]
        [--pooled] [--out FILE]

With ``--in-sample`` each fit is judged on the very check it was fitted on instead: the drift
of the machine between checks is left out, and what is left is how the step model's errors show
in the requests' latencies. ``short TPOT p50`` is the median TPOT of the requests of 4-7 output
tokens, whose TPOT is the few steps right after their own prefill.

With ``--around`` each check's fit is on the steps of the profile fitted around it
(``profile_steps.csv`` of ``twin-check --fit-around``, the noise measured within each of its runs,
as ``tidegate profile`` does) and judged on the check's own requests: what a twin check does,
each variant in its place. ``--pooled`` compares the real requests with the simulated requests of
all the seeds together (as ``twin-check`` does) instead of taking the median of each seed's figures.

Each DIR is a ``tidegate twin-check`` output folder (``twin_steps.csv`` with the prefill chunk
column, ``twin_requests.csv``). For every ordered pair of different checks, the step model is
fitted (``fit_step_time``, the median step) on the first one's steps and each variant below
simulates the 300 requests of the check (``--trace``, splitwise_conv by default, first 300, length x0.1) with
``--seeds`` noise seeds; its TTFT and TPOT are compared with the second check's real ones. A
variant that only does well on the steps it was fitted on does not show here; the machine's
drift between the two checks counts against every variant alike.

Variants (the fitted coefficients, the noise changed):

- ``no noise``: the median step every time (the step model's own spread of the requests' latencies);
- ``independent, symmetric``: one sigma (the scaled median absolute deviation), no correlation;
- ``correlated, symmetric``: that sigma, the fitted AR(1) correlation;
- ``independent, split``: a sigma above and one below the median, no correlation;
- ``correlated, split``: both sigmas and the correlation, the sigmas the same for every step length;
- ``correlated, split, by length``: and the sigmas falling for steps longer than a knee
  (``noise_knee_s``, ``noise_floor``: what ``tidegate profile`` fits, with the correlation and
  the fresh share of ``noise_wander``);
- ``lag-fitted AR(1) alone``: that, with the correlation of an AR(1) series fitted to the first
  50 lags' autocorrelation and no fresh share (``lag_fitted_corr``: what profiles had before);
- ``correlated, split, mean above``: the sigma above the median matched to the mean of the
  steps above it instead of their median distance;
- ``no prefill chunk or pair cost``: ``correlated, split`` refitted without the chunk and pair counts;
- ``no first-decode cost``: ``correlated, split`` refitted without the first-decode counts (on
  checks that recorded them);
- ``no after-prefill cost``: ``correlated, split`` refitted without the decaying cost of the steps
  after a prefill (every other variant has it where the fit finds it);
- ``no after-prefill token cost``: ``correlated, split`` refitted with that cost per prefill step
  only, none per prefill token;
- ``no prefill-alone cost``: ``correlated, split, by length`` refitted without the cost of a step
  that prefills with no decodes beside (``per_prefill_alone_s``): one cost per prefill chunk
  wherever it runs, as profiles had before it;
- ``detrended over W steps: correlation`` (W = 101, 401): ``correlated, split, by length`` with
  the correlation fitted on the residuals less their running median over W steps (within each
  run): a machine's slow wander taken out, the step-to-step correlation left;
- ``detrended over W steps: sigmas and correlation``: the sigmas fitted on those residuals too;
- with ``--around`` only, ``at the check's own speed (diagnostic)``: ``correlated, split, by
  length`` with every duration scaled by how much slower the machine ran single-token steps
  during the check than while profiling (the check's ``twin_report.json``): what is left once the
  machine's drift between profiling and checking is taken out. Not a model anyone can run ahead
  of a check: the ratio is measured on the check itself.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
from pathlib import Path

import numpy as np
from scipy.ndimage import median_filter
from scipy.stats import ks_2samp

from tidegate.ctrl import build_controller
from tidegate.engine.bench.report import csv_column, emit, rel_error
from tidegate.engine.core.profile import Profile, load_profile
from tidegate.engine.sim.fit import (NOISE_ACF_FLOOR, fit_step_time, noise_residuals, noise_sigma, noise_sigma_below,
                            noise_wander, profile_fields)
from tidegate.engine.twin.fit import read_step_runs, read_steps_csv
from tidegate.engine.twin.seeds import latencies, scaled_to_speed, simulate_seeds
from tidegate.engine.workloads import read_trace, resolve_trace

FIGURES = ("KS TPOT", "KS TTFT", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "short TPOT p50")
#: output lengths of the short requests, whose TPOT is the few steps right after their prefill
SHORT = (4, 7)
#: the running-median windows (steps) of the detrended variants
DETREND_WINDOWS = (101, 401)
VARIANTS = ("no noise", "independent, symmetric", "correlated, symmetric", "independent, split", "correlated, split",
            "correlated, split, by length", "lag-fitted AR(1) alone", "correlated, split, mean above",
            "no prefill chunk or pair cost",
            "no first-decode cost", "no after-prefill cost", "no after-prefill token cost", "no prefill-alone cost",
            *(f"detrended over {w} steps: {what}" for w in DETREND_WINDOWS
              for what in ("correlation", "sigmas and correlation")))
#: the diagnostic variant of ``--around``
AT_CHECK_SPEED = "at the check's own speed (diagnostic)"


def real_latencies(folder: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The real engine's TTFT and TPOT of a check's requests, and the TPOT of its ``SHORT`` ones."""
    path = folder / "twin_requests.csv"
    short = csv_column(path, "tpot_real_s", lambda r: SHORT[0] <= int(r["output_tokens"]) <= SHORT[1])
    return csv_column(path, "ttft_real_s"), csv_column(path, "tpot_real_s"), short


def _half_mean_sigma(logs: np.ndarray) -> float:
    """The sigma above the median whose half-normal factor has the mean of the steps above it."""
    from math import erf, exp, sqrt

    above = logs[logs > 0]
    target = float(np.mean(np.exp(above)))
    lo, hi = 0.0, 2.0
    for _ in range(60):
        mid = (lo + hi) / 2
        mean = 2 * exp(mid * mid / 2) * 0.5 * (1 + erf(mid / sqrt(2)))
        lo, hi = (mid, hi) if mean < target else (lo, mid)
    return (lo + hi) / 2


def detrended_ratios(rows: list[tuple], runs, profile: Profile, window: int) -> np.ndarray:
    """Real over predicted step times less their running median over ``window`` steps within each
    run, each step's log divided by its length's share of the noise (``Profile.noise_scale``)."""
    return _residual_ratios(rows, runs, profile, lambda x: median_filter(x, size=window, mode="nearest"))


def lag_fitted_corr(ratios, lags: int = 50) -> float:
    """The noise correlation profiles had before the fresh share: the lag-one ``rho`` of the AR(1)
    series whose autocorrelation ``rho^k`` fits that of ``noise_residuals(ratios)`` over lags 1 to
    ``lags`` while it stays above ``NOISE_ACF_FLOOR`` (least squares on its log, through the
    origin); 0 when even lag one is below the floor or there are fewer than ``4 * lags`` steps."""
    x = noise_residuals(ratios)
    if len(x) < 4 * lags or not np.any(x):
        return 0.0
    acf = [float(np.dot(x[:-k], x[k:]) / np.dot(x, x)) for k in range(1, lags + 1)]
    kept = next((k for k, a in enumerate(acf) if a < NOISE_ACF_FLOOR), lags)
    if not kept:
        return 0.0
    at = np.arange(1, kept + 1, dtype=float)
    return min(float(np.exp(np.dot(at, np.log(acf[:kept])) / np.dot(at, at))), 0.999)


def fitted_ratios(rows: list[tuple], runs, profile: Profile) -> np.ndarray:
    """Real over predicted step times over their run's median, each step's log divided by its
    length's share of the noise: the residuals ``fit_step_time`` fits the noise's correlation on."""
    return _residual_ratios(rows, runs, profile, np.median)


def _residual_ratios(rows: list[tuple], runs, profile: Profile, centre) -> np.ndarray:
    """Real over predicted step times, less ``centre`` of each run's logs, each step's log over its
    length's share of the noise (``Profile.noise_scale``)."""
    pred = np.array(profile.predict_steps((r[0], r[1]) + tuple(r[3:]) for r in rows))
    logs = _less_within_runs(np.log(np.array([r[2] for r in rows]) / pred), runs, centre)
    return np.exp(logs / np.array([profile.noise_scale(t) for t in pred]))


def _less_within_runs(logs: np.ndarray, runs, centre) -> np.ndarray:
    """``logs`` less ``centre`` of each run's own (all one run when ``runs`` is None)."""
    out = np.array(logs, dtype=float)
    labels = np.asarray(runs if runs is not None else [0] * len(out))
    for run in dict.fromkeys(labels.tolist()):
        mine = labels == run
        out[mine] -= centre(out[mine])
    return out


def at_speed(profile: Profile, report: Path) -> Profile:
    """``profile`` with every duration of its step model scaled by the check's measured speed
    against its profiling speed (``speed_drift.ratio`` of its report), as the check's diagnostic does."""
    import json

    return scaled_to_speed(profile, json.loads(report.read_text())["speed_drift"]["ratio"])


def variant_profiles(base: Profile, rows: list[tuple], runs=None) -> dict[str, Profile]:
    fitted = dataclasses.replace(base, **profile_fields(fit_step_time(rows, loss="l1", noise_by_length=False,
                                                                      runs=runs)))
    sized = dataclasses.replace(base, **profile_fields(fit_step_time(rows, loss="l1", runs=runs)))
    real = np.array([r[2] for r in rows])
    pred = np.array(fitted.predict_steps((r[0], r[1]) + tuple(r[3:]) for r in rows))
    logs = _less_within_runs(np.log(real / pred), runs, np.median)
    mad = float(1.4826 * np.median(np.abs(logs)))
    no_chunks = dataclasses.replace(base, **profile_fields(fit_step_time([r[:4] for r in rows], loss="l1", runs=runs)))
    detrended = {}
    for window in DETREND_WINDOWS:
        ratios = detrended_ratios(rows, runs, sized, window)
        corr, white = noise_wander(ratios)
        detrended[f"detrended over {window} steps: correlation"] = dataclasses.replace(
            sized, noise_corr=corr, noise_white=white)
        detrended[f"detrended over {window} steps: sigmas and correlation"] = dataclasses.replace(
            sized, noise_corr=corr, noise_white=white, noise_sigma=noise_sigma(ratios),
            noise_sigma_below=noise_sigma_below(ratios))
    lagged = dataclasses.replace(sized, noise_corr=lag_fitted_corr(fitted_ratios(rows, runs, sized)), noise_white=0.0)
    return detrended | {
        "lag-fitted AR(1) alone": lagged,
        "no noise": dataclasses.replace(sized, noise_sigma=0.0),
        "independent, symmetric": dataclasses.replace(fitted, noise_sigma=mad, noise_sigma_below=None, noise_corr=0.0),
        "correlated, symmetric": dataclasses.replace(fitted, noise_sigma=mad, noise_sigma_below=None),
        "independent, split": dataclasses.replace(fitted, noise_corr=0.0),
        "correlated, split": fitted,
        "correlated, split, by length": sized,
        "correlated, split, mean above": dataclasses.replace(fitted, noise_sigma=_half_mean_sigma(logs)),
        "no prefill chunk or pair cost": no_chunks,
        "no first-decode cost": dataclasses.replace(base, **profile_fields(fit_step_time([r[:6] for r in rows],
                                                                                        loss="l1", runs=runs))),
        "no after-prefill cost": dataclasses.replace(base, **profile_fields(fit_step_time(
            rows, loss="l1", after_prefill=False, runs=runs))),
        "no after-prefill token cost": dataclasses.replace(base, **profile_fields(fit_step_time(
            rows, loss="l1", after_prefill_tokens=False, runs=runs))),
        "no prefill-alone cost": dataclasses.replace(base, **profile_fields(fit_step_time(
            rows, loss="l1", prefill_alone=False, runs=runs))),
    }


def compare(profile: Profile, arrivals, ttft_real: np.ndarray, tpot_real: np.ndarray, short_real: np.ndarray,
            seeds: int, pooled: bool = False) -> np.ndarray:
    """The figures of ``FIGURES`` (relative errors for percentiles): the median of each noise seed's,
    or with ``pooled`` those of every seed's simulated requests together."""
    _, runs = simulate_seeds(arrivals, profile, lambda: build_controller("greedy", profile, arrivals), seeds)
    groups = [[r for done in runs for r in done]] if pooled else runs
    out = []
    for done in groups:
        lat = latencies(done)
        short = latencies([r for r in done if SHORT[0] <= r.num_output_tokens <= SHORT[1]])["tpot_s"]
        out.append([ks_2samp(tpot_real, lat["tpot_s"]).statistic, ks_2samp(ttft_real, lat["ttft_s"]).statistic,
                    rel_error(lat["ttft_s"], ttft_real, 50), rel_error(lat["ttft_s"], ttft_real, 99),
                    rel_error(lat["tpot_s"], tpot_real, 50), rel_error(lat["tpot_s"], tpot_real, 99),
                    rel_error(short, short_real, 50)])
    return np.median(np.array(out), axis=0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", type=Path, action="append", required=True, help="a twin-check output folder")
    ap.add_argument("--base", default="tiny-cpu", help="profile whose capacity, block size and SLOs the fits keep")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--trace", default="splitwise_conv", help="the trace the checks replayed (first 300, length x0.1)")
    ap.add_argument("--out", type=Path, default=None, help="also write the table to this file")
    ap.add_argument("--in-sample", action="store_true",
                    help="Judge each fit on the requests of the check it was fitted on: the machine's drift "
                         "between checks left out, the step model's errors as the requests see them left in.")
    ap.add_argument("--around", action="store_true",
                    help="Fit each check's variants on the steps of the profile fitted around it "
                         "(profile_steps.csv, twin-check --fit-around) and judge them on its own requests.")
    ap.add_argument("--pooled", action="store_true",
                    help="Compare with the simulated requests of all the seeds pooled (as twin-check does), "
                         "not the median of each seed's figures.")
    ap.add_argument("--only", action="append", default=None, metavar="VARIANT",
                    help="Judge only this variant (repeatable; default: every one).")
    args = ap.parse_args()
    unknown = [v for v in args.only or [] if v not in VARIANTS and v != AT_CHECK_SPEED]
    if unknown:
        ap.error(f"unknown variant {unknown[0]!r}; the variants are: " + "; ".join(VARIANTS + (AT_CHECK_SPEED,)))
    if args.in_sample and args.around:
        ap.error("--in-sample and --around exclude each other")
    if len(args.check) < 2 and not (args.in_sample or args.around):
        ap.error("give at least two --check folders (or --in-sample, or --around)")
    base = load_profile(args.base)
    arrivals = read_trace(resolve_trace(args.trace), first_n=300, length_scale=0.1, max_tokens_cap=256)
    steps_file = "profile_steps.csv" if args.around else "twin_steps.csv"
    for c in args.check:
        if not (c / steps_file).exists():
            hint = ": was it checked with --fit-around?" if args.around else ""
            raise SystemExit(f"{c} has no {steps_file}{hint}")
    steps = {c: read_steps_csv(c / steps_file) for c in args.check}
    runs = {c: read_step_runs(c / steps_file) if args.around else None for c in args.check}
    for c, rows in steps.items():
        if len(rows[0]) < 5:
            raise SystemExit(f"{c}/{steps_file} has no prefill chunk column: rerun the check with this version.")
    real = {c: real_latencies(c) for c in args.check}
    results: dict[str, list[np.ndarray]] = {}
    own = args.in_sample or args.around
    pairs = [(c, c) for c in args.check] if own else list(itertools.permutations(args.check, 2))
    for n, (fit_on, judge_on) in enumerate(pairs, 1):
        print(f"[{n}/{len(pairs)}] fit on {fit_on}/{steps_file}, judged on {judge_on}", flush=True)
        variants = variant_profiles(base, steps[fit_on], runs[fit_on])
        if args.around:
            variants[AT_CHECK_SPEED] = at_speed(variants["correlated, split, by length"], fit_on / "twin_report.json")
        for variant, profile in variants.items():
            if args.only and variant not in args.only:
                continue
            results.setdefault(variant, []).append(compare(profile, arrivals, *real[judge_on], args.seeds,
                                                           args.pooled))
    judged = ("checks, each fitted on the profiling steps around it and judged on its own requests" if args.around
              else "checks, each judged on its own requests" if args.in_sample
              else "pairs of checks (fit on one, judged on another)")
    over_seeds = "their requests pooled" if args.pooled else "median over them"
    lines = [f"{len(pairs)} {judged}, {args.seeds} noise seeds each, {over_seeds}; median over those (mean of |value| "
             f"in brackets); short: requests of {SHORT[0]}-{SHORT[1]} output tokens", "",
             "| variant | " + " | ".join(FIGURES) + " |", "|---|" + "---|" * len(FIGURES)]
    for name in [v for v in VARIANTS if v in results] + [v for v in results if v not in VARIANTS]:
        a = np.array(results[name])
        med, mean_abs = np.median(a, axis=0), np.mean(np.abs(a), axis=0)
        cells = [f"{m:.3f} ({s:.3f})" if i < 2 else f"{100 * m:+.1f}% ({100 * s:.1f}%)"
                 for i, (m, s) in enumerate(zip(med, mean_abs))]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    emit(lines, args.out)


if __name__ == "__main__":
    main()
