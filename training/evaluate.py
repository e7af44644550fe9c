"""Evaluate the exported policy against the heuristic controllers on the held-out traces.

    tidegate evaluate [--policy runs/ppo/policy.onnx] [--profile a100-llama2-7b] [--loads 0.8,1.0,1.2,1.5,2.0]
        [--requests 2000] [--seeds 0,1,2] [--out docs/bench_learned.md] [--plots docs/img]

Every controller replays the same windows of the evaluation split (the last 30% of
splitwise_conv and all of splitwise_code) through ``engine.sim.simulate`` at each load (multiples
of lambda_max). Seed 0 is the first ``requests`` requests of a segment, seed k > 0 a window
starting at a random request (drawn from ``numpy.random.default_rng(k)``). The learned
controller runs as deployed: ``make_learned_controller`` (the shield around it, the flow
controller as fallback); the heuristics get the same overload options (queue limit and
timeout) as the shield. The policy defaults to the shipped one (``ctrl.learned.DEFAULT_POLICY``);
a policy file that cannot be loaded is an error here, not a fallback. ``flow:tuned`` is ``flow``
(fixed budget) with the budget per load picked by grid search on windows of the training split
(the first 70% of splitwise_conv).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ctrl import build_controller
from ctrl.base import ReplicaProfile
from ctrl.learned import DEFAULT_POLICY, make_learned_controller
from engine.bench.bench import markdown_table
from engine.core.profile import load_profile
from engine.sim.simulate import simulate
from engine.workloads import TRAIN_FRACTION, Arrival, split_segments
from training.errors import EvaluationError

DEFAULT_HEURISTICS = ("greedy", "no-evict", "sglang", "watermark", "flow:adaptive=true", "flow:tuned")
DEFAULT_LOADS = (0.8, 1.0, 1.2, 1.5, 2.0)
#: candidate fixed flow budgets (activations per step) for ``flow:tuned``
FLOW_BUDGETS = (0.02, 0.03, 0.05, 0.07, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0)
COLUMNS = ("trace", "load", "seed", "controller", "requests", "completed", "rejected", "expired", "evictions",
           "goodput_frac", "slo_attainment", "ttft_p99_s", "tpot_p99_s", "kv_usage_mean", "fallbacks",
           "shield_intervention_rate")
LEARNED = "learned+shield"


def require_policy(path: str | Path, profile: ReplicaProfile) -> Path:
    """``path`` if the learned controller can run the policy in it on ``profile``.

    ``make_learned_controller`` falls back to the flow controller for a missing or corrupt policy (right
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


def _writable_folder(folder: str | Path) -> Path:
    """``folder``, created if missing; checked before a long run rather than after it.

    :raises EvaluationError: it cannot be created.
    """
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise EvaluationError(f"{folder}: cannot create this folder ({exc.strerror or type(exc).__name__})") from None
    return folder


def _check_run_sizes(loads, seeds, requests: int) -> None:
    """Loads must be positive, seeds non-negative integers, and at least one of each and one request.

    :raises EvaluationError: naming the first value out of range.
    """
    if not loads or any(not load > 0 for load in loads):
        raise EvaluationError(f"loads must be positive multiples of lambda_max, got {list(loads)}")
    if not seeds or any(isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s < 0 for s in seeds):
        raise EvaluationError(f"seeds must be non-negative integers, got {list(seeds)}")
    if requests < 1:
        raise EvaluationError(f"requests must be at least 1, got {requests}")


def _window(segment, n: int, load: float, seed: int = 0) -> list[Arrival]:
    """``n`` requests of the segment replayed at ``load`` x lambda_max: the first ``n`` for seed 0,
    otherwise from a random start (wrapping around the segment's end)."""
    scale = load * segment.lambda_max_rps / segment.mean_rate_rps
    total = len(segment.times_s)
    k = min(n, total)
    start = 0 if seed == 0 else int(np.random.default_rng(seed).integers(total))
    out, offset = [], -float(segment.times_s[start])
    for j in range(k):
        i = (start + j) % total
        if j and i == 0:
            offset += segment.span_s
        out.append(Arrival((float(segment.times_s[i]) + offset) / scale, segment.prompts[i], segment.outputs[i],
                           segment.max_tokens[i]))
    return out


def _overload(max_waiting: int, timeout: float) -> str:
    return f"max_waiting={max_waiting},queue_timeout_s={timeout}"


def tune_flow_budget(prof, load: float, requests: int, max_waiting: int, timeout: float,
                     seeds=(0, 1), budgets=FLOW_BUDGETS) -> float:
    """The fixed flow budget with the highest mean goodput on windows of the training split at ``load``."""
    seg = split_segments(None, "train", prof)[0]
    windows = [_window(seg, requests, load, s) for s in seeds]
    best, best_g = budgets[0], -1.0
    for b in budgets:
        g = np.mean([simulate(w, prof, build_controller(f"flow:budget={b},{_overload(max_waiting, timeout)}", prof),
                              record_steps=False).summary["goodput_rps"] for w in windows])
        if g > best_g:
            best, best_g = b, g
    return best


def evaluate(policy: str | Path | None = DEFAULT_POLICY, *, profile: str = "a100-llama2-7b",
             loads=DEFAULT_LOADS, requests: int = 2000, seeds=(0,), heuristics=DEFAULT_HEURISTICS,
             shield_mode: str = "soft", control_interval: int = 10, max_waiting: int = 512,
             queue_timeout_s: float | None = None, out: str | Path | None = None,
             plots: str | Path | None = None) -> list[dict]:
    """Goodput and friends of the learned controller and the heuristics on the evaluation split.

    :param policy: the exported ONNX policy (default: the shipped one; None: only the heuristics).
    :param profile: the profile name or path.
    :param loads: offered loads as multiples of lambda_max.
    :param requests: requests per run (a window of each evaluation segment).
    :param seeds: window seeds (0: the first ``requests`` requests).
    :param heuristics: controller specs to compare with (``flow:tuned``: see the module docstring).
    :param shield_mode: the learned controller's shield mode.
    :param control_interval: engine steps per policy call (as in training).
    :param max_waiting: queue limit for every controller.
    :param queue_timeout_s: queue timeout for every controller (default 5 x TTFT SLO, as the env).
    :param out: write Markdown tables here (a per-load summary with ratios, then every run).
    :param plots: write ``learned_goodput.png`` (goodput vs load per trace) into this folder.
    :return: one row per (trace, load, seed, controller).
    :raises EvaluationError: the policy cannot be loaded, or a load, seed or ``requests`` is out of range.
    """
    _check_run_sizes(loads, seeds, requests)
    prof = load_profile(profile)
    if policy is not None:
        policy = require_policy(policy, prof)
    out = None if out is None else _writable_folder(Path(out).parent) / Path(out).name
    plots = None if plots is None else _writable_folder(plots)
    timeout = queue_timeout_s or 5.0 * prof.ttft_slo_s
    tuned = {load: tune_flow_budget(prof, load, requests, max_waiting, timeout) for load in loads} \
        if "flow:tuned" in heuristics else {}
    rows = []
    for seg in split_segments(None, "eval", prof):
        for load in loads:
            for seed in seeds:
                arrivals = _window(seg, requests, load, seed)
                runs = []
                if policy is not None:
                    runs.append((LEARNED, make_learned_controller(
                        policy, profile=prof, lambda_max_rps=seg.lambda_max_rps,
                        control_interval=control_interval, shield_mode=shield_mode, max_waiting=max_waiting,
                        queue_timeout_s=timeout)))
                for spec in heuristics:
                    if spec == "flow:tuned":
                        full = f"flow:budget={tuned[load]},{_overload(max_waiting, timeout)}"
                    else:
                        sep = "," if ":" in spec else ":"
                        full = f"{spec}{sep}{_overload(max_waiting, timeout)}"
                    runs.append((spec, build_controller(full, prof)))
                for name, controller in runs:
                    s = simulate(arrivals, prof, controller, record_steps=False).summary
                    s.update(trace=seg.name, load=load, seed=seed, controller=name,
                             goodput_frac=s["goodput_rps"] / seg.lambda_max_rps,
                             fallbacks=getattr(getattr(controller, "inner", None), "fallback_total", 0),
                             shield_intervention_rate=getattr(controller, "intervention_rate", float("nan")))
                    rows.append(s)
    summary = summarize(rows)
    if out is not None:
        tuned_text = ", ".join(f"{k:g}x: {v:g}" for k, v in tuned.items())
        out.write_text(
            f"Evaluation split: the last {1 - TRAIN_FRACTION:.0%} of splitwise_conv and all of splitwise_code, "
            f"{requests}-request windows (seeds {', '.join(map(str, seeds))}), profile {prof.name}; "
            f"goodput_frac = goodput / lambda_max. flow:tuned budgets (activations/step, tuned on the training "
            f"split): {tuned_text or '-'}.\n\n"
            "Mean goodput_frac over seeds; ratios are learned / greedy and learned / best heuristic.\n\n"
            + markdown_table(summary, summary_columns(heuristics, policy is not None)) + "\n\n"
            "Every run:\n\n" + markdown_table(rows, COLUMNS) + "\n")
    if plots is not None:
        plot(summary, heuristics, plots, policy is not None)
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    """Mean goodput_frac over seeds per (trace, load, controller), with the learned controller's ratios."""
    acc: dict[tuple, dict[str, list[float]]] = {}
    for r in rows:
        acc.setdefault((r["trace"], r["load"]), {}).setdefault(r["controller"], []).append(r["goodput_frac"])
    out = []
    for (trace, load), by in acc.items():
        row = {"trace": trace, "load": load, **{c: float(np.mean(v)) for c, v in by.items()}}
        heur = {c: v for c, v in row.items() if c not in ("trace", "load", LEARNED)}
        if LEARNED in row and heur:
            best = max(heur, key=heur.get)
            row["best_heuristic"] = best
            row["vs_greedy"] = row[LEARNED] / row["greedy"] if row.get("greedy") else float("nan")
            row["vs_best"] = row[LEARNED] / heur[best] if heur[best] > 0 else float("nan")
        out.append(row)
    return out


def summary_columns(heuristics, learned: bool = True) -> tuple[str, ...]:
    extra = ("best_heuristic", "vs_greedy", "vs_best") if learned else ()
    return ("trace", "load", *((LEARNED,) if learned else ()), *heuristics, *extra)


def plot(summary: list[dict], heuristics, folder: Path, learned: bool = True) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    traces = list(dict.fromkeys(r["trace"] for r in summary))
    fig, axes = plt.subplots(1, len(traces), figsize=(6 * len(traces), 4.2), squeeze=False)
    for ax, trace in zip(axes[0], traces):
        rs = sorted((r for r in summary if r["trace"] == trace), key=lambda r: r["load"])
        for c in ((LEARNED,) if learned else ()) + tuple(heuristics):
            ax.plot([r["load"] for r in rs], [r.get(c, np.nan) for r in rs], marker="o",
                    lw=2.5 if c == LEARNED else 1.2, label=c)
        ax.set_title(trace)
        ax.set_xlabel("offered load (x lambda_max)")
        ax.set_ylabel("goodput / lambda_max")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    path = folder / "learned_goodput.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
