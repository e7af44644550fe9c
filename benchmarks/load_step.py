"""A step in load after an idle spell, in the twin: who misses the TTFT SLO, and when they arrived.

    python benchmarks/load_step.py --profile PROFILE.json --spec slo-flow --spec slo-flow:queue_witness=false \
        --phase 3.27:120 --gap-s 35 --phase 6.54:120 --out DIR [--draws 6] [--ttft-slo-s 2 --tpot-slo-s 0.2] \
        [--probe-period-s 0.5]

The arrivals of ``benchmarks/vllm_overload.py``: Poisson, every request ``--prompt-tokens`` in and exactly
``--output-tokens`` out, one ``--phase RATE:SECONDS`` after the other (repeatable), with the replica idle for
``--gap-s`` between them (the overload benchmark runs its loads on one server, one after the other, with a pause
between them; ``--probe-period-s`` adds its idle probe, a one-token completion every period, left out of the
figures). The profile is any profile, e.g. one fitted from that benchmark's step log
(``tidegate profile --from-steps DIR/logs/steps-tidegate.csv --out PROFILE.json``), with the benchmark's SLOs
given here. Every spec runs on the same ``--draws`` draws (arrivals and step noise seeded by the draw).

Per spec and phase: requests, served, goodput (requests within both SLOs per second of the phase), served
requests that missed the TTFT SLO (all, and those that arrived in the phase's first ``--early-s``), TTFT p99
of the served (the mean and worst over draws) and refusals. Writes ``load_step.md``, ``load_step.json`` and
``load_step.png`` (draw 0: each served request's TTFT against its arrival time) to ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np

from tidegate.ctrl import build_controller
from tidegate.engine.bench.report import usage_error
from tidegate.engine.core.figures import save_png
from tidegate.engine.core.profile import Profile, ProfileError, load_profile
from tidegate.engine.core.request import RequestState
from tidegate.engine.sim.simulate import simulate
from tidegate.engine.workloads.arrivals import Arrival
from tidegate.engine.workloads.synthetic import load_synthetic

PROG = "load_step"


def phase(text: str) -> tuple[float, float]:
    try:
        rate, seconds = (float(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not RATE:SECONDS") from None
    if not (rate > 0 and seconds > 0):
        raise argparse.ArgumentTypeError(f"{text!r}: the rate and the seconds must be positive")
    return rate, seconds


#: the class of the idle probe's requests, left out of every figure
PROBE_CLASS = 1


def arrivals(phases: list[tuple[float, float]], gap_s: float, prompt: int, output: int,
             draw: int, probe_period_s: float = 0.0) -> tuple[list[Arrival], list[float]]:
    """Poisson arrivals phase after phase (each a one-class synthetic workload, seeded by the draw and the
    phase), and each phase's start; with ``probe_period_s``, the overload benchmark's idle probe too: a
    one-token completion of a two-token prompt every period from the start to the end of the last gap
    (``PROBE_CLASS``)."""
    out: list[Arrival] = []
    starts: list[float] = []
    start = 0.0
    for i, (rate, seconds) in enumerate(phases):
        starts.append(start)
        workload = {"arrival": {"process": "poisson"}, "duration_s": seconds, "max_tokens": output,
                    "classes": [{"rate_rps": rate, "prompt_tokens": prompt, "output_tokens": output}]}
        out += [dataclasses.replace(a, arrival_time_s=start + a.arrival_time_s)
                for a in load_synthetic(workload, seed=len(phases) * draw + i)]
        start += seconds + gap_s
    if probe_period_s > 0:
        out += [Arrival(k * probe_period_s, 2, 1, 1, PROBE_CLASS) for k in range(int(start / probe_period_s))]
        out.sort(key=lambda a: a.arrival_time_s)
    return out, starts


def measure(result, starts: list[float], phases: list[tuple[float, float]], profile: Profile,
            early_s: float) -> list[dict]:
    """Per phase: the figures of the module docstring, and the served requests' (arrival, TTFT)."""
    ttft_slo, tpot_slo = profile.ttft_slo_s, profile.tpot_slo_s
    rows = []
    for start, (_, seconds) in zip(starts, phases):
        mine = [r for r in result.core.metrics.terminal
                if start <= r.arrival_time_s < start + seconds and r.class_id != PROBE_CLASS]
        served = [r for r in mine if r.first_token_time_s is not None and r.finish_time_s is not None]
        ttft = np.array([r.first_token_time_s - r.arrival_time_s for r in served])
        tpot = np.array([(r.finish_time_s - r.first_token_time_s) / max(r.num_output_tokens - 1, 1) for r in served])
        late = ttft > ttft_slo
        early = np.array([r.arrival_time_s - start < early_s for r in served], dtype=bool)
        rows.append({"requests": len(mine), "served": len(served),
                     "goodput_rps": float(np.sum(~late & (tpot <= tpot_slo))) / seconds,
                     "late": int(late.sum()), "late_early": int((late & early).sum()),
                     "ttft_p99_s": float(np.quantile(ttft, 0.99)) if len(ttft) else 0.0,
                     "tpot_p99_s": float(np.quantile(tpot, 0.99)) if len(tpot) else 0.0,
                     "late_tpot": int((tpot > tpot_slo).sum()),
                     "refused": sum(r.state is RequestState.REJECTED for r in mine),
                     "points": [(round(r.arrival_time_s, 3), round(float(t), 3)) for r, t in zip(served, ttft)]})
    return rows


def plot(runs: dict[str, list[list[dict]]], profile: Profile, path: Path) -> None:
    """Draw 0's served requests' TTFT against their arrival, one panel per spec, the SLO in red."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(runs), 1, figsize=(8, 2.4 * len(runs)), sharex=True, squeeze=False)
    for ax, (spec, draws) in zip(axes[:, 0], runs.items()):
        points = [p for ph in draws[0] for p in ph["points"]]
        ax.scatter([p[0] for p in points], [p[1] for p in points], s=3)
        ax.axhline(profile.ttft_slo_s, color="tab:red", lw=0.8)
        ax.set_ylabel("TTFT s")
        ax.set_title(spec, fontsize=9)
    axes[-1, 0].set_xlabel("arrival s (draw 0)")
    fig.tight_layout()
    save_png(fig, path, dpi=80)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", required=True, help="a profile name or file")
    ap.add_argument("--spec", action="append", required=True, help="a controller spec (repeatable)")
    ap.add_argument("--phase", action="append", type=phase, required=True, help="RATE:SECONDS (repeatable)")
    ap.add_argument("--gap-s", type=float, default=35.0, help="idle seconds before each phase")
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--ttft-slo-s", type=float, default=None, help="the TTFT SLO (default: the profile's)")
    ap.add_argument("--tpot-slo-s", type=float, default=None, help="the TPOT SLO (default: the profile's)")
    ap.add_argument("--early-s", type=float, default=15.0, help="a phase's first seconds, counted apart")
    ap.add_argument("--probe-period-s", type=float, default=0.0,
                    help="the overload benchmark's idle probe: a one-token completion every this many seconds, "
                         "phases and gaps alike, left out of the figures (0: none)")
    ap.add_argument("--draws", type=int, default=6)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    if not (args.prompt_tokens >= 1 and args.output_tokens >= 1 and args.draws >= 1 and args.gap_s >= 0
            and args.probe_period_s >= 0):
        usage_error("--prompt-tokens, --output-tokens and --draws must be at least 1, and --gap-s and "
                    "--probe-period-s at least 0", PROG)
    try:
        profile = load_profile(args.profile)
        slos = {k: v for k, v in (("ttft_slo_s", args.ttft_slo_s), ("tpot_slo_s", args.tpot_slo_s)) if v is not None}
        profile = dataclasses.replace(profile, **slos)
        for spec in args.spec:
            build_controller(spec, profile)
    except (ValueError, OSError, ProfileError) as exc:
        usage_error(str(exc), PROG)

    runs: dict[str, list[list[dict]]] = {spec: [] for spec in args.spec}
    for draw in range(args.draws):
        arr, starts = arrivals(args.phase, args.gap_s, args.prompt_tokens, args.output_tokens, draw,
                               args.probe_period_s)
        for spec in args.spec:
            result = simulate(arr, profile, build_controller(spec, profile), noise_seed=draw, record_steps=False)
            runs[spec].append(measure(result, starts, args.phase, profile, args.early_s))
        print(f"draw {draw + 1} of {args.draws} done", file=sys.stderr)

    lines = [f"# A step in load after an idle spell, in the twin ({profile.name})", "",
             f"Profile `{args.profile}`, SLO TTFT <= {profile.ttft_slo_s:g} s and TPOT <= {profile.tpot_slo_s:g} s; "
             f"{args.prompt_tokens} prompt and {args.output_tokens} output tokens, Poisson; phases "
             + ", ".join(f"{r:g} req/s for {s:g} s" for r, s in args.phase)
             + f", {args.gap_s:g} s idle between them"
             + (f" (an idle probe every {args.probe_period_s:g} s throughout)" if args.probe_period_s else "")
             + f"; {args.draws} draws. Sums over the draws; TTFT p99 of the served "
             "requests, mean and worst over draws.", "",
             f"| spec | phase | requests | served | refused | goodput req/s (mean) | late TTFT | of them in the first "
             f"{args.early_s:g} s | TTFT p99 s, mean / worst | TPOT over the SLO | TPOT p99 ms, mean / worst |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|---:|---|"]
    summary: dict[str, list[dict]] = {}
    for spec, draws in runs.items():
        summary[spec] = []
        for i, (rate, seconds) in enumerate(args.phase):
            cells = [d[i] for d in draws]
            row = {"rate_rps": rate, "seconds": seconds,
                   **{k: sum(c[k] for c in cells)
                      for k in ("requests", "served", "refused", "late", "late_early", "late_tpot")},
                   "goodput_rps": float(np.mean([c["goodput_rps"] for c in cells])),
                   "ttft_p99_s_mean": float(np.mean([c["ttft_p99_s"] for c in cells])),
                   "ttft_p99_s_worst": float(max(c["ttft_p99_s"] for c in cells)),
                   "tpot_p99_s_mean": float(np.mean([c["tpot_p99_s"] for c in cells])),
                   "tpot_p99_s_worst": float(max(c["tpot_p99_s"] for c in cells))}
            summary[spec].append(row)
            lines.append(f"| `{spec}` | {rate:g} req/s | {row['requests']} | {row['served']} | {row['refused']} | "
                         f"{row['goodput_rps']:.3f} | {row['late']} | {row['late_early']} | "
                         f"{row['ttft_p99_s_mean']:.2f} / {row['ttft_p99_s_worst']:.2f} | {row['late_tpot']} | "
                         f"{1e3 * row['tpot_p99_s_mean']:.0f} / {1e3 * row['tpot_p99_s_worst']:.0f} |")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "load_step.md").write_text("\n".join(lines) + "\n")
    (args.out / "load_step.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                         "summary": summary}, indent=1))
    print("\n".join(lines))

    plot(runs, profile, args.out / "load_step.png")


if __name__ == "__main__":
    main()
