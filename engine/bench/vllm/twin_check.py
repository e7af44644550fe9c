"""The twin check against vLLM: one workload through a vLLM server and through the simulator twin.

``tidegate twin-check --engine vllm`` starts vLLM's OpenAI server (``.venv-vllm``) with tidegate's
scheduler plugin and a step log. With ``--controller vllm`` (the default) the plugin passes every
step through, so vLLM schedules as it does by itself (chunked prefill, its token budget, preemption
of the newest request by recompute, its prefix cache) and only the step log is written; any other
controller runs inside vLLM's scheduler and in the twin alike.

Three open-loop replays go through the one server, each request a streamed completion of the
arrival's prompt token ids with ``ignore_eos`` and exactly its output length:

1. requests ``first .. first + first/2 - 1`` of the workload (profiling, before the check);
2. the check's requests ``0 .. first - 1``;
3. requests ``first + first/2 .. 2 first - 1`` (profiling, after the check).

The step-time profile is fitted on the step log's rows of 1 and 3 (``fit_step_time``, the fit of
``tidegate profile --from-steps``), so the check is out of sample; vLLM's KV capacity, block size,
``max_num_seqs`` and token budget come from the same log and ``/metrics``. The profiling replays
draw their prompts' content from another seed than the check's, so nothing they leave in vLLM's
prefix cache is found by the check (the twin starts with an empty cache). ``--profile`` uses a
given profile's step-time model instead (the replica's limits are still vLLM's) and skips 1 and 3.

The twin simulates the check's requests with the fitted profile (``greedy``, vLLM's scheduling,
for ``--controller vllm``) and several noise seeds pooled, as the check against tidegate's engine
does, and the report has that check's shape: each figure's relative error, the KS distances, the
step times of the check's steps against the profile's predictions.

What the twin does not model, and the report shows as error: the time a request spends in vLLM's
API process and on the wire (tokenising nothing here: prompts are token ids; streaming every token
back), and the engine loop's work between two steps, which the step log's durations (from the start
of ``schedule()`` to the end of ``update_from_output()``) leave out. ``step_gaps`` says how much the
latter is.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Callable

import numpy as np

from tidegate.ctrl import build_controller
from tidegate.engine.bench.vllm.arms import plugin_args
from tidegate.engine.bench.vllm.clients import send, session
from tidegate.engine.bench.vllm.model import model_folder, prompt_token_ids
from tidegate.engine.bench.vllm.phases import step_log_lines
from tidegate.engine.bench.vllm.server import VLLM_PYTHON, ServerError, VllmServer
from tidegate.engine.core.metrics import EngineMetrics
from tidegate.engine.core.profile import Profile, load_profile
from tidegate.engine.core.request import Request, RequestState
from tidegate.engine.core.slo import time_to_first_token_s
from tidegate.engine.real.profiler import serving_defaults
from tidegate.engine.sim.fit import binned_samples, fit_step_time, profile_fields
from tidegate.engine.sim.simulate import simulate
from tidegate.engine.twin.check import (
    COMPARED, compare_metrics, refit_floor, report_table, speed_drift, step_errors, step_errors_by_size, targets_met,
    write_check_steps_csv, write_requests_csv,
)
from tidegate.engine.twin.fit import (
    LIMIT_COLUMNS, batch1_median_s, limits_of_row, loop_gaps, model_config, read_records, serving_arrivals, step_rows,
)
from tidegate.engine.twin.plot import plot_step_times
from tidegate.engine.twin.replay import random_prompts
from tidegate.engine.twin.seeds import (
    ks_distances, latencies, pooled_percentiles, real_sampling, scaled_to_speed, seed_spread, simulate_seeds,
    write_sim_requests_csv,
)
from tidegate.engine.workloads import load_workload

#: the controller name that leaves vLLM's scheduling untouched, and the twin's controller for it
PASS_THROUGH = "vllm"
VLLM_POLICY = "greedy"
#: seconds vLLM may take to start (model load and warm-up: about a minute on two cores)
START_TIMEOUT_S = 600.0
#: seconds a replay waits, after its last arrival, for its last request to end
DRAIN_S = 600.0
LOG_EVERY_S = 10.0


class VllmCheckError(ValueError):
    """A setting the check against vLLM cannot use, or a vLLM run it cannot judge; one sentence."""


def content_prompts(arrivals, ids: list[int], seed: int) -> list[list[int]]:
    """Prompt token ids for ``arrivals`` drawn from ``ids`` (the tokenizer's ordinary ids), equal
    content (``Arrival.prefix_ids``) getting equal tokens as in ``random_prompts``."""
    drawn = random_prompts(arrivals, len(ids) + 3, seed)  # ids 3 .. len(ids) + 2: one per ordinary id
    return [[ids[x - 3] for x in prompt] for prompt in drawn]


async def _replay(url: str, model_name: str, arrivals, prompts: list[list[int]],
                  log: Callable[[str], None] | None, label: str) -> tuple[float, list[dict]]:
    """Each arrival sent at its time as a streamed completion; the replay's start (monotonic) and a
    record per request (``engine.bench.vllm.clients.send``), in arrival order."""
    client = session(max(len(arrivals), 1))
    t0 = time.monotonic()
    deadline = t0 + arrivals[-1].arrival_time_s + DRAIN_S
    tasks: list[asyncio.Task] = []
    next_log = t0 + LOG_EVERY_S
    try:
        for a, prompt in zip(arrivals, prompts):
            due = t0 + a.arrival_time_s
            while True:
                now = time.monotonic()
                if log and now >= next_log:
                    done = sum(t.done() for t in tasks)
                    log(f"  {label}: t={now - t0:6.1f}s sent={len(tasks)}/{len(arrivals)} ended={done}")
                    next_log = now + LOG_EVERY_S
                if now >= due:
                    break
                await asyncio.sleep(min(due - now, 1.0))
            body = {"model": model_name, "prompt": prompt, "max_tokens": a.output_tokens,
                    "min_tokens": a.output_tokens, "ignore_eos": True, "temperature": 0.0, "stream": True,
                    "stream_options": {"include_usage": True}}
            tasks.append(asyncio.create_task(send(client, url, body, deadline, scheduled_s=due)))
        while not all(t.done() for t in tasks):
            await asyncio.sleep(0.5)
            if log and time.monotonic() >= next_log:
                log(f"  {label}: draining, ended={sum(t.done() for t in tasks)}/{len(tasks)}")
                next_log = time.monotonic() + LOG_EVERY_S
        return t0, [t.result() for t in tasks]
    finally:
        await client.close()


def real_requests(arrivals, t0: float, records: list[dict]) -> list[Request]:
    """The replay's requests as the engine's ``Request``, times on the replay's clock (0 at its
    start, arrival when each was sent): finished (every token streamed), rejected (429) or failed."""
    out = []
    for i, (a, rec) in enumerate(zip(arrivals, records)):
        r = Request(str(i), rec["start_s"] - t0, a.prompt_tokens, a.max_tokens, target_output_len=a.output_tokens)
        r.num_output_tokens = int(rec["tokens"])
        if rec["first_token_s"] is not None:
            r.first_token_time_s = rec["first_token_s"] - t0
        if rec["outcome"] == "completed" and rec["first_token_s"] is not None:
            r.state = RequestState.FINISHED
            r.finish_time_s = rec["last_token_s"] - t0
        else:
            r.state = RequestState.REJECTED if rec["status"] == 429 else RequestState.FAILED
            r.finish_time_s = (rec["end_s"] or rec["start_s"]) - t0
        out.append(r)
    return out


def _numbered(rows: list[dict[str, str]]) -> list[tuple[int, float, float]]:
    return [(int(r["step"]), float(r["time_s"]), float(r["real_s"])) for r in rows]


def step_gaps(rows: list[dict[str, str]]) -> dict:
    """The engine loop's time between steps scheduled back to back (``loop_seconds`` adds it to the
    steps), against the median logged step."""
    gaps = [g for g in loop_gaps(_numbered(rows)) if g is not None]
    if not gaps:
        return {"steps": 0}
    g = np.array(gaps)
    median_step = float(np.median([float(r["real_s"]) for r in rows]))
    return {"steps": len(gaps), "median_s": float(np.median(g)), "mean_s": float(g.mean()),
            "p90_s": float(np.percentile(g, 90)), "of_median_step": float(np.median(g)) / median_step}


def replica_limits(rows: list[dict[str, str]], kv_info: dict) -> dict:
    """vLLM's KV capacity, block size, running cap and token budget, as its step log's last row says
    (``engine.twin.fit.limits_of_row``; the block size from ``/metrics`` where the log lacks it)."""
    limits: dict = limits_of_row(rows[-1])
    if "block_size" not in limits and str(kv_info.get("block_size", "")).isdigit():
        limits["block_size"] = int(kv_info["block_size"])
    if len(limits) < len(LIMIT_COLUMNS):
        raise VllmCheckError("vLLM's step log or /metrics lacks the replica's limits (KV capacity, block size, "
                             "running cap, token budget): is the plugin current?")
    limits["prefix_caching"] = str(kv_info.get("enable_prefix_caching", "")).lower() == "true"
    return limits


def fitted_profile(base: Profile, halves: list[list[tuple]], source: str, serving: dict) -> Profile:
    """``base`` with the step-time model fitted on the two profiling replays' steps (their noise
    fitted within each: the replays' speeds differing is drift, not step noise)."""
    rows = halves[0] + halves[1]
    if len(rows) < 3:
        raise VllmCheckError(f"the profiling replays ran {len(rows)} steps: too few to fit a profile")
    runs = np.repeat(np.arange(2), [len(h) for h in halves])
    fit = fit_step_time(rows, loss="l1", runs=runs)
    return dataclasses.replace(base, **profile_fields(fit), source=source,
                               extra={"fit": fit, "method": "vllm-steps", "serving": serving,
                                      "samples": binned_samples(rows)})


@dataclasses.dataclass
class VllmRuns:
    """What the replays through vLLM left: each replay's start and records, the step log's rows of
    each (by label), vLLM's limits and how long it took to start."""

    replays: dict[str, tuple[float, list[dict]]]
    steps: dict[str, list[dict[str, str]]]
    limits: dict
    ready_s: float | None


def serve_replays(python: Path, folder: Path, phases: list[tuple[str, list, int]], out: Path, controller_spec: str,
                  prefix_caching: bool, vllm_args: tuple[str, ...], kv_cache_gib: float,
                  log: Callable[[str], None] | None) -> VllmRuns:
    """Start vLLM with the plugin and its step log (``out/vllm_steps.csv``), warm it up, replay each
    ``(label, arrivals, prompt seed)`` of ``phases`` in turn (each ending idle), stop it."""
    import shlex

    ids = prompt_token_ids(folder)
    step_log = out / "vllm_steps.csv"
    args = [*plugin_args(controller_spec, str(step_log.resolve())), "--served-model-name", "twin",
            *([] if prefix_caching else ["--no-enable-prefix-caching"]),
            *[word for arg in vllm_args for word in shlex.split(arg)]]
    server = VllmServer(python, folder, args, out / "vllm.log", {"VLLM_CPU_KVCACHE_SPACE": f"{kv_cache_gib:g}"})
    marks: dict[str, tuple[int, int]] = {}
    replays: dict[str, tuple[float, list[dict]]] = {}
    if log:
        log(f"starting vLLM ({folder}) with the plugin, controller {controller_spec!r}")
    try:
        try:
            server.start(START_TIMEOUT_S)
        except ServerError as exc:  # most often an argument vLLM refused: its log says which
            raise VllmCheckError(str(exc)) from None
        if log:
            log(f"vLLM answered after {server.ready_after_s:.0f} s")
        first = phases[0][1]
        warm = [dataclasses.replace(a, arrival_time_s=0.0) for a in first[:4]]
        asyncio.run(_replay(server.url, "twin", warm, content_prompts(warm, ids, -1), None, "warm-up"))
        server.wait_idle(120)
        for label, part, prompt_seed in phases:
            if log:
                log(f"{label}: {len(part)} requests through vLLM, about {part[-1].arrival_time_s:.0f}s of arrivals")
            start = step_log_lines(step_log)
            replays[label] = asyncio.run(_replay(server.url, "twin", part, content_prompts(part, ids, prompt_seed),
                                                 log, label))
            server.wait_idle(120)
            time.sleep(0.5)  # the last step's row
            marks[label] = (start, step_log_lines(step_log))
        kv_info = server.kv_info()
    finally:
        server.stop()
    rows = read_records(step_log)[1]
    return VllmRuns(replays, {label: rows[a:b] for label, (a, b) in marks.items()}, replica_limits(rows, kv_info),
                    server.ready_after_s)


def run_vllm_twin_check(model: str = "tiny", trace: str = "splitwise_conv", first_n: int = 300,
                        length_scale: float = 0.1, rate_scale: float = 1.0, max_tokens: int = 256,
                        profile_name: str | None = None, controller_spec: str = PASS_THROUGH, seed: int = 0,
                        noise_seeds: int = 8, out_dir: Path | str = "twin-out", vllm_python: Path | None = None,
                        vllm_args: tuple[str, ...] = (), kv_cache_gib: float = 1.0, prefix_caching: bool = True,
                        log: Callable[[str], None] | None = None) -> dict:
    """Run the check (module docstring); writes ``twin_report.json``, ``twin_step_time.png``,
    ``twin_steps.csv`` (the check's steps), ``twin_requests.csv``, ``twin_sim_requests.csv``,
    ``vllm_steps.csv`` (vLLM's whole step log), ``vllm.log`` and, when fitted, ``profile.json``.

    :param model: a Hugging Face folder, or ``tiny`` / ``llama-24m`` (built from a config into the output folder).
    :param vllm_args: more vLLM server arguments (each split like a shell word list).
    :return: the report, in the shape of ``engine.twin.check.run_twin_check``'s.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    python = Path(vllm_python or VLLM_PYTHON)
    if not python.is_file():
        raise VllmCheckError(f"vLLM's python {str(python)!r} is missing: run `make vllm-setup`, or pass --vllm-python.")
    folder = model_folder(model, out / "models")
    arrivals = load_workload(trace, seed=seed, rate_scale=rate_scale, length_scale=length_scale,
                             max_tokens_cap=max_tokens)[:first_n]
    if not arrivals:
        raise VllmCheckError(f"{trace} has no requests")
    given = load_profile(profile_name) if profile_name else None
    phases = [("check", arrivals, seed)]
    if given is None:
        halves = profiling_halves(trace, len(arrivals), length_scale, rate_scale, max_tokens, seed)
        phases = [("before", halves[0], seed + 1), *phases, ("after", halves[1], seed + 1)]
    runs = serve_replays(python, folder, phases, out, controller_spec, prefix_caching, vllm_args, kv_cache_gib, log)
    limits = runs.limits
    base = dataclasses.replace(
        given if given is not None else serving_defaults(model_config(str(folder)), "vllm-around-check"),
        kv_capacity_tokens=limits["kv_capacity_tokens"], block_size=limits["block_size"],
        max_num_seqs=limits["max_num_seqs"], max_num_batched_tokens=limits["max_num_batched_tokens"],
        description=f"vLLM serving {folder.name} on this machine, fitted on its step log.")
    profile = base
    if given is None:
        fit_halves = [step_rows(runs.steps["before"]), step_rows(runs.steps["after"])]
        serving = {"trace": trace, "skip": len(arrivals), "first": len(arrivals), "length_scale": length_scale,
                   "rate_scale": rate_scale, "max_tokens": max_tokens, "controller": controller_spec,
                   "steps": sum(map(len, fit_halves)), "around_check": True, "engine": "vllm", "limits": limits,
                   "runs": [{"when": w, "steps": len(h), "batch1_decode_median_s": batch1_median_s(h)}
                            for w, h in zip(("before", "after"), fit_halves)]}
        profile = fitted_profile(base, fit_halves, f"fitted on vLLM's step log around a check (--model {model} "
                                 f"--trace {trace} --first {first_n} --length-scale {length_scale} --rate-scale "
                                 f"{rate_scale})", serving)
        profile.save(out / "profile.json")
    overhead_s = 0.0
    if given is None:
        overhead_s = client_overhead([("before", halves[0]), ("after", halves[1])], runs, profile, controller_spec,
                                     seed, prefix_caching)
    report = judge(arrivals, runs, profile, controller_spec, seed, noise_seeds, prefix_caching, overhead_s, out, log)
    report.update({"trace": trace, "length_scale": length_scale, "rate_scale": rate_scale, "model": str(folder),
                   "fit_around": given is None})
    report["table"] = (f"twin check against vLLM: {len(arrivals)} requests of {trace} (length x{length_scale}, "
                       f"rate x{rate_scale}), " + report["table"])
    (out / "twin_report.json").write_text(json.dumps(report, indent=2, default=float) + "\n")
    return report


def profiling_halves(trace: str, skip: int, length_scale: float, rate_scale: float, max_tokens: int,
                     seed: int) -> list[list]:
    """The ``skip`` requests after the check's, split in two, each arriving from 0."""
    profiling = serving_arrivals(trace, skip, skip, length_scale, rate_scale, max_tokens, seed)
    if len(profiling) < 2:
        raise VllmCheckError(f"{trace} has fewer than 2 requests after the check's {skip} to fit a profile on; "
                             "pass --profile or a smaller --first")
    half = len(profiling) // 2
    t_half = profiling[half].arrival_time_s
    return [profiling[:half], [dataclasses.replace(a, arrival_time_s=a.arrival_time_s - t_half)
                               for a in profiling[half:]]]


def twin_controller(controller_spec: str) -> str:
    """The controller the twin runs for the plugin's ``controller_spec``: vLLM's own scheduling is greedy."""
    return VLLM_POLICY if controller_spec.strip() == PASS_THROUGH else controller_spec


def make_controller(spec: str, profile: Profile, arrivals, seed: int):
    c = build_controller(spec, profile, arrivals)
    if hasattr(c, "seed"):
        c.seed = seed
    return c


def outside(r: Request, overhead_s: float) -> None:
    """Move a simulated request's tokens ``overhead_s`` later: what its client sees of them."""
    if r.first_token_time_s is not None:
        r.first_token_time_s += overhead_s
    if r.finish_time_s is not None and r.state is RequestState.FINISHED:
        r.finish_time_s += overhead_s


def client_overhead(parts: list[tuple[str, list]], runs: VllmRuns, profile: Profile, controller_spec: str,
                    seed: int, prefix_caching: bool) -> float:
    """A request's time outside vLLM's engine, as its client sees it: the median, over the profiling
    replays' requests, of the measured TTFT less the twin's for the same request (each replay
    simulated with ``profile``). It is the API server's and the wire's: receiving the request and
    handing it to the engine, and streaming the tokens back. 0 without profiling replays."""
    diffs = []
    spec = twin_controller(controller_spec)
    for label, part in parts:
        t0, records = runs.replays[label]
        real = {r.request_id: r for r in real_requests(part, t0, records) if r.state is RequestState.FINISHED}
        sim = simulate(part, profile, make_controller(spec, profile, part, seed), record_steps=False,
                       prefix_caching=prefix_caching)
        for r in sim.core.metrics.terminal:
            q = real.get(r.request_id)
            if q is not None and r.state is RequestState.FINISHED:
                diffs.append(time_to_first_token_s(q) - time_to_first_token_s(r))
    return float(np.median(diffs)) if diffs else 0.0


def simulate_twin(arrivals, profile: Profile, spec: str, seed: int, noise_seeds: int, prefix_caching: bool,
                  overhead_s: float) -> tuple[dict, list[list]]:
    """``simulate_seeds`` of the check's requests, each simulated request's tokens ``overhead_s``
    later (``outside``) and the pooled latency figures taken again."""
    summary, requests = simulate_seeds(arrivals, profile, lambda: make_controller(spec, profile, arrivals, seed),
                                       noise_seeds, prefix_caching)
    for run in requests:
        for r in run:
            outside(r, overhead_s)
    summary.update(pooled_percentiles(latencies([r for run in requests for r in run])))
    return summary, requests


def judge(arrivals, runs: VllmRuns, profile: Profile, controller_spec: str, seed: int, noise_seeds: int,
          prefix_caching: bool, overhead_s: float, out: Path, log: Callable[[str], None] | None) -> dict:
    """The check's requests simulated with ``profile`` and compared with vLLM's, each simulated
    request's tokens ``overhead_s`` later (``client_overhead``); the report and its files."""
    twin_spec = twin_controller(controller_spec)
    if log:
        log(f"simulating {len(arrivals)} requests with profile {profile.name} and controller {twin_spec}")
    sim_summary, sim_requests = simulate_twin(arrivals, profile, twin_spec, seed, noise_seeds, prefix_caching,
                                              overhead_s)
    seeds = len(sim_requests)
    t0, records = runs.replays["check"]
    reqs = real_requests(arrivals, t0, records)
    check_rows = runs.steps["check"]
    real = _real_summary(reqs, check_rows, profile)
    cols = np.array(step_rows(check_rows), dtype=float).reshape(-1, 7)
    errors = step_errors(cols[:, 0], cols[:, 1], cols[:, 3], cols[:, 4], cols[:, 5], cols[:, 6], cols[:, 2], profile)
    errors.update(refit_floor(errors))
    by_size = step_errors_by_size(errors)
    write_check_steps_csv(out / "twin_steps.csv", errors)
    write_requests_csv(out / "twin_requests.csv", reqs, sim_requests[0])
    write_sim_requests_csv(out / "twin_sim_requests.csv", sim_requests)
    rows = compare_metrics(real, sim_summary)
    for key in ("prefill_tokens", "cached_prompt_tokens"):
        r, s = float(real[key]), float(sim_summary[key])
        rows[key] = {"real": r, "sim": s, "rel_error": (s - r) / r if r else math.nan}
    ks = ks_distances(reqs, [r for requests in sim_requests for r in requests])
    spread = seed_spread(real, reqs, sim_requests) if seeds > 1 else None
    met = targets_met(errors, rows)
    gaps = step_gaps(check_rows)
    headline = (f"controller {controller_spec} (twin: {twin_spec}), profile {profile.name}"
                + (f", simulated with {seeds} noise seeds pooled" if seeds > 1 else ""))
    drift = speed_drift(profile, errors)
    if drift is not None:  # diagnostic: the twin with the profile at the check's own speed
        scaled, scaled_requests = simulate_twin(arrivals, scaled_to_speed(profile, drift["ratio"]), twin_spec, seed,
                                                noise_seeds, prefix_caching, overhead_s)
        drift["rel_error_speed_adjusted"] = {k: (float(scaled[k]) - rows[k]["real"]) / rows[k]["real"]
                                             for k in COMPARED if rows[k]["real"]}
        drift["ks_speed_adjusted"] = ks_distances(reqs, [r for requests in scaled_requests for r in requests])
    sampling = real_sampling(reqs, sim_requests)
    table = report_table(headline, errors, rows, by_size, drift, met, ks, spread, sampling)
    if gaps.get("steps"):
        table += (f"\nthe engine loop between steps (in the twin's step, not in the logged durations): median "
                  f"{1e3 * gaps['median_s']:.2f} ms, {100 * gaps['of_median_step']:.1f}% of the median logged step")
    table += (f"\na request's time outside the engine (the API server and the wire, from the profiling replays, "
              f"added to the twin's TTFT and end-to-end latency): {1e3 * overhead_s:.2f} ms")
    plot_step_times(errors, out / "twin_step_time.png",
                    f"vLLM vs profile {profile.name}: {len(arrivals)} requests")
    return {
        "engine": "vllm", "requests": len(arrivals), "controller": controller_spec, "twin_controller": twin_spec,
        "profile": profile.name, "prefix_caching": prefix_caching, "vllm_limits": runs.limits,
        "vllm_ready_s": runs.ready_s, "client_overhead_s": overhead_s,
        "step_time": {k: v for k, v in errors.items() if not isinstance(v, np.ndarray)},
        "step_time_by_size": by_size, "step_gaps": gaps, "speed_drift": drift,
        "metrics": rows, "ks_distance": ks, "targets_met": met, "noise_seeds": seeds, "seed_spread": spread,
        "real_sampling": sampling, "real_summary": real, "sim_summary": sim_summary,
        "table": table,
    }


def _real_summary(reqs: list[Request], rows: list[dict[str, str]], profile: Profile) -> dict:
    """The check's figures on vLLM, as ``EngineMetrics.summary`` gives the simulator's: latencies
    from the client's records, preemptions, prefill and cached tokens from the step log."""
    metrics = EngineMetrics(record_steps=False)
    for r in sorted(reqs, key=lambda r: r.arrival_time_s):
        metrics.on_arrival(r)
    for r in sorted(reqs, key=lambda r: r.finish_time_s or 0.0):
        metrics.on_terminal(r)
    metrics.last_time_s = max((r.finish_time_s or 0.0) for r in reqs)
    metrics.evictions = sum(int(r["preempted"]) for r in rows)
    metrics.prefill_tokens = sum(int(r["prefill_tokens"]) for r in rows)
    metrics.cached_prompt_tokens = sum(int(r["cached_tokens"]) for r in rows)
    metrics.steps = len(rows)
    return metrics.summary(profile.kv_capacity_tokens, profile.ttft_slo_s, profile.tpot_slo_s)
