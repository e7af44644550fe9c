"""The evaluation matrix with a profile axis: the shipped policy, its prior and the heuristics on every
shipped profile and on perturbed ones.

    python benchmarks/profile_matrix.py [--draws 2] [--requests 1000] [--out docs/bench/profiles]

Profiles: ``a100-llama2-7b`` and ``h200-llama3-8b`` (the roofline presets), ``tiny-cpu`` (the tiny
model on this CPU), ``tiny-vllm-cpu`` (fitted from vLLM's steps), and two perturbations of the A100
preset: its step-time coefficients and KV capacity each scaled by up to +-30% (``--perturbed``, fixed
seeds; the policy trained on up to 30% around its two presets). Every shipped family at loads 0.5,
0.8, 1.2, 2 and 3 x lambda_max (``--loads``). Writes ``matrix.md``, ``matrix.json``, the heatmaps and
``profiles.md`` (one line per profile: the worst and mean cells of learned and of slo-flow against the best
heuristic) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path

import numpy as np

from tidegate.ctrl.learned import DEFAULT_POLICY
from tidegate.engine.core.profile import load_profile
from tidegate.engine.workloads.families import perturbed_profile
from tidegate.training.evaluate import evaluate, summarize, write_report

#: the slot model is not among them: on the families' real token lengths no controller meets an SLO there
#: (its own workload is benchmarks/slot_prior.py's)
SHIPPED = ("a100-llama2-7b", "h200-llama3-8b", "tiny-cpu", "tiny-vllm-cpu")


def profile_rows(summary: list[dict], names: list[str]) -> list[str]:
    """One table row a profile: the worst and mean cells of learned and slo-flow against the best heuristic (cells
    where no heuristic met an SLO have no ratio and are counted apart)."""
    out = []
    for name in names:
        cells = [r for r in summary if r["family"].endswith(f" @ {name}")]
        vb = [r["vs_best"] for r in cells if math.isfinite(r.get("vs_best", math.nan))]
        pb = [r["prior_vs_best"] for r in cells if math.isfinite(r.get("prior_vs_best", math.nan))]

        def worst_mean(xs: list[float]) -> str:
            return f"{min(xs):.3f}, {np.mean(xs):.3f}" if xs else "no ratio"

        out.append(f"| {name} | {len(cells)} ({len(cells) - len(vb)} without a ratio) | {worst_mean(vb)} | "
                   f"{worst_mean(pb)} | {sum(x < 0.97 for x in vb)}, {sum(x < 0.97 for x in pb)} |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draws", type=int, default=2)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--loads", default="0.5,0.8,1.2,2,3")
    ap.add_argument("--perturbed", type=int, default=2, help="perturbations of the A100 preset")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("docs/bench/profiles"))
    args = ap.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="tidegate-profiles-"))
    profiles = list(SHIPPED)
    for i in range(args.perturbed):
        p = perturbed_profile(load_profile("a100-llama2-7b"), np.random.default_rng([7, i]), 0.3)
        path = folder / f"a100-perturbed-{i}.json"
        p.save(path)
        profiles.append(str(path))
    start = time.monotonic()
    rows = evaluate({"learned": DEFAULT_POLICY}, loads=[float(x) for x in args.loads.split(",")],
                    seeds=tuple(range(args.draws)), requests=args.requests, profile=profiles, workers=args.workers)
    wall = time.monotonic() - start
    write_report(rows, ["learned"], args.out, held_out=("long-context", "flash-crowd", "code-trace"))
    summary = summarize(rows, ["learned"], held_out=("long-context", "flash-crowd", "code-trace"))
    lines = [f"# The matrix on {len(profiles)} profiles ({time.strftime('%Y-%m-%d')}, {wall / 60:.1f} min)", "",
             "| profile | cells | learned / best: worst, mean | slo-flow / best: worst, mean | cells below 0.97 "
             "(learned, slo-flow) |", "|---|---:|---|---|---|"]
    lines += profile_rows(summary, [Path(p).stem for p in profiles])
    (args.out / "profiles.md").write_text("\n".join(lines) + "\n")
    (args.out / "profiles.json").write_text(json.dumps({"profiles": profiles, "wall_s": wall}, indent=2))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
