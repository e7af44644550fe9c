"""The fidelity check of the simulator twin against the real engine.

One workload runs through the real engine (``TorchExecutor``, arrivals replayed in real time on
the ``WallClock``) and through the simulator (``SimExecutor`` with the fitted profile), with the
same controller, KV capacity and block size. Both are the same ``EngineCore``, so they differ
only in step durations (output lengths are forced equal: each real request ignores EOS and ends
at the trace's output length, as in the simulator). The check reports:

- step-time MAPE: each real step's duration against the profile's prediction for that batch;
- relative error of throughput, TTFT p50/p99 and TPOT p50/p99 between the two runs.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Callable

import numpy as np

from engine.core.executor import Batch, StepResult
from engine.core.request import Request

TARGETS = {"step_time_mape": 0.05, "throughput_rps": 0.10, "ttft_p50_s": 0.10}
COMPARED = ("throughput_rps", "output_tps", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s",
            "e2e_p50_s", "evictions", "completed")


class RecordingExecutor:
    """Wraps an executor and records the work (T, K) of every step it runs."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.tokens: list[int] = []
        self.kv_tokens_read: list[int] = []

    def execute(self, batch: Batch) -> StepResult:
        self.tokens.append(batch.num_tokens)
        self.kv_tokens_read.append(batch.kv_tokens_read)
        return self.inner.execute(batch)

    def release(self, request: Request) -> None:
        self.inner.release(request)


def replay_real(arrivals, profile, controller, model: str = "tiny", device=None, dtype=None, seed: int = 0,
                log: Callable[[str], None] | None = None):
    """Replay ``arrivals`` through the real engine in wall-clock time; returns the core and recorder."""
    from engine.core.clock import WallClock
    from engine.core.engine_core import EngineCore
    from engine.real.model import load_model
    from engine.real.executor import SamplingParams, TorchExecutor

    hf_model, tokenizer = load_model(model, device, dtype)
    executor = TorchExecutor(hf_model, tokenizer, device=device, dtype=dtype)
    recorder = RecordingExecutor(executor)
    idle = profile.idle_s if profile.idle_s is not None else profile.base_s
    controller.reset()
    core = EngineCore(controller, recorder, WallClock(), kv_capacity_tokens=profile.kv_capacity_tokens,
                      block_size=profile.block_size, rate_window_s=max(10.0, 200 * idle))
    executor.attach_pool(core.pool)
    rng = random.Random(seed)
    vocab = executor.vocab_size
    low = 3 if vocab > 3 else 0
    sampling = SamplingParams(ignore_eos=True)
    prompts = [[rng.randrange(low, vocab) for _ in range(a.prompt_tokens)] for a in arrivals]
    # Warm up the kernels (first calls allocate) before the clock starts mattering.
    warm = Request("warm-up", 0.0, 16, 2, prompt_token_ids=prompts[0][:16] or [low] * 16, sampling=sampling)
    core.add_request(warm)
    while core.has_unfinished:
        core.step()
    controller.reset()
    core = EngineCore(controller, recorder, WallClock(), kv_capacity_tokens=profile.kv_capacity_tokens,
                      block_size=profile.block_size, rate_window_s=max(10.0, 200 * idle))
    executor.attach_pool(core.pool)
    recorder.tokens.clear()
    recorder.kv_tokens_read.clear()

    clock = core.clock
    n, i = len(arrivals), 0
    next_log = 0.0
    while i < n or core.has_unfinished:
        now = clock.now()
        while i < n and arrivals[i].arrival_time_s <= now:
            a = arrivals[i]
            # max_tokens and target_output_len exactly as the simulator sets them.
            core.add_request(Request(str(i), a.arrival_time_s, a.prompt_tokens, a.max_tokens,
                                     target_output_len=a.output_tokens, prompt_token_ids=prompts[i],
                                     sampling=sampling, class_id=a.class_id))
            i += 1
        if not (core.waiting or core.running):
            if i >= n:
                break
            clock.advance_to(arrivals[i].arrival_time_s)
            continue
        core.step()
        if log is not None and now >= next_log:
            log(f"  real engine: t={now:6.1f}s arrived={i}/{n} running={len(core.running)} "
                f"waiting={len(core.waiting)} kv={core.pool.used_tokens}/{core.pool.capacity_tokens}")
            next_log = now + 10.0
    return core, recorder


def step_time_errors(recorder: RecordingExecutor, durations, profile) -> dict:
    """Real step durations against the profile's prediction for the same batches (non-empty steps)."""
    t = np.asarray(recorder.tokens, dtype=float)
    k = np.asarray(recorder.kv_tokens_read, dtype=float)
    d = np.asarray(durations, dtype=float)[:len(t)]
    busy = t > 0
    t, k, d = t[busy], k[busy], d[busy]
    pred = profile.base_s + profile.per_token_s * t + profile.per_kv_token_s * k
    ape = np.abs(pred - d) / d
    return {"tokens": t, "kv_tokens_read": k, "real_s": d, "predicted_s": pred,
            "mape": float(ape.mean()), "median_ape": float(np.median(ape)),
            "total_time_error": float(pred.sum() / d.sum() - 1.0), "steps": int(busy.sum())}


def speed_drift(profile, errors: dict) -> dict | None:
    """How fast the machine ran during the check against while the profile was fitted.

    Compares the median single-token step of this check with the one recorded by
    ``tidegate profile --from-twin`` (``extra.serving.runs``); None for other profiles.
    """
    runs = (profile.extra.get("serving") or {}).get("runs") or []
    ref = [r["batch1_decode_median_s"] for r in runs if r.get("batch1_decode_median_s")]
    single = errors["real_s"][errors["tokens"] == 1]
    if not ref or not len(single):
        return None
    profile_s, check_s = float(np.median(ref)), float(np.median(single))
    return {"profile_s": profile_s, "check_s": check_s, "ratio": check_s / profile_s}


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


def _write_steps_csv(path: Path, errors: dict) -> None:
    """Every non-empty real step: T, K, real and predicted seconds (``tidegate profile --from-steps`` reads it)."""
    with open(path, "w") as f:
        f.write("tokens,kv_tokens_read,real_s,predicted_s\n")
        for t, k, r, p in zip(errors["tokens"], errors["kv_tokens_read"], errors["real_s"], errors["predicted_s"]):
            f.write(f"{int(t)},{int(k)},{r:.7g},{p:.7g}\n")


def _write_requests_csv(path: Path, real_reqs, sim_reqs) -> None:
    """Per request: TTFT and TPOT in the real engine and in the simulator."""
    def row(r):
        if r.first_token_time_s is None or r.finish_time_s is None:
            return float("nan"), float("nan")
        outs = r.num_output_tokens
        tpot = (r.finish_time_s - r.first_token_time_s) / (outs - 1) if outs > 1 else float("nan")
        return r.first_token_time_s - r.arrival_time_s, tpot
    sims = {r.request_id: r for r in sim_reqs}
    with open(path, "w") as f:
        f.write("request_id,arrival_s,prompt_tokens,output_tokens,ttft_real_s,ttft_sim_s,tpot_real_s,tpot_sim_s\n")
        for r in sorted(real_reqs, key=lambda r: r.arrival_time_s):
            s = sims.get(r.request_id)
            (tr, pr), (ts, ps) = row(r), (row(s) if s is not None else (float("nan"), float("nan")))
            f.write(f"{r.request_id},{r.arrival_time_s:.6f},{r.prompt_len},{r.num_output_tokens},"
                    f"{tr:.6g},{ts:.6g},{pr:.6g},{ps:.6g}\n")


def plot_step_times(errors: dict, path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    real, pred = errors["real_s"] * 1e3, errors["predicted_s"] * 1e3
    fig, (ax1, ax3, ax2) = plt.subplots(1, 3, figsize=(15, 4.2))
    ax1.scatter(pred, real, s=4, alpha=0.3)
    lo = float(min(real.min(), pred.min())) * 0.9
    hi = float(max(real.max(), pred.max())) * 1.1
    ax1.plot([lo, hi], [lo, hi], color="black", lw=1, label="real = predicted")
    ax1.set_xscale("log")
    ax1.set_yscale("log")
    ax1.set_xlabel("predicted step time (ms)")
    ax1.set_ylabel("real step time (ms)")
    ax1.set_xlim(lo, hi)
    ax1.set_ylim(lo, hi)
    from matplotlib.ticker import FixedLocator, NullLocator, ScalarFormatter
    ticks = [t for t in (0.5, 1, 2, 3, 5, 10, 20, 50, 100, 200, 500, 1000) if lo <= t <= hi]
    for axis in (ax1.xaxis, ax1.yaxis):
        axis.set_major_locator(FixedLocator(ticks))
        axis.set_minor_locator(NullLocator())
        axis.set_major_formatter(ScalarFormatter())
    ax1.legend(loc="upper left")
    ax1.set_title(f"per step: MAPE {100 * errors['mape']:.1f}%")
    ratio = real / pred
    small = errors["tokens"] <= 4
    bins = np.linspace(0.3, 3.0, 55)
    ax3.hist(np.clip(ratio[small], bins[0], bins[-1]), bins=bins, alpha=0.6, label=f"T <= 4 ({int(small.sum())} steps)")
    ax3.hist(np.clip(ratio[~small], bins[0], bins[-1]), bins=bins, alpha=0.6, label=f"T > 4 ({int((~small).sum())} steps)")
    ax3.axvline(1.0, color="black", lw=1)
    ax3.set_xlabel("real / predicted step time")
    ax3.set_ylabel("steps")
    refit = errors.get("refit_mape")
    ax3.set_title("spread" + (f" (best linear refit on these steps: MAPE {100 * refit:.1f}%)" if refit is not None else ""),
                  fontsize=9)
    ax3.legend()
    n = min(len(real), 400)
    ax2.plot(real[:n], lw=1, label="real")
    ax2.plot(pred[:n], lw=1, label="predicted (profile)")
    ax2.set_xlabel("step")
    ax2.set_ylabel("step time (ms)")
    ax2.set_title(f"first {n} steps")
    ax2.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_twin_check(model: str = "tiny", trace: str = "splitwise_conv", first_n: int | None = 300,
                   length_scale: float = 0.1, rate_scale: float = 1.0, max_tokens: int = 256,
                   profile_name: str = "tiny-cpu", controller_spec: str = "greedy", seed: int = 0,
                   out_dir: Path | str = "twin-out", device=None, dtype=None,
                   log: Callable[[str], None] | None = None) -> dict:
    """Run the workload through both engines; writes ``twin_report.json`` and ``twin_step_time.png``.

    :return: the report: per-metric real, simulated and relative error, step-time errors, targets met.
    """
    from ctrl import build_controller
    from engine.core.profile import load_profile
    from engine.sim.simulate import simulate
    from engine.workloads.workload import read_trace, resolve_trace

    profile = load_profile(profile_name)
    arrivals = read_trace(resolve_trace(trace), first_n=first_n, rate_scale=rate_scale,
                          length_scale=length_scale, max_tokens_cap=max_tokens)

    def controller():
        c = build_controller(controller_spec, profile, arrivals)
        if hasattr(c, "seed"):
            c.seed = seed
        return c

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if log:
        log(f"simulating {len(arrivals)} requests with profile {profile.name}")
    sim_result = simulate(arrivals, profile, controller(), record_steps=True)
    sim = sim_result.summary
    if log:
        log(f"replaying them through the real engine ({model}); about {arrivals[-1].arrival_time_s:.0f}s of arrivals")
    core, recorder = replay_real(arrivals, profile, controller(), model=model, device=device, dtype=dtype,
                                 seed=seed, log=log)
    real = core.metrics.summary(core.pool.capacity_tokens, profile.ttft_slo_s, profile.tpot_slo_s,
                                final_waiting=len(core.waiting))
    errors = step_time_errors(recorder, core.metrics.step_duration_s, profile)
    # The best any linear profile could do on these very steps (fitted on them, in-sample): the
    # part of the MAPE that is step-to-step noise or beyond the linear model, not the profile.
    from engine.real.profiler import fit_step_time
    floor = fit_step_time(list(zip(errors["tokens"], errors["kv_tokens_read"], errors["real_s"])), loss="l1")
    errors["refit_mape"] = floor["mape"]
    errors["refit_coefficients"] = {k: floor[k] for k in ("base_s", "per_token_s", "per_kv_token_s")}

    by_size = step_errors_by_size(errors)
    _write_steps_csv(out_dir / "twin_steps.csv", errors)
    _write_requests_csv(out_dir / "twin_requests.csv", core.metrics.terminal, sim_result.core.metrics.terminal)

    rows = {}
    for key in COMPARED:
        r, s = float(real[key]), float(sim[key])
        rows[key] = {"real": r, "sim": s, "rel_error": (s - r) / r if r else float("nan")}
    drift = speed_drift(profile, errors)
    if drift is not None:
        # Diagnostic only: the same simulation with the profile scaled by how much slower (or
        # faster) the machine ran single-token steps during this check than while profiling.
        import dataclasses
        k = drift["ratio"]
        scaled = dataclasses.replace(profile, base_s=profile.base_s * k, per_token_s=profile.per_token_s * k,
                                     per_kv_token_s=profile.per_kv_token_s * k,
                                     idle_s=None if profile.idle_s is None else profile.idle_s * k)
        sim_scaled = simulate(arrivals, scaled, controller(), record_steps=False).summary
        drift["rel_error_speed_adjusted"] = {key: (float(sim_scaled[key]) - rows[key]["real"]) / rows[key]["real"]
                                             for key in COMPARED if rows[key]["real"]}
    met = {"step_time_mape": errors["mape"] <= TARGETS["step_time_mape"],
           "throughput_rps": abs(rows["throughput_rps"]["rel_error"]) <= TARGETS["throughput_rps"],
           "ttft_p50_s": abs(rows["ttft_p50_s"]["rel_error"]) <= TARGETS["ttft_p50_s"]}
    lines = [f"twin check: {len(arrivals)} requests of {trace} (length x{length_scale}, rate x{rate_scale}), "
             f"controller {controller_spec}, profile {profile.name}",
             f"step time: MAPE {100 * errors['mape']:.1f}% (median {100 * errors['median_ape']:.1f}%) over "
             f"{errors['steps']} steps; total busy time predicted {100 * errors['total_time_error']:+.1f}% "
             f"(target MAPE <= {100 * TARGETS['step_time_mape']:.0f}%: {'met' if met['step_time_mape'] else 'missed'}); "
             f"a linear profile fitted on these very steps: MAPE {100 * errors['refit_mape']:.1f}%",
             "", "| metric | real engine | simulator | relative error |", "|---|---|---|---|"]
    for key, row in rows.items():
        lines.append(f"| {key} | {row['real']:.4g} | {row['sim']:.4g} | {100 * row['rel_error']:+.1f}% |")
    lines += ["", "| steps with T new tokens | steps | real mean (ms) | real median (ms) | predicted mean (ms) | MAPE |",
              "|---|---|---|---|---|---|"]
    for b in by_size:
        lines.append(f"| {b['tokens']} | {b['steps']} | {1e3 * b['real_mean_s']:.2f} | {1e3 * b['real_median_s']:.2f} | "
                     f"{1e3 * b['predicted_mean_s']:.2f} | {100 * b['mape']:.1f}% |")
    if drift is not None:
        adj = drift["rel_error_speed_adjusted"]
        lines.append(f"\nmachine speed: single-token steps took {1e3 * drift['check_s']:.2f} ms (median) in this check "
                     f"against {1e3 * drift['profile_s']:.2f} ms while profiling (x{drift['ratio']:.2f}). Diagnostic, "
                     f"with the profile scaled by that ratio: TTFT p50 {100 * adj['ttft_p50_s']:+.1f}%, "
                     f"TTFT p99 {100 * adj['ttft_p99_s']:+.1f}%, TPOT p50 {100 * adj['tpot_p50_s']:+.1f}%, "
                     f"TPOT p99 {100 * adj['tpot_p99_s']:+.1f}%")
    lines.append(f"\ntargets: throughput within 10%: {'met' if met['throughput_rps'] else 'missed'}; "
                 f"TTFT p50 within 10%: {'met' if met['ttft_p50_s'] else 'missed'}")
    report = {
        "trace": trace, "requests": len(arrivals), "length_scale": length_scale, "rate_scale": rate_scale,
        "controller": controller_spec, "profile": profile.name, "model": model,
        "step_time": {k: v for k, v in errors.items() if not isinstance(v, np.ndarray)},
        "step_time_by_size": by_size, "speed_drift": drift, "metrics": rows, "targets_met": met, "real_summary": real, "sim_summary": sim,
        "table": "\n".join(lines),
    }
    (out_dir / "twin_report.json").write_text(json.dumps(report, indent=2, default=float) + "\n")
    plot_step_times(errors, out_dir / "twin_step_time.png",
                    f"real engine vs profile {profile.name}: {len(arrivals)} requests of {trace}")
    return report
