"""The step's plan: which decodes and prefill chunks a step runs within its token budget.

A fresh :class:`Batch` per step (``executor.Batch``: one comment per field), built from the
scheduler's running requests: the decodes first (steady ones counted, the others listed, rotated
from step to step when they alone exceed the budget), then prefill chunks in activation order.
"""

from __future__ import annotations

from typing import Callable

from tidegate.engine.core.clock import Clock
from tidegate.engine.core.executor import Batch
from tidegate.engine.core.request import Request
from tidegate.engine.core.stats import ObservationStats
from tidegate.engine.core.steady_decodes import SteadyDecodes


class Planner:
    """The part of the scheduler (``scheduler.Scheduler``, its subclass) that builds each step's plan
    from the running requests."""

    clock: Clock
    stats: ObservationStats
    on_token: Callable[[Request, int | None], None] | None
    #: the executor reads the batch's requests, not only its counts (``Executor``)
    lists_requests: bool
    #: the running requests, in activation order
    running: list[Request]
    #: running requests whose decodes are not counted in aggregate, in activation order
    explicit: list[Request]
    steady: SteadyDecodes
    #: the last plan served only some of the decodes
    rotating: bool
    #: round-robin start of the decodes served when the budget cuts them
    decode_offset: int

    def build_batch(self, token_budget: int, late_after_s: float | None = None) -> Batch:
        """Decodes (a request with one token pending and an output token to feed), then prefill
        chunks of the other requests' pending tokens (the prompt, or after an eviction the prompt
        and the kept output), never more than ``token_budget`` tokens in all. When the decodes
        alone exceed the budget, which of them run rotates from step to step.

        Prefill chunks go in activation order; with ``late_after_s``, requests still without a
        first token that many seconds after their arrival (late: their TTFT SLO is missed
        whatever happens next) come after the others, in activation order among themselves.

        Steady decodes are counted, not listed: ``batch.num_decodes`` includes them, and
        ``batch.requests`` starts with the listed decodes (none while any decode is steady)."""
        batch = Batch()
        prefilling = self._add_decodes(batch, token_budget)
        n_decodes = batch.num_decodes
        left = token_budget - n_decodes
        if late_after_s is not None and len(prefilling) > 1:
            cutoff_s = self.clock.now() - late_after_s
            prefilling.sort(key=lambda r: r.first_token_time_s is None and r.arrival_time_s < cutoff_s)
        reqs, counts = batch.requests, batch.num_new_tokens
        kv_read = 0
        pending = 0
        prefill = 0
        pairs = 0
        for r in prefilling:
            chunk = r.prompt_len + r.num_output_tokens - r.num_computed_tokens
            pending += chunk
            if left <= 0:
                continue
            if chunk > left:
                chunk = left
            reqs.append(r)
            counts.append(chunk)
            kv_read += r.num_computed_tokens + chunk
            pairs += chunk * r.num_computed_tokens + chunk * (chunk + 1) // 2
            left -= chunk
            prefill += chunk
        batch.num_tokens = n_decodes + prefill
        batch.num_prefills = len(reqs) - (n_decodes - self.steady.count)
        batch.prefill_pairs = pairs
        self.stats.prefill_pending(pending - prefill)
        batch.kv_tokens_read += kv_read
        return batch

    def _add_decodes(self, batch: Batch, token_budget: int) -> list[Request]:
        """Put the step's decodes in ``batch`` (steady ones counted, the others listed, rotated
        when they exceed the budget); returns the listed requests that prefill, in activation order."""
        steady_set = self.steady
        steady = steady_set.count
        if steady and (self.on_token is not None or self.lists_requests):
            self.dissolve_steady()
            steady = 0
        reqs = batch.requests
        kv_read = 0
        prefilling: list[Request] = []
        decode, prefill_next = reqs.append, prefilling.append
        for r in self.explicit:
            out = r.num_output_tokens
            computed = r.num_computed_tokens
            if out and computed + 1 == r.prompt_len + out:
                decode(r)
                kv_read += computed
            else:
                prefill_next(r)
        n_listed = len(reqs)
        n_decodes = n_listed + steady
        self.rotating = n_decodes > token_budget
        if self.rotating:
            if steady:  # rotation picks among all decodes in running order: list them
                self.dissolve_steady()
                reqs.clear()
                return self._add_decodes(batch, token_budget)
            kv_read = self._rotate_decodes(reqs, token_budget)
            n_decodes = n_listed = token_budget
        else:
            kv_read += n_listed  # each decode reads its new token too
            if steady:  # each steady decode reads its prompt and output, the new token included
                kv_read += steady_set.base + steady * steady_set.tick
        batch.num_new_tokens.extend([1] * n_listed)
        self.stats.decodes_read(kv_read)
        batch.num_decodes = n_decodes
        batch.kv_tokens_read = kv_read
        first = 0
        for r in reqs:  # the listed decodes (all of the list so far)
            first += r.num_output_tokens == 1
        if steady:
            fresh_tick, fresh = steady_set.first
            if fresh_tick == steady_set.tick:
                first += fresh
        batch.first_decodes = first
        return prefilling

    def _rotate_decodes(self, decodes: list[Request], budget: int) -> int:
        """Keep ``budget`` of ``decodes`` (in place), starting where the last cut stopped; returns
        the KV tokens they read."""
        start = self.decode_offset % len(decodes)
        kept = (decodes[start:] + decodes[:start])[:budget]
        self.decode_offset = (start + budget) % len(decodes)
        decodes[:] = kept
        return sum(r.num_computed_tokens for r in kept) + budget

    def dissolve_steady(self) -> None:
        """List every running request again (before a rotation of the decodes, or when tokens must
        be seen one by one)."""
        self.steady.dissolve(self.running)
        self.explicit = list(self.running)
