"""Measure the real engine's step time and fit the simulator's step-time model.

Steps are timed through the ``TorchExecutor`` over a grid of batch shapes: decode batches of
several sizes and context lengths, prefill chunks with and without cached context, and mixes
of both. The fit is ``t = base_s + per_token_s * T + per_kv_token_s * K`` (T new tokens, K KV
tokens read), least squares on relative error (so short steps count as much as long ones),
with coefficients kept non-negative. A quarter of the grid is held out to report MAPE.
"""

from __future__ import annotations

import platform
import random
import statistics
import time
from typing import Callable

import numpy as np
import torch

from engine.block_pool import BlockPool
from engine.executor import Batch
from engine.profile import Profile
from engine.request import Request
from engine.torch_executor import SamplingParams, TorchExecutor

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


def fit_step_time(rows, heldout_fraction: float = 0.25, seed: int = 0) -> dict:
    """Fit ``t = a + b*T + c*K`` to ``(T, K, t)`` rows; returns coefficients and fit quality.

    :return: ``base_s``, ``per_token_s``, ``per_kv_token_s`` (fitted on all rows), ``r2`` and
        ``mape`` on all rows, ``heldout_mape`` of a fit on the other rows, and ``points``.
    """
    data = np.asarray(rows, dtype=float)
    idx = np.random.default_rng(seed).permutation(len(data))
    n_test = max(1, int(round(heldout_fraction * len(data)))) if len(data) >= 8 else 0
    test, train = idx[:n_test], idx[n_test:]
    coef_train = _nonneg_relative_lstsq(data[train])
    coef = _nonneg_relative_lstsq(data)
    pred = _predict(coef, data)
    t = data[:, 2]
    r2 = 1.0 - float(np.sum((t - pred) ** 2) / np.sum((t - t.mean()) ** 2))
    mape = float(np.mean(np.abs(pred - t) / t))
    heldout = float(np.mean(np.abs(_predict(coef_train, data[test]) - data[test, 2]) / data[test, 2])) if n_test else mape
    return {"base_s": float(coef[0]), "per_token_s": float(coef[1]), "per_kv_token_s": float(coef[2]),
            "r2": r2, "mape": mape, "heldout_mape": heldout, "heldout_points": int(n_test), "points": len(data)}


def _predict(coef, data) -> np.ndarray:
    return coef[0] + coef[1] * data[:, 0] + coef[2] * data[:, 1]


def _nonneg_relative_lstsq(data) -> np.ndarray:
    """Least squares on relative error; a coefficient that comes out negative is fixed at 0."""
    x = np.column_stack([np.ones(len(data)), data[:, 0], data[:, 1]])
    y = data[:, 2]
    w = 1.0 / y
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
                block_size: int = 16, log: Callable[[str], None] | None = None) -> Profile:
    """Profile ``model`` on ``device`` and return the fitted Profile (fit report under ``extra``)."""
    from engine.tiny_model import default_device, load_model, resolve_dtype

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
    fit = fit_step_time(rows)
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
               "grid": {k: list(v) for k, v in grid.items()}, "repeats": repeats, "passes": passes,
               "samples": [{"tokens": t, "kv_tokens_read": k, "step_s": s} for t, k, s in rows]},
    )
