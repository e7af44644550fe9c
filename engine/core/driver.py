"""Replay arrivals through an EngineCore: the one loop behind ``simulate`` (virtual clock) and
the twin's real replay (wall clock)."""

from __future__ import annotations

import math
from typing import Callable, Sequence

from tidegate.engine.core.engine_core import EngineCore
from tidegate.engine.core.request import Request


#: steps in a row with requests waiting, none running and none admitted after which a replay stops: its controller
#: admits nothing (a budget of 0), and the replay would never end
STALL_STEPS = 1_000_000


class ReplayStalled(ValueError):
    """The controller admitted nothing for ``STALL_STEPS`` steps while requests waited and none ran."""


def replay(core: EngineCore, arrival_times_s: Sequence[float], make_request: Callable[[int], Request],
           on_step: Callable[[int], None] | None = None,
           fast_forward: Callable[[EngineCore, float], object] | None = None) -> None:
    """Add request ``i`` once the clock reaches ``arrival_times_s[i]`` and step the engine
    until every request has ended. While nothing is queued or running, the clock jumps to (on a
    wall clock: waits for) the next arrival.

    :param arrival_times_s: non-decreasing arrival times on the core's clock.
    :param make_request: builds request ``i`` when it arrives.
    :param on_step: called after every step (or stretch of steady steps) with the number of
        requests added so far; the running requests' token counts lag until the replay ends
        (``EngineCore.step(sync=False)``).
    :param fast_forward: runs the stretch of steps in which only steady decodes can happen before
        the given time, in one call, and says in ``core.steady_steps`` how many it ran (the
        simulator's ``tidegate.engine.sim.steady.run_steady``: the same steps, without asking the
        controller at each). None: every step one by one.
    """
    clock, step, add, sched = core.clock, core.step, core.add_request, core.scheduler
    n, i = len(arrival_times_s), 0
    idle = 0  # steps in a row with requests waiting and none running
    while i < n or core.has_unfinished:
        now = clock.now()
        while i < n and arrival_times_s[i] <= now:
            add(make_request(i))
            i += 1
        if not (sched.waiting or sched.running):
            if i >= n:
                break
            clock.advance_to(arrival_times_s[i])
            continue
        if fast_forward is not None:
            fast_forward(core, arrival_times_s[i] if i < n else math.inf)
            if core.steady_steps:
                if on_step is not None:
                    on_step(i)
                continue
        step(False)
        if on_step is not None:
            on_step(i)
        if sched.running:
            idle = 0
        else:
            idle += 1
            if idle >= STALL_STEPS:
                raise ReplayStalled(f"the controller admitted none of {len(sched.waiting)} waiting requests in "
                                    f"{STALL_STEPS:,} steps while none ran: it admits nothing (a budget of 0?), and "
                                    "the run would never end")
    core.sync()
