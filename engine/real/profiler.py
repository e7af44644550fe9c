"""Time the real engine's steps over a grid of batch shapes and fit the simulator's step-time model.

The grid (``run_profile``, ``tidegate profile``): steps timed through the ``TorchExecutor`` over
batch shapes (decode batches of several sizes and context lengths, prefill chunks with and
without cached context, mixes), each shape repeated back to back. The fit
(``engine.sim.fit.fit_step_time``) is ``Profile.step_time_s``, least squares on relative error
with non-negative coefficients; a quarter of the shapes is held out to report MAPE.

Fitting on the steps of a serving run instead (``tidegate profile --from-twin``) lives in
``engine.twin.fit``, beside the replay it times.
"""

from __future__ import annotations

import platform
import random
import statistics
import time
from typing import Callable

import torch

from tidegate.engine.core.block_pool import BlockPool
from tidegate.engine.core.executor import Batch
from tidegate.engine.core.profile import Profile
from tidegate.engine.core.request import Request
from tidegate.engine.real.executor import TorchExecutor
from tidegate.engine.real.model import load_model, resolve_device, resolve_dtype
from tidegate.engine.real.sampling import SamplingParams
from tidegate.engine.sim.fit import fit_step_time, profile_fields

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


def batch_of_shape(pool: BlockPool, decodes: list[int], prefills: list[tuple[int, int]],
                   rng: random.Random) -> Batch:
    """A step's batch of one grid shape, with random prompt tokens and KV blocks from ``pool``.

    :param decodes: context length of each decoding request (it reads that many KV tokens).
    :param prefills: ``(cached tokens, new tokens)`` of each prefill chunk.
    """
    batch = Batch()
    kv = 0
    for i, ctx in enumerate(decodes):
        # A request with ctx - 1 tokens cached and one output token to feed: the step reads ctx.
        r = Request(f"d{i}", 0.0, ctx - 1, 1 << 20, prompt_token_ids=_random_ids(rng, ctx - 1), sampling=_IGNORE_EOS)
        r.num_computed_tokens = ctx - 1
        r.num_output_tokens = 1
        r.output_token_ids = [rng.randrange(3, 259)]
        pool.grow(r, ctx)
        batch.requests.append(r)
        batch.num_new_tokens.append(1)
        kv += ctx
    for j, (cached, n) in enumerate(prefills):
        r = Request(f"p{j}", 0.0, cached + n, 1 << 20, prompt_token_ids=_random_ids(rng, cached + n),
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


def _random_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 259) for _ in range(n)]


def time_batches(executor: TorchExecutor, pool: BlockPool, points, repeats: int = 5, passes: int = 3,
                 seed: int = 0, log: Callable[[str], None] | None = None) -> list[tuple[int, int, float, int]]:
    """Median step time of each batch shape: ``(T, K, seconds, D)`` per point (D decodes among T).

    The grid is walked ``passes`` times in a shuffled order and each visit times ``repeats``
    steps after a warm-up, so a burst of load from elsewhere on the machine hits a few samples
    of many points rather than every sample of one.
    """
    rng = random.Random(seed)
    sync = torch.cuda.synchronize if executor.device.type == "cuda" else (lambda: None)
    samples: list[list[float]] = [[] for _ in points]
    shapes: list[tuple[int, int, int]] = [(0, 0, 0)] * len(points)
    order = list(range(len(points)))
    for p in range(passes):
        rng.shuffle(order)
        for i in order:
            decodes, prefills = points[i]
            batch = batch_of_shape(pool, decodes, prefills, rng)
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
            shapes[i] = (batch.num_tokens, batch.kv_tokens_read, batch.num_decodes)
        if log is not None:
            log(f"  pass {p + 1}/{passes} over {len(points)} batch shapes done")
    return [(t, k, statistics.median(s), n) for (t, k, n), s in zip(shapes, samples)]


def describe_device(device: torch.device) -> str:
    """The GPU's name, or the CPU's model and torch's thread count (recorded with a fit)."""
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
    """Profile ``model`` on ``device`` and return the fitted Profile (fit report under ``extra``).

    :param kv_capacity_tokens: written into the profile; None: eight full model contexts.
    :param repeats: timed steps per visit of a batch shape.
    :param passes: walks over the shuffled grid.
    :param quick: the small grid (for tests), instead of the full one.
    :param loss: ``l2`` or ``l1`` (see ``fit_step_time``).
    """
    device = resolve_device(device)
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
    described = describe_device(device)
    return serving_defaults(
        hf_model.config, name, block_size, kv_capacity_tokens,
        **profile_fields(fit, noise=False),  # medians of repeated steps: their spread is not step noise
        description=f"{model} model ({str(dtype).removeprefix('torch.')}) on {described} (fitted).",
        source=f"fitted (tidegate profile --model {model} --device {device.type})",
        extra={"fit": fit, "device": described, "torch": torch.__version__,
               "profiling_time_s": time.perf_counter() - t0, "method": "grid",
               "grid": {k: list(v) for k, v in grid.items()}, "repeats": repeats, "passes": passes,
               "samples": [{"tokens": t, "kv_tokens_read": k, "step_s": s, "decodes": n} for t, k, s, n in rows]},
    )


def serving_defaults(model_config, name: str, block_size: int = 16, kv_capacity_tokens: int | None = None,
                     base_s: float = 0.003, per_token_s: float = 1e-4, per_kv_token_s: float = 1e-6,
                     **kw) -> Profile:
    """A profile with the serving defaults of the fitted tiny profiles (SLOs, batch limits, KV size).

    The coefficients default to placeholders; a fit passes its own, and ``description``,
    ``source`` and ``extra`` through ``kw``.
    """
    if kv_capacity_tokens is None:
        # Eight full contexts: room for a few dozen typical requests, so admission and
        # eviction matter, in a few tens of MB for the tiny model.
        kv_capacity_tokens = 8 * getattr(model_config, "max_position_embeddings", 2048)
    return Profile(name=name, description=kw.pop("description", "placeholder"), base_s=base_s, per_token_s=per_token_s,
                   per_kv_token_s=per_kv_token_s, kv_capacity_tokens=kv_capacity_tokens, block_size=block_size,
                   ttft_slo_s=1.0, tpot_slo_s=0.1, max_num_batched_tokens=512, max_num_seqs=64, **kw)
