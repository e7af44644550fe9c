"""Which replica takes a request: one of the candidates the gateway hands over (the replicas with room,
or every replica that is up when admission is off).

- ``round-robin`` and ``least-loaded``: the baselines.
- ``power-of-two``: the less loaded of two drawn at random (Ray Serve's default).
- ``predicted-delay``: the soonest predicted end, from each replica's load and its measured rate
  of completions.
- ``prefix-affinity``: the replica that served the longest run of the prompt's leading blocks, from
  an approximate index of the gateway's own routing history; it yields to load when that replica
  holds clearly more than the least loaded one (SGLang's router's rule: more than 1.5 times and more
  than ``imbalance`` requests above it).
"""

from __future__ import annotations

import hashlib
import random
from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

from tidegate.engine.gateway.replicas import ReplicaView


class Router(Protocol):
    def pick(self, candidates: Sequence[ReplicaView], prompt, now: float) -> ReplicaView:
        """One of ``candidates`` (never empty) for a request of ``prompt`` (its text, or the twin's
        content ids)."""
        ...


class RoundRobin:
    def __init__(self) -> None:
        self._next = 0

    def pick(self, candidates: Sequence[ReplicaView], prompt: str, now: float) -> ReplicaView:
        choice = candidates[self._next % len(candidates)]
        self._next += 1
        return choice


def _least_loaded(candidates: Sequence[ReplicaView], now: float) -> ReplicaView:
    return min(candidates, key=lambda r: (r.load(now), r.in_flight))


class LeastLoaded:
    def pick(self, candidates: Sequence[ReplicaView], prompt: str, now: float) -> ReplicaView:
        return _least_loaded(candidates, now)


class PowerOfTwo:
    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def pick(self, candidates: Sequence[ReplicaView], prompt: str, now: float) -> ReplicaView:
        if len(candidates) == 1:
            return candidates[0]
        return _least_loaded(self._rng.sample(list(candidates), 2), now)


class PredictedDelay:
    """The soonest predicted end: by Little's law a request joining a replica that holds ``L``
    requests and completes ``rate`` a second stays about ``(L + 1) / rate``, so the fleet's load
    splits in proportion to each replica's measured speed. A replica with no completion measured yet
    is counted at the slowest measured one's speed, so it is tried but not flooded."""

    def pick(self, candidates: Sequence[ReplicaView], prompt: str, now: float) -> ReplicaView:
        rates = [r.completion_rate(now) for r in candidates]
        measured = [x for x in rates if x > 0]
        if not measured:
            return _least_loaded(candidates, now)
        slowest = min(measured)

        def sojourn(i: int) -> tuple[float, int]:
            r = candidates[i]
            return (r.load(now) + 1.0) / (rates[i] or slowest), r.in_flight

        return candidates[min(range(len(candidates)), key=sojourn)]


class PrefixAffinity:
    """Routes a prompt to the replica that took the longest run of its leading blocks before.

    :param block_chars: characters a block of the index covers (the gateway does not tokenize)
    :param capacity: block hashes the index remembers, least recently used forgotten first
    :param imbalance: requests above the least loaded replica a warm one may hold and still be chosen
    """

    def __init__(self, block_chars: int = 256, capacity: int = 200_000, imbalance: int = 4) -> None:
        self.block_chars = block_chars
        self.capacity = capacity
        self.imbalance = imbalance
        self._index: OrderedDict[object, str] = OrderedDict()
        #: requests routed to the replica of their longest match, and those that yielded to load
        self.hits = self.yielded = 0

    def block_hashes(self, prompt: str | tuple) -> list:
        """Chained hashes of the prompt's full blocks: a block's hash stands for every block before it.
        A tuple is a prompt already in blocks (the twin's content ids), one id a block."""
        if isinstance(prompt, tuple):
            out_ids, h = [], 0
            for block in prompt:
                h = hash((h, block))
                out_ids.append(h)
            return out_ids
        out, prev = [], b""
        data = prompt.encode("utf-8", "surrogatepass")
        for start in range(0, len(data) - self.block_chars + 1, self.block_chars):
            prev = hashlib.blake2b(prev + data[start:start + self.block_chars], digest_size=16).digest()
            out.append(prev)
        return out

    def pick(self, candidates: Sequence[ReplicaView], prompt: str, now: float) -> ReplicaView:
        hashes = self.block_hashes(prompt)
        by_name = {r.name: r for r in candidates}
        warm = None
        for h in reversed(hashes):  # the longest match first
            name = self._index.get(h)
            if name is not None and name in by_name:
                warm = by_name[name]
                break
        least = _least_loaded(candidates, now)
        choice = least
        if warm is not None:
            low, high = least.load(now), warm.load(now)
            if high <= low + self.imbalance or high <= 1.5 * low:
                choice = warm
                self.hits += 1
            else:
                self.yielded += 1
        for h in hashes:
            self._index[h] = choice.name
            self._index.move_to_end(h)
        while len(self._index) > self.capacity:
            self._index.popitem(last=False)
        return choice


ROUTERS = {
    "round-robin": RoundRobin,
    "least-loaded": LeastLoaded,
    "power-of-two": PowerOfTwo,
    "predicted-delay": PredictedDelay,
    "prefix-affinity": PrefixAffinity,
}


#: the routers that need no prompt (Ray Serve's router is handed the HTTP request before its body is read)
PROMPT_FREE_ROUTERS = tuple(name for name in ROUTERS if name != "prefix-affinity")


def make_router(name: str) -> Router:
    try:
        return ROUTERS[name]()
    except KeyError:
        raise ValueError(f"unknown router {name!r}; one of {', '.join(ROUTERS)}") from None
