"""A runtime guard for the learned controller: the twin replays each window of live traffic under
the learned policy and under its heuristic, and hands control to the heuristic while the policy
loses.

The learned controller adjusts ``slo-flow`` by residuals (action 0 *is* the heuristic), so the
question "is the policy helping on this traffic?" has a direct answer: replay the same arrivals
through the simulator twin twice, from an empty engine, once with a copy of the learned controller
and once with the heuristic inside the same shield, and compare goodput. Both replays go through
the same twin on the same arrivals, so the twin's own error (its step-time model) and the replay's
simplifications (an empty engine at the window's start, estimated output lengths of requests that
did not finish) apply to both alike and cancel in the comparison; only the controllers differ.

Windows are keyed by arrival time: window ``k`` holds the requests that arrived in
``[k W, (k + 1) W)`` and reached a terminal state, and it is judged ``settle_s`` after it closes,
when the requests that arrived in it have ended (those that end later are left out, counted in
``late_requests``). A request that did not finish (refused, expired, cancelled, failed) has no
known output length: it is replayed with the window's mean output length of finished requests,
capped by its ``max_tokens``. Only the windows not judged yet are kept: at most
``2 + ceil(settle_s / window_s)`` of them.

If learned goodput falls below ``(1 - tolerance)`` x the heuristic's, ``set_guarded(True)`` hands
every decision to the heuristic; it keeps control for ``hold_windows`` windows, after which each
window is again replayed under both and control goes back to the policy once it no longer loses.

A check costs two replays of a window (about N / several thousand requests per second of CPU
time). :meth:`TwinGuard.maybe_check` is cheap to call every engine step; synchronously
(simulations, deterministic) it replays on the caller's thread, with ``background=True`` (the
server) it runs the replays in a daemon thread, one check at a time, and applies the result at a
later call on the engine's thread, so the replays stay off the request path (they share the
interpreter's lock with the engine thread, not its loop).
"""

from __future__ import annotations

import copy
import logging
import math
import threading
import time
from dataclasses import dataclass

from tidegate.ctrl.base import Controller
from tidegate.ctrl.shield import ShieldedController
from tidegate.engine.core.profile import Profile
from tidegate.engine.core.request import Request, RequestState
from tidegate.engine.sim.simulate import simulate
from tidegate.engine.workloads.arrivals import Arrival

log = logging.getLogger(__name__)


def replay_controllers(live: ShieldedController) -> tuple[Controller, Controller]:
    """(learned, heuristic) controllers for the twin's replays, with the live one's settings.

    Both are deep copies of ``live`` (the shield and every option), so replays never touch the
    live controller's state. The learned copy shares the live ``policy`` object (it must be safe
    to call from another thread: the numpy and onnxruntime policies are) and has no wall-clock
    budget, so a replay's result never depends on the machine's load. The heuristic copy wraps a
    copy of the policy's prior, ``slo-flow`` with residuals 1 (the policy's action 0), in the
    same shield.
    """
    inner = live.inner
    learned = copy.deepcopy(live, {id(inner.policy): inner.policy})
    learned.inner.set_guarded(False)
    learned.inner.time_budget_s = None
    prior = copy.deepcopy(inner.prior)
    prior.set_residual()
    heuristic = copy.deepcopy(live, {id(inner): prior})
    return learned, heuristic


class GuardWindow:
    """The requests that arrived in one window and have ended.

    :param index: ``k`` of the window ``[k W, (k + 1) W)``.
    :param start_s: ``k W`` on the engine's clock.
    """

    __slots__ = ("index", "start_s", "requests", "finished", "output_tokens")

    def __init__(self, index: int, start_s: float) -> None:
        self.index = index
        self.start_s = start_s
        #: (arrival time, prompt, max_tokens, output tokens, finished, class) of each request
        self.requests: list[tuple[float, int, int, int, bool, int]] = []
        self.finished = 0
        self.output_tokens = 0

    def add(self, request: Request) -> None:
        finished = request.state is RequestState.FINISHED
        output = min(request.num_output_tokens, request.max_tokens)
        self.requests.append((request.arrival_time_s, request.prompt_len, request.max_tokens, output, finished,
                              request.class_id))
        if finished:
            self.finished += 1
            self.output_tokens += output

    def arrivals(self, prior_output_tokens: int) -> list[Arrival]:
        """The window's requests as arrivals from its start, in arrival order. A request that did not
        finish gets the mean output length of the finished ones (``prior_output_tokens`` when none
        finished), at least what it had produced and at most its ``max_tokens``."""
        mean_output = max(1, round(self.output_tokens / self.finished)) if self.finished else prior_output_tokens
        out = []
        for t, prompt, max_tokens, output, finished, class_id in sorted(self.requests):
            if not finished:
                output = max(output, mean_output)
            out.append(Arrival(max(t - self.start_s, 0.0), prompt, min(max(output, 1), max_tokens), max_tokens,
                               class_id))
        return out


@dataclass(frozen=True)
class GuardCheck:
    """One window replayed under both controllers.

    :param window_index: ``k`` of the window ``[k W, (k + 1) W)``.
    :param window_start_s: ``k W`` on the engine's clock.
    :param requests: requests replayed.
    :param learned_goodput_rps: goodput of the learned controller's replay.
    :param heuristic_goodput_rps: goodput of the heuristic's replay.
    :param wall_s: wall time of both replays.
    """

    window_index: int
    window_start_s: float
    requests: int
    learned_goodput_rps: float
    heuristic_goodput_rps: float
    wall_s: float


class TwinGuard:
    """Replays each window of traffic under the learned policy and under the heuristic, and
    guards the live learned controller while the policy loses.

    :param profile: the replica's profile (the twin's step time, KV size, SLOs).
    :param live: the served learned controller: a ``ShieldedController`` whose ``inner`` has
        ``set_guarded`` (``make_learned_controller``).
    :param window_s: seconds of arrivals per judged window.
    :param min_requests: a window in which fewer requests ended is not judged.
    :param tolerance: the policy loses when its goodput is below ``(1 - tolerance)`` x the
        heuristic's.
    :param hold_windows: the heuristic keeps control for at least this many windows: after a switch
        on window ``k``, window ``k + hold_windows`` is the first judged again (and may hand control
        back).
    :param settle_s: how long after a window closes it is judged (default ``window_s``).
    :param controllers: the (learned, heuristic) controllers of the replays; default
        :func:`replay_controllers` of ``live``. Each replay resets them.
    """

    def __init__(self, profile: Profile, live: ShieldedController, *, window_s: float = 60.0,
                 min_requests: int = 40, tolerance: float = 0.03, hold_windows: int = 1,
                 settle_s: float | None = None, controllers: tuple[Controller, Controller] | None = None) -> None:
        if not callable(getattr(getattr(live, "inner", None), "set_guarded", None)):
            raise TypeError("TwinGuard needs the shielded learned controller (make_learned_controller), "
                            f"got {type(live).__name__}")
        settle_s = window_s if settle_s is None else settle_s
        if not (window_s > 0 and settle_s >= 0 and min_requests >= 1 and 0 <= tolerance < 1 and hold_windows >= 1):
            raise ValueError("need window_s > 0, settle_s >= 0, min_requests >= 1, 0 <= tolerance < 1 and "
                             "hold_windows >= 1")
        self.profile = profile
        self.live = live
        self.window_s = float(window_s)
        self.settle_s = float(settle_s)
        self.min_requests = min_requests
        self.tolerance = tolerance
        self.hold_windows = hold_windows
        self.learned, self.heuristic = controllers if controllers is not None else replay_controllers(live)
        self._lock = threading.Lock()
        self._windows: dict[int, GuardWindow] = {}
        self._judged_through: float = -math.inf  # windows up to this index are judged or dropped
        self._hold_until: float = -math.inf  # while guarded, windows before this index are not judged
        self._thread: threading.Thread | None = None
        self._result: GuardCheck | None = None  # a background check waiting to be applied
        self.last: GuardCheck | None = None
        self.checks = 0
        self.switches = 0
        self.releases = 0
        self.skipped_windows = 0
        self.held_windows = 0
        self.late_requests = 0
        self.errors = 0

    @property
    def guarded(self) -> bool:
        """Whether the heuristic has control of the live controller."""
        return bool(self.live.inner.guarded)

    @property
    def windows_held(self) -> int:
        """Windows recorded and not judged yet (the guard's memory)."""
        return len(self._windows)

    # ------------------------------------------------------------------ feeding
    def on_finish(self, request: Request) -> None:
        """Record a request that reached a terminal state (the engine's ``on_finish``)."""
        if request.prompt_len < 1 or request.max_tokens < 1:
            return
        index = math.floor(request.arrival_time_s / self.window_s)
        if index <= self._judged_through:
            self.late_requests += 1
            return
        with self._lock:
            window = self._windows.get(index)
            if window is None:
                window = self._windows[index] = GuardWindow(index, index * self.window_s)
            window.add(request)

    # ------------------------------------------------------------------ checking
    def maybe_check(self, now_s: float, background: bool = False) -> GuardCheck | None:
        """Judge the last window once it has settled; cheap when none has.

        :param now_s: the engine's clock.
        :param background: run the replays in a daemon thread (one at a time); their result is
            applied at a later call. Otherwise replay here and apply at once.
        :return: the check applied in this call, or None.
        """
        applied = self._apply_background_result()
        if self._thread is not None and self._thread.is_alive():
            return applied
        window = self._take_due(now_s)
        if window is None:
            return applied
        if background:
            self._thread = threading.Thread(target=self._check_in_background, args=(window,),
                                            name="tidegate-twin-guard", daemon=True)
            self._thread.start()
            return applied
        check = self.replay(window)
        self._apply(check)
        return check

    def wait(self, timeout_s: float | None = None) -> None:
        """Wait for a background check to finish (its result is applied at the next call)."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout_s)

    def _take_due(self, now_s: float) -> GuardWindow | None:
        """Drop every window that has settled and return the newest if it is to be judged."""
        due = math.floor((now_s - self.settle_s) / self.window_s) - 1
        if due <= self._judged_through:
            return None
        with self._lock:
            taken = [self._windows.pop(k) for k in [k for k in self._windows if k <= due]]
            self._judged_through = due
        if not taken:
            return None
        window = max(taken, key=lambda w: w.index)
        if len(window.requests) < self.min_requests:
            self.skipped_windows += 1
            return None
        if self.guarded and window.index < self._hold_until:
            self.held_windows += 1
            return None
        return window

    def replay(self, window: GuardWindow) -> GuardCheck:
        """Replay a window's arrivals, from an empty engine, under the learned controller and the
        heuristic."""
        t0 = time.perf_counter()
        arrivals = window.arrivals(self.live.prior_output_tokens)
        learned = simulate(arrivals, self.profile, self.learned, record_steps=False).summary["goodput_rps"]
        heuristic = simulate(arrivals, self.profile, self.heuristic, record_steps=False).summary["goodput_rps"]
        return GuardCheck(window.index, window.start_s, len(arrivals), learned, heuristic, time.perf_counter() - t0)

    def _check_in_background(self, window: GuardWindow) -> None:
        try:
            check = self.replay(window)
        except Exception:
            self.errors += 1
            if self.errors == 1:
                log.exception("twin guard: a replay failed; the window is not judged (logged once)")
            return
        with self._lock:
            self._result = check

    def _apply_background_result(self) -> GuardCheck | None:
        if self._result is None:
            return None
        with self._lock:
            check, self._result = self._result, None
        if check is not None:
            self._apply(check)
        return check

    def _apply(self, check: GuardCheck) -> None:
        """Guard or release the live controller on a check's result (on the engine's thread)."""
        self.checks += 1
        self.last = check
        losing = check.learned_goodput_rps < (1.0 - self.tolerance) * check.heuristic_goodput_rps
        if losing and not self.guarded:
            self.live.inner.set_guarded(True)
            self.switches += 1
            self._hold_until = check.window_index + self.hold_windows
            log.warning("twin guard: learned goodput %.3f req/s < heuristic %.3f req/s on window %d "
                        "(%d requests): the heuristic takes control", check.learned_goodput_rps,
                        check.heuristic_goodput_rps, check.window_index, check.requests)
        elif not losing and self.guarded:
            self.live.inner.set_guarded(False)
            self.releases += 1
            log.warning("twin guard: learned goodput %.3f req/s >= %.0f%% of the heuristic's %.3f req/s on "
                        "window %d: the policy takes control again", check.learned_goodput_rps,
                        100 * (1 - self.tolerance), check.heuristic_goodput_rps, check.window_index)

    def status(self) -> dict:
        """The guard's state and last check, for /health or logs."""
        last = self.last
        return {
            "guarded": self.guarded,
            "checks": self.checks,
            "switches": self.switches,
            "releases": self.releases,
            "skipped_windows": self.skipped_windows,
            "held_windows": self.held_windows,
            "late_requests": self.late_requests,
            "errors": self.errors,
            "checking": self._thread is not None and self._thread.is_alive(),
            "window_s": self.window_s,
            "tolerance": self.tolerance,
            "last_window_start_s": last.window_start_s if last else None,
            "last_window_requests": last.requests if last else None,
            "last_learned_goodput_rps": last.learned_goodput_rps if last else None,
            "last_heuristic_goodput_rps": last.heuristic_goodput_rps if last else None,
            "last_check_wall_s": last.wall_s if last else None,
        }


def simulate_guarded(arrivals, profile: Profile, live: ShieldedController, *, window_requests: int = 300,
                     **guard_options) -> tuple[dict, TwinGuard]:
    """Simulate ``arrivals`` with the learned controller and its runtime guard, as a server runs
    them (the guard checking synchronously, so the result is deterministic).

    :param window_requests: the guard's window in requests at the workload's mean arrival rate
        (the window in seconds would not fit traffic of every rate); ``window_s`` overrides it.
    :return: the run's summary and the guard (its ``status()`` has the checks and switches).
    """
    from tidegate.engine.core.driver import replay
    from tidegate.engine.sim.simulate import make_request, make_sim_engine
    from tidegate.engine.sim.steady import run_steady

    span = arrivals[-1].arrival_time_s - arrivals[0].arrival_time_s if len(arrivals) > 1 else 0.0
    rate = (len(arrivals) - 1) / span if span > 0 else 0.0
    guard_options.setdefault("window_s", window_requests / rate if rate > 0 else 60.0)
    live.reset()
    live.inner.set_guarded(False)
    guard = TwinGuard(profile, live, **guard_options)
    core = make_sim_engine(profile, live, record_steps=False)
    core.on_finish = guard.on_finish
    replay(core, [a.arrival_time_s for a in arrivals], lambda i: make_request(i, arrivals[i]),
           lambda _: guard.maybe_check(core.clock.now()), run_steady)
    return core.metrics.summary(core.pool.capacity_tokens, profile.ttft_slo_s, profile.tpot_slo_s,
                                len(core.waiting)), guard
