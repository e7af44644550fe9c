"""What one noise seed can do to a twin check: each recorded check's own profile simulated again
with single seeds and with the seeds pooled, against the check's real requests.

    python benchmarks/twin_seeds.py --check DIR [--check DIR ...] [--seeds 8] [--trace splitwise_conv] [--out FILE]

Each DIR is a ``tidegate twin-check`` output folder with the ``profile.json`` it simulated with
(``--fit-around``) and its ``twin_requests.csv``. For each, the check's requests (the first 300
of ``--trace``, length x0.1) are simulated with noise seeds 0 to ``--seeds`` - 1
(``engine.twin.seeds.simulate_seeds``); the table gives TPOT p99's relative error and the KS
distance of TPOT for seed 0 alone (what checks simulated before the seeds were pooled), the range
over the single seeds, and the pooled figures a check now reports.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from scipy.stats import ks_2samp

from tidegate.ctrl import build_controller
from tidegate.engine.bench.report import csv_column, rel_error
from tidegate.engine.core.profile import load_profile
from tidegate.engine.twin.seeds import latencies, simulate_seeds
from tidegate.engine.workloads import read_trace, resolve_trace


def real_tpot(folder: Path) -> np.ndarray:
    return csv_column(folder / "twin_requests.csv", "tpot_real_s")


def figures(real: np.ndarray, requests: list) -> tuple[float, float]:
    """TPOT p99's relative error and the KS distance of TPOT of ``requests`` against ``real``."""
    tpot = latencies(requests)["tpot_s"]
    return rel_error(tpot, real, 99), float(ks_2samp(real, tpot).statistic)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", type=Path, action="append", required=True, help="a twin-check output folder")
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--trace", default="splitwise_conv", help="the trace the checks replayed (first 300, length x0.1)")
    ap.add_argument("--out", type=Path, default=None, help="also write the table to this file")
    args = ap.parse_args()
    if args.seeds < 2:
        ap.error("--seeds must be at least 2: the point is to compare them")
    for c in args.check:
        if not (c / "profile.json").exists() or not (c / "twin_requests.csv").exists():
            raise SystemExit(f"{c} has no profile.json and twin_requests.csv: was it checked with --fit-around?")
    arrivals = read_trace(resolve_trace(args.trace), first_n=300, length_scale=0.1, max_tokens_cap=256)
    lines = [f"| check | TPOT p99, seed 0 | TPOT p99, seeds 0-{args.seeds - 1} one at a time | TPOT p99, pooled "
             f"| KS TPOT, seed 0 | KS TPOT, one at a time | KS TPOT, pooled |", "|---|---|---|---|---|---|---|"]
    for c in args.check:
        profile = load_profile(str(c / "profile.json"))
        real = real_tpot(c)
        _, runs = simulate_seeds(arrivals, profile, lambda p=profile: build_controller("greedy", p, arrivals),
                                 args.seeds)
        single = np.array([figures(real, requests) for requests in runs])
        p99, ks = figures(real, [r for requests in runs for r in requests])
        lines.append(f"| {c} | {100 * single[0, 0]:+.1f}% | {100 * single[:, 0].min():+.0f}% to "
                     f"{100 * single[:, 0].max():+.0f}% | {100 * p99:+.1f}% | {single[0, 1]:.3f} | "
                     f"{single[:, 1].min():.3f}-{single[:, 1].max():.3f} | {ks:.3f} |")
        print(lines[-1], flush=True)
    table = "\n".join(lines)
    print("\n" + table)
    if args.out:
        args.out.write_text(table + "\n")


if __name__ == "__main__":
    main()
