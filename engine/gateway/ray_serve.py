"""tidegate's server as Ray Serve replicas, routed by the gateway's routers (``tidegate serve
--ray-replicas N``; the ``tidegate[ray]`` extra).

- :class:`TidegateReplica`: one deployment replica is one ``tidegate serve``: its engine, its
  controller (which admits, queues or refuses with 429 and a Retry-After) and its OpenAI routes,
  served through Ray Serve's HTTP proxy. It reports its load gauges to Ray Serve
  (``record_routing_stats``) and fails Ray's health check while its engine is down.
- :class:`TidegateRouter`: Ray Serve's request router for that deployment, the gateway's
  :class:`~engine.gateway.ranking.GatewayRanking` over the replicas Ray offers: the gateway's
  router picks among the replicas with room; with none, the request waits in Ray's router (late
  dispatch) while the requests before it drain within the TTFT SLO, and is refused with 429 and a
  Retry-After (Ray's ``BackPressureError``, which its proxy answers with that status) once it would
  not start in time. What waits is served as the gateway's queue serves it (``queue.GatewayQueue``):
  priority levels in order (the priority header), fair between tenants within a level (the tenant
  header; by requests, as Ray's router does not see a request's tokens), first come first served
  within a tenant; a request that waits past the queue's TTL ends with 503 and says why.
- Ray's own bound on what waits at the router (``max_queued_requests``) answers 429 with a fixed
  Retry-After at once, so nothing queues without bound before the replicas either.

The same call runs on one machine (a local Ray) or a cluster (``address``); a model folder other
than the built-in ``tiny`` must then exist on every node.
"""

from __future__ import annotations

import logging
import math
import pickle
import time
from dataclasses import dataclass
from typing import Any

from ray import serve
from ray.serve.config import BackpressureConfig, RequestRouterConfig
from ray.serve.exceptions import BackPressureError
from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

from tidegate.engine.gateway.queue import PRIORITY_HEADER, TENANT_HEADER, GatewayQueue, Queued, header_priority
from tidegate.engine.gateway.ranking import GatewayRanking, Refused
from tidegate.engine.gateway.routers import PROMPT_FREE_ROUTERS
from tidegate.engine.serve.config import ServeConfig

log = logging.getLogger("tidegate.ray")



@dataclass
class RayFleetConfig:
    """How the replicas run on Ray (``tidegate serve --help``: the ``--ray-*`` options)."""

    replicas: int = 2
    router: str = "predicted-delay"
    #: what the router's admission promises: a request is refused (429) when it would not start within it
    ttft_slo_s: float = 2.0
    #: how often each replica reports its gauges, in seconds
    report_period_s: float = 0.25
    #: the most requests one replica holds at once (Ray's ``max_ongoing_requests``)
    max_ongoing: int = 256
    #: the most requests that wait at the router; more get 429 (Ray's ``max_queued_requests``)
    max_queued: int = 256
    #: the Retry-After of that 429, in seconds
    retry_after_s: float = 1.0
    #: the longest a request waits at the router for a replica with room; then 503
    queue_ttl_s: float = 30.0
    cpus: float = 1.0
    gpus: float = 0.0
    #: a running Ray cluster (``auto``, ``ray://host:10001``); None: a local Ray on this machine
    address: str | None = None
    #: the Ray application's name
    app_name: str = "tidegate"

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError("--ray-replicas must be at least 1")
        if self.router not in PROMPT_FREE_ROUTERS:
            raise ValueError(f"the router {self.router!r} cannot run in Ray Serve (it needs the prompt, which Ray's "
                             f"router does not see); one of {', '.join(PROMPT_FREE_ROUTERS)}")
        if not (self.ttft_slo_s > 0 and self.report_period_s > 0 and self.retry_after_s > 0 and self.queue_ttl_s > 0):
            raise ValueError("the TTFT SLO, the report period, the Retry-After and the queue's TTL must be above 0")
        if self.max_ongoing < 1 or self.max_queued < 1:
            raise ValueError("the replicas' and the router's request limits must be at least 1")
        if self.cpus < 0 or self.gpus < 0:
            raise ValueError("--ray-replica-cpus and --ray-replica-gpus cannot be negative")


@serve.ingress()
class TidegateReplica:
    """One ``tidegate serve`` as a Ray Serve replica.

    :param config: the server's settings (its host and port are Ray's proxy's, not this replica's)
    """

    def __init__(self, config: ServeConfig) -> None:
        from tidegate.engine.serve.launch import build_service

        logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        self.config = config
        self.service = build_service(config)

    def __serve_build_asgi_app__(self):
        from tidegate.engine.serve.app import create_app

        app = create_app(self.service, self.config)
        return _NameReplica(app, serve.get_replica_context().replica_id.unique_id)

    def record_routing_stats(self) -> dict[str, float]:
        """What :class:`TidegateRouter` ranks by: the load gauges and when they were read."""
        return {**self.service.load_gauges(), "at": time.time()}

    def check_health(self) -> None:
        if not self.service.alive:
            raise RuntimeError("the engine is not running")

    def __del__(self) -> None:
        service = getattr(self, "service", None)
        if service is not None:
            service.stop()


class _NameReplica:
    """ASGI middleware: every response says which replica answered (``x-tidegate-replica``), as an
    operator tracing a slow or failed request across the fleet needs; a request whose priority header is not an
    integer gets 400, as from ``tidegate gateway`` (the router read it as 0: Ray's proxy answers no 400 for it)."""

    def __init__(self, app, name: str) -> None:
        self.app = app
        self.header = (b"x-tidegate-replica", name.encode("ascii", "replace"))

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for key, value in scope.get("headers", ()):
            if key.lower() == _PRIORITY_NAME:
                try:
                    header_priority(value.decode("latin-1"))
                except ValueError:
                    from tidegate.engine.serve.protocol import error_response

                    return await error_response(400, f"the {PRIORITY_HEADER} header must be an integer",
                                                param=PRIORITY_HEADER)(scope, receive, send)

        async def named(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), self.header]}
            await send(message)

        await self.app(scope, receive, named)


class TidegateRouter(FIFOMixin, RequestRouter):
    """Ray Serve's request router with the gateway's ranking (``request_router_kwargs`` are
    :class:`GatewayRanking`'s, and ``max_queued``, ``queue_ttl_s``, ``priority_header`` and ``tenant_header``).

    Ray's router hands a replica that a routing found to the pending request that
    :meth:`_get_pending_request_matching_metadata` names (its FIFO mixin's hook): here the next one of the
    gateway's queue, which mirrors Ray's pending requests.
    """

    def initialize_state(self, max_queued: int = -1, queue_ttl_s: float = 30.0, priority_header: str = PRIORITY_HEADER,
                         tenant_header: str = TENANT_HEADER, **kwargs: Any) -> None:
        self._max_queued = max_queued
        self._queue_ttl_s = queue_ttl_s
        self._headers = (priority_header.lower().encode("latin-1"), tenant_header.lower().encode("latin-1"))
        self.ranking = GatewayRanking(**kwargs)
        self.queue = GatewayQueue()
        #: the queue's entry of each pending request it holds, by Ray's internal request id
        self._queued: dict[str, Queued] = {}
        #: the entries of requests handed a replica and not routed yet: one that Ray tries again (the replica
        #: turned it away) goes back to the head of its tenant's turn, as the HTTP gateway's does
        self._handed: dict[str, Queued] = {}

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        now, wall = time.monotonic(), time.time()
        ranking = self.ranking
        by_key = {}
        for replica in candidate_replicas:
            key = replica.replica_id.unique_id
            by_key[key] = replica
            ranking.view(key, replica.max_ongoing_requests)
            ranking.report(key, replica.routing_stats or {}, now, wall)
        ranking.keep([r.replica_id.unique_id for r in self.curr_replicas.values()])
        self._sync(wall)
        if pending_request is not None and pending_request.future.done():  # refused here (its TTL), or cancelled
            return [[replica] for replica in candidate_replicas[:1]]
        ahead = None
        if pending_request is None:
            request_id, waited = "", math.inf
        else:
            request_id = pending_request.metadata.internal_request_id
            waited = max(0.0, wall - pending_request.created_at)
            item = self._queued.get(request_id)
            if item is None:  # not among Ray's pending requests (a first try): queued now
                item = self._enqueue(pending_request)
            # Ray routes a few requests at a time (two routing tasks a replica); the others wait in its FIFO
            # unseen by this method, and in the queue that mirrors it: the queue says which leave first
            ahead = self.queue.before(item)
            ranking.prune(set(self._queued))
        try:
            order = ranking.rank([(key, by_key[key].max_ongoing_requests) for key in by_key], "", request_id,
                                 waited, now, ahead)
        except Refused as refusal:
            assert pending_request is not None  # a request that has waited was handed in
            self._refuse(pending_request, str(refusal), refusal.retry_after_s)
            return [[replica] for replica in candidate_replicas[:1]]
        if pending_request is not None:
            # every replica was looked at: Ray's router backs off before asking again, instead of spinning
            pending_request.routing_context.should_backoff = True
        return [[by_key[key]] for key in order]

    def _get_pending_request_matching_metadata(self, request_metadata=None) -> PendingRequest | None:
        """The pending request a replica that a routing found goes to: the next of the gateway's queue (priority,
        then the least-served tenant, then first come) that still waits."""
        self._sync(time.time())
        while len(self.queue):
            item = self.queue.pop()
            if item is None:
                break
            pending = item.payload
            rid = pending.metadata.internal_request_id
            self._queued.pop(rid, None)
            if not pending.future.done():
                self._handed[rid] = item
                return pending
        return None

    def _sync(self, wall: float) -> None:
        """Queue the pending requests not queued yet, drop the entries of those that ended (cancelled: their clients
        left), and end those past the queue's TTL with 503. An entry left behind would count as ahead of every
        later arrival, and its tenant be charged for it."""
        for rid in [rid for rid, item in self._queued.items() if item.payload.future.done()]:
            self.queue.remove(self._queued.pop(rid))
        for rid in [rid for rid, item in self._handed.items() if item.deadline <= wall]:
            del self._handed[rid]  # routed long ago, or never: a try after its TTL is a new arrival
        for pending in getattr(self, "_pending_requests_to_fulfill", ()):
            rid = pending.metadata.internal_request_id
            if not pending.future.done() and rid not in self._queued:
                handed = self._handed.pop(rid, None)
                if handed is not None:  # Ray tries it again: back to its turn's head, not to the end of the queue
                    self.queue.push(handed, front=True)
                    self._queued[rid] = handed
                else:
                    self._enqueue(pending)
        for item in self.queue.expire(wall):
            pending = item.payload
            self._queued.pop(pending.metadata.internal_request_id, None)
            self._refuse(pending, f"waited {self._queue_ttl_s:g} s (the queue's TTL) for a replica with room", 1.0,
                         status=503)

    def _enqueue(self, pending: PendingRequest) -> Queued:
        """The request's entry in the queue, by its class (:func:`request_class`)."""
        priority, tenant = request_class(pending, *self._headers)
        item = Queued(priority, tenant, 1.0, pending.created_at, pending.created_at + self._queue_ttl_s,
                      payload=pending)
        self.queue.push(item)
        self._queued[pending.metadata.internal_request_id] = item
        return item

    def _refuse(self, pending_request: PendingRequest, reason: str, retry_after_s: float, status: int = 429) -> None:
        """Fail the request's routing with ``status``: Ray's proxy answers a BackPressureError with its status code
        and Retry-After, and a rank handed back with the request's future done ends its routing."""
        if not pending_request.future.done():
            pending_request.future.set_exception(_Refusal(reason, self.ranking.holding, self._max_queued,
                                                          math.ceil(retry_after_s), status))
        item = self._queued.pop(pending_request.metadata.internal_request_id, None)
        if item is not None:
            self.queue.remove(item)
        # Ray drops a request from its indices when it is fulfilled or cancelled; a refused one is neither
        drop = getattr(self, "_remove_pending_request_from_indices", None)
        if drop is not None:
            drop(pending_request)

    def on_request_routed(self, pending_request: PendingRequest, replica_id, result) -> None:
        self._handed.pop(pending_request.metadata.internal_request_id, None)
        self.ranking.routed(pending_request.metadata.internal_request_id, replica_id.unique_id, time.monotonic())

    def on_request_completed(self, replica_id, internal_request_id: str) -> None:
        self.ranking.ended(internal_request_id, replica_id.unique_id, time.monotonic())


_PRIORITY_NAME = PRIORITY_HEADER.encode("latin-1")


def request_class(pending: PendingRequest, priority_header: bytes, tenant_header: bytes) -> tuple[int, str]:
    """(priority, tenant) of a request Ray's HTTP proxy hands on, from its headers (0 and "" without them, and
    for a request from a deployment handle, which carries no HTTP scope). A priority header that is not an
    integer counts as 0 here, and the replica answers the request 400 (:class:`_NameReplica`): Ray's proxy
    answers a router's refusal only with 408, 429 or 503."""
    arg = pending.args[0] if pending.args else None
    if isinstance(arg, (bytes, bytearray)):
        try:  # Ray's proxy pickles the request it forwards (StreamingHTTPRequest: the ASGI scope)
            arg = pickle.loads(arg)
        except Exception:
            return 0, ""
    scope = getattr(arg, "asgi_scope", None) or getattr(arg, "_asgi_scope", None)
    headers = scope.get("headers", ()) if isinstance(scope, dict) else ()
    priority, tenant = 0, ""
    for name, value in headers:
        name = bytes(name).lower()
        if name == priority_header:
            try:
                priority = header_priority(bytes(value).decode("latin-1"))
            except ValueError:
                priority = 0
        elif name == tenant_header:
            tenant = bytes(value).decode("latin-1")[:256]
    return priority, tenant


class _Refusal(BackPressureError):
    """The router's refusal, as Ray's proxy answers it (its status, Retry-After) with the router's reason."""

    def __init__(self, reason: str, queued: int, max_queued: int, retry_after_s: float, status: int = 429) -> None:
        super().__init__(queued, max_queued, status, retry_after_s)
        self.reason = reason

    @property
    def message(self) -> str:
        return self.reason

    def __str__(self) -> str:
        return self.reason

    def __reduce__(self):
        return (_rebuild_refusal, (self.reason, *self.args))


def _rebuild_refusal(reason: str, queued: int, max_queued: int, status_code: int, retry_after_s: float):
    return _Refusal(reason, queued, max_queued, retry_after_s, status_code)


def build_app(config: ServeConfig, fleet: RayFleetConfig):
    """The Ray Serve application: ``fleet.replicas`` tidegate servers behind :class:`TidegateRouter`."""
    router_config = RequestRouterConfig(
        request_router_class=TidegateRouter,
        request_router_kwargs={"router": fleet.router, "ttft_slo_s": fleet.ttft_slo_s,
                               "report_period_s": fleet.report_period_s, "max_queued": fleet.max_queued,
                               "queue_ttl_s": fleet.queue_ttl_s},
        request_routing_stats_period_s=fleet.report_period_s,
        request_routing_stats_timeout_s=max(1.0, 4 * fleet.report_period_s),
        # a held request is looked at again soon: it waits for room, not for a backoff
        initial_backoff_s=0.01, backoff_multiplier=1.5, max_backoff_s=max(0.01, min(0.1, fleet.ttft_slo_s / 10)),
    )
    deployment = serve.deployment(TidegateReplica).options(
        name="tidegate", num_replicas=fleet.replicas,
        ray_actor_options={"num_cpus": fleet.cpus, "num_gpus": fleet.gpus},
        max_ongoing_requests=fleet.max_ongoing, max_queued_requests=fleet.max_queued,
        backpressure_config=BackpressureConfig(status_code=429, retry_after_s=fleet.retry_after_s),
        request_router_config=router_config,
        health_check_period_s=2.0, health_check_timeout_s=30.0,
        graceful_shutdown_timeout_s=config.drain_timeout_s,
    )
    return deployment.bind(config)


def start(config: ServeConfig, fleet: RayFleetConfig, num_cpus: int | None = None) -> None:
    """Start Ray (or join ``fleet.address``), Ray Serve's proxy on ``config.host:config.port`` and the
    application; returns once every replica serves.

    :param num_cpus: the CPUs a local Ray may use (None: the machine's)
    """
    import ray

    if not ray.is_initialized():
        if fleet.address is None:
            ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=True)
        else:
            ray.init(address=fleet.address, log_to_driver=True)
    # one proxy, on the head node: its router is the one that counts the fleet's queue and drain rate (a proxy on
    # every node would each admit as if the whole fleet drained its queue alone)
    serve.start(proxy_location="HeadOnly", http_options={"host": config.host, "port": config.port})
    serve.run(build_app(config, fleet), name=fleet.app_name, route_prefix="/", blocking=False)


def stop(fleet: RayFleetConfig) -> None:
    """Delete the application; on a local Ray, stop Ray Serve and Ray too (on a cluster, what else runs
    there is left running)."""
    import ray

    if not ray.is_initialized():
        return
    try:
        if fleet.address is None:
            serve.shutdown()
        else:
            serve.delete(fleet.app_name)
    finally:
        ray.shutdown()
