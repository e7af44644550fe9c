"""Select each training seed's checkpoint on validation draws, then run the test matrix.

    .venv/bin/python benchmarks/learned_matrix.py --run runs/ppo --out docs/bench/matrix

1. Every checkpoint of every seed (``RUN/seed<N>/ppo_serving_<steps>_steps.zip`` and the final
   ``model.zip``) is exported to ONNX and simulated on *validation* draws of the training families
   (``training.evaluate.VALIDATION``: a random stream the test matrix never uses), next to slo-flow,
   the policy's prior. A seed's checkpoint is the one with the best worst-cell ratio to the prior
   (ties: the best mean ratio).
1b. Each selected checkpoint gets its residual scale (the share of its action applied, 0 being the
   prior alone) on five further validation draws: of the scales in ``SCALES`` whose worst cell is
   at least ``SCALE_FLOOR`` x the prior, the one with the best mean ratio (0 always qualifies). The
   scale is written into the policy file the matrix runs. The policy to ship (``--ship``) is the
   seed whose checkpoint at its scale scored best on these draws.
2. The selected checkpoints of all seeds run the *test* matrix (every shipped family, the families
   in the config's ``held_out`` marked, loads 0.5-3 x lambda_max, ``--draws`` draws each, six by
   default: on bursty traffic one draw can move a cell's goodput by half, and three draws left
   chance spreads of up to 26% against a 3% floor) against the heuristics; ``matrix.md``,
   ``matrix.json`` and heatmaps go to OUT, with ``selection.json``.
3. Poisson families at loads 0.3, 0.5 and 0.7: refusals of the shipped choice over ``--light-draws``
   test draws, beside greedy's SLO misses and slo-flow (``light_load_sim.light_load``:
   ``light_load.md`` and ``light_load.json``).

Cells run in parallel (``--workers``, ``--backend``/``--address`` for Ray).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
from pathlib import Path

import numpy as np
import yaml

from light_load_sim import light_load  # noqa: I001 (benchmarks/ is the script's own folder)
from tidegate.training.evaluate import PRIOR, TEST, VALIDATION, choose_residual_scale, evaluate, summarize, write_report
from tidegate.training.export import export, set_residual_scale

LOADS = (0.5, 0.8, 1.2, 2.0, 3.0)
VALIDATION_LOADS = (0.5, 1.2, 2.5)
#: residual scales tried for each selected checkpoint (0: the prior alone, inside the learned
#: controller's shield, measured too)
SCALES = (0.0, 0.25, 0.5, 1.0)
#: a scale qualifies if no validation cell falls below this share of the prior's goodput (the matrix asks
#: 0.97 x the best heuristic; the prior's own margin and the step from validation to test draws need the rest)
SCALE_FLOOR = 0.98
#: validation draws of the scale selection (the checkpoint selection uses draws 0 and 1)
SCALE_DRAWS = (2, 3, 4, 5, 6)


def checkpoints(seed_dir: Path) -> list[Path]:
    """The seed's checkpoints by step count, then its final model."""
    steps = sorted(seed_dir.glob("ppo_serving_*_steps.zip"), key=lambda p: int(re.findall(r"(\d+)_steps", p.name)[0]))
    return steps + ([seed_dir / "model.zip"] if (seed_dir / "model.zip").is_file() else [])


def export_all(run: Path) -> dict[str, dict[str, Path]]:
    """seed name -> checkpoint name -> its ONNX export (in ``seed<N>/onnx/``)."""
    out: dict[str, dict[str, Path]] = {}
    for seed_dir in sorted(run.glob("seed*")):
        folder = seed_dir / "onnx"
        folder.mkdir(exist_ok=True)
        out[seed_dir.name] = {ckpt.stem: export(ckpt, folder / f"{ckpt.stem}.onnx") for ckpt in checkpoints(seed_dir)}
    return out


def ratio_scores(rows: list[dict], names) -> dict[str, dict[str, float]]:
    """Worst-cell and mean ratio of each name's goodput to the prior's over the (family, load) cells
    of ``rows``, each cell's goodput the mean over its draws, as the matrix's targets count it.

    One draw is too noisy to rank on: on bursty and trace arrivals, moving one knob of the prior by
    3.5% changes a single draw's goodput by -23% to +53% (docs/BENCHMARKS.md,
    ``benchmarks/knob_sensitivity.py``)."""
    goodput: dict[tuple, dict[str, list[float]]] = {}
    for r in rows:
        goodput.setdefault((r["family"], r["load"]), {}).setdefault(r["controller"], []).append(r["goodput_frac"])
    scores = {}
    for name in names:
        ratios = [float(np.mean(g[name])) / float(np.mean(g[PRIOR])) for g in goodput.values()
                  if np.mean(g[PRIOR]) > 0] or [math.nan]
        scores[name] = {"min": float(np.min(ratios)), "mean": float(np.mean(ratios))}
    return scores


def select(exports: dict[str, dict[str, Path]], families: list[str], requests: int, opts: dict) -> dict:
    """Each seed's checkpoint with the best worst-cell ratio to the prior on validation draws."""
    named = {f"{seed}/{name}": path for seed, by_name in exports.items() for name, path in by_name.items()}
    rows = evaluate(named, families=families, loads=VALIDATION_LOADS, seeds=(0, 1), requests=requests,
                    heuristics=(PRIOR,), purpose=VALIDATION, **opts)
    scores = ratio_scores(rows, named)
    chosen = {}
    for seed, by_name in exports.items():
        best = max(by_name, key=lambda n: (round(scores[f"{seed}/{n}"]["min"], 3), scores[f"{seed}/{n}"]["mean"]))
        chosen[seed] = {"checkpoint": best, "onnx": str(by_name[best]), **scores[f"{seed}/{best}"]}
    return {"scores": scores, "chosen": chosen, "validation_loads": list(VALIDATION_LOADS),
            "validation_families": families, "validation_draws": [0, 1]}


def select_scales(chosen: dict, families: list[str], requests: int, opts: dict) -> dict:
    """Each seed's residual scale on validation draws ``SCALE_DRAWS``; writes the scaled policy files.

    :return: seed -> {"residual_scale", "onnx" (the file with the scale recorded), "scores" by scale}.
    """
    named = {}
    for seed, c in chosen.items():
        src = Path(c["onnx"])
        for scale in SCALES:
            named[f"{seed}@{scale:g}"] = set_residual_scale(src, scale, src.with_name(f"{src.stem}@{scale:g}.onnx"))
    rows = evaluate(named, families=families, loads=VALIDATION_LOADS, seeds=SCALE_DRAWS, requests=requests,
                    heuristics=(PRIOR,), purpose=VALIDATION, **opts)
    scores = ratio_scores(rows, named)
    out = {}
    for seed, c in chosen.items():
        by_scale = {s: scores[f"{seed}@{s:g}"] for s in SCALES}
        best = choose_residual_scale(by_scale, SCALE_FLOOR)
        chosen_score = by_scale.get(best, {"min": 1.0, "mean": 1.0})
        src = Path(c["onnx"])
        onnx = set_residual_scale(src, best, src.with_name(f"{src.stem}@selected.onnx"))
        out[seed] = {"residual_scale": best, "onnx": str(onnx), **chosen_score,
                     "scores": {f"{s:g}": v for s, v in by_scale.items()}}
    return out


def write_guard_table(rows: list[dict], shipped: str, out: Path, held_out) -> None:
    """The shipped seed alone and with its runtime guard, per cell, against the best heuristic and the prior."""
    summary = summarize(rows, [shipped], held_out)
    guard = f"{shipped}+guard"
    lines = ["| family | load | learned / best | learned+guard / best | learned / prior | learned+guard / prior |",
             "|---|---|---|---|---|---|"]
    ratios = []
    def div(a: float, b: float) -> float:
        return a / b if b > 0 else math.nan

    for r in summary:
        best = r[r["best_heuristic"]]
        g = r.get(guard, math.nan)
        ratios.append(div(g, best))
        lines.append(f"| {r['family']}{' (held out)' if r['held_out'] else ''} | {r['load']:g} | "
                     f"{div(r[shipped], best):.3f} | {div(g, best):.3f} | {div(r[shipped], r[PRIOR]):.3f} | "
                     f"{div(g, r[PRIOR]):.3f} |")
    finite = [x for x in ratios if x == x]
    lines.append(f"\nworst cell, learned+guard / best heuristic: {min(finite) if finite else math.nan:.3f}")
    (out / "guard.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", type=Path, default=Path("runs/ppo"), help="A `tidegate train --seeds` output folder.")
    ap.add_argument("--out", type=Path, default=Path("docs/bench/matrix"))
    ap.add_argument("--requests", type=int, default=1500, help="Requests per test cell.")
    ap.add_argument("--draws", type=int, default=6, help="Test draws per (family, load) cell.")
    ap.add_argument("--validation-requests", type=int, default=1000)
    ap.add_argument("--light-draws", type=int, default=8, help="Test draws of the light-load check.")
    ap.add_argument("--profile", default="a100-llama2-7b")
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--address", default=None)
    ap.add_argument("--select-only", action="store_true",
                    help="Stop after the checkpoint and scale selection (selection.json names each seed's file).")
    ap.add_argument("--ship", type=Path, default=None, help="Copy the chosen policy here (checkpoints/policy.onnx).")
    args = ap.parse_args()
    opts = {"workers": args.workers, "backend": args.backend, "address": args.address}
    cfg = yaml.safe_load((args.run / "seed0" / "train_run.yaml").read_text())
    train_families = list(cfg["env_kwargs"]["families"])
    held_out = list(cfg.get("held_out") or [])

    exports = export_all(args.run)
    selection = select(exports, train_families, args.validation_requests, {**opts, "profile": args.profile})
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "selection.json").write_text(json.dumps(selection, indent=1))
    print(json.dumps(selection["chosen"], indent=1))

    scales = select_scales(selection["chosen"], train_families, args.validation_requests,
                           {**opts, "profile": args.profile})
    selection["scales"] = scales
    selection["scale_floor"], selection["scale_draws"] = SCALE_FLOOR, list(SCALE_DRAWS)
    selection["ship"] = max(scales, key=lambda s: (round(scales[s]["min"], 3), scales[s]["mean"]))
    (args.out / "selection.json").write_text(json.dumps(selection, indent=1))
    print("residual scales:", {seed: s["residual_scale"] for seed, s in scales.items()}, "ship:", selection["ship"])
    if args.select_only:
        return

    learned = {seed: Path(s["onnx"]) for seed, s in scales.items()}
    shipped = selection["ship"]
    rows = evaluate(learned, loads=LOADS, seeds=tuple(range(args.draws)), requests=args.requests, profile=args.profile,
                    purpose=TEST, guarded=(shipped,), **opts)
    plain = [r for r in rows if not r["controller"].endswith("+guard")]
    report = write_report(plain, list(learned), args.out, held_out)
    print(json.dumps(report["targets"], indent=1))
    write_guard_table(rows, shipped, args.out, held_out)

    light = light_load(learned[shipped], args.out, args.requests, args.light_draws, **opts)
    print(f"refusals at light Poisson load ({args.light_draws} draws):",
          {f"{t['family']}@{t['load']}": t["learned_refusals"] for t in light})
    summary = summarize(rows, list(learned), held_out)
    worst = min(summary, key=lambda r: r.get("vs_best_min", math.inf))
    print("worst cell:", worst["family"], worst["load"], f"{worst['vs_best_min']:.3f}")
    if args.ship is not None:
        shutil.copy(learned[selection["ship"]], args.ship)
        print("shipped", learned[selection["ship"]], "->", args.ship)


if __name__ == "__main__":
    main()
