"""Fit the simulator's step-time model on the steps of real serving runs.

Two sources of serving steps, both fitted with ``engine.sim.fit.fit_step_time`` (by default the
``l1`` fit of the median step, with separate prefill and decode costs and the log-normal noise
of what is left; ``engine.sim.fit`` has the details):

- ``run_profile_from_serving`` (``tidegate profile --from-twin``): a trace slice replayed through
  the real engine in wall-clock time exactly as ``twin-check`` does (``replay_real``), every
  step's (T, K) and whole ``EngineCore.step`` duration recorded (scheduling and sampling
  included, shapes changing every step, idle gaps between arrivals). By default the run uses
  requests 300-599 of ``splitwise_conv``, disjoint from the 300 the twin check replays.
- ``run_profile_from_steps`` (``tidegate profile --from-steps``): the ``twin_steps.csv`` a twin
  check wrote, without serving again.
"""

from __future__ import annotations

import csv
import dataclasses
import time
from typing import Callable, TypeVar

import numpy as np
import torch

from tidegate.ctrl import build_controller
from tidegate.engine.core.profile import Profile
from tidegate.engine.real.model import load_model, resolve_device, resolve_dtype
from tidegate.engine.real.profiler import describe_device, serving_defaults
from tidegate.engine.sim.fit import binned_samples, fit_step_time, profile_fields
from tidegate.engine.twin.replay import replay_real
from tidegate.engine.workloads import load_workload

T = TypeVar("T")


def serving_arrivals(trace: str = "splitwise_conv", skip: int = 300, first_n: int = 300, length_scale: float = 0.1,
                     rate_scale: float = 1.0, max_tokens: int = 256, seed: int = 0):
    """Requests ``skip .. skip+first_n-1`` of a trace, or of a synthetic workload sampled with ``seed``,
    re-based to arrive from 0 (as ``read_trace`` does)."""
    arrivals = load_workload(trace, seed=seed, rate_scale=rate_scale, length_scale=length_scale,
                             max_tokens_cap=max_tokens)[skip:skip + first_n]
    if not arrivals:
        raise ValueError(f"{trace} has no requests after the first {skip}")
    t0 = arrivals[0].arrival_time_s
    return [dataclasses.replace(a, arrival_time_s=a.arrival_time_s - t0) for a in arrivals]


def run_profile_from_serving(model: str = "tiny", device=None, dtype=None, name: str = "tiny-cpu",
                             trace: str = "splitwise_conv", skip: int = 300, first_n: int = 300,
                             length_scale: float = 0.1, rate_scale: float = 1.0, max_tokens: int = 256,
                             controller_spec: str = "greedy", kv_capacity_tokens: int | None = None,
                             block_size: int = 16, loss: str = "l1", seed: int = 0, runs: int = 1,
                             log: Callable[[str], None] | None = None) -> Profile:
    """Fit the profile on the steps of a real serving run (``tidegate profile --from-twin``).

    The trace slice is replayed through the real engine in wall-clock time (``replay_real``, the
    same loop ``twin-check`` uses); each non-empty step's (T, K) and its whole ``EngineCore.step``
    duration are the fit's rows. ``runs`` > 1 replays it that many times and pools the steps, so
    the fit averages over the load other jobs put on a shared machine.
    """
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    base = serving_defaults(load_model(model, device, dtype)[0].config, name, block_size, kv_capacity_tokens)
    arrivals = serving_arrivals(trace, skip, first_n, length_scale, rate_scale, max_tokens, seed)
    if log:
        log(f"replaying requests {skip}-{skip + len(arrivals) - 1} of {trace} (length x{length_scale}, "
            f"rate x{rate_scale}) through the real engine: about {arrivals[-1].arrival_time_s:.0f}s")
    t0 = time.perf_counter()
    rows, per_run = _serve_and_record(arrivals, base, controller_spec, runs, model, device, dtype, seed, log)
    source = (f"fitted on serving steps (tidegate profile --from-twin --model {model} --device {device.type} "
              f"--trace {trace} --skip {skip} --first {first_n} --length-scale {length_scale} "
              f"--rate-scale {rate_scale} --runs {runs})")
    serving = {"trace": trace, "skip": skip, "first": first_n, "length_scale": length_scale,
               "rate_scale": rate_scale, "max_tokens": max_tokens, "controller": controller_spec,
               "steps": len(rows), "runs": per_run}
    return _serving_profile(base, rows, loss, model, device, dtype, source, serving, time.perf_counter() - t0)


def _serving_profile(base: Profile, rows: list[tuple], loss: str, model: str, device, dtype, source: str,
                     serving: dict, seconds: float) -> Profile:
    """``base`` with the step-time model fitted on serving ``rows`` (in the order they ran; the
    noise within each of ``serving["runs"]``, the rows of one run after another's)."""
    counts = [r["steps"] for r in serving.get("runs", [])]
    runs = np.repeat(np.arange(len(counts)), counts) if len(counts) > 1 and sum(counts) == len(rows) else None
    fit = fit_step_time(rows, loss=loss, runs=runs)
    described = describe_device(device)
    return dataclasses.replace(
        base, **profile_fields(fit),
        description=f"{model} model ({str(dtype).removeprefix('torch.')}) on {described} (fitted on serving steps).",
        source=source,
        extra={"fit": fit, "device": described, "torch": torch.__version__,
               "profiling_time_s": seconds, "method": "serving", "serving": serving,
               "samples": binned_samples(rows)},
    )


def fit_around(check: Callable[[Profile], T], model: str = "tiny", device=None, dtype=None, name: str = "around",
               trace: str = "splitwise_conv", skip: int = 300, first_n: int = 300, length_scale: float = 0.1,
               rate_scale: float = 1.0, max_tokens: int = 256, controller_spec: str = "greedy",
               kv_capacity_tokens: int | None = None, block_size: int = 16, loss: str = "l1", seed: int = 0,
               steps_out=None, log: Callable[[str], None] | None = None) -> tuple[Profile, Profile, T]:
    """Fit a profile on serving runs placed around ``check``: the first half of the profiling
    slice (requests ``skip .. skip+first_n-1``) is served before it, the second half after it,
    and the fit pools both. A machine whose speed drifts steadily during the three runs is then
    profiled, on average, at the speed it checked at; fitted on a run before the check only, the
    profile is off by the whole drift. The noise is fitted within each half (``fit_step_time``'s
    ``runs``): the two halves' speeds differing is drift, not step noise.

    :param check: runs the check (the real engine's part of it) given the profile fitted on the
        first half, which is what it may need before the second half exists (a controller's
        step-time model, the KV capacity).
    :param steps_out: also write the two halves' steps there (``write_steps_csv``; ``tidegate
        profile --from-steps`` fits the same profile on them).
    :return: the profile fitted on both halves, the one fitted on the first half, and what
        ``check`` returned.
    """
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    base = serving_defaults(load_model(model, device, dtype)[0].config, name, block_size, kv_capacity_tokens)
    arrivals = serving_arrivals(trace, skip, first_n, length_scale, rate_scale, max_tokens, seed)
    if len(arrivals) < 2:
        raise ValueError(f"fitting around a check needs at least 2 profiling requests, got {len(arrivals)}")
    half = len(arrivals) // 2
    t_half = arrivals[half].arrival_time_s
    halves = (arrivals[:half], [dataclasses.replace(a, arrival_time_s=a.arrival_time_s - t_half)
                                for a in arrivals[half:]])
    serving_s = [0.0]  # the profiling runs' time, the check's left out

    def serve(when: str, part) -> tuple[list[tuple], dict]:
        if log:
            log(f"profiling {when} the check: {len(part)} requests of {trace} through the real engine, "
                f"about {part[-1].arrival_time_s:.0f}s")
        t0 = time.perf_counter()
        got, info = _serve_and_record(part, base, controller_spec, 1, model, device, dtype, seed, log)
        serving_s[0] += time.perf_counter() - t0
        return got, {**info[0], "when": when}

    rows, before = serve("before", halves[0])
    if len(rows) < 3:
        raise ValueError(f"the first {half} profiling requests ran fewer than 3 steps: too few to fit")
    first = _serving_profile(base, rows, loss, model, device, dtype, "fitted on the serving run before a check",
                             {"runs": [before]}, serving_s[0])
    result = check(first)
    more, after = serve("after", halves[1])
    if steps_out is not None:
        write_steps_csv(steps_out, rows + more, ["before"] * len(rows) + ["after"] * len(more))
    rows += more
    per_run = [before, after]
    source = (f"fitted on serving steps around a check (--model {model} --device {device.type} --trace {trace} "
              f"--skip {skip} --first {first_n} --length-scale {length_scale} --rate-scale {rate_scale}): "
              f"requests {skip}-{skip + half - 1} served before it, {skip + half}-{skip + len(arrivals) - 1} after")
    serving = {"trace": trace, "skip": skip, "first": first_n, "length_scale": length_scale,
               "rate_scale": rate_scale, "max_tokens": max_tokens, "controller": controller_spec,
               "steps": len(rows), "runs": per_run, "around_check": True}
    profile = _serving_profile(base, rows, loss, model, device, dtype, source, serving, serving_s[0])
    return profile, first, result


def _serve_and_record(arrivals, base: Profile, controller_spec: str, runs: int, model: str, device, dtype,
                      seed: int, log) -> tuple[list[tuple[int, int, float, int, int, int, int]], list[dict]]:
    """Replay ``arrivals`` ``runs`` times; the pooled ``(T, K, seconds, D, C, Q, F)`` of every
    non-empty step in the order they ran, and per run its step count and median single-token step."""
    rows: list[tuple[int, int, float, int, int, int, int]] = []
    per_run = []
    for run in range(runs):
        controller = build_controller(controller_spec, base, arrivals)
        core, recorder = replay_real(arrivals, base, controller, model=model, device=device, dtype=dtype, seed=seed,
                                     log=log)
        durations = core.metrics.step_duration_s
        got = [(t, k, d, n, c, q, f) for t, k, d, n, c, q, f in
               zip(recorder.tokens, recorder.kv_tokens_read, durations, recorder.decodes, recorder.prefills,
                   recorder.prefill_pairs, recorder.first_decodes) if t > 0]
        rows += got
        median_s = batch1_median_s(got)
        per_run.append({"steps": len(got), "batch1_decode_median_s": median_s})
        if log and runs > 1:
            said = "no single-token step" if median_s is None else f"median single-token step {1e3 * median_s:.2f} ms"
            log(f"  run {run + 1}/{runs}: {len(got)} steps, {said}")
    return rows, per_run


def read_records(path) -> tuple[list[str], list[dict[str, str]]]:
    """A steps file's header and its rows as ``{column: text}`` (lines with too few or too many
    fields left out)."""
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        header = list(reader.fieldnames or [])
        return header, [r for r in reader if None not in r and None not in r.values()]


def step_rows(records: list[dict[str, str]]) -> list[tuple]:
    """``(T, K, seconds)`` of each row with new tokens, then those of ``D``, ``C``, ``Q`` and ``F``
    (columns ``decodes``, ``prefills``, ``prefill_pairs``, ``first_decodes``) as far as the rows
    have them in that order. Rows of an engine's step log (columns ``step`` and ``time_s``, the vLLM
    plugin's) are timed by their period in the engine's loop (``loop_seconds``)."""
    if not records:
        return []
    keys = records[0].keys()
    counts = []
    for column in ("decodes", "prefills", "prefill_pairs", "first_decodes"):
        if column not in keys:
            break
        counts.append(column)
    if "step" in keys and "time_s" in keys:
        seconds = loop_seconds([(int(r["step"]), float(r["time_s"]), float(r["real_s"])) for r in records])
    else:
        seconds = [float(r["real_s"]) for r in records]
    return [(int(r["tokens"]), int(r["kv_tokens_read"]), sec, *(int(r[c]) for c in counts))
            for r, sec in zip(records, seconds) if int(r["tokens"]) > 0]


def read_steps_file(path) -> tuple[list[tuple], list[str] | None, dict[str, int]]:
    """A steps file in one read: its ``step_rows``, their ``run`` labels (None without the column:
    the serving steps of a profile fitted around a check have one) and the replica's limits it
    gives (``limits_of_row`` of its last row).

    A ``twin_steps.csv`` written by ``twin-check`` gives ``(T, K, seconds)``, ``(T, K, seconds, D)``
    with the ``decodes`` column, and so on up to ``(..., F)`` (files from before any of them still
    read); the vLLM plugin's step log gives all seven, each step timed by its period in vLLM's loop.

    :raises ValueError: the file lacks ``tokens``, ``kv_tokens_read`` or ``real_s``, or has fewer than 3 steps.
    """
    header, records = read_records(path)
    if not {"tokens", "kv_tokens_read", "real_s"} <= set(header):
        raise ValueError(f"{path}: expected the columns tokens, kv_tokens_read, real_s "
                         f"(a twin_steps.csv or a vLLM step log)")
    rows = step_rows(records)
    if len(rows) < 3:
        raise ValueError(f"{path}: fewer than 3 steps to fit")
    runs = [r["run"] for r in records if int(r["tokens"]) > 0] if "run" in header else None
    return rows, runs, limits_of_row(records[-1])


def read_steps_csv(path) -> list[tuple]:
    """The rows of a steps file (``read_steps_file``)."""
    return read_steps_file(path)[0]


def read_step_runs(path) -> list[str] | None:
    """The ``run`` labels of a steps file's rows (``read_steps_file``)."""
    return read_steps_file(path)[1]


#: the longest time between two steps that counts as the engine loop's own work (not an idle spell)
MAX_GAP_S = 0.05


def loop_gaps(steps: list[tuple[int, float, float]]) -> list[float | None]:
    """Per step ``(number, start, logged seconds)`` of an engine's step log: the loop's time from its
    end to the next step's start when that one was scheduled right after it (the next number,
    within ``MAX_GAP_S``); None after an idle spell, and for the last."""
    gaps: list[float | None] = []
    for (n, start, sec), (m, nxt, _) in zip(steps, steps[1:]):
        gap = nxt - start - sec
        gaps.append(gap if m == n + 1 and 0 <= gap < MAX_GAP_S else None)
    return gaps + [None] if steps else []


def loop_seconds(steps: list[tuple[int, float, float]]) -> list[float]:
    """Each step's period in the engine's loop: its logged seconds (vLLM's: ``schedule()`` to
    ``update_from_output()``) plus the loop's work until the next step starts (handing outputs to
    the API process, taking new requests), which is the step's as much as its compute: the twin's
    step is the whole period. A step followed by an idle spell, or the last, gets the median gap."""
    gaps = loop_gaps(steps)
    known = [g for g in gaps if g is not None]
    typical = float(np.median(known)) if known else 0.0
    return [sec + (typical if g is None else g) for (_, _, sec), g in zip(steps, gaps)]


#: the replica's limits a vLLM step log's row gives: profile field -> column
LIMIT_COLUMNS = {"kv_capacity_tokens": "kv_capacity_tokens", "block_size": "block_size",
                 "max_num_seqs": "running_cap", "max_num_batched_tokens": "token_budget"}


def limits_of_row(row: dict[str, str]) -> dict[str, int]:
    """The replica's limits a vLLM step log's row gives (``LIMIT_COLUMNS``); those it lacks, or
    leaves empty or 0, are left out (a ``twin_steps.csv`` gives none)."""
    out = {}
    for field, column in LIMIT_COLUMNS.items():
        value = row.get(column) or ""
        if value and float(value) > 0:
            out[field] = int(float(value))
    return out


def step_log_limits(path) -> dict[str, int]:
    """The replica's limits a steps file's last row gives (``read_steps_file``)."""
    return read_steps_file(path)[2]


def batch1_median_s(rows: list[tuple]) -> float | None:
    """The median seconds of the single-token steps among ``(T, K, seconds, ...)`` rows (None without one)."""
    single = [row[2] for row in rows if row[0] == 1]
    return float(np.median(single)) if single else None


def write_steps_csv(path, rows: list[tuple], runs: list[str]) -> None:
    """Serving steps ``(T, K, seconds, D, C, Q, F)`` as a steps file ``read_steps_csv`` reads,
    with each row's run. Seconds are written to the bit (``repr``): an L1 fit can move on a
    rounding, so fitting on the file must see the very durations fitted on in memory."""
    with open(path, "w") as f:
        f.write("tokens,kv_tokens_read,real_s,decodes,prefills,prefill_pairs,first_decodes,run\n")
        for (t, k, sec, d, c, q, first), run in zip(rows, runs):
            f.write(f"{t},{k},{float(sec)!r},{d},{c},{q},{first},{run}\n")


def run_profile_from_steps(path, model: str = "tiny", name: str = "tiny-cpu", kv_capacity_tokens: int | None = None,
                           block_size: int = 16, loss: str = "l1") -> Profile:
    """Fit the profile on the steps a ``twin-check`` recorded (its ``twin_steps.csv``), without serving again.

    Checking the twin against the very run its profile was fitted on is in-sample: use it to see
    how far a linear profile can get, and fit on a different run for an honest check.
    """
    rows, runs, limits = read_steps_file(path)  # limits: a vLLM step log's replica (KV, blocks, batches)
    fit = fit_step_time(rows, loss=loss, runs=runs)
    if kv_capacity_tokens is not None:
        limits["kv_capacity_tokens"] = kv_capacity_tokens
    base = serving_defaults(model_config(model), name, limits.pop("block_size", block_size),
                            limits.pop("kv_capacity_tokens", None))
    return dataclasses.replace(
        base, **limits, **profile_fields(fit),
        description=f"{model} model, fitted on the serving steps in {path}.",
        source=f"fitted on recorded serving steps (tidegate profile --from-steps {path})",
        extra={"fit": fit, "method": "steps", "steps_file": str(path), "samples": binned_samples(rows)})


def model_config(model: str):
    """The model's transformers config (the tiny model is built; a folder's config is read, not its weights)."""
    if model == "tiny":
        return load_model(model, "cpu", None)[0].config
    from transformers import AutoConfig
    return AutoConfig.from_pretrained(model)
