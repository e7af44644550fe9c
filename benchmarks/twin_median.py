"""Twin fidelity: the median of several twin checks on one pinned core, against the issue's targets.

    python benchmarks/twin_median.py [--checks 3] [--pin-cpu 1] [--profile FILE | --one-profile]
        [--max-drift 0.05 --retries 2] [--noise-seeds 8] [--out docs/bench/twin]

Runs ``tidegate twin-check`` on the first 300 requests of ``--trace`` (splitwise_conv) ``--checks`` times, each
in its own process pinned to one core. Each check fits a profile of its own around it
(``twin-check --fit-around``: requests 300-449 served through the real engine before the check,
450-599 after, one fit on both), so a check is judged against the machine as it ran during the
check, on average, not as it ran at the start or minutes before: the machine's speed drifted by
x0.72-1.09 within one session, as much as the model's own errors. ``--fit-before`` fits each
check's profile right before it instead (``tidegate profile --from-twin`` on requests 300-599),
``--one-profile`` fits one profile first for every check; ``--profile`` uses a given one. With
``--max-drift 0.05`` a check whose machine ran more than 5% off its profile's speed (single-token
steps) is set aside, folder and figures kept and reported, and run again (``--retries`` times at
most): the target is the model's fidelity, and a check on a machine that changed speed under it
measures the machine. Writes
``twin_median.md`` (per metric: each check's relative error and the median; KS distances; step
MAPE), ``twin_median.json`` and ``twin_cdf.png`` (TTFT and TPOT distributions of the real engine
and the simulator in the first check) to ``--out``. Each check simulates its requests with
``--noise-seeds`` step-noise seeds and pools them (the model's distribution, not one draw of it;
``twin_median.md`` says how far one seed alone would have landed). Needs a quiet machine: anything
else running on the core changes the real engine's step times.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from scipy.stats import ks_2samp

from tidegate.engine.bench.report import csv_column, rel_error
from tidegate.engine.core.figures import save_png
from tidegate.engine.core.profile import load_profile
from tidegate.engine.twin.seeds import NOISE_SEEDS, POOLED, SPREAD, ks_floor, sampling_range

#: metric -> bound on |relative error| (None: reported only)
TARGETS = {"ttft_p50_s": 0.10, "ttft_p99_s": 0.10, "tpot_p50_s": 0.10, "tpot_p99_s": 0.10,
           "throughput_rps": None, "e2e_p50_s": None}
KS_TARGETS = {"tpot_s": 0.10, "ttft_s": None, "e2e_s": None}


def tidegate(*args: str) -> None:
    cmd = [sys.executable, "-m", "tidegate", *args]
    print("$ tidegate", " ".join(args), flush=True)
    subprocess.run(cmd, check=True)


def plot_cdfs(folder: Path, out: Path) -> None:
    """The real requests' TTFT and TPOT CDFs of a check against the simulator's, every noise seed's
    requests pooled (``twin_sim_requests.csv``; a check without it: its ``twin_requests.csv``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    lat = read_latencies(folder)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, metric in zip(axes, ("ttft", "tpot")):
        for side, style in (("real", "-"), ("sim", "--")):
            x = np.sort(lat[f"{metric}_{side}"])
            ax.plot(1e3 * x, np.arange(1, len(x) + 1) / len(x), style,
                    label="real engine" if side == "real" else "simulator (noise seeds pooled)")
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(ticker.NullFormatter())
        ax.set_xlabel(f"{metric.upper()} (ms)")
        ax.set_ylabel("share of requests")
        ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle("twin check: real engine against the simulator (first check)")
    fig.tight_layout()
    save_png(fig, out, dpi=110)
    plt.close(fig)


def run_checks(args: argparse.Namespace, pin: list[str]) -> tuple[list[dict], list[Path], list[tuple[Path, dict]]]:
    """Each check's report and profile, and the attempts set aside for the machine's drift."""

    def fit_profile(path: Path) -> Path:
        tidegate("profile", "--model", "tiny", "--from-twin", "--trace", args.trace, "--runs", str(args.runs), *pin,
                 "--out", str(path),
                 "--name", "tiny-cpu-pinned")
        return path

    shared = args.profile or (fit_profile(args.out / "tiny-pinned.json") if args.one_profile else None)
    around = shared is None and not args.fit_before
    reports, profiles, set_aside = [], [], []
    for i in range(args.checks):
        for attempt in range(1 + args.retries):
            folder = args.out / f"check{i + 1}"
            if folder.exists():
                shutil.rmtree(folder)
            folder.mkdir(parents=True)
            if around:
                profile = folder / "profile.json"
                fitting = ["--fit-around"]
            else:
                profile = shared or fit_profile(folder / "tiny-pinned.json")
                fitting = ["--profile", str(profile)]
            tidegate("twin-check", "--model", "tiny", "--trace", args.trace, "--first", "300", "--length-scale",
                     "0.1", *fitting, "--controller", "greedy", "--noise-seeds", str(args.noise_seeds), *pin,
                     "--out", str(folder))
            report = json.loads((folder / "twin_report.json").read_text())
            ratio = (report.get("speed_drift") or {}).get("ratio")
            if (args.max_drift is None or ratio is None or abs(ratio - 1.0) <= args.max_drift
                    or attempt == args.retries):
                break
            # the machine's speed moved between the profile and the check: keep the attempt, run again
            kept = args.out / f"check{i + 1}-set-aside{attempt + 1}"
            if kept.exists():
                shutil.rmtree(kept)
            folder.rename(kept)
            set_aside.append((kept, report))
            print(f"check {i + 1}: the machine ran at x{ratio:.2f} its profiling speed; set aside in {kept}",
                  flush=True)
        profiles.append(profile)
        reports.append(report)
    return reports, profiles, set_aside


def speed_text(drift: dict | None) -> str:
    """``x1.03`` (the check against its profile), with the check against each serving run of a
    profile fitted around it: ``x1.03 (x1.05 before, x1.01 after)``."""
    if drift is None:
        return "n/a"
    runs = {when: drift["check_s"] / s for when, s in (drift.get("runs_s") or {}).items() if s}
    return f"x{drift['ratio']:.2f}" + (" (" + ", ".join(f"x{v:.2f} {w}" for w, v in runs.items()) + ")" if runs else "")


def set_aside_lines(set_aside: list[tuple[Path, dict]], max_drift: float) -> list[str]:
    """The report's table of the attempts set aside for the machine's drift."""
    lines = ["", f"Set aside and run again (machine speed off its profiling speed by more than "
             f"{100 * max_drift:.0f}%):", "",
             "| attempt | speed | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 | KS TPOT |",
             "|---|---|---|---|---|---|---|"]
    for kept, r in set_aside:
        m = r["metrics"]
        lines.append(f"| {kept.name} | x{r['speed_drift']['ratio']:.2f} | "
                     + " | ".join(f"{100 * m[k]['rel_error']:+.1f}%"
                                  for k in ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s"))
                     + f" | {r['ks_distance']['tpot_s']:.3f} |")
    return lines


def read_latencies(folder: Path) -> dict[str, np.ndarray]:
    """A check's real TTFT and TPOT (``twin_requests.csv``) and its simulated ones, every noise
    seed's (``twin_sim_requests.csv``; a check without it: seed 0's in ``twin_requests.csv``)."""
    def column(path: Path, key: str) -> np.ndarray:
        x = csv_column(path, key)
        return x[np.isfinite(x)]

    sim = folder / "twin_sim_requests.csv"
    sim = sim if sim.exists() else folder / "twin_requests.csv"
    return {f"{m}_{side}": column(folder / "twin_requests.csv" if side == "real" else sim, f"{m}_{side}_s")
            for m in ("ttft", "tpot") for side in ("real", "sim")}


def pooled_lines(folders: list[Path], summary: dict) -> list[str]:
    """The checks' real requests pooled against their simulated requests pooled: percentiles of
    some 900 real requests instead of 300, whose p99 is no longer the third slowest, with the
    range the pooled real figures could have landed in by their requests' luck (resampled) and
    the KS distance two samples of these sizes from one distribution exceed 5% of the time."""
    lat = [read_latencies(f) for f in folders]
    pooled = {k: np.concatenate([x[k] for x in lat]) for k in lat[0]}
    rng = np.random.default_rng(0)
    out = {}
    for key in SPREAD:  # the percentiles of POOLED the report judges
        which, q = POOLED[key]
        real, sim = pooled[f"{which.removesuffix('_s')}_real"], pooled[f"{which.removesuffix('_s')}_sim"]
        out[key] = {"rel_error": rel_error(sim, real, q),
                    "real_sampling": sampling_range(real, q, rng)}
    n, k = len(pooled["tpot_real"]), len(pooled["tpot_sim"])
    out["ks_tpot"] = {"value": float(ks_2samp(pooled["tpot_real"], pooled["tpot_sim"]).statistic),
                      "floor": ks_floor(n, k)}
    summary["pooled"] = out
    cells = [f"{SPREAD[key]} {100 * out[key]['rel_error']:+.1f}% (the real side's own sampling "
             "{:+.1f}% to {:+.1f}%)".format(*(100 * v for v in out[key]["real_sampling"])) for key in SPREAD]
    return [f"\nthe {len(folders)} checks pooled ({n} real TPOTs, {k} simulated): " + ", ".join(cells)
            + f"; KS TPOT {out['ks_tpot']['value']:.3f} (two samples this size from one distribution: above "
            f"{out['ks_tpot']['floor']:.3f} 5% of the time)"]


def spread_lines(reports: list[dict], summary: dict) -> list[str]:
    """How far one noise seed alone would have landed in each check, and how far the check's real
    run could have by its requests' luck (its ``real_sampling``); fills ``summary`` with them."""
    lines: list[str] = []
    spreads = [r.get("seed_spread") for r in reports]
    if all(spreads) and all("tpot_p99_s" in sp and "ks_tpot" in sp for sp in spreads):
        summary["seed_spread"] = spreads
        lines.append(f"\neach check simulated with {reports[0]['noise_seeds']} noise seeds, their requests pooled; "
                     "one seed alone would have given, per check: "
                     + "; ".join(f"TPOT p99 {100 * s['tpot_p99_s'][0]:+.0f}% to {100 * s['tpot_p99_s'][1]:+.0f}%, "
                                 f"KS TPOT {s['ks_tpot'][0]:.3f} to {s['ks_tpot'][1]:.3f}" for s in spreads))
    samplings = [r.get("real_sampling") for r in reports]
    if all(samplings) and all("tpot_p99_s" in sp for sp in samplings):
        summary["real_sampling"] = samplings
        lines.append("\neach check's real run, its requests resampled (5th to 95th percentile of the draws), "
                     "could have given: "
                     + "; ".join("TPOT p99 {:+.0f}% to {:+.0f}%".format(*(100 * v for v in sp["tpot_p99_s"]))
                                 + (f", KS TPOT above {sp['ks_tpot'][1]:.3f} 5% of the time" if "ks_tpot" in sp
                                    else "") for sp in samplings)
                     + " of what it measured")
    return lines


def ks_lines(reports: list[dict], summary: dict) -> list[str]:
    """The table's rows of KS distances (``KS_TARGETS``), and of the KS distance of TPOT with the
    profile scaled to each check's speed (a diagnostic); fills ``summary`` with them."""
    lines = []
    for key, bound in KS_TARGETS.items():
        vals = [r["ks_distance"][key] for r in reports]
        med = statistics.median(vals)
        verdict = "" if bound is None else (f"<= {bound}: " + ("met" if med <= bound else "missed"))
        summary["ks"][key] = {"values": vals, "median": med, "met": None if bound is None else med <= bound}
        lines.append(f"| KS {key.removesuffix('_s').upper()} | " + " | ".join(f"{v:.3f}" for v in vals)
                     + f" | {med:.3f} | {verdict} |")
    adjusted = [((r.get("speed_drift") or {}).get("ks_speed_adjusted") or {}).get("tpot_s") for r in reports]
    if all(v is not None for v in adjusted):
        summary["ks_tpot_speed_adjusted"] = {"values": adjusted, "median": statistics.median(adjusted)}
        lines.append("| KS TPOT, profile scaled to the check's speed | " + " | ".join(f"{v:.3f}" for v in adjusted)
                     + f" | {statistics.median(adjusted):.3f} | diagnostic |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checks", type=int, default=3)
    ap.add_argument("--trace", default="splitwise_conv", help="Trace the checks and their profiles replay.")
    ap.add_argument("--pin-cpu", type=int, default=1)
    ap.add_argument("--profile", type=Path, default=None, help="A fitted profile for every check (default: each "
                    "check fits its own around it, half before and half after: twin-check --fit-around).")
    ap.add_argument("--fit-before", action="store_true",
                    help="Fit each check's profile right before it (tidegate profile --from-twin) instead.")
    ap.add_argument("--one-profile", action="store_true", help="Fit one profile first, for every check.")
    ap.add_argument("--runs", type=int, default=1, help="With --fit-before or --one-profile: serving runs pooled "
                    "by the fit.")
    ap.add_argument("--max-drift", type=float, default=None,
                    help="Run a check again (profile included) when the machine's speed during it is off its "
                         "profiling speed by more than this share, e.g. 0.05; every attempt is reported.")
    ap.add_argument("--retries", type=int, default=2, help="With --max-drift: most runs again per check.")
    ap.add_argument("--noise-seeds", type=int, default=NOISE_SEEDS,
                    help="Noise seeds each check simulates, their requests pooled (twin-check --noise-seeds).")
    ap.add_argument("--out", type=Path, default=Path("docs/bench/twin"))
    args = ap.parse_args()
    if args.noise_seeds < 1 or args.checks < 1 or args.retries < 0:
        ap.error("--noise-seeds and --checks must be at least 1, --retries at least 0")
    args.out.mkdir(parents=True, exist_ok=True)
    pin = ["--pin-cpu", str(args.pin_cpu)]
    t0 = time.perf_counter()

    reports, profiles, set_aside = run_checks(args, pin)
    fits = [load_profile(p).to_dict()["step_time"] for p in profiles]
    fitting = "given" if args.profile else "one" if args.one_profile else "before" if args.fit_before else "around"
    summary = {"checks": args.checks, "trace": args.trace, "pin_cpu": args.pin_cpu, "fitting": fitting,
               "profiles": [str(p) for p in profiles],
               "step_time": fits, "wall_s": time.perf_counter() - t0, "metrics": {}, "ks": {}}
    named = list(dict.fromkeys(map(str, profiles)))
    lines = [f"Profile {p}: " + ", ".join(f"{k} {v:.4g}" for k, v in load_profile(p).to_dict()["step_time"].items())
             for p in named]
    lines += ["",
             "| metric | " + " | ".join(f"check {i + 1}" for i in range(args.checks)) + " | median | target |",
             "|---|" + "---|" * (args.checks + 2)]
    for key, bound in TARGETS.items():
        errs = [r["metrics"][key]["rel_error"] for r in reports]
        med = statistics.median(errs)
        verdict = "" if bound is None else (f"within {100 * bound:.0f}%: " + ("met" if abs(med) <= bound else "missed"))
        met = None if bound is None else abs(med) <= bound
        summary["metrics"][key] = {"rel_errors": errs, "median": med, "met": met}
        cells = " | ".join(f"{100 * e:+.1f}%" for e in errs)
        lines.append(f"| {key} | {cells} | {100 * med:+.1f}% | {verdict} |")
    lines += ks_lines(reports, summary)
    mape = [r["step_time"]["mape"] for r in reports]
    summary["step_mape"] = {"values": mape, "median": statistics.median(mape)}
    lines.append("| step-time MAPE | " + " | ".join(f"{100 * m:.1f}%" for m in mape)
                 + f" | {100 * statistics.median(mape):.1f}% | reported |")
    lines.append("\nmachine speed during each check against while its profile was fitted (single-token steps): "
                 + ", ".join(speed_text(r.get("speed_drift")) for r in reports))
    lines += spread_lines(reports, summary)
    lines += pooled_lines([args.out / f"check{i + 1}" for i in range(args.checks)], summary)
    if set_aside:
        lines += set_aside_lines(set_aside, args.max_drift)
        summary["set_aside"] = [{"folder": str(kept), "speed": r["speed_drift"]["ratio"],
                                 "ks_tpot": r["ks_distance"]["tpot_s"],
                                 "rel_errors": {k: v["rel_error"] for k, v in r["metrics"].items()}}
                                for kept, r in set_aside]
    (args.out / "twin_median.md").write_text("\n".join(lines) + "\n")
    (args.out / "twin_median.json").write_text(json.dumps(summary, indent=1) + "\n")
    plot_cdfs(args.out / "check1", args.out / "twin_cdf.png")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
