"""The fleet behind a gateway: replica views kept fresh, the gateway queue and its dispatcher.

One asyncio task per replica scrapes its ``/metrics`` (or, while it is down, its ``/health``); one
dispatcher task hands the queue's next request to a replica with room whenever something changes
(an arrival, an end, a scrape, a refusal) and ends requests whose TTL ran out. Everything runs on
the gateway's event loop, so no state here needs a lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from dataclasses import dataclass, field

import aiohttp
import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from tidegate.engine.gateway.features import FleetFeatures, budget_scale, load_fleet_policy
from tidegate.engine.gateway.gate import Gate
from tidegate.engine.gateway.queue import PRIORITY_HEADER, TENANT_HEADER, Queued
from tidegate.engine.gateway.replicas import ReplicaView, outlier, parse_gauges

log = logging.getLogger("tidegate.gateway")

#: what a replica that cannot be reached, or that breaks off, raises (a timeout of aiohttp's is one too)
TRANSPORT_ERRORS: tuple[type[BaseException], ...] = (aiohttp.ClientError, TimeoutError)
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 40.0)


@dataclass
class GatewayConfig:
    """The gateway's settings (``tidegate gateway --help`` says what each does)."""

    replicas: list[str]
    router: str = "predicted-delay"
    #: False: every request is dispatched at once, to a replica that is up, with no 429 (a plain router)
    admission: bool = True
    ttft_slo_s: float = 2.0
    tpot_slo_s: float = 0.2
    queue_ttl_s: float = 30.0
    scrape_interval_s: float = 0.1
    stale_after_s: float = 2.0
    health_interval_s: float = 1.0
    connect_timeout_s: float = 2.0
    #: the longest a replica may stay silent on a request (a host that vanishes sends no reset)
    read_timeout_s: float = 600.0
    #: how long a replica whose answers are server errors while the others' are not is taken out, times its
    #: ejections in a row (0: never; ``replicas.outlier`` says when)
    ejection_s: float = 30.0
    tenant_header: str = TENANT_HEADER
    priority_header: str = PRIORITY_HEADER
    #: where a request's priority comes from: ``body`` (its ``priority`` field, else the header), ``header`` (the
    #: header alone: set by a trusted proxy in front, so clients cannot jump the queue) or ``none`` (all at 0)
    priority_from: str = "body"
    max_request_bytes: int = 32 << 20
    #: a fleet admission policy (ONNX, ``tidegate train --env fleet`` then ``tidegate export``) that sets the
    #: admission budget every ``policy_interval_s`` (None: the gateway's own rule)
    admission_policy: str | None = None
    #: seconds between the policy's decisions (None: half the TTFT SLO, the fleet env's interval)
    policy_interval_s: float | None = None
    host: str = "127.0.0.1"
    port: int = 8080
    #: extra settings of no effect on routing, kept for the operator's view (``/health``)
    labels: dict = field(default_factory=dict)


class GatewayMetrics:
    """The gateway's Prometheus metrics."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("tidegate:gateway_requests_total", "Requests that ended at the gateway, by outcome.",
                                ["outcome"], registry=r)
        self.retries = Counter("tidegate:gateway_retries_total", "Requests sent again to another replica before "
                               "their stream started, by cause.", ["cause"], registry=r)
        self.queue = Gauge("tidegate:gateway_queue_length", "Requests waiting in the gateway for a replica with room.",
                           registry=r)
        self.fail_open = Gauge("tidegate:gateway_fail_open", "1 while every replica's gauges are stale: requests "
                               "are dispatched on the gateway's own counts.", registry=r)
        self.ttfb = Histogram("tidegate:gateway_time_to_first_byte_seconds", "Arrival at the gateway to the "
                              "replica's first byte.", buckets=_LATENCY_BUCKETS, registry=r)
        labels = ["replica"]
        self.up = Gauge("tidegate:gateway_replica_up", "1 while the replica is up.", labels, registry=r)
        self.stale = Gauge("tidegate:gateway_replica_stale", "1 while the replica's gauges are stale.", labels,
                           registry=r)
        self.in_flight = Gauge("tidegate:gateway_replica_in_flight", "The gateway's requests at the replica.", labels,
                               registry=r)
        self.waiting = Gauge("tidegate:gateway_replica_waiting", "The replica's queue, as last scraped.", labels,
                             registry=r)
        self.running = Gauge("tidegate:gateway_replica_running", "The replica's running requests, as last scraped.",
                             labels, registry=r)
        self.preemptions = Gauge("tidegate:gateway_replica_preemptions", "The replica's count of preempted requests, "
                                 "as last scraped (its concurrency limit's loss signal).", labels, registry=r)
        self.limit = Gauge("tidegate:gateway_replica_limit", "The most of the gateway's requests the replica may "
                           "hold (its concurrency limit; NaN without admission).", labels, registry=r)
        self.budget_scale = Gauge("tidegate:gateway_admission_budget_scale", "The queue wait admission allows, as a "
                                  "multiple of what the TTFT SLO leaves (the admission policy's last decision).",
                                  registry=r)
        self.budget_scale.set(1.0)
        self.drain_rate = Gauge("tidegate:gateway_drain_rate", "The fleet's measured completions a second that "
                                "admission counts on (0 while it is not trusted).", registry=r)
        self.first_byte = Gauge("tidegate:gateway_admission_first_byte_seconds", "The 90th percentile of the "
                                "replicas' dispatch-to-first-byte that admission counts for a prompt of this size "
                                "(estimated tokens).", ["prompt_tokens"], registry=r)
        self.ejections = Counter("tidegate:gateway_replica_ejections_total", "Times the replica was taken out "
                                 "for answering with server errors while the other replicas did not.", labels,
                                 registry=r)
        self.policy_fallbacks = Counter("tidegate:gateway_policy_fallbacks_total", "Admission policy decisions that "
                                        "failed and fell back to the gateway's own rule.", registry=r)


class Fleet:
    """The replicas, the queue and the dispatcher of one gateway; started and stopped with the app."""

    def __init__(self, config: GatewayConfig) -> None:
        if not config.replicas:
            raise ValueError("a gateway needs at least one replica (--replica URL)")
        self.config = config
        tpot = config.tpot_slo_s if config.admission else None
        self.gate = Gate([ReplicaView(u.rstrip("/"), stale_after_s=config.stale_after_s, tpot_slo_s=tpot)
                          for u in config.replicas], config.router, config.admission, config.ttft_slo_s,
                         config.scrape_interval_s)
        self.views, self.queue, self.admission = self.gate.views, self.gate.queue, self.gate.admission
        self.metrics = GatewayMetrics()
        #: what the admission policy reads (counted whether or not one runs)
        self.features = FleetFeatures(config.ttft_slo_s)
        self.policy = None
        self.last_action = 0.0
        if config.admission_policy is not None:
            if not config.admission:
                raise ValueError("an admission policy needs the gateway's admission: drop --no-admission")
            self.policy = load_fleet_policy(config.admission_policy)
        self.client: aiohttp.ClientSession | None = None
        self._wake: asyncio.Event | None = None
        self._tasks: list[asyncio.Task] = []

    # ------------------------------------------------------------------------------- life
    async def start(self) -> None:
        c = self.config
        # a dead process resets its connections; a host that vanishes is found by the read timeout. aiohttp's
        # pool finds a free connection per host at once (httpx's scanned every connection for every request: a
        # gateway relaying hundreds of streams spent most of its time there); bytes are relayed as they come
        self.client = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, connect=c.connect_timeout_s, sock_read=c.read_timeout_s),
            connector=aiohttp.TCPConnector(limit=0, limit_per_host=0), auto_decompress=False)
        self._wake = asyncio.Event()
        self._tasks = [asyncio.create_task(self._watch(v)) for v in self.views]
        self._tasks.append(asyncio.create_task(self._dispatch_loop()))
        if self.policy is not None:
            self._tasks.append(asyncio.create_task(self._policy_loop()))

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        while (item := self.queue.pop()) is not None:
            _resolve(item, None)
        if self.client is not None:
            await self.client.close()

    def wake(self) -> None:
        if self._wake is not None:
            self._wake.set()

    # ------------------------------------------------------------------------------- state
    def any_up(self) -> bool:
        return any(v.up for v in self.views)

    def fail_open(self, now: float) -> bool:
        """Every replica that is up has stale gauges: room cannot be judged."""
        up = [v for v in self.views if v.up]
        return bool(up) and all(v.stale(now) for v in up)

    def in_flight(self) -> int:
        return sum(v.in_flight for v in self.views)

    def admit(self, priority: int, now: float, prompt_tokens: float | None = None) -> float | None:
        """None admits an arrival of ``priority`` (of about ``prompt_tokens``); else its Retry-After in seconds."""
        return self.gate.admit(priority, now, prompt_tokens)

    def enqueue(self, item: Queued, front: bool = False) -> None:
        """Queue ``item`` and dispatch at once what can go (arrivals of one instant see each other)."""
        self.queue.push(item, front)
        self.dispatch(time.monotonic())

    def dispatch(self, now: float) -> None:
        """End what outlived its TTL; hand the queue's next requests to replicas with room."""
        self.gate.dispatch(now, _resolve, lambda item: _resolve(item, None))
        self.metrics.queue.set(len(self.queue))

    # ------------------------------------------------------------------------------- tasks
    async def _dispatch_loop(self) -> None:
        assert self._wake is not None
        while True:
            self._wake.clear()
            try:
                self.dispatch(time.monotonic())
            except Exception:  # the loop must outlive any one failure, or TTLs stop
                log.exception("the gateway's dispatch failed; it goes on")
            deadline = self.queue.next_deadline()
            timeout = self.config.scrape_interval_s if deadline is None else \
                min(self.config.scrape_interval_s, max(0.0, deadline - time.monotonic()))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)

    async def _policy_loop(self) -> None:
        interval = self.config.policy_interval_s or self.config.ttft_slo_s / 2
        self.features.reset(time.monotonic())
        while True:
            await asyncio.sleep(interval)
            self.decide(time.monotonic())

    def decide(self, now: float) -> None:
        """The admission policy's decision for the next interval, from the features of the last; a policy
        that fails (or answers a non-finite action) leaves the gateway's own rule (action 0) for the interval."""
        assert self.policy is not None
        try:
            x = self.features.read(self.gate, now, self.last_action)
            action = float(np.asarray(self.policy(x[None, :])).reshape(-1)[0])
            if not math.isfinite(action):
                raise ValueError(f"the policy answered {action}")
        except Exception:
            log.exception("the admission policy failed; the gateway's own rule holds for this interval")
            self.metrics.policy_fallbacks.inc()
            action = 0.0
        self.last_action = max(-1.0, min(1.0, action))
        self.admission.budget_scale = budget_scale(self.last_action)
        self.metrics.budget_scale.set(self.admission.budget_scale)

    async def _watch(self, view: ReplicaView) -> None:
        """Scrape the replica's gauges while it is up; check its health while it is down."""
        assert self.client is not None
        c = self.config
        while True:
            sent = time.monotonic()
            try:
                if not view.up and sent < view.ejected_until and 2 * sum(v.up for v in self.views) >= len(self.views):
                    pass  # ejected: no health check before its time is over, unless under half the fleet is up
                elif view.up:
                    async with self.client.get(view.url + "/metrics" + view.metrics_query,
                                               timeout=aiohttp.ClientTimeout(total=c.stale_after_s)) as r:
                        if r.status == 200:
                            gauges = parse_gauges(await r.text())
                            if not gauges and view.metrics_query:
                                # a page built by a collector without names (prometheus_client's multiprocess
                                # mode: SGLang's, vLLM's with PROMETHEUS_MULTIPROC_DIR) filters to nothing
                                view.metrics_query = ""
                                continue
                            view.scraped(sent, gauges)
                else:
                    async with self.client.get(view.url + "/health",
                                               timeout=aiohttp.ClientTimeout(total=c.health_interval_s)) as r:
                        if r.status == 200:
                            log.warning("replica %s is up again", view.url)
                            view.mark_up()
            except (*TRANSPORT_ERRORS, ValueError) as exc:
                if view.up and isinstance(exc, TRANSPORT_ERRORS):
                    self.replica_failed(view, f"its /metrics failed ({type(exc).__name__})")
            except Exception:  # an odd answer must not end the replica's watch
                log.exception("reading replica %s failed", view.url)
            self.wake()
            elapsed = time.monotonic() - sent
            await asyncio.sleep(max(0.0, (c.scrape_interval_s if view.up else c.health_interval_s) - elapsed))

    def answered(self, view: ReplicaView, status: int) -> None:
        """The replica answered with ``status``; a replica whose answers are server errors where the others' are not
        is ejected (``replicas.outlier``): a replica that fails fast looks idle and would draw the traffic."""
        now = time.monotonic()
        view.answered(status, now)
        if status < 500 or self.config.ejection_s <= 0 or not view.up:
            return
        why = outlier(view, self.views, now)
        if why is not None:
            seconds = view.eject(now, why, self.config.ejection_s)
            self.metrics.ejections.labels(view.name).inc()
            log.warning("replica %s is ejected for %g s: %s", view.url, seconds, why)

    def replica_failed(self, view: ReplicaView, why: str) -> None:
        if view.up:
            log.warning("replica %s is down: %s", view.url, why)
            view.mark_down(why)

    # ------------------------------------------------------------------------------- metrics
    def refresh_metrics(self) -> None:
        now = time.monotonic()
        m = self.metrics
        m.queue.set(len(self.queue))
        m.fail_open.set(1 if self.fail_open(now) else 0)
        m.drain_rate.set(self.admission.rate(now))
        for size, seconds in self.admission.first_byte_by_size().items():
            m.first_byte.labels(size).set(seconds)
        for v in self.views:
            m.up.labels(v.name).set(1 if v.up else 0)
            m.stale.labels(v.name).set(1 if v.stale(now) else 0)
            m.in_flight.labels(v.name).set(v.in_flight)
            m.waiting.labels(v.name).set(v.waiting if v.waiting is not None else float("nan"))
            m.running.labels(v.name).set(v.running if v.running is not None else float("nan"))
            m.preemptions.labels(v.name).set(v.preemptions if v.preemptions is not None else float("nan"))
            m.limit.labels(v.name).set(v.limit if self.config.admission else float("nan"))

    def status(self) -> dict:
        now = time.monotonic()
        return {
            "queue": len(self.queue), "fail_open": self.fail_open(now), "router": self.config.router,
            "admission": self.config.admission, "admission_policy": self.config.admission_policy,
            "admission_budget_scale": self.admission.budget_scale,
            "replicas": [{"url": v.url, "up": v.up, "down_reason": v.down_reason or None, "stale": v.stale(now),
                          "in_flight": v.in_flight, "waiting": v.waiting, "running": v.running,
                          "kv_usage": v.kv_usage, "preemptions": v.preemptions, "completed": v.completed_total,
                          "limit": round(v.limit, 2) if self.config.admission else None,
                          "ejected_for_s": round(v.ejected_until - now, 1) if v.ejected_until > now else None,
                          "tpot_s": v.tpot_s} for v in self.views],
        }


def _resolve(item: Queued, view: ReplicaView | None) -> None:
    if item.ticket is not None and not item.ticket.done():
        item.ticket.set_result(view)
