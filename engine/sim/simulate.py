"""Drive EngineCore with a SimExecutor over a workload, in virtual time."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ctrl.base import Controller
from engine.core.clock import VirtualClock
from engine.core.engine_core import EngineCore
from engine.core.request import Request
from engine.sim.executor import SimExecutor


@dataclass
class SimResult:
    """A finished simulation: the summary figures and the engine (for step traces and requests)."""

    summary: dict
    core: EngineCore = field(repr=False)


def make_sim_engine(profile, controller: Controller, record_steps: bool = True) -> EngineCore:
    """An EngineCore on a virtual clock with the profile's executor and KV pool."""
    idle = profile.idle_s if profile.idle_s is not None else profile.base_s
    return EngineCore(
        controller, SimExecutor(profile), VirtualClock(),
        kv_capacity_tokens=profile.kv_capacity_tokens, block_size=profile.block_size,
        rate_window_s=max(10.0, 200 * idle), record_steps=record_steps)


def make_request(i: int, arrival) -> Request:
    return Request(str(i), arrival.arrival_time_s, arrival.prompt_tokens, arrival.max_tokens,
                   target_output_len=arrival.output_tokens, class_id=arrival.class_id)


def simulate(arrivals, profile, controller: Controller, *, record_steps: bool = True,
             progress: bool = False, desc: str = "simulating") -> SimResult:
    """Replay ``arrivals`` through the engine until every request has ended.

    :param arrivals: time-sorted ``engine.workloads.workload.Arrival`` items.
    :param profile: the step-time profile (``engine.core.profile.Profile``).
    :param controller: the controller under test; it is reset first.
    :param progress: show a progress bar over arrivals.
    """
    controller.reset()
    core = make_sim_engine(profile, controller, record_steps)
    clock = core.clock
    step = core.step
    add = core.add_request
    n = len(arrivals)
    i = 0
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=n, desc=desc, unit="req", leave=False, mininterval=0.5)
    wall0 = time.perf_counter()
    while i < n or core.has_unfinished:
        now = clock.now_s
        if i < n and arrivals[i].arrival_time_s <= now:
            start = i
            while i < n and arrivals[i].arrival_time_s <= now:
                add(make_request(i, arrivals[i]))
                i += 1
            if bar is not None:
                bar.update(i - start)
        if not (core.waiting or core.running):
            if i >= n:
                break
            clock.advance_to(arrivals[i].arrival_time_s)
            continue
        step()
    if bar is not None:
        bar.close()
    wall = time.perf_counter() - wall0
    summary = core.metrics.summary(core.pool.capacity_tokens, profile.ttft_slo_s, profile.tpot_slo_s,
                                   final_waiting=len(core.waiting))
    summary["wall_time_s"] = wall
    return SimResult(summary, core)
