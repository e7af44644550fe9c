"""The gateway's routing and admission for replicas that another system dispatches to (Ray Serve's
request router): which of the replicas it offers should take a request, best first; none yet; or a
refusal with the seconds to come back after.

The replicas report their own load gauges (``EngineService.load_gauges``, the figures ``/metrics``
exports) instead of being scraped, each report stamped with the wall-clock time it was taken. The
views, the rule for room and the routers are the HTTP gateway's (``replicas``, ``routers``), and so
is the admission (``queue.DrainAdmission``): a request that finds no replica with room waits for one
(late dispatch) while the requests waiting before it drain within the TTFT SLO, counting what it has
waited already; one that would not start in time is refused. Until the drain rate is measured, a
request waits at most the SLO and then goes to the best replica, whose own controller decides.

It keeps no clock and does no I/O: the caller passes ``time.monotonic()`` and ``time.time()``.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence

from tidegate.engine.gateway.queue import DrainAdmission
from tidegate.engine.gateway.replicas import ReplicaView
from tidegate.engine.gateway.routers import make_router

#: the gauges a report may carry, by the gateway's names
_GAUGES = ("waiting", "running", "kv_usage", "preemptions")
#: seconds past twice the TTFT SLO after which a waiting request not seen again is forgotten
_FORGET_AFTER_S = 5.0
#: ends heard before their routing that are remembered, the oldest forgotten first
_ENDED_EARLY_KEPT = 4096
#: completions one report may add to a replica's rate (a replica that restarted reports fewer)
_MAX_COMPLETIONS_A_REPORT = 10_000


class Refused(Exception):
    """The request would not start within the TTFT SLO: refuse it (429) with this Retry-After."""

    def __init__(self, retry_after_s: float) -> None:
        super().__init__(f"the fleet would not start this request within its TTFT SLO; retry after "
                         f"{retry_after_s:.1f} s")
        self.retry_after_s = retry_after_s


class GatewayRanking:
    """Ranks the replicas offered for a request by the gateway's router, and admits it.

    :param router: the router's name (``routers.ROUTERS``)
    :param ttft_slo_s: what admission promises: a request is refused when what it has waited and the
        drain of the requests before it pass this
    :param report_period_s: how often the replicas report (what a replica may queue between reports)
    :param stale_after_s: how old a report may be before it is not trusted (default: four periods, at
        least 2 s)
    """

    def __init__(self, router: str = "predicted-delay", ttft_slo_s: float = 2.0, report_period_s: float = 0.5,
                 stale_after_s: float | None = None) -> None:
        if not (ttft_slo_s > 0 and report_period_s > 0):
            raise ValueError("ttft_slo_s and report_period_s must be above 0")
        self.router = make_router(router)
        self.admission = DrainAdmission(ttft_slo_s)
        self.report_period_s = report_period_s
        self.stale_after_s = stale_after_s if stale_after_s is not None else max(2.0, 4 * report_period_s)
        self.views: dict[str, ReplicaView] = {}
        self._finished: dict[str, float] = {}
        #: when each replica's last completions were counted
        self._completions_at: dict[str, float] = {}
        self._routed: dict[str, tuple[str, float]] = {}
        #: requests waiting for room: request id -> (arrived at, predicted wait, waited when first held)
        self._holding: dict[str, tuple[float, float, float]] = {}
        #: (request id, replica) whose end was heard before their routing
        self._ended_early: OrderedDict[tuple[str, str], float] = OrderedDict()
        #: requests that found no replica with room and waited; refused; sent on unmeasured after the SLO
        self.held_total = 0
        self.refused_total = 0
        self.released_total = 0

    def view(self, key: str, limit: int) -> ReplicaView:
        """The view of replica ``key``, which takes at most ``limit`` requests at once."""
        view = self.views.get(key)
        if view is None:
            view = ReplicaView(url=key, stale_after_s=self.stale_after_s, limit=float(limit), slow_start=False)
            self.views[key] = view
        view.limit = float(max(1, limit))
        return view

    def report(self, key: str, stats: Mapping[str, object], now: float, wall_now: float) -> None:
        """Replica ``key``'s own report: its gauges, ``finished`` (requests finished whole so far) and
        ``at`` (the wall-clock second it was taken). A report no newer than the last is ignored."""
        view = self.views.get(key)
        at = stats.get("at")
        if view is None or not isinstance(at, (int, float)) or not math.isfinite(at):
            return
        sent_at = now - max(0.0, wall_now - float(at))
        if view.scraped_at is not None and sent_at <= view.scraped_at:
            return
        gauges = {name: float(value) for name in _GAUGES
                  if isinstance(value := stats.get(name), (int, float)) and math.isfinite(value)}
        view.scraped(sent_at, gauges)
        finished = stats.get("finished")
        if isinstance(finished, (int, float)) and math.isfinite(finished):
            before = self._finished.get(key)
            self._finished[key] = float(finished)
            if before is not None and finished > before:
                # counted when the report was taken (a report read after a quiet spell is not news of now),
                # never before a completion already counted
                at_s = max(sent_at, self.admission.last_completion_s, self._completions_at.get(key, -math.inf))
                self._completions_at[key] = at_s
                count = int(min(finished - before, _MAX_COMPLETIONS_A_REPORT))
                view.completions.add(at_s, count)
                for _ in range(min(count, DrainAdmission.WINDOW)):
                    self.admission.completed(at_s)

    def rank(self, replicas: Sequence[tuple[str, int]], prompt: str, request_id: str, waited_s: float,
             now: float, ahead: int | None = None) -> list[str]:
        """The keys of ``replicas`` (``(key, limit)`` pairs) to try for a request that has waited
        ``waited_s`` so far, best first; empty while it waits for room.

        :param ahead: the requests waiting before it, where the caller knows (else those held here)
        :raises Refused: it would not start within the TTFT SLO
        """
        views = [self.view(key, limit) for key, limit in replicas]
        if not views:
            return []
        room = [v for v in views if v.room(now, self.report_period_s)]
        if not room:
            room = self._hold(request_id, views, waited_s, now, ahead)
            if not room:
                return []
        first = self.router.pick(room, prompt, now)
        rest = sorted((v for v in room if v is not first), key=lambda v: (v.load(now), v.in_flight))
        return [first.url] + [v.url for v in rest]

    def _hold(self, request_id: str, views: list[ReplicaView], waited_s: float, now: float,
              ahead: int | None) -> list[ReplicaView]:
        """No replica has room: hold the request (nothing), refuse it, or, with the drain rate not yet
        measured and the SLO spent, hand it to every replica (its best one's controller decides)."""
        slo = self.admission.ttft_slo_s
        # a request is looked at again every few tens of milliseconds while it waits, and refused or sent
        # on once the SLO is spent: one not seen for longer ended unseen (its client left)
        for rid in [r for r, (a, _, _) in self._holding.items() if now - a > 2 * slo + _FORGET_AFTER_S]:
            del self._holding[rid]
        held = self._holding.get(request_id)
        arrived = held[0] if held is not None else now - waited_s
        if ahead is None:
            ahead = sum(1 for a, _, _ in self._holding.values() if a < arrived)
        predicted = self.admission.predicted_wait_s(now, ahead)
        if predicted > 0.0:  # the drain rate is measured
            if waited_s + predicted + self.admission.late_s > slo:
                self._holding.pop(request_id, None)
                self.refused_total += 1
                backlog = self.admission.predicted_wait_s(now, max(ahead, len(self._holding)))
                raise Refused(max(1.0, backlog - slo))
        elif waited_s >= slo:
            self._holding.pop(request_id, None)
            self.released_total += 1
            return views
        if held is None:
            self._holding[request_id] = (arrived, predicted, waited_s)
            self.held_total += 1
        return []

    def routed(self, request_id: str, key: str, now: float) -> None:
        """The request went to replica ``key`` (the router may hand a replica found for one request to
        the oldest waiting one)."""
        held = self._holding.pop(request_id, None)
        if held is not None:
            arrived, predicted, waited_then = held
            self.admission.waited(predicted, now - arrived - waited_then, now)
        if self._ended_early.pop((request_id, key), None) is not None:
            return  # its end was heard first (a reply quicker than the routing's own bookkeeping)
        view = self.views.get(key)
        if view is None:
            return
        view.dispatched(now)
        self._routed[request_id] = (key, now)

    def ended(self, request_id: str, key: str, now: float) -> None:
        """A request sent to replica ``key`` ended, however it ended (its completions are counted from the
        reports). An end heard before its routing is remembered, so the routing does not count it."""
        routed = self._routed.get(request_id)
        if routed is None or routed[0] != key:  # not routed yet, or a stale end of an earlier try elsewhere
            if routed is None:
                self._ended_early[(request_id, key)] = now
                while len(self._ended_early) > _ENDED_EARLY_KEPT:
                    self._ended_early.popitem(last=False)
            return
        del self._routed[request_id]
        view = self.views.get(key)
        if view is not None:
            view.ended(now, completed=False)

    def prune(self, waiting: set[str]) -> None:
        """Forget the held requests not among ``waiting`` (the caller's requests still waiting): their
        clients left, or another request's routing served them."""
        for rid in [r for r in self._holding if r not in waiting]:
            del self._holding[rid]

    @property
    def holding(self) -> int:
        """Requests waiting for a replica with room."""
        return len(self._holding)

    def keep(self, keys: Sequence[str]) -> None:
        """Forget the replicas not in ``keys`` (they stopped)."""
        alive = set(keys)
        for key in [k for k in self.views if k not in alive]:
            del self.views[key]
            self._finished.pop(key, None)
            self._completions_at.pop(key, None)
