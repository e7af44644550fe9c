"""The gateway's routing for replicas that another system dispatches to (Ray Serve's request router):
which of the replicas it offers should take a request, best first, or none yet.

The replicas report their own load gauges (``EngineService.load_gauges``, the figures ``/metrics``
exports) instead of being scraped, each report stamped with the wall-clock time it was taken. The
views, the rule for room and the routers are the HTTP gateway's (``replicas``, ``routers``). A
request that finds no replica with room waits, up to ``hold_s``, for one (late dispatch); after that
it goes to the best replica anyway, whose own controller admits it or refuses it with 429.

It keeps no clock and does no I/O: the caller passes ``time.monotonic()`` and ``time.time()``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from tidegate.engine.gateway.replicas import ReplicaView
from tidegate.engine.gateway.routers import make_router

#: the gauges a report may carry, by the gateway's names
_GAUGES = ("waiting", "running", "kv_usage")
#: completions one report may add to a replica's rate (a replica that restarted reports fewer)
_MAX_COMPLETIONS_A_REPORT = 10_000


class GatewayRanking:
    """Ranks the replicas offered for a request by the gateway's router.

    :param router: the router's name (``routers.ROUTERS``)
    :param hold_s: the longest a request waits for a replica with room before it goes to the best one
    :param report_period_s: how often the replicas report (what a replica may queue between reports)
    :param stale_after_s: how old a report may be before it is not trusted (default: four periods, at
        least 2 s)
    """

    def __init__(self, router: str = "predicted-delay", hold_s: float = 1.0, report_period_s: float = 0.5,
                 stale_after_s: float | None = None) -> None:
        if hold_s < 0 or report_period_s <= 0:
            raise ValueError("hold_s must be at least 0 and report_period_s above 0")
        self.router = make_router(router)
        self.hold_s = hold_s
        self.report_period_s = report_period_s
        self.stale_after_s = stale_after_s if stale_after_s is not None else max(2.0, 4 * report_period_s)
        self.views: dict[str, ReplicaView] = {}
        self._finished: dict[str, float] = {}
        self._routed: dict[str, tuple[str, float]] = {}
        #: requests that found no replica with room and waited, and those sent on once their hold ran out
        self.held_total = 0
        self.released_total = 0
        self._holding: set[str] = set()

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
                view.completions.add(now, int(min(finished - before, _MAX_COMPLETIONS_A_REPORT)))

    def rank(self, replicas: Sequence[tuple[str, int]], prompt: str, request_id: str, waited_s: float,
             now: float) -> list[str]:
        """The keys of ``replicas`` (``(key, limit)`` pairs) to try for a request, best first; empty
        while none has room and the request has waited less than ``hold_s``."""
        views = [self.view(key, limit) for key, limit in replicas]
        room = [v for v in views if v.room(now, self.report_period_s)]
        if not room:
            if not views:
                return []
            if waited_s < self.hold_s:
                if request_id not in self._holding:
                    self._holding.add(request_id)
                    self.held_total += 1
                return []
            self.released_total += 1
            room = views
        self._holding.discard(request_id)
        first = self.router.pick(room, prompt, now)
        rest = sorted((v for v in room if v is not first), key=lambda v: (v.load(now), v.in_flight))
        return [first.url] + [v.url for v in rest]

    def routed(self, request_id: str, key: str, now: float) -> None:
        """The request went to replica ``key``."""
        view = self.views.get(key)
        if view is None:
            return
        view.dispatched(now)
        self._routed[request_id] = (key, now)

    def ended(self, request_id: str, now: float) -> None:
        """A routed request ended, however it ended (its completions are counted from the reports)."""
        routed = self._routed.pop(request_id, None)
        if routed is None:
            return
        view = self.views.get(routed[0])
        if view is not None:
            view.ended(now, completed=False)

    def keep(self, keys: Sequence[str]) -> None:
        """Forget the replicas not in ``keys`` (they stopped)."""
        alive = set(keys)
        for key in [k for k in self.views if k not in alive]:
            del self.views[key]
            self._finished.pop(key, None)
