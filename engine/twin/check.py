"""The fidelity check of the simulator twin against the real engine.

One workload runs through the real engine (``TorchExecutor``, arrivals replayed in real time on
the ``WallClock``: ``engine.twin.replay.replay_real``) and through the simulator (``SimExecutor``
with the fitted profile), with the same controller, KV capacity and block size. Both are the
same ``EngineCore``, so they differ only in step durations (output lengths are forced equal:
each real request ignores EOS and ends at the trace's output length, as in the simulator). The
check reports:

- step-time MAPE: each real step's duration against the profile's prediction for that batch;
- relative error of throughput, TTFT p50/p99 and TPOT p50/p99 between the two runs;
- the two-sample Kolmogorov-Smirnov distance (``scipy.stats.ks_2samp``) between the real and the
  simulated distributions of TTFT, TPOT and end-to-end latency over the requests.

A profile with step noise is simulated with several noise seeds, their requests pooled
(``engine.twin.seeds``): the model's distribution, not one draw of it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable

import numpy as np

from tidegate.ctrl import build_controller
from tidegate.ctrl.base import Controller
from tidegate.engine.core.profile import Profile, load_profile
from tidegate.engine.sim.fit import fit_step_time, profile_fields
from tidegate.engine.twin.plot import plot_step_times
from tidegate.engine.twin.fit import fit_around as fit_around_check
from tidegate.engine.twin.replay import RecordingExecutor, replay_real
from tidegate.engine.twin.seeds import (
    NOISE_SEEDS, SPREAD, ks_distances, real_sampling, request_latencies, scaled_to_speed, seed_spread, simulate_seeds,
    write_sim_requests_csv,
)
from tidegate.engine.workloads import load_workload

TARGETS = {"step_time_mape": 0.05, "throughput_rps": 0.10, "ttft_p50_s": 0.10}
COMPARED = ("throughput_rps", "output_tps", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s",
            "e2e_p50_s", "evictions", "completed")


def step_time_errors(recorder: RecordingExecutor, durations, profile: Profile) -> dict:
    """Real step durations against the profile's prediction for the same batches (non-empty steps)."""
    n = len(recorder.tokens)
    return step_errors(recorder.tokens, recorder.kv_tokens_read, recorder.decodes, recorder.prefills,
                       recorder.prefill_pairs, recorder.first_decodes, np.asarray(durations, dtype=float)[:n], profile)


def step_errors(tokens, kv_tokens_read, decodes, prefills, prefill_pairs, first_decodes, durations,
                profile: Profile) -> dict:
    """Steps' durations against the profile's prediction for their batches (the steps with new
    tokens): each argument one value per step, in the order they ran."""
    t, k, dec, chunks, pairs, firsts, d = (np.asarray(x, dtype=float) for x in
                                           (tokens, kv_tokens_read, decodes, prefills, prefill_pairs, first_decodes,
                                            durations))
    busy = t > 0
    t, k, dec, chunks, pairs, firsts, d = t[busy], k[busy], dec[busy], chunks[busy], pairs[busy], firsts[busy], d[busy]
    pred = np.array(profile.predict_steps(zip(t, k, dec, chunks, pairs, firsts)), dtype=float)
    ape = np.abs(pred - d) / d
    return {"tokens": t, "kv_tokens_read": k, "decodes": dec, "prefills": chunks, "prefill_pairs": pairs,
            "first_decodes": firsts,
            "real_s": d, "predicted_s": pred,
            "mape": float(ape.mean()), "median_ape": float(np.median(ape)),
            "total_time_error": float(pred.sum() / d.sum() - 1.0), "steps": int(busy.sum())}


def refit_floor(errors: dict) -> dict:
    """A profile fitted on these very steps (in-sample, the median step): about the best the linear
    model's median can do, so the part of the MAPE above it is the profile's, the rest step-to-step
    noise or beyond the linear model."""
    floor = fit_step_time(list(zip(errors["tokens"], errors["kv_tokens_read"], errors["real_s"], errors["decodes"],
                                   errors["prefills"], errors["prefill_pairs"], errors["first_decodes"])), loss="l1")
    return {"refit_mape": floor["mape"], "refit_coefficients": profile_fields(floor)}


def speed_drift(profile, errors: dict) -> dict | None:
    """How fast the machine ran during the check against while the profile was fitted.

    Compares the median single-token step of this check with the median over the profile's
    serving runs (``extra.serving.runs``: ``tidegate profile --from-twin``'s, or the runs before
    and after a check fitted around it); None for other profiles.
    """
    runs = (profile.extra.get("serving") or {}).get("runs") or []
    ref = [r["batch1_decode_median_s"] for r in runs if r.get("batch1_decode_median_s")]
    single = errors["real_s"][errors["tokens"] == 1]
    if not ref or not len(single):
        return None
    profile_s, check_s = float(np.median(ref)), float(np.median(single))
    drift = {"profile_s": profile_s, "check_s": check_s, "ratio": check_s / profile_s}
    if all("when" in r for r in runs):
        drift["runs_s"] = {r["when"]: r["batch1_decode_median_s"] for r in runs}
    return drift


SIZE_BUCKETS = ((1, 1), (2, 2), (3, 4), (5, 16), (17, 64), (65, 256), (257, 1 << 30))


def step_errors_by_size(errors: dict) -> list[dict]:
    """Real and predicted step times grouped by the step's new tokens T."""
    t, real, pred = errors["tokens"], errors["real_s"], errors["predicted_s"]
    out = []
    for lo, hi in SIZE_BUCKETS:
        sel = (t >= lo) & (t <= hi)
        if not sel.any():
            continue
        label = str(lo) if lo == hi else (f"{lo}-{hi}" if hi < 1 << 30 else f">= {lo}")
        out.append({"tokens": label, "steps": int(sel.sum()), "real_mean_s": float(real[sel].mean()),
                    "real_median_s": float(np.median(real[sel])), "predicted_mean_s": float(pred[sel].mean()),
                    "mape": float(np.mean(np.abs(pred[sel] - real[sel]) / real[sel]))})
    return out


def write_check_steps_csv(path: Path, errors: dict) -> None:
    """Every non-empty real step, in the order they ran: T, K, real and predicted seconds, decodes D
    among the T tokens, prefill chunks C, their attention's query-key pairs Q and the first
    decodes F (``tidegate profile --from-steps`` reads it)."""
    with open(path, "w") as f:
        f.write("tokens,kv_tokens_read,real_s,predicted_s,decodes,prefills,prefill_pairs,first_decodes\n")
        for t, k, r, p, n, c, q, fd in zip(errors["tokens"], errors["kv_tokens_read"], errors["real_s"],
                                           errors["predicted_s"], errors["decodes"], errors["prefills"],
                                           errors["prefill_pairs"], errors["first_decodes"]):
            f.write(f"{int(t)},{int(k)},{r:.7g},{p:.7g},{int(n)},{int(c)},{int(q)},{int(fd)}\n")


def write_requests_csv(path: Path, real_reqs, sim_reqs) -> None:
    """Per request: TTFT and TPOT in the real engine and in the simulator."""
    sims = {r.request_id: r for r in sim_reqs}
    with open(path, "w") as f:
        f.write("request_id,arrival_s,prompt_tokens,output_tokens,ttft_real_s,ttft_sim_s,tpot_real_s,tpot_sim_s\n")
        for r in sorted(real_reqs, key=lambda r: r.arrival_time_s):
            s = sims.get(r.request_id)
            (tr, pr), (ts, ps) = request_latencies(r), (request_latencies(s) if s is not None else (math.nan, math.nan))
            f.write(f"{r.request_id},{r.arrival_time_s:.6f},{r.prompt_len},{r.num_output_tokens},"
                    f"{tr:.6g},{ts:.6g},{pr:.6g},{ps:.6g}\n")


def compare_metrics(real: dict, sim: dict) -> dict:
    """Per compared metric: the real and simulated value and the simulator's relative error."""
    rows = {}
    for key in COMPARED:
        r, s = float(real[key]), float(sim[key])
        rows[key] = {"real": r, "sim": s, "rel_error": (s - r) / r if r else float("nan")}
    return rows


def targets_met(errors: dict, rows: dict) -> dict:
    """Which of the twin's accuracy targets (``TARGETS``) this check met."""
    return {"step_time_mape": errors["mape"] <= TARGETS["step_time_mape"],
            "throughput_rps": abs(rows["throughput_rps"]["rel_error"]) <= TARGETS["throughput_rps"],
            "ttft_p50_s": abs(rows["ttft_p50_s"]["rel_error"]) <= TARGETS["ttft_p50_s"]}


def _speed_adjusted_errors(arrivals, profile: Profile, controller: Callable[[], Controller], ratio: float,
                           rows: dict, seeds: int, real_requests=None,
                           prefix_caching: bool = True) -> tuple[dict, dict]:
    """Diagnostic only: the simulator's relative errors (``seeds`` pooled, as the check's) with the
    profile scaled by how much slower (or faster) the machine ran single-token steps during the
    check than while profiling, and with ``real_requests`` the KS distances (``ks_distances``)
    of that simulation's requests (an empty dict without them)."""
    sim_scaled, requests = simulate_seeds(arrivals, scaled_to_speed(profile, ratio), controller, seeds, prefix_caching)
    errors = {key: (float(sim_scaled[key]) - rows[key]["real"]) / rows[key]["real"]
              for key in COMPARED if rows[key]["real"]}
    ks = {} if real_requests is None else ks_distances(real_requests, [r for reqs in requests for r in reqs])
    return errors, ks


def _runs_text(drift: dict) -> str:
    """`` (before 1.02 ms, after 1.05 ms)`` for a profile fitted around the check, else nothing."""
    runs = drift.get("runs_s") or {}
    cells = [f"{when} {1e3 * s:.2f} ms" if s else f"{when} without a single-token step" for when, s in runs.items()]
    return f" ({', '.join(cells)})" if cells else ""


def report_table(headline: str, errors: dict, rows: dict, by_size: list[dict], drift: dict | None,
                 met: dict, ks: dict[str, float] | None = None, spread: dict | None = None,
                 sampling: dict | None = None) -> str:
    """The check as text: the step-time headline, the metric table, step times by size, targets."""
    verdict = "met" if met["step_time_mape"] else "missed"
    lines = [headline,
             f"step time: MAPE {100 * errors['mape']:.1f}% (median {100 * errors['median_ape']:.1f}%) over "
             f"{errors['steps']} steps; total busy time predicted {100 * errors['total_time_error']:+.1f}% "
             f"(target MAPE <= {100 * TARGETS['step_time_mape']:.0f}%: {verdict}); "
             f"a linear profile fitted on these very steps: MAPE {100 * errors['refit_mape']:.1f}%",
             "", "| metric | real engine | simulator | relative error |", "|---|---|---|---|"]
    for key, row in rows.items():
        lines.append(f"| {key} | {row['real']:.4g} | {row['sim']:.4g} | {100 * row['rel_error']:+.1f}% |")
    if ks:
        lines.append("\nKS distance, real against simulated: " +
                     ", ".join(f"{key.removesuffix('_s').upper()} {value:.3f}" for key, value in ks.items()))
    if spread:
        cells = [f"{SPREAD[key]} {100 * lo:+.1f}% to {100 * hi:+.1f}%" for key, (lo, hi) in spread.items()
                 if key in SPREAD]
        if "ks_tpot" in spread:
            cells.append("KS TPOT {:.3f} to {:.3f}".format(*spread["ks_tpot"]))
        lines.append("one noise seed alone: " + ", ".join(cells))
    if sampling:
        cells = [f"{SPREAD[key]} {100 * lo:+.1f}% to {100 * hi:+.1f}%" for key, (lo, hi) in sampling.items()
                 if key in SPREAD]
        lines.append("the real run's own sampling (its requests resampled, 5th to 95th percentile of the draws): "
                     + ", ".join(cells)
                     + (f"; KS TPOT of two samples this size from one distribution: above "
                        f"{sampling['ks_tpot'][1]:.3f} 5% of the time" if "ks_tpot" in sampling else ""))
    lines += ["", "| steps with T new tokens | steps | real mean (ms) | real median (ms) | predicted mean (ms) "
              "| MAPE |", "|---|---|---|---|---|---|"]
    for b in by_size:
        lines.append(f"| {b['tokens']} | {b['steps']} | {1e3 * b['real_mean_s']:.2f} | "
                     f"{1e3 * b['real_median_s']:.2f} | {1e3 * b['predicted_mean_s']:.2f} | {100 * b['mape']:.1f}% |")
    if drift is not None:
        adj, adj_ks = drift["rel_error_speed_adjusted"], drift.get("ks_speed_adjusted")
        lines.append(f"\nmachine speed: single-token steps took {1e3 * drift['check_s']:.2f} ms (median) in this check "
                     f"against {1e3 * drift['profile_s']:.2f} ms while profiling{_runs_text(drift)} "
                     f"(x{drift['ratio']:.2f}). Diagnostic, "
                     f"with the profile scaled by that ratio: TTFT p50 {100 * adj['ttft_p50_s']:+.1f}%, "
                     f"TTFT p99 {100 * adj['ttft_p99_s']:+.1f}%, TPOT p50 {100 * adj['tpot_p50_s']:+.1f}%, "
                     f"TPOT p99 {100 * adj['tpot_p99_s']:+.1f}%"
                     + (f", KS TPOT {adj_ks['tpot_s']:.3f}" if adj_ks else ""))
    lines.append(f"\ntargets: throughput within 10%: {'met' if met['throughput_rps'] else 'missed'}; "
                 f"TTFT p50 within 10%: {'met' if met['ttft_p50_s'] else 'missed'}")
    return "\n".join(lines)


def run_twin_check(model: str = "tiny", trace: str = "splitwise_conv", first_n: int | None = 300,
                   length_scale: float = 0.1, rate_scale: float = 1.0, max_tokens: int = 256,
                   profile_name: str = "tiny-cpu", controller_spec: str = "greedy", seed: int = 0,
                   out_dir: Path | str = "twin-out", device=None, dtype=None, fit_around: bool = False,
                   noise_seeds: int = NOISE_SEEDS, log: Callable[[str], None] | None = None,
                   prefix_caching: bool = True) -> dict:
    """Run the workload through both engines; writes ``twin_report.json``, ``twin_step_time.png``,
    ``twin_steps.csv`` (every real step), ``twin_requests.csv`` (TTFT and TPOT per request, the
    simulator's of noise seed 0) and ``twin_sim_requests.csv`` (the simulator's of every seed).

    :param fit_around: instead of ``profile_name``, fit the profile on the trace's next
        ``first_n`` requests served through the real engine, half before the check and half after
        (``engine.twin.fit.fit_around``), and write it to ``profile.json`` (its serving steps to
        ``profile_steps.csv``); the controllers of
        both runs are built with the profile fitted on the first half.
    :param noise_seeds: noise seeds simulated, their requests pooled (:func:`simulate_seeds`).
    :param prefix_caching: both engines' prefix cache (a trace with Mooncake ``hash_ids`` shares prefixes).
    :return: the report: per-metric real, simulated and relative error, step-time errors, targets met.
    """

    # the first requests of a trace, or of a synthetic workload sampled with the check's seed
    arrivals = load_workload(trace, seed=seed, rate_scale=rate_scale, length_scale=length_scale,
                             max_tokens_cap=max_tokens)[:first_n]

    def controller(p: Profile):
        c = build_controller(controller_spec, p, arrivals)
        if hasattr(c, "seed"):
            c.seed = seed
        return c

    def real_run(p: Profile) -> tuple:
        if log:
            log(f"replaying {len(arrivals)} requests through the real engine ({model}); "
                f"about {arrivals[-1].arrival_time_s:.0f}s of arrivals")
        return replay_real(arrivals, p, controller(p), model=model, device=device, dtype=dtype, seed=seed, log=log,
                           prefix_caching=prefix_caching)

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if fit_around:
        if first_n is None:
            raise ValueError("fitting around the check needs --first: the profile is fitted on the requests after them")
        profile, control_profile, (core, recorder) = fit_around_check(
            real_run, model=model, device=device, dtype=dtype, name="around-check", trace=trace,
            skip=len(arrivals), first_n=len(arrivals), length_scale=length_scale, rate_scale=rate_scale,
            max_tokens=max_tokens, controller_spec=controller_spec, seed=seed, steps_out=out_dir / "profile_steps.csv",
            log=log)
        profile.save(out_dir / "profile.json")
    else:
        profile = control_profile = load_profile(profile_name)
        core, recorder = real_run(profile)
    if log:
        log(f"simulating {len(arrivals)} requests with profile {profile.name}")
    sim_summary, sim_requests = simulate_seeds(arrivals, profile, lambda: controller(control_profile), noise_seeds,
                                               prefix_caching)
    seeds = len(sim_requests)  # one when the profile has no noise
    real = core.metrics.summary(core.pool.capacity_tokens, profile.ttft_slo_s, profile.tpot_slo_s,
                                final_waiting=len(core.waiting))
    errors = step_time_errors(recorder, core.metrics.step_duration_s, profile)
    errors.update(refit_floor(errors))
    by_size = step_errors_by_size(errors)
    write_check_steps_csv(out_dir / "twin_steps.csv", errors)
    write_requests_csv(out_dir / "twin_requests.csv", core.metrics.terminal, sim_requests[0])
    write_sim_requests_csv(out_dir / "twin_sim_requests.csv", sim_requests)

    rows = compare_metrics(real, sim_summary)
    ks = ks_distances(core.metrics.terminal, [r for requests in sim_requests for r in requests])
    spread = seed_spread(real, core.metrics.terminal, sim_requests) if seeds > 1 else None
    sampling = real_sampling(core.metrics.terminal, sim_requests)
    drift = speed_drift(profile, errors)
    if drift is not None:
        drift["rel_error_speed_adjusted"], drift["ks_speed_adjusted"] = _speed_adjusted_errors(
            arrivals, profile, lambda: controller(control_profile), drift["ratio"], rows, seeds, core.metrics.terminal,
            prefix_caching)
    met = targets_met(errors, rows)
    headline = (f"twin check: {len(arrivals)} requests of {trace} (length x{length_scale}, rate x{rate_scale}), "
                f"controller {controller_spec}, profile {profile.name}"
                + (f", simulated with {seeds} noise seeds pooled" if seeds > 1 else ""))
    report = {
        "trace": trace, "requests": len(arrivals), "length_scale": length_scale, "rate_scale": rate_scale,
        "controller": controller_spec, "profile": profile.name, "model": model, "fit_around": fit_around,
        "prefix_caching": prefix_caching,
        "step_time": {k: v for k, v in errors.items() if not isinstance(v, np.ndarray)},
        "step_time_by_size": by_size, "speed_drift": drift, "metrics": rows, "ks_distance": ks, "targets_met": met,
        "noise_seeds": seeds, "seed_spread": spread, "real_sampling": sampling, "real_summary": real,
        "sim_summary": sim_summary,
        "table": report_table(headline, errors, rows, by_size, drift, met, ks, spread, sampling),
    }
    (out_dir / "twin_report.json").write_text(json.dumps(report, indent=2, default=float) + "\n")
    plot_step_times(errors, out_dir / "twin_step_time.png",
                    f"real engine vs profile {profile.name}: {len(arrivals)} requests of {trace}")
    return report
