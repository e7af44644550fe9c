"""The fleet twin: N simulated replicas behind the gateway's own code, on one virtual clock.

Each replica is the simulator's engine (``make_sim_engine``: the profile's step model, KV pool and
the replica's own controller). In front of them run the gateway's pieces exactly as the HTTP
gateway runs them: ``ReplicaView`` (gauges, in-flight counts, the concurrency limit), the routers,
``GatewayQueue`` and ``DrainAdmission``, all through the same ``Gate``. What the wire adds is
modelled: a one-way network delay between the gateway and a replica, and gauges that are only as
fresh as their last scrape.

The events run in time order: arrivals at the gateway, scrapes, requests reaching a replica and
replies reaching the gateway sit in one heap; between them the replica whose clock is earliest
steps (a stretch of steady decodes at once, as ``simulate`` does, never past the next event). A
request that reaches a replica mid-step joins its next step, as in a real engine.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tidegate.ctrl.base import Controller
from tidegate.engine.core.metrics import EngineMetrics
from tidegate.engine.core.profile import Profile
from tidegate.engine.core.request import Request, RequestState, unservable_reason
from tidegate.engine.gateway.gate import Gate
from tidegate.engine.gateway.queue import Queued
from tidegate.engine.gateway.replicas import ReplicaView
from tidegate.engine.gateway.routers import PrefixAffinity
from tidegate.engine.sim.simulate import make_request, make_sim_engine
from tidegate.engine.sim.steady import run_steady

_ARRIVE, _SCRAPE, _DELIVER, _REPLY = range(4)


@dataclass
class FleetSettings:
    """The gateway's settings in the twin (``tidegate gateway`` has the same ones) and the wire's."""

    router: str = "predicted-delay"
    admission: bool = True
    scrape_interval_s: float = 0.1
    stale_after_s: float = 2.0
    queue_ttl_s: float = 30.0
    #: one way, gateway to replica and back
    network_s: float = 0.001
    #: what an evicted request keeps in the replicas (``simulate --eviction``)
    eviction: str = "recompute"


def simulate_fleet(arrivals: Sequence, profile: Profile | Sequence[Profile], controllers: Sequence[Controller],
                   settings: FleetSettings | None = None, *, prefix_caching: bool = True, noise_seed: int = 0,
                   on_progress: Callable[[int], None] | None = None) -> dict:
    """Replay ``arrivals`` through a gateway in front of ``len(controllers)`` replicas of ``profile``.

    :param profile: every replica's profile, or one per replica (a fleet of unlike replicas: the first
        one's SLOs are the fleet's).
    :param controllers: each replica's own controller (reset first); one per replica.
    :returns: the fleet's summary (the keys ``simulate`` prints, over all replicas) with ``gateway``
        (its refusals, expiries and re-sends) and ``replicas`` (each one's figures).
    """
    fleet = FleetTwin(arrivals, profile, controllers, settings or FleetSettings(), prefix_caching, noise_seed)
    wall = time.perf_counter()
    fleet.run(on_progress)
    summary = fleet.summary()
    summary["wall_time_s"] = time.perf_counter() - wall
    return summary


class FleetTwin:
    """The fleet on its virtual clock: ``start``, ``advance`` to a time as often as wanted (the fleet env
    advances it one control interval at a time), then ``finish``. ``simulate_fleet`` runs it whole."""

    def __init__(self, arrivals, profile: Profile | Sequence[Profile], controllers, settings: FleetSettings,
                 prefix_caching: bool, noise_seed: int) -> None:
        profiles = [profile] * len(controllers) if isinstance(profile, Profile) else list(profile)
        if len(profiles) != len(controllers):
            raise ValueError(f"{len(profiles)} profiles for {len(controllers)} replicas")
        self.arrivals, self.s = arrivals, settings
        self.profile = profile = profiles[0]
        self.cores = []
        for i, (c, prof) in enumerate(zip(controllers, profiles)):
            c.reset()
            core = make_sim_engine(prof, c, record_steps=False, eviction=settings.eviction, keep_requests=False,
                                   noise_seed=noise_seed + i, prefix_caching=prefix_caching)
            self.cores.append(core)
        tpot = profile.tpot_slo_s if settings.admission else None
        self.gate = Gate([ReplicaView(f"replica-{i}", stale_after_s=settings.stale_after_s, tpot_slo_s=tpot)
                          for i in range(len(self.cores))], settings.router, settings.admission,
                         profile.ttft_slo_s, settings.scrape_interval_s)
        self.views, self.queue, self.admission = self.gate.views, self.gate.queue, self.gate.admission
        self._index = {id(v): i for i, v in enumerate(self.views)}
        self.metrics = EngineMetrics(record_steps=False, keep_requests=False)
        self.heap: list[tuple[float, int, int, object]] = []
        self._seq = itertools.count()
        self.dispatched_at: dict[str, float] = {}
        #: each replica's requests not yet started, whose first byte its view hears of (with admission on)
        self.starting: list[list[Request]] = [[] for _ in self.cores]
        self.rejected = self.expired = self.resent = 0
        self.refused_by_replica = [0] * len(self.cores)
        self.pending = 0  # arrivals not yet ended
        self.arrived = 0
        self._now = 0.0
        #: called with every request as it ends (served, refused or expired), for a caller that counts
        self.on_end: Callable[[Request], None] | None = None

    # ------------------------------------------------------------------------------- events
    def push(self, t: float, kind: int, payload: object = None) -> None:
        heapq.heappush(self.heap, (t, next(self._seq), kind, payload))

    def run(self, on_progress) -> None:
        self.start()
        self.advance(math.inf, on_progress)
        self.finish()

    def start(self) -> None:
        """Put every arrival on the heap, and the first scrape."""
        for i, a in enumerate(self.arrivals):
            self.push(a.arrival_time_s, _ARRIVE, i)
        self.pending = len(self.arrivals)
        if self.arrivals:
            self.push(self.arrivals[0].arrival_time_s, _SCRAPE)

    @property
    def now(self) -> float:
        """The time the fleet has run to: its last event's."""
        return self._now

    def advance(self, until: float, on_progress: Callable[[int], None] | None = None) -> bool:
        """Run every event and replica step that starts before ``until`` (a step may end after it).

        :returns: whether anything is left (events, or requests in a replica)
        """
        cores, heap = self.cores, self.heap
        while heap or any(c.has_unfinished for c in cores):
            t_event = heap[0][0] if heap else math.inf
            j, t_core = -1, math.inf
            for k, c in enumerate(cores):
                if c.has_unfinished:
                    now = c.clock.now()
                    if now < t_core:
                        j, t_core = k, now
            if min(t_event, t_core) >= until:
                self._now = max(self._now, until)
                return True
            if j >= 0 and t_core < t_event:
                self._step(j, min(t_event, until))
                continue
            t, _, kind, payload = heapq.heappop(heap)
            self._now = max(self._now, t)
            if kind == _ARRIVE:
                self._arrive(t, payload)
                self.arrived += 1
                if on_progress is not None and self.arrived % 1000 == 0:
                    on_progress(self.arrived)
            elif kind == _SCRAPE:
                self._scrape(t)
            elif kind == _DELIVER:
                self._deliver(t, *payload)
            else:
                self._reply(t, *payload)
        if math.isfinite(until):
            self._now = max(self._now, until)
        return False

    def finish(self) -> None:
        """Bring every replica's clock and figures up to date (after the last ``advance``)."""
        for c in self.cores:
            c.sync()

    def _step(self, j: int, until: float) -> None:
        core, view = self.cores[j], self.views[j]
        start = core.clock.now()
        ended = run_steady(core, until)
        steps = core.steady_steps
        if not steps:
            ended = core.step(False)
            steps = 1
        end = core.clock.now()
        if core.running and end > start:
            view.tokens_streamed(end, (end - start) / steps, 1)
        starting = self.starting[j]
        if starting:
            waiting = []
            for r in starting:
                first = r.first_token_time_s
                if first is None and not r.state.is_terminal:
                    waiting.append(r)
                elif first is not None and r.request_id in self.dispatched_at:
                    view.first_byte(self.dispatched_at[r.request_id], first + self.s.network_s)
            self.starting[j] = waiting
        for r in ended:
            self.push(end + self.s.network_s, _REPLY, (j, r))

    def _arrive(self, t: float, i: int) -> None:
        a = self.arrivals[i]
        request = make_request(i, a)
        self.metrics.on_arrival(request)
        item = Queued(0, "", a.prompt_tokens + a.max_tokens, t, t + self.s.queue_ttl_s, prompt=_prefix_key(request),
                      payload=request, predicted_wait_s=self.gate.predicted_wait_s(0, t), prompt_tokens=a.prompt_tokens)
        if self.gate.admit(item.priority, t, a.prompt_tokens) is not None:
            self.rejected += 1
            self._end(request, RequestState.REJECTED, t)
            return
        self.queue.push(item)
        self._dispatch(t)

    def _scrape(self, t: float) -> None:
        for core, view in zip(self.cores, self.views):
            view.scraped(t, {"waiting": float(len(core.waiting)), "running": float(len(core.running)),
                             "kv_usage": core.pool.used_tokens / core.pool.capacity_tokens,
                             "preemptions": float(core.metrics.evictions)})
        self._dispatch(t)
        if self.pending:
            self.push(t + self.s.scrape_interval_s, _SCRAPE)

    def _dispatch(self, t: float) -> None:
        self.gate.dispatch(t, lambda item, view: self._send(item, view, t), lambda item: self._expire(item, t))

    def _send(self, item: Queued, view: ReplicaView, t: float) -> None:
        self.dispatched_at[item.payload.request_id] = t
        self.push(t + self.s.network_s, _DELIVER, (self._index[id(view)], item))

    def _expire(self, item: Queued, t: float) -> None:
        self.expired += 1
        self._end(item.payload, RequestState.EXPIRED, t)

    def _deliver(self, t: float, j: int, item: Queued) -> None:
        core = self.cores[j]
        if not core.has_unfinished and core.clock.now() < t:
            core.clock.advance_to(t)
        request: Request = item.payload
        # the replica's clock starts at its own receipt, as a real replica's does: what it measures (its TTFT and
        # the errors of its predictions, its queue timeout) holds no time spent in the gateway; the fleet's figures
        # count from the gateway's arrival again when the reply comes back
        request.arrival_time_s = t
        if core.add_request(request) is not None:  # the replica's own controller refused it
            self.refused_by_replica[j] += 1
            self.push(t + self.s.network_s, _REPLY, (j, request))
        elif self.s.admission:
            self.starting[j].append(request)

    def _reply(self, t: float, j: int, request: Request) -> None:
        view = self.views[j]
        request.arrival_time_s = self.arrivals[int(request.request_id)].arrival_time_s
        dispatched = self.dispatched_at.pop(request.request_id, t)
        finished = request.state is RequestState.FINISHED
        view.ended(t, completed=finished, lifetime_s=t - dispatched)
        if finished:
            self.admission.completed(t)
            if request.first_token_time_s is not None:
                self.admission.first_byte(max(0.0, request.first_token_time_s - dispatched), t, request.prompt_len)
            self._count(request)
        elif request.state is RequestState.REJECTED and self.s.admission and unservable_reason(
                request.prompt_len, request.max_tokens, self.cores[j].pool.capacity_tokens) is None:
            # refused before it started: back to its turn at the head of the queue, for another replica
            view.refused(t)
            self.resent += 1
            a = self.arrivals[int(request.request_id)]
            fresh = make_request(int(request.request_id), a)
            self.queue.push(Queued(0, "", a.prompt_tokens + a.max_tokens, a.arrival_time_s,
                                   a.arrival_time_s + self.s.queue_ttl_s, prompt=_prefix_key(fresh), payload=fresh,
                                   retries=1),
                            front=True)
        else:
            self._count(request)
        self._dispatch(t)

    def _end(self, request: Request, state: RequestState, t: float) -> None:
        request.state = state
        request.finish_time_s = t
        self._count(request)

    def _count(self, request: Request) -> None:
        if self.on_end is not None:
            self.on_end(request)
        self.metrics.on_terminal(request)
        self.metrics.last_time_s = max(self.metrics.last_time_s, request.finish_time_s or 0.0)
        self.pending -= 1

    # ------------------------------------------------------------------------------- figures
    def summary(self) -> dict:
        p = self.profile
        per = [c.metrics.summary(c.pool.capacity_tokens, p.ttft_slo_s, p.tpot_slo_s, final_waiting=len(c.waiting))
               for c in self.cores]
        m = self.metrics
        for key in ("steps", "evictions", "wasted_tokens", "prefill_tokens", "cached_prompt_tokens"):
            setattr(m, key, sum(getattr(c.metrics, key) for c in self.cores))
        m.busy_time_s = sum(c.metrics.busy_time_s for c in self.cores)
        m.kv_time_product = sum(c.metrics.kv_time_product for c in self.cores)
        m.kv_sq_time_product = sum(c.metrics.kv_sq_time_product for c in self.cores)
        m.kv_peak_tokens = max((c.metrics.kv_peak_tokens for c in self.cores), default=0)
        capacity = sum(c.pool.capacity_tokens for c in self.cores)
        out = m.summary(capacity // max(len(self.cores), 1), p.ttft_slo_s, p.tpot_slo_s)
        out["kv_capacity_tokens"] = capacity
        out["gateway"] = {"router": self.s.router, "admission": self.s.admission, "rejected": self.rejected,
                          "expired": self.expired, "resent": self.resent}
        router = self.gate.router
        if isinstance(router, PrefixAffinity):
            out["gateway"].update(affinity_hits=router.hits, affinity_yielded=router.yielded)
        out["replicas"] = [{"served": s["completed"], "goodput_rps": s["goodput_rps"],
                            "ttft_p50_s": s["ttft_p50_s"], "ttft_p99_s": s["ttft_p99_s"],
                            "tpot_p50_s": s["tpot_p50_s"], "prefill_tokens": s["prefill_tokens"],
                            "cached_prompt_tokens": s["cached_prompt_tokens"], "refused": self.refused_by_replica[i],
                            "kv_usage_mean": s["kv_usage_mean"], "final_limit": round(self.views[i].limit, 2)}
                           for i, s in enumerate(per)]
        return out


def _prefix_key(request: Request):
    """What the prefix-affinity router hashes: the request's prefix content ids (block hashes of a
    Mooncake trace, a conversation's shared turns), else nothing."""
    prefix = request.prefix
    return tuple(prefix[0]) if prefix else ""
