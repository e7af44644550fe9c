"""Whether a check's step residuals are noise or belong to particular steps: the real run's own
step factors fed back into the simulator.

    python benchmarks/step_factors.py --check DIR [--check DIR ...] [--trace splitwise_conv]
        [--without-prefill-alone] [--out FILE]

For each DIR (a ``tidegate twin-check`` output folder with ``twin_steps.csv``, prefill chunk column
included, and ``twin_requests.csv``), the step model is fitted on the check's own steps (in
sample, ``fit_step_time``), and each step's factor is its real time over the fit's prediction.
The check's requests (``--trace``, first 300, length x0.1, as the check replayed them) are then
simulated with the fit's median step times times factors taken from that list, noise off:

- ``in step order``: the simulator's n-th non-empty step gets the real run's n-th factor (the
  simulator runs nearly the same steps as the real engine did, a few shifted where an arrival
  fell on the other side of a step);
- ``by kind, in order``: the n-th step of each kind (a prefill, a decode step right after one,
  any other step) gets the real run's n-th factor of that kind;
- ``by kind, shifted S``: the same, each kind's list rotated by S and by -S (both pooled): the
  same factors, the same kinds and the same order, each on a step S of its kind away;
- ``noise model``: the profile's fitted noise instead (8 seeds pooled), as a twin check draws it.

If the residuals were noise, independent of which step they fell on, shifting them would change
nothing on average over many checks. A figure that moves when they are shifted is one the step
model gets wrong for particular steps: the kinds of step it comes back to on are the place to
look (``benchmarks/step_kinds.py``). The table gives each figure's relative error against the
check's real requests, median over the checks (mean of |value| in brackets).
``--without-prefill-alone`` fits the step model without ``per_prefill_alone_s`` (one cost per
prefill chunk, as profiles had before it).
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import numpy as np

from tidegate.ctrl import build_controller
from tidegate.engine.bench.report import emit, rel_error
from tidegate.engine.core.builder import build_engine
from tidegate.engine.core.clock import VirtualClock
from tidegate.engine.core.driver import replay
from tidegate.engine.core.executor import Batch, StepResult
from tidegate.engine.core.profile import Profile, load_profile
from tidegate.engine.sim.executor import SimExecutor
from tidegate.engine.sim.fit import fit_step_time, profile_fields
from tidegate.engine.sim.simulate import make_request
from tidegate.engine.twin.fit import read_steps_csv
from tidegate.engine.twin.seeds import latencies, simulate_seeds
from tidegate.engine.workloads import read_trace, resolve_trace

from twin_noise import real_latencies  # beside this script

FIGURES = ("TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99")
SHIFTS = (1, 4, 40)
NOISE_SEEDS = 8


class FactorExecutor(SimExecutor):
    """The profile's median step time times the next factor of the step's kind (0: a step with
    prefill chunks, 1: a decode step right after one, 2: any other), each kind's list used in
    order and from its start again when it runs out."""

    def __init__(self, profile: Profile, factors: list[np.ndarray]) -> None:
        super().__init__(dataclasses.replace(profile, noise_sigma=0.0))
        self.factors = factors
        self.used = [0] * len(factors)
        self.after_prefill_step = False

    def execute(self, batch: Batch) -> StepResult:
        result = super().execute(batch)
        if not batch.num_tokens or result.duration_s is None:
            return result
        kind = 0 if batch.num_prefills else (1 if self.after_prefill_step else 2)
        self.after_prefill_step = bool(batch.num_prefills)
        kind = min(kind, len(self.factors) - 1)  # one list: every step in order
        factors = self.factors[kind]
        factor = float(factors[self.used[kind] % len(factors)])
        self.used[kind] += 1
        return StepResult(result.duration_s * factor)


def simulate_with(profile: Profile, arrivals, factors: list[np.ndarray]) -> list:
    """The ended requests of one simulation of ``arrivals`` with a ``FactorExecutor``."""
    controller = build_controller("greedy", profile, arrivals)
    controller.reset()
    core = build_engine(profile, controller, FactorExecutor(profile, factors), VirtualClock(), record_steps=False)
    replay(core, [a.arrival_time_s for a in arrivals], lambda i: make_request(i, arrivals[i]))
    return list(core.metrics.terminal)


def figures(done: list, ttft_real: np.ndarray, tpot_real: np.ndarray) -> list[float]:
    lat = latencies(done)
    return [rel_error(lat[key], real, q) for key, real, q in (("ttft_s", ttft_real, 50), ("ttft_s", ttft_real, 99),
                                                        ("tpot_s", tpot_real, 50), ("tpot_s", tpot_real, 99))]


def check_figures(folder: Path, base: Profile, arrivals, prefill_alone: bool = True) -> dict[str, list[float]]:
    rows = read_steps_csv(folder / "twin_steps.csv")
    fit = fit_step_time(rows, loss="l1", prefill_alone=prefill_alone)
    profile = dataclasses.replace(base, **profile_fields(fit))
    predicted = np.array(profile.predict_steps((r[0], r[1]) + tuple(r[3:]) for r in rows))
    factors = np.array([r[2] for r in rows]) / predicted
    factors /= float(np.exp(np.median(np.log(factors))))  # median 1, as the noise's
    chunks = np.array([r[4] for r in rows])
    before = np.concatenate([[0], chunks[:-1]])
    kinds = [factors[chunks > 0], factors[(chunks == 0) & (before > 0)], factors[(chunks == 0) & (before == 0)]]
    ttft_real, tpot_real, _ = real_latencies(folder)
    out = {"in step order": figures(simulate_with(profile, arrivals, [factors]), ttft_real, tpot_real),
           "by kind, in order": figures(simulate_with(profile, arrivals, kinds), ttft_real, tpot_real)}
    for s in SHIFTS:
        done = [r for shift in (s, -s) for r in simulate_with(profile, arrivals, [np.roll(k, shift) for k in kinds])]
        out[f"by kind, shifted {s}"] = figures(done, ttft_real, tpot_real)
    _, runs = simulate_seeds(arrivals, profile, lambda: build_controller("greedy", profile, arrivals), NOISE_SEEDS)
    out["noise model"] = figures([r for done in runs for r in done], ttft_real, tpot_real)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", type=Path, action="append", required=True, help="a twin-check output folder")
    ap.add_argument("--base", default="tiny-cpu", help="profile whose capacity, block size and SLOs the fits keep")
    ap.add_argument("--trace", default="splitwise_conv", help="the trace the checks replayed (first 300, length x0.1)")
    ap.add_argument("--without-prefill-alone", action="store_true",
                    help="Fit without the cost of a prefill with no decodes beside (one cost per chunk).")
    ap.add_argument("--out", type=Path, default=None, help="also write the table to this file")
    args = ap.parse_args()
    for c in args.check:
        for name in ("twin_steps.csv", "twin_requests.csv"):
            if not (c / name).exists():
                raise SystemExit(f"{c} has no {name}: give twin-check output folders.")
        if len(read_steps_csv(c / "twin_steps.csv")[0]) < 5:
            raise SystemExit(f"{c}/twin_steps.csv has no prefill chunk column: rerun the check with this version.")
    base = load_profile(args.base)
    arrivals = read_trace(resolve_trace(args.trace), first_n=300, length_scale=0.1, max_tokens_cap=256)
    found: dict[str, list[list[float]]] = {}
    for n, c in enumerate(args.check, 1):
        print(f"[{n}/{len(args.check)}] {c}", flush=True)
        for name, values in check_figures(c, base, arrivals, not args.without_prefill_alone).items():
            found.setdefault(name, []).append(values)
    fitted = "one cost per prefill chunk" if args.without_prefill_alone else "the shipped step model"
    lines = [f"{len(args.check)} checks, each fitted on its own steps ({fitted}), its real step factors fed back; "
             "relative error "
             "against its real requests, median over the checks (mean of |value| in brackets)", "",
             "| factors | " + " | ".join(FIGURES) + " |", "|---|" + "---|" * len(FIGURES)]
    for name, values in found.items():
        a = np.array(values)
        cells = [f"{100 * m:+.1f}% ({100 * s:.1f}%)" for m, s in zip(np.median(a, axis=0), np.mean(np.abs(a), axis=0))]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    emit(lines, args.out)


if __name__ == "__main__":
    main()
