"""Measure the real engine's step time and fit the simulator's step-time model.

The fit is ``t = base_s + per_token_s * T + per_kv_token_s * K`` (T new tokens, K KV tokens
read) with non-negative coefficients, on relative error (so short steps count as much as long
ones). Two sources of timed steps:

- the grid (``run_profile``): steps timed through the ``TorchExecutor`` over batch shapes
  (decode batches of several sizes and context lengths, prefill chunks with and without cached
  context, mixes), each shape repeated back to back; least squares on relative error;
- serving (``run_profile_from_serving``, ``tidegate profile --from-twin``): a trace replayed
  through the real engine in wall-clock time exactly as ``twin-check`` does, every step's
  (T, K) and whole ``EngineCore.step`` duration recorded (scheduling and sampling included,
  shapes changing every step, idle gaps between arrivals), and the fit minimises the mean
  absolute relative error (the step-time MAPE the twin check reports). By default the serving
  run uses requests 300-599 of ``splitwise_conv``, disjoint from the 300 the twin check replays.

A quarter of the points (grid shapes or steps) is held out to report MAPE.
"""

from __future__ import annotations

import dataclasses
import platform
import random
import statistics
import time
from typing import Callable

import numpy as np
import torch

from engine.core.block_pool import BlockPool
from engine.core.executor import Batch
from engine.core.profile import Profile
from engine.core.request import Request
from engine.real.executor import SamplingParams, TorchExecutor

_IGNORE_EOS = SamplingParams(ignore_eos=True)

FULL_GRID = dict(
    decode_batches=(1, 2, 4, 8, 16, 32, 48, 64),
    decode_contexts=(32, 128, 384, 768),
    prefill_tokens=(16, 32, 64, 128, 256, 512),
    prefill_cached=(0, 256),
    mixed_batches=(4, 16, 32),
    mixed_contexts=(128, 512),
    mixed_prefill=(64, 256),
)
QUICK_GRID = dict(
    decode_batches=(1, 8, 32),
    decode_contexts=(32, 256),
    prefill_tokens=(32, 128),
    prefill_cached=(0,),
    mixed_batches=(8,),
    mixed_contexts=(128,),
    mixed_prefill=(64,),
)


def grid_points(grid: dict) -> list[tuple[list[int], list[tuple[int, int]]]]:
    """Batch shapes: (decode context lengths, [(cached tokens, new tokens) per prefill chunk])."""
    points = []
    for b in grid["decode_batches"]:
        for ctx in grid["decode_contexts"]:
            points.append(([ctx] * b, []))
    for n in grid["prefill_tokens"]:
        for c in grid["prefill_cached"]:
            points.append(([], [(c, n)]))
    for b in grid["mixed_batches"]:
        for ctx in grid["mixed_contexts"]:
            for n in grid["mixed_prefill"]:
                points.append(([ctx] * b, [(0, n)]))
    return points


def _batch(pool: BlockPool, decodes: list[int], prefills: list[tuple[int, int]], rng: random.Random) -> Batch:
    batch = Batch()
    kv = 0
    for i, ctx in enumerate(decodes):
        # A request with ctx - 1 tokens cached and one output token to feed: the step reads ctx.
        r = Request(f"d{i}", 0.0, ctx - 1, 1 << 20, prompt_token_ids=[rng.randrange(3, 259) for _ in range(ctx - 1)],
                    sampling=_IGNORE_EOS)
        r.num_computed_tokens = ctx - 1
        r.num_output_tokens = 1
        r.output_token_ids = [rng.randrange(3, 259)]
        pool.grow(r, ctx)
        batch.requests.append(r)
        batch.num_new_tokens.append(1)
        kv += ctx
    for j, (cached, n) in enumerate(prefills):
        r = Request(f"p{j}", 0.0, cached + n, 1 << 20, prompt_token_ids=[rng.randrange(3, 259) for _ in range(cached + n)],
                    sampling=_IGNORE_EOS)
        r.num_computed_tokens = cached
        pool.grow(r, cached + n)
        batch.requests.append(r)
        batch.num_new_tokens.append(n)
        kv += cached + n
    batch.num_decodes = len(decodes)
    batch.num_tokens = sum(batch.num_new_tokens)
    batch.kv_tokens_read = kv
    return batch


def time_batches(executor: TorchExecutor, pool: BlockPool, points, repeats: int = 5, passes: int = 3,
                 seed: int = 0, log: Callable[[str], None] | None = None) -> list[tuple[int, int, float]]:
    """Median step time of each batch shape: ``(T, K, seconds)`` per point.

    The grid is walked ``passes`` times in a shuffled order and each visit times ``repeats``
    steps after a warm-up, so a burst of load from elsewhere on the machine hits a few samples
    of many points rather than every sample of one.
    """
    rng = random.Random(seed)
    sync = torch.cuda.synchronize if executor.device.type == "cuda" else (lambda: None)
    samples: list[list[float]] = [[] for _ in points]
    shapes: list[tuple[int, int]] = [(0, 0)] * len(points)
    order = list(range(len(points)))
    for p in range(passes):
        rng.shuffle(order)
        for i in order:
            decodes, prefills = points[i]
            batch = _batch(pool, decodes, prefills, rng)
            executor.execute(batch)  # warm-up
            for _ in range(repeats):
                sync()
                t0 = time.perf_counter()
                executor.execute(batch)
                sync()
                samples[i].append(time.perf_counter() - t0)
            for r in batch.requests:
                executor.release(r)
                pool.free(r)
            shapes[i] = (batch.num_tokens, batch.kv_tokens_read)
        if log is not None:
            log(f"  pass {p + 1}/{passes} over {len(points)} batch shapes done")
    return [(t, k, statistics.median(s)) for (t, k), s in zip(shapes, samples)]


def fit_step_time(rows, heldout_fraction: float = 0.25, seed: int = 0, loss: str = "l2") -> dict:
    """Fit ``t = a + b*T + c*K`` to ``(T, K, t)`` rows; returns coefficients and fit quality.

    :param loss: ``"l2"``: least squares on relative error; ``"l1"``: least absolute relative
        error (minimises MAPE; iteratively reweighted least squares), robust to the stalls a
        shared machine puts into a few steps.
    :return: ``base_s``, ``per_token_s``, ``per_kv_token_s`` (fitted on all rows), ``r2`` and
        ``mape`` on all rows, ``heldout_mape`` of a fit on the other rows, and ``points``.
    """
    if loss not in ("l1", "l2"):
        raise ValueError(f"loss must be 'l1' or 'l2', got {loss!r}")
    fit = _nonneg_relative_lstsq if loss == "l2" else _nonneg_relative_l1
    data = np.asarray(rows, dtype=float)
    data = data[data[:, 2] > 0]
    idx = np.random.default_rng(seed).permutation(len(data))
    n_test = max(1, int(round(heldout_fraction * len(data)))) if len(data) >= 8 else 0
    test, train = idx[:n_test], idx[n_test:]
    coef_train = fit(data[train])
    coef = fit(data)
    pred = _predict(coef, data)
    t = data[:, 2]
    r2 = 1.0 - float(np.sum((t - pred) ** 2) / np.sum((t - t.mean()) ** 2))
    mape = float(np.mean(np.abs(pred - t) / t))
    heldout = float(np.mean(np.abs(_predict(coef_train, data[test]) - data[test, 2]) / data[test, 2])) if n_test else mape
    return {"base_s": float(coef[0]), "per_token_s": float(coef[1]), "per_kv_token_s": float(coef[2]),
            "loss": loss, "r2": r2, "mape": mape, "median_ape": float(np.median(np.abs(pred - t) / t)),
            "heldout_mape": heldout, "heldout_points": int(n_test), "points": len(data)}


def _predict(coef, data) -> np.ndarray:
    return coef[0] + coef[1] * data[:, 0] + coef[2] * data[:, 1]


def _nonneg_relative_l1(data, iterations: int = 60) -> np.ndarray:
    """Least absolute relative error by iteratively reweighted least squares (non-negative)."""
    y = data[:, 2]
    coef = _nonneg_relative_lstsq(data)
    for _ in range(iterations):
        rel = np.abs(_predict(coef, data) - y) / y
        new = _nonneg_relative_lstsq(data, extra_weight=1.0 / np.sqrt(np.maximum(rel, 1e-4)))
        if np.allclose(new, coef, rtol=1e-6, atol=1e-12):
            return new
        coef = new
    return coef


def _nonneg_relative_lstsq(data, extra_weight=None) -> np.ndarray:
    """Least squares on relative error; a coefficient that comes out negative is fixed at 0."""
    x = np.column_stack([np.ones(len(data)), data[:, 0], data[:, 1]])
    y = data[:, 2]
    w = 1.0 / y if extra_weight is None else extra_weight / y
    active = [0, 1, 2]
    while True:
        sol, *_ = np.linalg.lstsq(x[:, active] * w[:, None], y * w, rcond=None)
        if (sol >= 0).all() or len(active) == 1:
            coef = np.zeros(3)
            coef[active] = np.maximum(sol, 0)
            return coef
        active.pop(int(np.argmin(sol)))


def _describe_device(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    name = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{name}, {torch.get_num_threads()} torch threads"


def run_profile(model: str = "tiny", device=None, dtype=None, name: str = "tiny-cpu",
                kv_capacity_tokens: int | None = None, repeats: int = 3, passes: int = 3, quick: bool = False,
                block_size: int = 16, loss: str = "l2", log: Callable[[str], None] | None = None) -> Profile:
    """Profile ``model`` on ``device`` and return the fitted Profile (fit report under ``extra``)."""
    from engine.real.model import default_device, load_model, resolve_dtype

    device = torch.device(device) if device is not None else default_device()
    dtype = resolve_dtype(dtype, device)
    hf_model, tokenizer = load_model(model, device, dtype)
    grid = QUICK_GRID if quick else FULL_GRID
    points = grid_points(grid)
    need = max(sum(d) + sum(c + n for c, n in p) + block_size * (len(d) + len(p)) for d, p in points)
    pool = BlockPool(need, block_size)
    executor = TorchExecutor(hf_model, tokenizer, pool, device=device, dtype=dtype)
    if log:
        log(f"timing {len(points)} batch shapes x {passes} passes x {repeats} runs on {device} ({dtype})")
    t0 = time.perf_counter()
    rows = time_batches(executor, pool, points, repeats=repeats, passes=passes, log=log)
    fit = fit_step_time(rows, loss=loss)
    max_len = getattr(hf_model.config, "max_position_embeddings", 2048)
    if kv_capacity_tokens is None:
        # Eight full contexts: room for a few dozen typical requests, so admission and
        # eviction matter, in a few tens of MB for the tiny model.
        kv_capacity_tokens = 8 * max_len
    described = _describe_device(device)
    return Profile(
        name=name,
        description=f"{model} model ({str(dtype).removeprefix('torch.')}) on {described} (fitted).",
        base_s=fit["base_s"], per_token_s=fit["per_token_s"], per_kv_token_s=fit["per_kv_token_s"],
        kv_capacity_tokens=kv_capacity_tokens, block_size=block_size,
        ttft_slo_s=1.0, tpot_slo_s=0.1, max_num_batched_tokens=512, max_num_seqs=64,
        source=f"fitted (tidegate profile --model {model} --device {device.type})",
        extra={"fit": fit, "device": described, "torch": torch.__version__, "profiling_time_s": time.perf_counter() - t0,
               "method": "grid", "grid": {k: list(v) for k, v in grid.items()}, "repeats": repeats, "passes": passes,
               "samples": [{"tokens": t, "kv_tokens_read": k, "step_s": s} for t, k, s in rows]},
    )


def serving_arrivals(trace: str = "splitwise_conv", skip: int = 300, first_n: int = 300, length_scale: float = 0.1,
                     rate_scale: float = 1.0, max_tokens: int = 256):
    """Requests ``skip .. skip+first_n-1`` of a trace, re-based to arrive from 0 (as ``read_trace`` does)."""
    from engine.workloads.workload import read_trace, resolve_trace

    arrivals = read_trace(resolve_trace(trace), first_n=skip + first_n, rate_scale=rate_scale,
                          length_scale=length_scale, max_tokens_cap=max_tokens)[skip:]
    if not arrivals:
        raise ValueError(f"{trace} has no requests after the first {skip}")
    t0 = arrivals[0].arrival_time_s
    return [dataclasses.replace(a, arrival_time_s=a.arrival_time_s - t0) for a in arrivals]


def serving_defaults(model_config, name: str, block_size: int = 16, kv_capacity_tokens: int | None = None,
                     base_s: float = 0.003, per_token_s: float = 1e-4, per_kv_token_s: float = 1e-6, **kw) -> Profile:
    """A profile with the serving defaults of the fitted tiny profiles (coefficients are placeholders)."""
    if kv_capacity_tokens is None:
        # Eight full contexts: room for a few dozen typical requests, so admission and
        # eviction matter, in a few tens of MB for the tiny model.
        kv_capacity_tokens = 8 * getattr(model_config, "max_position_embeddings", 2048)
    return Profile(name=name, description=kw.pop("description", "placeholder"), base_s=base_s, per_token_s=per_token_s,
                   per_kv_token_s=per_kv_token_s, kv_capacity_tokens=kv_capacity_tokens, block_size=block_size,
                   ttft_slo_s=1.0, tpot_slo_s=0.1, max_num_batched_tokens=512, max_num_seqs=64, **kw)


def binned_samples(rows, max_bins: int = 120) -> list[dict]:
    """Median step time per (T, K) cell of a log grid: a compact record of thousands of steps."""
    groups: dict[tuple[int, int], list[tuple[int, int, float]]] = {}
    for t, k, s in rows:
        key = (int(np.log2(max(t, 1)) * 2), int(np.log2(max(k, 1)) * 2))
        groups.setdefault(key, []).append((t, k, s))
    out = []
    for key in sorted(groups, key=lambda kk: -len(groups[kk]))[:max_bins]:
        g = groups[key]
        out.append({"tokens": float(np.median([x[0] for x in g])), "kv_tokens_read": float(np.median([x[1] for x in g])),
                    "step_s": float(np.median([x[2] for x in g])), "steps": len(g)})
    return sorted(out, key=lambda d: (d["tokens"], d["kv_tokens_read"]))


def run_profile_from_serving(model: str = "tiny", device=None, dtype=None, name: str = "tiny-cpu",
                             trace: str = "splitwise_conv", skip: int = 300, first_n: int = 300,
                             length_scale: float = 0.1, rate_scale: float = 1.0, max_tokens: int = 256,
                             controller_spec: str = "greedy", kv_capacity_tokens: int | None = None,
                             block_size: int = 16, loss: str = "l1", seed: int = 0, runs: int = 1,
                             log: Callable[[str], None] | None = None) -> Profile:
    """Fit the profile on the steps of a real serving run (``tidegate profile --from-twin``).

    The trace slice is replayed through the real engine in wall-clock time (``engine.twin.check.replay_real``,
    the same loop ``twin-check`` uses); each non-empty step's (T, K) and its whole
    ``EngineCore.step`` duration are the fit's rows. ``runs`` > 1 replays it that many times and
    pools the steps, so the fit averages over the load other jobs put on a shared machine.
    """
    from ctrl import build_controller
    from engine.real.model import default_device, load_model, resolve_dtype
    from engine.twin.check import replay_real

    device = torch.device(device) if device is not None else default_device()
    dtype = resolve_dtype(dtype, device)
    config = load_model(model, device, dtype)[0].config
    base = serving_defaults(config, name, block_size, kv_capacity_tokens)
    arrivals = serving_arrivals(trace, skip, first_n, length_scale, rate_scale, max_tokens)
    if log:
        log(f"replaying requests {skip}-{skip + len(arrivals) - 1} of {trace} (length x{length_scale}, rate x{rate_scale}) "
            f"through the real engine: about {arrivals[-1].arrival_time_s:.0f}s")
    t0 = time.perf_counter()
    rows: list[tuple[int, int, float]] = []
    per_run = []
    for run in range(runs):
        controller = build_controller(controller_spec, base, arrivals)
        core, recorder = replay_real(arrivals, base, controller, model=model, device=device, dtype=dtype, seed=seed,
                                     log=log)
        durations = core.metrics.step_duration_s
        got = [(t, k, d) for t, k, d in zip(recorder.tokens, recorder.kv_tokens_read, durations) if t > 0]
        rows += got
        single = [d for t, _, d in got if t == 1]
        per_run.append({"steps": len(got), "batch1_decode_median_s": float(np.median(single)) if single else None})
        if log and runs > 1:
            log(f"  run {run + 1}/{runs}: {len(got)} steps, median single-token step "
                f"{1e3 * per_run[-1]['batch1_decode_median_s']:.2f} ms")
    fit = fit_step_time(rows, loss=loss)
    described = _describe_device(device)
    source = (f"fitted on serving steps (tidegate profile --from-twin --model {model} --device {device.type} "
              f"--trace {trace} --skip {skip} --first {first_n} --length-scale {length_scale} --rate-scale {rate_scale} "
              f"--runs {runs})")
    return dataclasses.replace(
        base, base_s=fit["base_s"], per_token_s=fit["per_token_s"], per_kv_token_s=fit["per_kv_token_s"],
        description=f"{model} model ({str(dtype).removeprefix('torch.')}) on {described} (fitted on serving steps).",
        source=source,
        extra={"fit": fit, "device": described, "torch": torch.__version__, "profiling_time_s": time.perf_counter() - t0,
               "method": "serving", "serving": {"trace": trace, "skip": skip, "first": first_n,
                                                "length_scale": length_scale, "rate_scale": rate_scale,
                                                "max_tokens": max_tokens, "controller": controller_spec,
                                                "steps": len(rows), "runs": per_run},
               "samples": binned_samples(rows)},
    )


def read_steps_csv(path) -> list[tuple[int, int, float]]:
    """``(T, K, seconds)`` rows of a ``twin_steps.csv`` written by ``twin-check``."""
    rows = []
    with open(path) as f:
        header = f.readline().strip().split(",")
        try:
            it, ik, ir = header.index("tokens"), header.index("kv_tokens_read"), header.index("real_s")
        except ValueError:
            raise ValueError(f"{path}: expected the columns tokens, kv_tokens_read, real_s (a twin_steps.csv)") from None
        for line in f:
            parts = line.strip().split(",")
            if len(parts) == len(header) and int(parts[it]) > 0:
                rows.append((int(parts[it]), int(parts[ik]), float(parts[ir])))
    if len(rows) < 3:
        raise ValueError(f"{path}: fewer than 3 steps to fit")
    return rows


def run_profile_from_steps(path, model: str = "tiny", name: str = "tiny-cpu", kv_capacity_tokens: int | None = None,
                           block_size: int = 16, loss: str = "l1") -> Profile:
    """Fit the profile on the steps a ``twin-check`` recorded (its ``twin_steps.csv``), without serving again.

    Checking the twin against the very run its profile was fitted on is in-sample: use it to see
    how far a linear profile can get, and fit on a different run for an honest check.
    """
    from engine.real.model import load_model

    rows = read_steps_csv(path)
    fit = fit_step_time(rows, loss=loss)
    base = serving_defaults(load_model(model, "cpu", None)[0].config if model == "tiny" else _config_of(model),
                            name, block_size, kv_capacity_tokens)
    return dataclasses.replace(
        base, base_s=fit["base_s"], per_token_s=fit["per_token_s"], per_kv_token_s=fit["per_kv_token_s"],
        description=f"{model} model, fitted on the serving steps in {path}.",
        source=f"fitted on recorded serving steps (tidegate profile --from-steps {path})",
        extra={"fit": fit, "method": "steps", "steps_file": str(path), "samples": binned_samples(rows)})


def _config_of(model: str):
    from transformers import AutoConfig
    return AutoConfig.from_pretrained(model)
