"""The gateway's decisions, one piece for the HTTP gateway and its twin: which replicas may take a
request now, whether an arrival is admitted, and handing the queue's next requests to replicas.

It keeps no clock and does no I/O: the HTTP gateway (``fleet``) calls it on its event loop with
``time.monotonic()``, the fleet twin (``twin``) on its virtual clock; each says what a dispatch and
an expiry mean to it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tidegate.engine.gateway.queue import DrainAdmission, GatewayQueue, Queued
from tidegate.engine.gateway.replicas import ReplicaView
from tidegate.engine.gateway.routers import make_router


class Gate:
    """The replica views, the router, the gateway queue and its admission.

    :param views: the replicas as the gateway sees them
    :param router: the router's name (``routers.ROUTERS``)
    :param admission: False: every request goes at once to a replica that is up, nothing is refused
    :param ttft_slo_s: what admission promises
    :param scrape_interval_s: how often the replicas' gauges are read (what a replica may queue)
    """

    def __init__(self, views: Sequence[ReplicaView], router: str, admission: bool, ttft_slo_s: float,
                 scrape_interval_s: float) -> None:
        self.views = list(views)
        self.router = make_router(router)
        self.admission_on = admission
        self.scrape_interval_s = scrape_interval_s
        self.queue = GatewayQueue()
        self.admission = DrainAdmission(ttft_slo_s)

    def candidates(self, now: float) -> list[ReplicaView]:
        """The replicas the next request may go to now."""
        up = [v for v in self.views if v.up]
        if not self.admission_on:
            return up
        return [v for v in up if v.room(now, self.scrape_interval_s)]

    def admit(self, priority: int, now: float, prompt_tokens: float | None = None) -> float | None:
        """None admits an arrival of ``priority`` (of about ``prompt_tokens``); else its Retry-After in seconds."""
        if not self.admission_on:
            return None
        return self.admission.retry_after(now, self.queue.ahead(priority), sum(v.up for v in self.views),
                                          bool(self.candidates(now)), prompt_tokens)

    def predicted_wait_s(self, priority: int, now: float) -> float:
        """The queue wait admission predicts for an arrival of ``priority`` now."""
        return self.admission.predicted_wait_s(now, self.queue.ahead(priority))

    def dispatch(self, now: float, send: Callable[[Queued, ReplicaView], None],
                 expired: Callable[[Queued], None]) -> None:
        """End what outlived its TTL (``expired``); hand the queue's next requests to replicas with room
        (``send``). A request whose ticket is done (its client went away while it waited) is dropped."""
        for item in self.queue.expire(now):
            expired(item)
        while len(self.queue):
            candidates = self.candidates(now)
            if not candidates:
                break
            item = self.queue.pop()
            if item is None:
                break
            if item.ticket is not None and item.ticket.done():
                continue
            view = self.router.pick(candidates, item.prompt, now)
            view.dispatched(now)
            if not item.retries:
                self.admission.waited(item.predicted_wait_s, now - item.arrived_at, now)
            send(item, view)
