"""The decodes an engine counts in aggregate: running requests that decode one token a step.

With an executor that reads only a batch's counts (``reads_requests = False``, the simulator's),
a request that has started to decode is counted here, its decodes "steady", until it ends, is
evicted or the decodes must rotate. A step's bookkeeping then grows with the requests that start,
end, prefill or need a KV block in it, not with the running set; the schedule is exactly the one
per-request bookkeeping gives, and only the steady requests' token counts lag until ``sync``.

A steady request's output length is ``tick - decode_lag``: every step whose batch holds the steady
decodes advances the tick, and a steady request decodes in every such step. Its end and the ticks
at which it needs a KV block are known when it joins (``ends``, ``blocks``). The scheduler keeps
this bookkeeping exact for any executor; the simulator's fast path (``tidegate.engine.sim.steady``)
runs whole stretches of steady steps from it.
"""

from __future__ import annotations

from heapq import heapify, heappop, heappush, nlargest
from typing import Iterable

from tidegate.ctrl.base import UNLIMITED
from tidegate.engine.core.request import Request, RequestState

_RUNNING = RequestState.RUNNING


class SteadyDecodes:
    """The steady decodes of one engine, for a pool of ``block_size``-token blocks."""

    __slots__ = ("block_size", "count", "base", "tick", "ends", "blocks", "first", "_low_lags", "_high_lags",
                 "_lags_kept")

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        #: running requests in steady decode
        self.count = 0
        #: their sum of ``prompt_len - decode_lag``: they hold ``base + count * tick`` tokens
        self.base = 0
        #: decode tick: steps whose batch held the steady decodes
        self.tick = 0
        #: heap of (tick it ends at, activation_seq, request)
        self.ends: list[tuple[int, int, Request]] = []
        #: steady requests by the tick, modulo the block size, at which their next token starts a block
        self.blocks: list[list[Request]] = [[] for _ in range(block_size)]
        #: (tick, steady requests that joined at it with one output token: their next decode is the first)
        self.first = (0, 0)
        # heaps of (lag, seq, request) and (-lag, seq, request): the most and the least output among the
        # steady decodes (``outputs``); an entry outlives its request's time in steady decode, as in ``ends``.
        # Kept from the first call of ``outputs`` on: an engine whose controller never asks pays nothing
        self._low_lags: list[tuple[int, int, Request]] = []
        self._high_lags: list[tuple[int, int, Request]] = []
        self._lags_kept = False

    def join(self, requests: Iterable[Request]) -> bool:
        """Count the requests among ``requests`` that now decode (running, their sequence computed
        but for the last token, at least one output token); returns whether any joined."""
        tick, bs = self.tick, self.block_size
        joined = False
        for r in requests:
            if r.state is not _RUNNING or r.decode_lag is not None:
                continue
            out = r.num_output_tokens
            if not out or r.num_computed_tokens + 1 != r.prompt_len + out:
                continue  # prefilling still
            lag = tick - out
            r.decode_lag = lag
            self.count += 1
            self.base += r.prompt_len - lag
            heappush(self.ends, (end_tokens(r) + lag, r.activation_seq, r))
            if self._lags_kept:
                heappush(self._low_lags, (lag, r.activation_seq, r))
                heappush(self._high_lags, (-lag, r.activation_seq, r))
            if out == 1:  # its next decode is its first (Batch.first_decodes)
                fresh_tick, fresh = self.first
                self.first = (tick, fresh + 1 if fresh_tick == tick else 1)
            # its tokens start blocks at ticks t with prompt_len + t - lag = 1 modulo the block size
            self.blocks[(1 + lag - r.prompt_len) % bs].append(r)
            joined = True
        return joined

    def advance(self) -> list[Request] | None:
        """Every steady request decoded one token: advance the tick. Returns None when no end was
        due, else the requests that end now, in activation order (the caller ends them)."""
        self.tick = tick = self.tick + 1
        heap = self.ends
        if not heap or heap[0][0] > tick:
            return None
        return due(heap, tick)

    def leave(self, r: Request) -> None:
        """Take ``r`` out of the steady decodes, its token counts made current."""
        lag = r.decode_lag
        assert lag is not None
        out = self.tick - lag
        r.num_output_tokens = out
        r.num_computed_tokens = r.prompt_len + out - 1
        r.decode_lag = None
        self.count -= 1
        self.base -= r.prompt_len - lag
        fresh_tick, fresh = self.first
        if out == 1 and fresh_tick == self.tick:
            self.first = (fresh_tick, fresh - 1)
        self.blocks[(1 + lag - r.prompt_len) % self.block_size].remove(r)

    def outputs(self, tick: int) -> tuple[int, int]:
        """The most and the least output of the steady decodes (there must be some) at decode ``tick``."""
        low, high = self._low_lags, self._high_lags
        if not self._lags_kept or len(low) > 2 * self.count + 64:  # built, or rid of entries that left
            self._lags_kept = True
            low.clear()
            for _, seq, r in self.ends:  # every steady decode has one entry there
                lag = r.decode_lag
                if lag is not None and r.activation_seq == seq and r.state is _RUNNING:
                    low.append((lag, seq, r))
            heapify(low)
            high[:] = [(-lag, seq, r) for lag, seq, r in low]
            heapify(high)
        lag, seq, r = low[0]
        while r.decode_lag != lag or r.activation_seq != seq or r.state is not _RUNNING:
            heappop(low)
            lag, seq, r = low[0]
        most = tick - lag
        lag, seq, r = high[0]
        while r.decode_lag != -lag or r.activation_seq != seq or r.state is not _RUNNING:
            heappop(high)
            lag, seq, r = high[0]
        return most, tick + lag

    def sync(self, running: Iterable[Request]) -> None:
        """Write the current token counts into the steady requests among ``running``."""
        tick = self.tick
        for r in running:
            lag = r.decode_lag
            if lag is not None:
                out = tick - lag
                r.num_output_tokens = out
                r.num_computed_tokens = r.prompt_len + out - 1

    def dissolve(self, running: Iterable[Request]) -> None:
        """Stop counting any of ``running`` (the running set) in aggregate, their counts made current."""
        if self.count:
            self.sync(running)
        for r in running:
            r.decode_lag = None
        self.count = self.base = 0
        self.ends = []
        self.first = (0, 0)
        self._low_lags = []
        self._high_lags = []
        for blocks in self.blocks:
            blocks.clear()


def due(heap: list[tuple[int, int, Request]], tick: int) -> list[Request]:
    """Pop the entries of ``heap`` due by ``tick``; the requests they still stand for (an entry
    outlives its request's time in steady decode: ended, evicted or re-activated ones are skipped)."""
    found = []
    while heap and heap[0][0] <= tick:
        _, seq, r = heappop(heap)
        if r.decode_lag is not None and r.activation_seq == seq and r.state is _RUNNING:
            found.append(r)
    return found


def end_tokens(r: Request) -> int:
    """The output length at which ``r`` ends for certain: ``max_tokens``, or the target length."""
    target = r.target_output_len
    return target if target is not None and target < r.max_tokens else r.max_tokens


def running_outputs(steady: SteadyDecodes, explicit: list[Request], tick: int) -> tuple[int, int]:
    """The most and the least output tokens of the running requests ((0, 0) when none runs): the
    ``steady`` decodes' from their lags at decode ``tick``, the others' (``explicit``) one by one."""
    most, least = steady.outputs(tick) if steady.count else (0, UNLIMITED)
    for r in explicit:
        out = r.num_output_tokens
        if out > most:
            most = out
        if 0 < out < least:
            least = out
    return most, least if least < UNLIMITED else 0


def leading_outputs(steady: SteadyDecodes, explicit: list[Request], tick: int, k: int) -> tuple[int, ...]:
    """The outputs of the ``k`` most advanced running requests at most, most first: the steady decodes'
    from the least lags of their heap (``outputs`` must have been called at ``tick``: it keeps the heap),
    walked from its root so that only the entries it returns and the stale ones among them are read, the
    others' (``explicit``) one by one."""
    outs = [r.num_output_tokens for r in explicit]
    low = steady._low_lags
    if steady.count and low:
        want = min(k, steady.count)
        found = 0
        frontier = [(low[0], 0)]
        while frontier and found < want:
            (lag, seq, r), i = heappop(frontier)
            if r.decode_lag == lag and r.activation_seq == seq and r.state is _RUNNING:
                outs.append(tick - lag)
                found += 1
            for j in (2 * i + 1, 2 * i + 2):
                if j < len(low):
                    heappush(frontier, (low[j], j))
    return tuple(nlargest(k, outs))
