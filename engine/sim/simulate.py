"""Drive EngineCore with a SimExecutor over a workload, in virtual time."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from tidegate.ctrl.base import Controller
from tidegate.engine.core.builder import build_engine
from tidegate.engine.core.clock import VirtualClock
from tidegate.engine.core.driver import replay
from tidegate.engine.core.engine_core import EngineCore
from tidegate.engine.core.profile import Profile
from tidegate.engine.core.request import Request
from tidegate.engine.sim.executor import SimExecutor
from tidegate.engine.sim.steady import run_steady


@dataclass
class SimResult:
    """A finished simulation: the summary figures and the engine (for step traces and requests)."""

    summary: dict
    core: EngineCore = field(repr=False)


def make_sim_engine(profile: Profile, controller: Controller, record_steps: bool = True,
                    eviction: str = "recompute", keep_requests: bool = True, noise_seed: int = 0,
                    prefix_caching: bool = True) -> EngineCore:
    """An EngineCore on a virtual clock with the profile's executor and KV pool.

    :param eviction: ``recompute`` or ``reset`` (the paper's model); see ``EngineCore``.
    :param keep_requests: keep every ended request in ``core.metrics.terminal``; without it memory
        grows by 40 bytes per finished request (see ``EngineMetrics``).
    :param noise_seed: seeds the step-time noise of a profile with ``noise_sigma`` > 0.
    :param prefix_caching: requests whose arrivals carry content ids (``Arrival.prefix_ids``) share
        the KV blocks of a common prefix (see ``EngineCore``).
    """
    core = build_engine(profile, controller, SimExecutor(profile, noise_seed), VirtualClock(),
                        record_steps=record_steps, eviction=eviction, prefix_caching=prefix_caching)
    core.metrics.keep_requests = keep_requests
    return core


def make_request(i: int, arrival) -> Request:
    """Request ``i`` of a replay, with the arrival's lengths (the simulator ends it at its output length)."""
    return Request(str(i), arrival.arrival_time_s, arrival.prompt_tokens, arrival.max_tokens,
                   target_output_len=arrival.output_tokens, class_id=arrival.class_id, prefix=arrival.prefix)


def simulate(arrivals, profile: Profile, controller: Controller, *, record_steps: bool = True,
             progress: bool = False, desc: str = "simulating", eviction: str = "recompute",
             keep_requests: bool = True, noise_seed: int = 0, prefix_caching: bool = True) -> SimResult:
    """Replay ``arrivals`` through the engine until every request has ended.

    :param arrivals: time-sorted ``engine.workloads.Arrival`` items.
    :param profile: the step-time profile (``engine.core.profile.Profile``).
    :param controller: the controller under test; it is reset first.
    :param progress: show a progress bar over arrivals.
    :param eviction: ``recompute`` (default: an evicted request keeps its tokens and re-prefills them)
        or ``reset`` (the paper's model: its progress is discarded).
    :param keep_requests: keep every ended request in ``core.metrics.terminal``; False keeps only
        what the summary needs, for long runs.
    :param noise_seed: seeds the step-time noise of a profile with ``noise_sigma`` > 0 (the same
        seed gives the same steps: a simulation stays a pure function of its inputs).
    :param prefix_caching: see ``make_sim_engine``.
    """
    controller.reset()
    core = make_sim_engine(profile, controller, record_steps, eviction, keep_requests, noise_seed, prefix_caching)
    on_step = None
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(arrivals), desc=desc, unit="req", leave=False, mininterval=0.5)

        def on_step(added: int) -> None:
            bar.update(added - bar.n)

    wall0 = time.perf_counter()
    replay(core, [a.arrival_time_s for a in arrivals], lambda i: make_request(i, arrivals[i]), on_step, run_steady)
    if bar is not None:
        bar.update(len(arrivals) - bar.n)
        bar.close()
    wall = time.perf_counter() - wall0
    summary = core.metrics.summary(core.pool.capacity_tokens, profile.ttft_slo_s, profile.tpot_slo_s,
                                   final_waiting=len(core.waiting))
    summary["wall_time_s"] = wall
    return SimResult(summary, core)
