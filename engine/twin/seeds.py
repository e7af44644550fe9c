"""The simulator's side of a twin check: the workload simulated with several noise seeds, pooled.

A profile with step noise makes the simulator a random model of the engine, and a twin check
judges the model, not one draw of it: it simulates the check's requests with several noise seeds
(``NOISE_SEEDS``) and compares the real requests with the simulated requests of all the seeds
pooled. One seed's TPOT p99 is the third-slowest request of 300, and it hangs on races (whether a
short request ends before a long prompt's prefill joins its batch) that one slow spell of the
noise decides: over the three checks of one run it ranged from -21% to +70% of the real
engine's between seeds. ``seed_spread`` keeps the single seeds' figures beside the pooled ones.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Callable

import numpy as np
from scipy.special import kolmogi
from scipy.stats import ks_2samp

from tidegate.ctrl.base import Controller
from tidegate.engine.core.profile import Profile, StepExtras
from tidegate.engine.core.request import RequestState
from tidegate.engine.core.slo import time_per_output_token_s, time_to_first_token_s
from tidegate.engine.sim.simulate import simulate

#: noise seeds a check simulates by default (a profile without noise is simulated once)
NOISE_SEEDS = 8
#: the summary's figures taken over the pooled requests of every seed: figure -> (latency, percentile)
POOLED = {"ttft_p50_s": ("ttft_s", 50), "ttft_p99_s": ("ttft_s", 99), "tpot_p50_s": ("tpot_s", 50),
          "tpot_p99_s": ("tpot_s", 99), "e2e_p50_s": ("e2e_s", 50), "e2e_p99_s": ("e2e_s", 99)}
#: the summary's figures that the seeds' largest stands for (the rest: their mean, or their sum here)
PEAKS = ("kv_peak_tokens",)
SUMS = ("wall_time_s",)
#: resamples of the real requests behind the range of the real run's own figures (``real_sampling``)
REAL_RESAMPLES = 2000
#: the relative errors whose range over single seeds the report gives, and their names in it
SPREAD = {"ttft_p50_s": "TTFT p50", "ttft_p99_s": "TTFT p99", "tpot_p50_s": "TPOT p50", "tpot_p99_s": "TPOT p99"}


def latencies(requests) -> dict[str, np.ndarray]:
    """TTFT, TPOT and end-to-end seconds of the finished requests (TPOT of those with two tokens
    or more), as ``EngineMetrics.summary`` counts them."""
    done = [r for r in requests if r.state is RequestState.FINISHED and r.first_token_time_s is not None
            and r.finish_time_s is not None]
    tpot = [time_per_output_token_s(r) for r in done]
    return {"ttft_s": np.array([time_to_first_token_s(r) for r in done], dtype=float),
            "tpot_s": np.array([t for t in tpot if t is not None], dtype=float),
            "e2e_s": np.array([r.finish_time_s - r.arrival_time_s for r in done], dtype=float)}


def ks_distances(real_requests, sim_requests) -> dict[str, float]:
    """The two-sample KS statistic (the largest gap between the two empirical CDFs, 0 to 1) of
    each latency between the real and the simulated requests; NaN where either side has none."""
    real, sim = latencies(real_requests), latencies(sim_requests)
    return {key: float(ks_2samp(real[key], sim[key]).statistic) if len(real[key]) and len(sim[key]) else math.nan
            for key in real}


def simulate_seeds(arrivals, profile: Profile, controller: Callable[[], Controller],
                   seeds: int = NOISE_SEEDS, prefix_caching: bool = True) -> tuple[dict, list[list]]:
    """Simulate ``arrivals`` with noise seeds 0 to ``seeds`` - 1 (once, seed 0, when the profile has
    no noise); returns the pooled summary and each seed's ended requests.

    The pooled summary has the ``POOLED`` percentiles over the finished requests of every seed
    together (``latencies``); of its other figures, a figure every seed agrees on keeps its value,
    ``PEAKS`` take the seeds' largest, ``SUMS`` their sum and the rest their mean. With one seed it
    is that simulation's own summary.

    :param controller: makes a fresh controller for each simulation.
    :param prefix_caching: the simulated engine's prefix cache (``EngineCore``).
    """
    if seeds < 1:
        raise ValueError(f"seeds must be at least 1, got {seeds}")
    n = seeds if profile.noise_sigma else 1
    runs = [simulate(arrivals, profile, controller(), record_steps=False, noise_seed=seed,
                     prefix_caching=prefix_caching) for seed in range(n)]
    requests = [list(run.core.metrics.terminal) for run in runs]
    if n == 1:
        return runs[0].summary, requests
    summaries = [run.summary for run in runs]
    pooled: dict = {}
    for key, first in summaries[0].items():
        values = [s[key] for s in summaries]
        numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
        if not numeric or all(v == first for v in values):
            pooled[key] = first
        else:
            pooled[key] = max(values) if key in PEAKS else sum(values) if key in SUMS else float(np.mean(values))
    pooled.update(pooled_percentiles(latencies([r for reqs in requests for r in reqs])))
    return pooled, requests


def pooled_percentiles(lat: dict[str, np.ndarray]) -> dict[str, float]:
    """The ``POOLED`` figures of ``latencies``' arrays (NaN where there is no request)."""
    return {key: float(np.percentile(lat[which], q)) if len(lat[which]) else math.nan
            for key, (which, q) in POOLED.items()}


def seed_spread(real: dict, real_requests, sim_requests: list[list]) -> dict:
    """The lowest and highest relative error of each ``SPREAD`` figure, and of the KS distance of
    TPOT, over the single seeds' simulations: how far one draw of the model could land."""
    out: dict[str, list[float]] = {}
    for requests in sim_requests:
        figures = pooled_percentiles(latencies(requests))
        for key in SPREAD:
            if real[key] and not math.isnan(figures[key]):
                out.setdefault(key, []).append(figures[key] / real[key] - 1.0)
        out.setdefault("ks_tpot", []).append(ks_distances(real_requests, requests)["tpot_s"])
    return {key: [min(v), max(v)] for key, v in out.items()}


def real_sampling(real_requests, sim_requests: list[list], resamples: int = REAL_RESAMPLES, seed: int = 0) -> dict:
    """How far the real run's own figures could have landed by the luck of its requests alone: for
    each ``SPREAD`` figure, :func:`sampling_range` of the real requests' latencies; and
    ``ks_tpot``, ``[0, ks_floor(...)]`` for the real and the pooled simulated TPOTs
    (``sim_requests``: each seed's). A relative error inside the range is one the check cannot
    tell from 0."""
    lat = latencies(real_requests)
    rng = np.random.default_rng(seed)
    out: dict[str, list[float]] = {}
    for key in SPREAD:
        which, q = POOLED[key]
        if len(lat[which]) and np.percentile(lat[which], q):
            out[key] = sampling_range(lat[which], q, rng, resamples)
    n, m = len(lat["tpot_s"]), len(latencies([r for reqs in sim_requests for r in reqs])["tpot_s"])
    if n and m:
        out["ks_tpot"] = [0.0, ks_floor(n, m)]
    return out


def sampling_range(values: np.ndarray, q: float, rng: np.random.Generator,
                   resamples: int = REAL_RESAMPLES) -> list[float]:
    """The 5th and 95th percentiles of the ``q``-th percentile of ``values`` resampled with
    replacement (``resamples`` times), relative to that of ``values`` itself (which is not 0). For
    a tail percentile of a few hundred values this percentile bootstrap covers the truth less
    often than 90% (it cannot draw values beyond the largest one seen): a lower bound on the
    figure's own uncertainty."""
    values = np.asarray(values, dtype=float)
    draws = np.percentile(values[rng.integers(0, len(values), (resamples, len(values)))], q, axis=1)
    lo, hi = np.percentile(draws / np.percentile(values, q) - 1.0, [5, 95])
    return [float(lo), float(hi)]


def ks_floor(n: int, m: int) -> float:
    """The two-sample KS distance that samples of ``n`` and ``m`` drawn independently from one
    distribution exceed 5% of the time (asymptotic: ``K sqrt((n + m) / (n m))``, K = 1.358 the
    Kolmogorov distribution's 95th percentile). Pooled noise seeds share their arrivals, so for
    them it is a floor."""
    return float(kolmogi(0.05)) * math.sqrt((n + m) / (n * m))


def scaled_to_speed(profile: Profile, ratio: float) -> Profile:
    """``profile`` with every duration of its step model (the costs, the idle tick, the noise's
    knee; not the SLOs) times ``ratio``: the profile of a machine ``ratio`` times slower."""
    costs = [f.name for f in (*dataclasses.fields(Profile), *dataclasses.fields(StepExtras))
             if f.name.endswith("_s") and "_slo_" not in f.name]
    return dataclasses.replace(profile, **{c: None if getattr(profile, c) is None else getattr(profile, c) * ratio
                                           for c in costs})


def request_latencies(r) -> tuple[float, float]:
    """A request's TTFT and TPOT for the per-request files, NaN where it has none (no first token
    or end; TPOT with fewer than two tokens)."""
    if r.first_token_time_s is None or r.finish_time_s is None:
        return math.nan, math.nan
    tpot = time_per_output_token_s(r)
    return time_to_first_token_s(r), math.nan if tpot is None else tpot


def write_sim_requests_csv(path: Path, sim_requests: list[list]) -> None:
    """Per noise seed and request: the simulator's TTFT and TPOT (``nan`` where it has none)."""
    with open(path, "w") as f:
        f.write("seed,request_id,output_tokens,ttft_sim_s,tpot_sim_s\n")
        for seed, requests in enumerate(sim_requests):
            for r in sorted(requests, key=lambda r: r.arrival_time_s):
                ttft, tpot = request_latencies(r)
                f.write(f"{seed},{r.request_id},{r.num_output_tokens},{ttft:.6g},{tpot:.6g}\n")
