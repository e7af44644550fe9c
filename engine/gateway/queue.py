"""The gateway queue and its admission.

Requests wait here, not in the replicas, until a replica has room (late dispatch: a request queued
in a replica cannot move to the one that frees first). The queue serves priority levels in order
(lower first, as vLLM's ``priority``); within a level, tenants share by tokens (start-time fair
queuing on each request's estimated prompt and output tokens: the tenant that has been served the
fewest tokens goes next, and a tenant that comes back after a pause starts level with the others
instead of spending credit saved while idle); within a tenant, first come first served. A request
that waits longer than the TTL ends with 503 and says why.

**Admission.** An arrival with ``k`` requests of its level or more urgent ahead of it leaves the
queue after about ``(k + 1) / D`` seconds, ``D`` the fleet's measured rate of completions (each one
frees room for one request). It is admitted when that wait and the replicas' measured time from
dispatch to first byte for prompts of its size (within a factor of two) fit the TTFT SLO; otherwise it
gets 429 with a Retry-After of the time the queue needs to drain that far. An arrival with nothing
ahead while a replica has room is always admitted. Before 16 completions, and after 10 s without one,
``D`` is not trusted, and the queue holds at most one request per replica that is up. The worst
case: an admitted request waits in the queue at most the TTL, and the queue never holds more than
``D`` times the TTFT SLO while the rate holds, whatever the arrivals do.

The first byte is most of the SLO for a long prompt (its own prefill) and little of it for a short
one; a time pooled over every size let long prompts in to miss and refused short ones that would
have met it. So in overload the long prompts are refused first, as the TTFT SLO is one for all
sizes: an operator who wants them served gives them a more urgent priority (only the requests of
their level or more urgent count as ahead).
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from tidegate.engine.core.stats import RateEstimator, SlidingQuantile


#: the headers that give a request's tenant and priority level (the llm-d router's names)
TENANT_HEADER = "x-gateway-inference-fairness-id"
PRIORITY_HEADER = "x-gateway-inference-priority"
#: the most urgent and the least urgent priority a request may be given
PRIORITY_BOUND = 1 << 20


def clamp_priority(priority: int) -> int:
    """A request's priority within ``PRIORITY_BOUND``."""
    return max(-PRIORITY_BOUND, min(priority, PRIORITY_BOUND))


def header_priority(value: str) -> int:
    """The priority a header gives (surrounding whitespace allowed), within ``PRIORITY_BOUND``.

    :raises ValueError: it is not an integer.
    """
    return clamp_priority(int(value.strip()))


@dataclass(eq=False)
class Queued:
    """A request in the gateway queue.

    :param cost: its estimated tokens (prompt and output), what tenants are charged
    :param deadline: when it leaves the queue with 503 (``time.monotonic()``)
    :param ticket: the handler's wait for a replica: ``set_result`` hands it one (or None: the TTL ran out)
    """

    priority: int
    tenant: str
    cost: float
    arrived_at: float
    deadline: float
    #: what the router reads: the prompt's text (or the twin's content ids)
    prompt: Any = ""
    ticket: Any = None
    #: the twin's request
    payload: Any = None
    retries: int = 0
    #: the queue wait predicted at admission
    predicted_wait_s: float = 0.0
    #: its prompt's tokens, or an estimate (what its first byte is predicted by; None: not known)
    prompt_tokens: float | None = None
    #: the replicas that refused it (429 or 503) since it arrived
    refused_by: set[str] = field(default_factory=set)
    seq: int = field(default_factory=itertools.count().__next__)


class _Level:
    """One priority level: a queue per tenant and the tokens each has been served."""

    def __init__(self) -> None:
        self.tenants: dict[str, deque[Queued]] = {}
        self.served: dict[str, float] = {}

    def push(self, item: Queued, front: bool) -> None:
        q = self.tenants.get(item.tenant)
        if q is None:
            # a tenant that comes back starts level with the least-served tenant still waiting
            floor = self._floor()
            self.served[item.tenant] = max(self.served.get(item.tenant, 0.0), floor)
            q = self.tenants[item.tenant] = deque()
        if front:  # sent back (a replica turned it away): its tenant was charged when it left, and keeps its turn
            self.served[item.tenant] -= item.cost
            q.appendleft(item)
        else:
            q.append(item)

    def pop(self) -> Queued:
        tenant = min(self.tenants, key=lambda t: (self.served[t], self.tenants[t][0].seq))
        q = self.tenants[tenant]
        item = q.popleft()
        self.served[tenant] += item.cost
        if not q:
            del self.tenants[tenant]
            if len(self.served) > 2 * len(self.tenants) + 64:
                # a tenant not waiting whose count is at most the floor would come back at the floor anyway:
                # forgotten, so a client that names a new tenant each request does not grow this without bound
                floor = self._floor()
                self.served = {t: v for t, v in self.served.items() if t in self.tenants or v > floor}
        return item

    def _floor(self) -> float:
        return min((self.served[t] for t in self.tenants), default=0.0)

    def __len__(self) -> int:
        return sum(len(q) for q in self.tenants.values())


class GatewayQueue:
    """Priority levels, token-fair tenants within each, first come first served within a tenant."""

    def __init__(self) -> None:
        self._levels: dict[int, _Level] = {}
        self._count = 0

    def push(self, item: Queued, front: bool = False) -> None:
        """Queue ``item``; ``front``: at its tenant's head, its charge refunded (a request sent back by a replica, which
        left the queue before, keeps its turn)."""
        self._levels.setdefault(item.priority, _Level()).push(item, front)
        self._count += 1

    def peek_priority(self) -> int | None:
        return min((p for p, lv in self._levels.items() if lv.tenants), default=None)

    def pop(self) -> Queued | None:
        p = self.peek_priority()
        if p is None:
            return None
        self._count -= 1
        level = self._levels[p]
        item = level.pop()
        if not level.tenants:  # a level per priority ever seen would grow without bound
            del self._levels[p]
        return item

    def ahead(self, priority: int) -> int:
        """Requests that leave before a new arrival of ``priority``."""
        return sum(len(lv) for p, lv in self._levels.items() if p <= priority)

    def remove(self, item: Queued) -> bool:
        """Take ``item`` out without serving it (its tenant is not charged); False when it is not queued."""
        level = self._levels.get(item.priority)
        q = level.tenants.get(item.tenant) if level is not None else None
        if q is None or not any(x is item for x in q):
            return False
        q.remove(item)
        self._count -= 1
        if not q:
            del level.tenants[item.tenant]
            if not level.tenants:
                del self._levels[item.priority]
        return True

    def before(self, item: Queued) -> int:
        """Requests queued that leave before ``item`` (queued itself): those of more urgent levels, and those of its
        own level that came before it (its tenant's turn aside)."""
        return sum(len(lv) if p < item.priority else sum(x.seq < item.seq for q in lv.tenants.values() for x in q)
                   for p, lv in self._levels.items() if p <= item.priority)

    def expire(self, now: float) -> list[Queued]:
        """Takes out and returns the requests whose deadline has passed."""
        out = []
        for lv in self._levels.values():
            for tenant in list(lv.tenants):
                q = lv.tenants[tenant]
                keep = deque(x for x in q if x.deadline > now)
                if len(keep) != len(q):
                    out.extend(x for x in q if x.deadline <= now)
                    if keep:
                        lv.tenants[tenant] = keep
                    else:
                        del lv.tenants[tenant]
        self._count -= len(out)
        for p in [p for p, lv in self._levels.items() if not lv.tenants]:
            del self._levels[p]
        return out

    def next_deadline(self) -> float | None:
        return min((x.deadline for lv in self._levels.values() for q in lv.tenants.values() for x in q),
                   default=None)

    def __len__(self) -> int:
        return self._count


class DrainAdmission:
    """Admits an arrival when the queue ahead of it drains within the TTFT SLO (the module's docstring).

    The prediction is held to what recent requests saw: the 90th percentile of the replicas' time from
    dispatch to first byte (of prompts in the arrival's size class, a power of two, once 16 are known;
    else of all), and of how much longer than predicted requests waited in the queue, over the drain
    rate's window (``WINDOW_S``, and at least the last 64 of each). An admitted request is then
    predicted to meet the SLO nine times in ten, not one time in two. The window is one of time: 64
    samples span a tenth of a second of a fleet's 500 dispatches a second, and the queue, which keeps
    what was admitted, followed the low swings of percentiles that short (on short requests at 3 x
    the fleet's bound, 15% of the served requests missed the SLO, 6% over ten seconds).

    :param ttft_slo_s: the time to first token a client is promised
    :param budget_scale: the queue wait admitted is this multiple of what the SLO leaves after the first
        byte (1: the SLO's; below 1 refuses sooner, above later). The fleet env's agent sets it.
    """

    #: completions before the measured rate is trusted
    MIN_COMPLETIONS = 16
    #: the quantile of the first byte's time and of the queue's lateness the prediction is held to
    QUANTILE = 0.9
    #: samples the percentiles span at least, however old
    WINDOW = 64
    #: the drain rate's time constant; a rate whose last completion is older says nothing of now
    WINDOW_S = 10.0

    def __init__(self, ttft_slo_s: float, budget_scale: float = 1.0) -> None:
        self.ttft_slo_s = ttft_slo_s
        self.budget_scale = budget_scale
        self.drain = RateEstimator(self.WINDOW_S, min_events=self.MIN_COMPLETIONS)
        self.completions = 0
        self.last_completion_s = -math.inf
        self._first_byte = self._recent()
        self._late = self._recent()
        self._first_byte_by: dict[int, SlidingQuantile] = {}

    def _recent(self) -> SlidingQuantile:
        """The ``QUANTILE`` of the values of the drain rate's window (at least the last ``WINDOW``)."""
        return SlidingQuantile(self.QUANTILE, self.WINDOW_S, min_samples=self.WINDOW)

    def completed(self, now: float) -> None:
        self.drain.add(now)
        self.completions += 1
        self.last_completion_s = now

    def rate(self, now: float) -> float:
        """The drain rate in requests per second, or 0 while it is not trusted: before ``MIN_COMPLETIONS``
        completions, or after a silence longer than its window (an idle hour's rate is not the next burst's)."""
        if self.completions < self.MIN_COMPLETIONS or now - self.last_completion_s > self.WINDOW_S:
            return 0.0
        return self.drain.rate(now)

    def first_byte(self, seconds: float, now: float, prompt_tokens: float | None = None) -> None:
        """A replica's time from dispatch to a request's first byte, which came at ``now``."""
        self._first_byte.add(seconds, now)
        if prompt_tokens is not None:
            key = _size_class(prompt_tokens)
            q = self._first_byte_by.get(key)
            if q is None:
                q = self._first_byte_by[key] = self._recent()
            q.add(seconds, now)

    def first_byte_for(self, prompt_tokens: float | None) -> float:
        """The first byte's time admission counts for a prompt of ``prompt_tokens`` (None: of any size)."""
        if prompt_tokens is not None:
            q = self._first_byte_by.get(_size_class(prompt_tokens))
            if q is not None and len(q) >= self.MIN_COMPLETIONS:
                return q.value
        return self._first_byte.value

    def first_byte_by_size(self) -> dict[str, float]:
        """The first byte's time admission counts for each size class it has seen, by the class's prompt tokens
        (``"512-1023"``); a class with too few samples yet shows the pooled time it is judged by."""
        return {f"{1 << (k - 1)}-{(1 << k) - 1}": self.first_byte_for(1 << (k - 1))
                for k in sorted(self._first_byte_by)}

    def waited(self, predicted_s: float, waited_s: float, now: float) -> None:
        """A request left the queue at ``now`` after ``waited_s``; it was predicted to wait ``predicted_s``."""
        self._late.add(waited_s - predicted_s, now)

    @property
    def first_byte_s(self) -> float:
        return self._first_byte.value

    @property
    def late_s(self) -> float:
        """How much longer than predicted requests waited in the queue: the 90th percentile, at least 0."""
        return max(0.0, self._late.value)

    def predicted_wait_s(self, now: float, ahead: int) -> float:
        """The queue wait predicted for an arrival with ``ahead`` requests before it (0 while the rate is
        not trusted)."""
        rate = self.rate(now)
        return (ahead + 1) / rate if rate > 0.0 else 0.0

    def retry_after(self, now: float, ahead: int, replicas: int, room: bool,
                    prompt_tokens: float | None = None) -> float | None:
        """None admits an arrival with ``ahead`` requests before it; else the seconds to come back after.

        :param room: a replica has room now (an arrival with nothing ahead then leaves the queue at once)
        """
        if ahead == 0 and room:
            return None
        rate = self.rate(now)
        if rate <= 0.0:
            return None if ahead < replicas else self.ttft_slo_s
        wait = (ahead + 1) / rate + self.late_s
        budget = self.ttft_slo_s * self.budget_scale - self.first_byte_for(prompt_tokens)
        return None if wait <= budget else wait - max(budget, 0.0)


def _size_class(prompt_tokens: float) -> int:
    """Prompts within a factor of two of each other share a class."""
    return int(max(prompt_tokens, 1.0)).bit_length()
