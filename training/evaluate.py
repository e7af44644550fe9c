"""The evaluation matrix: workload families x loads x seeds, the learned controller against the
heuristics, each cell a simulation on the twin.

Each cell samples ``requests`` arrivals from a family (``engine.workloads.families``: a shipped name,
a family YAML, or a trace file), scales them to ``load`` x the fluid bound lambda_max of those very
requests on the profile, and simulates every controller on the same arrivals. Simulations are pure
functions of their inputs (the virtual clock never lets the policy's speed change a result), so a
cell gives the same figures on an idle and on a busy machine.

Draws are keyed by purpose: ``TEST`` draws (the matrix) and ``VALIDATION`` draws (checkpoint
selection) come from different random streams, and neither is the training env's stream.

The comparison set is the field's policies (``HEURISTICS``: vLLM's greedy, SGLang's, watermark
backpressure, adaptive flow control) plus ``slo-flow``, the heuristic the policy adjusts (its
action 0); "best heuristic" is the best of the first four in the cell, "prior" the last.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np

from tidegate.ctrl import build_controller
from tidegate.ctrl.base import ReplicaProfile
from tidegate.ctrl.learned import make_learned_controller
from tidegate.ctrl.theory import capacity
from tidegate.engine.core.figures import save_png
from tidegate.engine.core.profile import load_profile
from tidegate.engine.sim.simulate import simulate
from tidegate.engine.twin.guard import simulate_guarded
from tidegate.engine.workloads import Arrival, WorkloadError
from tidegate.engine.workloads.families import Family, load_family, shipped_families
from tidegate.training.errors import EvaluationError
from tidegate.training.parallel import run_tasks

#: the field's policies the learned controller is held against
HEURISTICS = ("greedy", "sglang", "watermark", "flow")
#: the heuristic under the learned policy (its action 0)
PRIOR = "slo-flow"
DEFAULT_LOADS = (0.5, 0.8, 1.2, 2.0, 3.0)
#: purposes of the random draws: the test matrix and checkpoint selection never share a draw
TEST, VALIDATION = 1, 2


def require_policy(path: str | Path, profile: ReplicaProfile) -> Path:
    """``path`` if the learned controller can run the policy in it on ``profile``.

    ``make_learned_controller`` falls back to the heuristic for a missing or corrupt policy (right
    for serving); an evaluation of that fallback under the name of the learned controller would be wrong.

    :raises EvaluationError: the file is missing or not a policy exported by ``tidegate export``.
    """
    path = Path(path)
    if not path.is_file():
        raise EvaluationError(f"{path}: no such policy file (write one with `tidegate export CHECKPOINT OUT`)")
    probe = make_learned_controller(path, profile=profile).inner
    if probe.policy is None:
        cause = (probe.load_error or "").rpartition(": ")[2]
        raise EvaluationError(f"{path}: not a policy written by `tidegate export` ({cause})")
    return path


def writable_folder(folder: str | Path) -> Path:
    """``folder``, created if missing; checked before a long run rather than after it.

    :raises EvaluationError: it cannot be created.
    """
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise EvaluationError(f"{folder}: cannot create this folder ({exc.strerror or type(exc).__name__})") from None
    return folder


def check_sizes(loads, seeds, requests: int) -> None:
    """At least one load and seed, loads positive, seeds non-negative, at least 2 requests per cell.

    :raises EvaluationError: naming the bad value.
    """
    if not loads or not seeds:
        raise EvaluationError("need at least one load and one seed")
    for x in loads:
        if not (x > 0 and math.isfinite(x)):
            raise EvaluationError(f"loads must be positive multiples of lambda_max, got {x}")
    for s in seeds:
        if s < 0:
            raise EvaluationError(f"seeds must be >= 0, got {s}")
    if requests < 2:
        raise EvaluationError(f"requests must be at least 2 per cell, got {requests}")


def resolve_family(source: str | Path) -> Family:
    """A shipped family name, a family YAML, or a trace file (a family of windows of that trace).

    :raises EvaluationError: none of these.
    """
    text = str(source)
    try:
        if text in shipped_families() or text.endswith((".yaml", ".yml")):
            return load_family(text)
        return load_family({"name": Path(text).stem, "trace": text})
    except WorkloadError as exc:
        raise EvaluationError(str(exc)) from None


def cell_arrivals(family: Family, load: float, seed: int, requests: int, profile,
                  purpose: int = TEST) -> tuple[list[Arrival], float]:
    """The arrivals of one cell and their lambda_max on ``profile``: ``requests`` drawn from the
    family with the stream ``(seed, purpose)``, at ``load`` x lambda_max of those requests."""
    arrivals = family.sample(np.random.default_rng([seed, purpose]), requests, 1.0)
    lam = capacity([a.prompt_tokens for a in arrivals], [a.output_tokens for a in arrivals], profile).lambda_max_rps
    k = 1.0 / (load * lam)  # the sample's mean rate is 1 request/s
    return [replace(a, arrival_time_s=a.arrival_time_s * k) for a in arrivals], lam


def run_cell(family: str, load: float, seed: int, requests: int, profile: str, specs: list[str],
             policies: dict[str, str], purpose: int = TEST, guarded: tuple[str, ...] = ()) -> list[dict]:
    """Every controller on one cell's arrivals: one row each (a Ray or process task). A policy
    named in ``guarded`` also runs with its runtime guard, as ``<name>+guard``."""
    prof = load_profile(profile)
    fam = resolve_family(family)
    arrivals, lam = cell_arrivals(fam, load, seed, requests, prof, purpose)
    rows = []

    def sim(controller):  # every controller of the cell sees the same step noise (a noisy profile's)
        return simulate(arrivals, prof, controller, record_steps=False, noise_seed=seed).summary

    def with_guard(path):
        return simulate_guarded(arrivals, prof, make_learned_controller(path, profile=prof))[0]

    controllers = [(spec, lambda s=spec: sim(build_controller(s, prof, arrivals))) for spec in specs]
    controllers += [(name, lambda p=path: sim(make_learned_controller(p, profile=prof)))
                    for name, path in policies.items()]
    controllers += [(f"{name}+guard", lambda p=policies[name]: with_guard(p)) for name in guarded]
    for name, run in controllers:
        s = run()
        rows.append({"family": fam.name, "profile": profile, "load": load, "seed": seed, "controller": name,
                     "goodput_frac": s["goodput_rps"] / lam, "requests": s["requests"], "rejected": s["rejected"],
                     "evictions": s["evictions"], "slo_attainment": s["slo_attainment"],
                     "ttft_pred_wrong_side": s["ttft_pred_wrong_side"], "ttft_pred_mae_s": s["ttft_pred_mae_s"]})
    return rows


def evaluate(policies: dict[str, str | Path], *, families=None, loads=DEFAULT_LOADS, seeds=(0, 1, 2),
             requests: int = 1500, profile: str | Sequence[str] = "a100-llama2-7b", heuristics=(*HEURISTICS, PRIOR),
             purpose: int = TEST, backend: str = "auto", address: str | None = None, workers: int | None = None,
             progress: bool = True, guarded: tuple[str, ...] = ()) -> list[dict]:
    """The matrix's rows: one per (profile, family, load, seed, controller).

    :param policies: name -> exported policy (e.g. one per training seed).
    :param families: family names, family YAML files or trace files (default: every shipped family).
    :param profile: a profile (name or file), or several: the matrix's profile axis.
    :param guarded: policies to run also with their runtime guard (``engine.twin.guard``), as ``<name>+guard``.
    :raises EvaluationError: a policy, family, load, seed, profile or request count that cannot be used.
    """
    check_sizes(loads, seeds, requests)
    profiles = [profile] if isinstance(profile, (str, Path)) else list(profile)
    if not profiles:
        raise EvaluationError("give at least one profile")
    for p in profiles:
        try:
            prof = load_profile(p)
        except (ValueError, OSError) as exc:
            raise EvaluationError(f"profile {str(p)!r}: {exc}") from None
        policies = {name: str(require_policy(path, prof)) for name, path in policies.items()}
    families = list(families or shipped_families())
    for f in families:
        resolve_family(f)  # fail before any task starts
    tasks = [{"family": str(f), "load": float(load), "seed": int(seed), "requests": requests, "profile": str(p),
              "specs": list(heuristics), "policies": policies, "purpose": purpose, "guarded": tuple(guarded)}
             for p in profiles for f in families for load in loads for seed in seeds]
    cells = run_tasks(run_cell, tasks, backend=backend, address=address, workers=workers,
                      desc=f"{len(tasks)} cells", progress=progress)
    return [row for cell in cells for row in cell]


def choose_residual_scale(scores: dict[float, dict[str, float]], floor: float) -> float:
    """The residual scale to ship: of the scales whose worst validation cell is at least ``floor`` x
    the prior's goodput, the one with the best mean ratio to the prior (ties: the smaller scale).
    Scale 0 is the prior itself (ratio 1 everywhere) and always qualifies, so a policy that loses
    anywhere by more than the floor at every scale ships as its prior.

    :param scores: scale -> ``{"min": worst-cell ratio, "mean": mean ratio}`` to the prior; scale 0
        may be among them (measured: the prior inside the learned controller's shield), else it
        scores 1.
    """
    by_scale = {0.0: {"min": 1.0, "mean": 1.0}, **scores}
    fit = {s for s, sc in by_scale.items() if sc["min"] >= floor} | {0.0}  # NaN never qualifies; 0 always
    return max(fit, key=lambda s: (round(by_scale[s]["mean"], 3), -s))


def summarize(rows: list[dict], learned: list[str], held_out=()) -> list[dict]:
    """One row per (family, load): each controller's goodput / lambda_max (mean over seeds), the
    learned controllers' mean and spread, the best heuristic, the ratios and the refusals."""
    by_cell: dict[tuple, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    refusals: dict[tuple, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    # with a profile axis a cell is a family on a profile, named "family @ profile" (the profile's file name
    # without its folder and suffix, or its whole path where two files share a name)
    profiles = {str(r.get("profile")) for r in rows}
    stems = {p: Path(p).stem for p in profiles}
    short = len(set(stems.values())) == len(profiles)
    for r in rows:
        name = stems[str(r.get("profile"))] if short else str(r.get("profile"))
        key = (f"{r['family']} @ {name}" if len(profiles) > 1 else r["family"], r["load"])
        by_cell[key][r["controller"]].append(r["goodput_frac"])
        refusals[key][r["controller"]] += r["rejected"]
    out = []
    for (family, load), got in sorted(by_cell.items()):
        row: dict = {"family": family, "held_out": family.split(" @ ")[0] in held_out, "load": load}
        for name, values in got.items():
            row[name] = float(np.mean(values))
        heur = {h: row[h] for h in HEURISTICS if h in row}
        best = max(heur, key=heur.get) if heur else None
        row["best_heuristic"] = best
        ratios = [row[name] / heur[best] if best and heur[best] > 0 else math.nan for name in learned if name in row]
        if learned:
            row["learned"] = float(np.mean([row[n] for n in learned if n in row]))
            row["vs_best"] = float(np.mean(ratios))
            row["vs_best_min"] = float(np.min(ratios))
            row["vs_best_std"] = float(np.std(ratios))
            row["vs_prior"] = row["learned"] / row[PRIOR] if row.get(PRIOR) else math.nan
            row["learned_refusals"] = int(np.mean([refusals[(family, load)][n] for n in learned]))
        if PRIOR in row and best:
            row["prior_vs_best"] = row[PRIOR] / heur[best] if heur[best] > 0 else math.nan
        if PRIOR in got and len(got[PRIOR]) > 1 and row[PRIOR] > 0:
            # how far the cell's mean moves by chance: the prior's standard error over its draws
            row["prior_rel_se"] = float(np.std(got[PRIOR], ddof=1) / math.sqrt(len(got[PRIOR])) / row[PRIOR])
        out.append(row)
    return out


def targets(summary: list[dict]) -> dict[str, float]:
    """The issue's figures: the worst cell at loads 0.5-3, the geometric mean at loads >= 1.2 (cells
    where no controller met any SLO have no ratio and are left out)."""
    cells = [r for r in summary if 0.5 <= r["load"] <= 3.0 and "vs_best" in r]

    def worst(key: str) -> float:
        values = [r[key] for r in cells if math.isfinite(r[key])]
        return min(values) if values else math.nan

    over = [r["vs_best"] for r in cells if r["load"] >= 1.2 and math.isfinite(r["vs_best"]) and r["vs_best"] > 0]
    noise = [r["prior_rel_se"] for r in cells if math.isfinite(r.get("prior_rel_se", math.nan))]
    return {"worst_cell_vs_best": worst("vs_best_min"), "worst_cell_mean_vs_best": worst("vs_best"),
            "geomean_vs_best_load_ge_1.2": float(np.exp(np.mean(np.log(over)))) if over else math.nan,
            "worst_cell_vs_prior": worst("vs_prior"),
            "prior_rel_se_median": float(np.median(noise)) if noise else math.nan,
            "prior_rel_se_max": float(np.max(noise)) if noise else math.nan}


def markdown(summary: list[dict], learned: list[str]) -> str:
    """The summary as a Markdown table."""
    cols = ["family", "load", *(["learned", "vs_best", "vs_best_std", "vs_prior"] if learned else []),
            PRIOR, *HEURISTICS, "best_heuristic", "prior_rel_se", *(["learned_refusals"] if learned else [])]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in summary:
        cells = []
        for c in cols:
            v = r.get(c, "")
            if c == "family" and r.get("held_out"):
                v = f"{v} (held out)"
            cells.append(f"{v:.3g}" if isinstance(v, float) else str(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def heatmap(summary: list[dict], path: Path, column: str = "vs_best", title: str = "learned / best heuristic") -> Path:
    """A family x load heatmap of ``column``, centred on 1 (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import TwoSlopeNorm

    families = list(dict.fromkeys(r["family"] for r in summary))
    loads = sorted({r["load"] for r in summary})
    grid = np.full((len(families), len(loads)), np.nan)
    for r in summary:
        grid[families.index(r["family"]), loads.index(r["load"])] = r.get(column, np.nan)
    fig, ax = plt.subplots(figsize=(1.2 * len(loads) + 3, 0.5 * len(families) + 1.5))
    vmax = max(2.0, float(np.nanmax(grid)) if np.isfinite(grid).any() else 2.0)
    im = ax.imshow(np.clip(grid, 0.5, vmax), cmap="RdYlGn", norm=TwoSlopeNorm(1.0, 0.5, vmax), aspect="auto")
    for i in range(len(families)):
        for j in range(len(loads)):
            if np.isfinite(grid[i, j]):
                ax.text(j, i, f"{grid[i, j]:.2f}", ha="center", va="center", fontsize=8)
    held = {r["family"] for r in summary if r.get("held_out")}
    ax.set_yticks(range(len(families)), [f + (" *" if f in held else "") for f in families])
    ax.set_xticks(range(len(loads)), [f"{x:g}" for x in loads])
    ax.set_xlabel("offered load (x lambda_max)")
    ax.set_title(title + (" (* held out of training)" if held else ""))
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    save_png(fig, path, dpi=110)
    plt.close(fig)
    return path


def write_report(rows: list[dict], learned: list[str], out: str | Path, held_out=()) -> dict:
    """``matrix.md``, ``matrix.json`` (rows, summary and target figures) and heatmaps in ``out``."""
    out = writable_folder(out)
    summary = summarize(rows, learned, held_out)
    figures = targets(summary) if learned else {}
    (out / "matrix.md").write_text(markdown(summary, learned) + "\n")
    (out / "matrix.json").write_text(json.dumps({"targets": figures, "summary": summary, "rows": rows}))
    if learned:
        heatmap(summary, out / "learned_vs_best.png")
        heatmap(summary, out / "learned_vs_prior.png", "vs_prior", "learned / slo-flow (its prior)")
    heatmap(summary, out / "prior_vs_best.png", "prior_vs_best", "slo-flow / best heuristic")
    return {"summary": summary, "targets": figures}
