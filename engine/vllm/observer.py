"""vLLM's state and steps into tidegate's ObservationStats: the numbers a controller sees.

The scheduler tells the observer what vLLM did (an arrival, a step scheduled, a step's outputs
committed, a request finished) and the observer turns it into the engine events of
``ObservationStats``, exactly as tidegate's own ``EngineCore`` reports them, so a controller sees
the same figures whichever engine it runs in. It reads vLLM's ``Request`` objects (``arrival_time``,
``num_prompt_tokens``, ``num_tokens``, ``num_computed_tokens``, ``num_output_tokens``,
``max_tokens``, ``status``) and the ``SchedulerOutput`` of each step; it never changes them.
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass
from typing import Any

from tidegate.ctrl.base import LEADING_OUTPUTS, Observation, ReplicaProfile
from tidegate.ctrl.slo_flow import predicted_ttft_s
from tidegate.engine.core.request import Request, RequestState
from tidegate.engine.core.stats import ObservationStats
from tidegate.engine.vllm.step_log import StepRow


@dataclass(slots=True)
class _Tracked:
    """What the observer keeps of one request, on its own clock."""

    arrival_s: float
    predicted_ttft_s: float
    first_token_s: float | None = None


class VllmObserver:
    """Feeds an :class:`ObservationStats` from a vLLM scheduler's requests and steps.

    :param kv_capacity_tokens: the KV cache's capacity in tokens.
    :param block_size: tokens per KV block.
    :param rate_window_s: the stats' rate window (``tidegate.engine.core.builder.rate_window_s``).
    :param profile: the replica's profile, for the TTFT predictions' compute bound on prefill (as
        ``EngineCore``'s ``ttft_profile``).
    """

    def __init__(self, kv_capacity_tokens: int, block_size: int, rate_window_s: float,
                 profile: ReplicaProfile | None = None) -> None:
        self.stats = ObservationStats(kv_capacity_tokens, block_size, rate_window_s)
        self.profile = profile
        self.kv_capacity_tokens = kv_capacity_tokens
        # the observer's clock: monotonic seconds since start-up; vLLM stamps arrivals with time.time()
        self._mono0 = time.monotonic()
        self._wall0 = time.time()
        self._tracked: dict[str, _Tracked] = {}
        self._awaiting_first: set[str] = set()
        self.evicted_last_step = 0
        #: the token budget last applied, for the arrivals' TTFT predictions
        self.token_budget = 8192
        self.running_cap: float = math.inf  # the applied running cap (the TTFT prediction's slots)

    def now(self) -> float:
        return time.monotonic() - self._mono0

    # ------------------------------------------------------------------ events
    def arrived(self, request: Any) -> None:
        """A request entered vLLM's queue (the API process admitted it)."""
        stats, prompt = self.stats, request.num_prompt_tokens
        stats.settle_arrival_rates()  # no observation follows the arrival: keep the last one's rates
        arrival = min(request.arrival_time - self._wall0, self.now())
        stats.arrived(arrival, prompt, not self._tracked)
        stats.admitted(prompt, True)
        predicted = predicted_ttft_s(stats.current, prompt, self.token_budget, running_cap=self.running_cap,
                                     profile=self.profile)
        self._tracked[request.request_id] = _Tracked(arrival, predicted)
        self._awaiting_first.add(request.request_id)

    def refused(self, prompt_tokens: int) -> None:
        """The API process refused an arrival (it never entered vLLM's queue)."""
        stats = self.stats
        stats.settle_arrival_rates()
        stats.arrived(self.now(), prompt_tokens, not self._tracked)
        stats.admitted(prompt_tokens, False)
        stats.refused()

    def observe(self, step_index: int, waiting: Any, holding: Any, running: list, kv_usage: float) -> Observation:
        """The state at the start of a step into the stats; returns the controller's fresh copy.

        :param waiting: vLLM's waiting queue; ``holding``: its queue of waiting requests that hold
            KV blocks (scheduled before ``waiting``).
        :param kv_usage: ``kv_cache_manager.usage``, the share of KV blocks in use.
        """
        now = self.now()
        kv_used = round(kv_usage * self.kv_capacity_tokens)
        queued = 0
        for queue in (holding, waiting):
            for r in queue:
                queued += r.num_tokens - r.num_computed_tokens
        head = holding.peek_request() if holding else waiting.peek_request() if waiting else None
        prompts = least = 0
        outs = []
        for r in running:
            prompts += r.num_prompt_tokens
            out = r.num_output_tokens
            outs.append(out)
            if out and (out < least or not least):  # the least of those with a token (as the engine's)
                least = out
        leading = tuple(heapq.nlargest(LEADING_OUTPUTS, outs))  # the most advanced first
        stats = self.stats
        stats.observe(now, step_index, kv_used, len(waiting) + len(holding), len(running), queued, prompts,
                      head.num_prompt_tokens if head is not None else 0, self.evicted_last_step,
                      leading[0] if leading else 0, stats.outputs.short_above(least), leading)
        stats.step_started(kv_used)
        return stats.snapshot()

    def scheduled(self, output: Any, requests: dict, running: list, row: StepRow) -> None:
        """A step was scheduled (``output``: its ``SchedulerOutput``); fills ``row``'s batch columns."""
        decode_kv = 0
        for req_id, n in output.num_scheduled_tokens.items():
            r = requests[req_id]
            after = r.num_computed_tokens  # advanced by the step already
            before = after - n
            row.kv_tokens_read += after
            out = r.num_output_tokens
            if out and before >= r.num_tokens - 1:  # it feeds its last sampled token (and spec tokens)
                decode_kv += after
                row.decode_tokens += n
                row.decodes += 1
                row.first_decodes += out == 1
            else:
                row.prefill_tokens += n
                row.prefills += 1
                row.prefill_pairs += n * before + n * (n + 1) // 2
        row.tokens = output.total_num_scheduled_tokens
        row.requests = len(output.num_scheduled_tokens)
        row.cached_tokens = sum(new.num_computed_tokens for new in output.scheduled_new_reqs)
        cached = output.scheduled_cached_reqs
        if cached.resumed_req_ids:
            row.cached_tokens += sum(c for req_id, c in zip(cached.req_ids, cached.num_computed_tokens)
                                     if req_id in cached.resumed_req_ids)
        preempted = len(output.preempted_req_ids or ())
        row.preempted = preempted
        self.evicted_last_step = preempted
        stats = self.stats
        for _ in range(preempted):
            stats.evicted()
        stats.decodes_read(decode_kv)
        # what the running requests still have to prefill after this step
        stats.prefill_pending(sum(max(r.num_tokens - r.num_computed_tokens, 0) for r in running))

    def committed(self, output: Any, requests: dict, duration_s: float) -> None:
        """A step's outputs were committed after ``duration_s``: its first tokens and its time."""
        awaiting = self._awaiting_first
        if awaiting:
            now = self.now()
            for req_id in output.num_scheduled_tokens:
                if req_id in awaiting:
                    r = requests.get(req_id)
                    if r is not None and r.num_output_tokens:
                        self._first_token(req_id, now)
        self.stats.step_ended(duration_s, output.total_num_scheduled_tokens)

    def _first_token(self, req_id: str, now: float) -> None:
        self._awaiting_first.discard(req_id)
        t = self._tracked.get(req_id)
        if t is not None:
            t.first_token_s = now
            self.stats.first_token(now, now - t.arrival_s - t.predicted_ttft_s, t.predicted_ttft_s)

    def finished(self, request: Any, completed: bool) -> Request | None:
        """``request`` reached a terminal state (``completed``: it stopped or hit its length, rather
        than being aborted); returns it as a tidegate ``Request`` for the runtime guard."""
        req_id, out = request.request_id, request.num_output_tokens
        t = self._tracked.pop(req_id, None)
        if t is None:
            return None
        now = self.now()
        if req_id in self._awaiting_first:
            self._awaiting_first.discard(req_id)
            if out:  # its first token was its last
                t.first_token_s = now
                self.stats.first_token(now, now - t.arrival_s - t.predicted_ttft_s, t.predicted_ttft_s)
        prompt = request.num_prompt_tokens
        ended = Request(req_id, t.arrival_s, prompt, max(int(request.max_tokens), 1))
        ended.num_output_tokens = out
        ended.first_token_time_s = t.first_token_s
        ended.finish_time_s = now
        if completed and t.first_token_s is not None:
            ttft = t.first_token_s - t.arrival_s
            tpot = (now - t.first_token_s) / (out - 1) if out > 1 else None
            self.stats.completed(now, prompt, out, ttft, tpot)
            ended.state = RequestState.FINISHED
        else:
            ended.state = RequestState.CANCELLED
        return ended
