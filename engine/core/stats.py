"""The statistics that make an Observation: one object fed by engine events.

Whatever engine a controller runs in (tidegate's own ``EngineCore``, a scheduler inside another
engine, a gateway in front of replicas), it tells an :class:`ObservationStats` what happened
(an arrival, a refusal, a step with its duration, tokens and KV read, a first token, a completion,
an eviction) and the state it holds now (KV in use, queue and batch), and the stats make the
Observation. So a controller sees the same numbers whatever engine feeds it.

The controller receives a fresh copy at every step and every arrival (:meth:`snapshot`): nothing
it writes into one reaches the figures the next step is made from.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right, insort
from collections import deque

from tidegate.ctrl.base import QUEUE_STEPS, RATE_EVENTS, STEADY_RATE_EVENTS, Observation
from tidegate.engine.core.offered import OfferedSizes

#: weight of the newest value in the latency and step-time estimates
LATENCY_ALPHA = 0.05
#: weight of the newest request in the request-size estimates: heavy-tailed, so a longer memory
WORKLOAD_ALPHA = 0.01
#: the quantile of recent outputs ``Observation.short_output_tokens`` reads
SHORT_OUTPUT_QUANTILE = 0.1
#: the quantile of recent TTFT prediction errors ``Observation.ttft_error_p95_s`` and ``ttft_rel_error_p95`` read:
#: a request admitted at slo-flow's threshold misses its TTFT SLO with about this chance's complement, and in
#: overload most admitted requests sit near the threshold, so it bounds the late share of what is served. Of the
#: last 64 errors it is the 4th largest, which three outliers together do not set (the 99th would be the largest
#: alone). The 90th percentile left about 6% of what a vLLM replica served at 3 x its capacity late
TTFT_ERROR_QUANTILE = 0.95


class RateEstimator:
    """Events per second: exponentially weighted over ``window_s`` while that window holds at least
    ``min_events`` events; at lower rates, the last ``min_events`` events over the time they span
    (up to now), so a rate is never judged from a handful of events. The weighted average is
    corrected for its start at zero (divided by ``1 - exp(-t / window_s)``, t the time since the
    first event), so a flood that starts a run is seen at its rate, not at a fraction of it.

    :param window_s: the time constant at high rates.
    :param min_events: events a low-rate estimate spans.
    """

    __slots__ = ("window_s", "min_events", "_value", "_last_s", "_first_s", "_times")

    def __init__(self, window_s: float, min_events: int = 64) -> None:
        self.window_s = window_s
        self.min_events = min_events
        self._value = 0.0
        self._last_s = 0.0
        self._first_s: float | None = None
        self._times: deque[float] = deque(maxlen=min_events)

    def add(self, now_s: float, count: int = 1) -> None:
        if self._first_s is None:
            self._first_s = now_s
        self._value = self._ewma(now_s) + count / self.window_s
        self._last_s = now_s
        if count == 1:
            self._times.append(now_s)
        else:
            self._times.extend([now_s] * min(count, self.min_events))

    def last_rate(self, events: int, now_s: float) -> float:
        """The gaps between the last ``events`` events (at most ``min_events``) over the time from the first of
        them to ``now_s`` (0 with fewer than two)."""
        times = self._times
        k = min(events, len(times))
        if k < 2:
            return 0.0
        first = times[-k]
        return (k - 1) / (now_s - first) if now_s > first else 0.0

    def _ewma(self, now_s: float) -> float:
        dt = now_s - self._last_s
        return self._value * math.exp(-dt / self.window_s) if dt > 0 else self._value

    def rate(self, now_s: float) -> float:
        times = self._times
        window = self.window_s
        if len(times) == self.min_events and now_s - times[0] <= window:
            # the window holds enough events; times[0] >= the first event, so the span is positive
            span = now_s - (self._first_s if self._first_s is not None else times[0])
            dt = now_s - self._last_s  # _ewma, inline: this runs four times a step
            value = self._value * math.exp(-dt / window) if dt > 0 else self._value
            return value / -math.expm1(-(span if span > 1e-12 else 1e-12) / window)
        if not times:
            return 0.0
        return len(times) / max(now_s - times[0], self.window_s)


class RecentQuantile:
    """A quantile of the last ``window`` values no older than ``horizon_s`` (exact, over a ring; 0
    when none is kept).

    The horizon makes the quantile forget what a burst that has passed taught it: without one,
    a quiet replica kept the errors of its last busy minute until 64 new values came in.

    :param q: the quantile, in [0, 1].
    :param window: values kept.
    :param horizon_s: values older than this (by the ``now_s`` they were added at) are dropped.
    """

    __slots__ = ("window", "horizon_s", "_index", "_values", "_times", "_current")

    def __init__(self, q: float, window: int = 64, horizon_s: float = math.inf) -> None:
        self.window = window
        self.horizon_s = horizon_s
        self._index = min(window - 1, max(0, math.ceil(q * window) - 1))
        self._values: deque[float] = deque(maxlen=window)
        self._times: deque[float] = deque(maxlen=window)
        self._current = 0.0

    def add(self, value: float, now_s: float = 0.0) -> float:
        """Take ``value`` at ``now_s``; return the quantile of the values kept."""
        self._values.append(value)
        self._times.append(now_s)
        return self._refresh(now_s)

    def current(self, now_s: float) -> float:
        """The quantile at ``now_s``: the last one unless a value has aged past the horizon (O(1) then)."""
        times = self._times
        if times and times[0] < now_s - self.horizon_s:
            return self._refresh(now_s)
        return self._current

    def _refresh(self, now_s: float) -> float:
        values, times, oldest = self._values, self._times, now_s - self.horizon_s
        while times and times[0] < oldest:
            times.popleft()
            values.popleft()
        if not values:
            self._current = 0.0
            return 0.0
        ordered = sorted(values)
        self._current = ordered[min(self._index * len(ordered) // self.window, len(ordered) - 1)]
        return self._current


class SlidingQuantile:
    """A quantile of the values of the last ``horizon_s``, and never of fewer than the last ``min_samples``
    however old (at most ``max_samples``); exact, over a sorted copy (0 when none is kept).

    Its span is one of time, not of count: a count of 64 spans a tenth of a second of a fleet's 500
    completions a second, and a quantile over so short a span moves with every burst of them.

    :param q: the quantile, in [0, 1].
    """

    __slots__ = ("q", "horizon_s", "min_samples", "max_samples", "_times", "_values", "_sorted")

    def __init__(self, q: float, horizon_s: float, min_samples: int = 64, max_samples: int = 4096) -> None:
        self.q = q
        self.horizon_s = horizon_s
        self.min_samples = min_samples
        self.max_samples = max_samples
        self._times: deque[float] = deque()
        self._values: deque[float] = deque()
        self._sorted: list[float] = []

    def add(self, value: float, now_s: float) -> None:
        self._times.append(now_s)
        self._values.append(value)
        insort(self._sorted, value)
        times, oldest = self._times, now_s - self.horizon_s
        while len(times) > self.max_samples or (len(times) > self.min_samples and times[0] < oldest):
            times.popleft()
            ordered = self._sorted
            del ordered[bisect_left(ordered, self._values.popleft())]

    @property
    def value(self) -> float:
        ordered = self._sorted
        if not ordered:
            return 0.0
        return ordered[min(len(ordered) - 1, int(self.q * len(ordered)))]

    def __len__(self) -> int:
        return len(self._sorted)


class RecentOutputs:
    """The outputs of the last ``window`` completions, for ``Observation.short_output_tokens`` (sorted when
    first asked after a change: an engine whose controller never asks pays one append a completion)."""

    __slots__ = ("_ring", "_sorted")

    def __init__(self, window: int = 64) -> None:
        self._ring: deque[int] = deque(maxlen=window)
        self._sorted: list[int] | None = []

    def add(self, output_tokens: int) -> None:
        self._ring.append(output_tokens)
        self._sorted = None

    def short_above(self, least: int) -> int:
        """The ``SHORT_OUTPUT_QUANTILE`` quantile of the outputs kept that are longer than ``least`` (0: none is)."""
        ordered = self._sorted
        if ordered is None:
            self._sorted = ordered = sorted(self._ring)
        start = bisect_right(ordered, least)
        above = len(ordered) - start
        if not above:
            return 0
        return ordered[start + max(math.ceil(SHORT_OUTPUT_QUANTILE * above) - 1, 0)]


class ObservationStats:
    """The running statistics behind every Observation, updated by engine events.

    :param kv_capacity_tokens: KV capacity M in tokens.
    :param block_size: tokens per KV block.
    :param rate_window_s: time constant of the arrival and completion rate estimates, and the
        horizon of the TTFT error's quantile.
    """

    def __init__(self, kv_capacity_tokens: int, block_size: int = 16, rate_window_s: float = 10.0) -> None:
        #: the figures as of the last event: the engine's own, never handed to a controller
        self.current = Observation(kv_capacity_tokens, block_size)
        #: the last copy handed out (:meth:`snapshot`)
        self.latest = self.current
        self.arrivals = RateEstimator(rate_window_s, min_events=RATE_EVENTS)
        self.offered = RateEstimator(rate_window_s, min_events=STEADY_RATE_EVENTS)
        self.completions = RateEstimator(rate_window_s, min_events=RATE_EVENTS)
        self.slot_completions = RateEstimator(rate_window_s, min_events=RATE_EVENTS)  # more than one token
        self.served = RateEstimator(rate_window_s, min_events=STEADY_RATE_EVENTS)
        # realised minus predicted TTFT of the last 64 first tokens within the rate estimates' memory
        self.ttft_error = RecentQuantile(TTFT_ERROR_QUANTILE, horizon_s=rate_window_s)
        self.ttft_rel_error = RecentQuantile(TTFT_ERROR_QUANTILE, horizon_s=rate_window_s)
        # the outputs of the last 64 completions, however old: their length is the traffic's, not a moment's
        self.outputs = RecentOutputs()
        self._workload_decay = 1.0  # (1 - alpha)^completions: the estimates' start-up correction
        self._offered_decay = 1.0  # (1 - alpha)^arrivals, the same for the offered prompt mean
        self.offered_sizes = OfferedSizes(WORKLOAD_ALPHA)
        # the busy period's arrivals with an expected output: their count and sums of prompt, output, W and W^2
        self._busy_sums: list[float] = [0, 0.0, 0.0, 0.0, 0.0]
        # the busy period's arrivals of a prompt size none completed of: their count and prompt sum
        self._busy_unsized: list[float] = [0, 0.0]
        self.kv_steps = 0.0  # KV tokens in use summed over steps, decayed per completion
        self.kv_completions = 0.0  # completions, decayed alike (Little's law on the KV)
        #: KV tokens read by decodes summed over steps, decayed alike (the simulator's fast path adds
        #: to it directly, once per steady step)
        self.decode_kv_steps = 0.0

    # ------------------------------------------------------------------ the state now
    def observe(self, now_s: float, step_index: int, kv_used_tokens: int, num_waiting: int, num_running: int,
                waiting_prompt_tokens: int, running_prompt_tokens: int, head_prompt_tokens: int,
                evicted_last_step: int, most_output_tokens: int = 0, short_output_tokens: int = 0,
                leading_outputs: tuple[int, ...] = ()) -> Observation:
        """Bring the figures up to ``now_s`` with the engine's state; returns :attr:`current`.

        :param kv_used_tokens: KV tokens held now.
        :param waiting_prompt_tokens: tokens the waiting requests must prefill.
        :param running_prompt_tokens: prompt tokens of the running requests.
        :param head_prompt_tokens: the prompt of the queue's first request (0: none waits).
        :param evicted_last_step: requests the last step evicted.
        :param most_output_tokens: the most output tokens so far of any running request.
        :param short_output_tokens: ``outputs.short_above`` the least output of a running request.
        :param leading_outputs: the outputs of the ``LEADING_OUTPUTS`` most advanced running requests, most first.
        """
        obs = self.current
        obs.now_s = now_s
        obs.step_index = step_index
        obs.kv_used_tokens = kv_used_tokens
        obs.num_waiting = num_waiting
        obs.num_running = num_running
        obs.waiting_prompt_tokens = waiting_prompt_tokens
        obs.running_prompt_tokens = running_prompt_tokens
        obs.head_prompt_tokens = head_prompt_tokens
        obs.most_output_tokens = most_output_tokens
        obs.short_output_tokens = short_output_tokens
        obs.leading_outputs = leading_outputs
        # the busy period's arrivals are the last ``busy_arrivals`` the arrival rate keeps; past its first
        # STEADY_RATE_EVENTS the steady rates span it alone, and nothing reads it (a step's cost saved)
        busy = obs.busy_arrivals
        obs.busy_rate_rps = self.arrivals.last_rate(busy, now_s) if busy < STEADY_RATE_EVENTS else 0.0
        obs.defer_rates(self.arrivals, self.offered, self.completions, self.served, self.slot_completions)
        obs.evicted_last_step = evicted_last_step
        obs.ttft_error_p95_s = self.ttft_error.current(now_s)
        obs.ttft_rel_error_p95 = self.ttft_rel_error.current(now_s)
        return obs

    def snapshot(self) -> Observation:
        """A fresh copy of :attr:`current` for a controller (its rates still computed when first read)."""
        self.latest = snap = self.current.copy(deferred=True)
        return snap

    def settle_arrival_rates(self) -> None:
        """Compute the deferred arrival rates of the figures handed out, before an arrival is counted."""
        current, latest = self.current, self.latest
        both = current._arrival_sources is not None
        current.settle_arrival_rates()
        if latest._arrival_sources is not None:
            # both deferred at the same time and computed now from the same estimators: the same rates
            if both and latest.now_s == current.now_s:
                latest._arrival_sources = None
                latest._arrival_rate_rps = current._arrival_rate_rps
                latest._offered_rate_rps = current._offered_rate_rps
            else:
                latest.settle_arrival_rates()

    def settle_completion_rates(self) -> None:
        """The same for the completion rates, before a completion is counted."""
        current, latest = self.current, self.latest
        both = current._completion_sources is not None
        current.settle_completion_rates()
        if latest._completion_sources is not None:
            if both and latest.now_s == current.now_s:
                latest._completion_sources = None
                latest._completion_rate_rps = current._completion_rate_rps
                latest._served_rate_rps = current._served_rate_rps
                latest._slot_completion_rate_rps = current._slot_completion_rate_rps
            else:
                latest.settle_completion_rates()

    # ------------------------------------------------------------------ events
    def arrived(self, now_s: float, prompt_len: int, idle: bool) -> None:
        """A request arrived (admitted or not).

        :param idle: nothing ran or waited in the engine when it arrived: a busy period starts. The engine
            knows; the last observation may still count a request that has completed since."""
        self.arrivals.add(now_s)
        self.offered.add(now_s)
        self._offered_decay *= 1.0 - WORKLOAD_ALPHA
        obs = self.current
        obs.offered_prompt_tokens += (WORKLOAD_ALPHA / (1.0 - self._offered_decay)
                                      * (prompt_len - obs.offered_prompt_tokens))
        if idle:  # a busy period starts: completions are due from now
            obs.last_completion_s = now_s
            obs.busy_arrivals = 0
            self._busy_sums = [0, 0.0, 0.0, 0.0, 0.0]
            self._busy_unsized = [0, 0.0]
            obs.busy_unsized_share = obs.busy_unsized_prompt_tokens = 0.0
        obs.busy_arrivals += 1
        if obs.busy_arrivals > STEADY_RATE_EVENTS:  # the mix of its first arrivals: past them nothing reads it
            return
        d = self.offered_sizes.output_for(prompt_len, fallback=False)
        unsized = self._busy_unsized
        if d > 0.0:  # the busy period's mix, of the arrivals whose output can be expected
            sums = self._busy_sums
            w = prompt_len * d + d * (d + 1.0) / 2.0
            sums[0] += 1
            sums[1] += prompt_len
            sums[2] += d
            sums[3] += w
            sums[4] += w * w
            n = sums[0]
            mean = sums[3] / n
            obs.busy_prompt_tokens, obs.busy_output_tokens, obs.busy_kv_workload = sums[1] / n, sums[2] / n, mean
            obs.busy_kv_workload_se = (math.sqrt(max(sums[4] / n - mean * mean, 0.0) / (n - 1)) if n > 1 else 0.0)
        else:  # no completion of its size says what it will answer: the controller's prior does
            unsized[0] += 1
            unsized[1] += prompt_len
            obs.busy_unsized_prompt_tokens = unsized[1] / unsized[0]
            if idle:
                obs.busy_prompt_tokens = obs.busy_output_tokens = obs.busy_kv_workload = obs.busy_kv_workload_se = 0.0
        obs.busy_unsized_share = unsized[0] / (unsized[0] + self._busy_sums[0])

    def admitted(self, prompt_len: int, accepted: bool) -> None:
        """The admission's verdict on an arrival that could fit (``accepted``: it was queued)."""
        self.offered_sizes.arrived(prompt_len, accepted)

    def refused(self) -> None:
        """A request was refused (by the controller, or because it can never fit)."""
        self.current.rejections_total += 1

    def step_started(self, kv_used_tokens: int) -> None:
        """A step starts holding ``kv_used_tokens``: Little's law's KV token-steps."""
        self.kv_steps += kv_used_tokens
        if self.kv_completions > 0:
            obs = self.current
            obs.occupied_kv_workload = self.kv_steps / self.kv_completions
            obs.decode_kv_workload = self.decode_kv_steps / self.kv_completions

    def decodes_read(self, kv_tokens: int) -> None:
        """The step's decodes read ``kv_tokens`` KV tokens."""
        self.decode_kv_steps += kv_tokens

    def prefill_pending(self, tokens: int) -> None:
        """Tokens the running requests still have to prefill after the step's batch."""
        self.current.running_prefill_tokens = tokens

    def step_ended(self, duration_s: float, num_tokens: int) -> None:
        """A step of ``num_tokens`` new tokens took ``duration_s``."""
        obs = self.current
        obs.last_step_time_s = duration_s
        obs.last_step_tokens = num_tokens
        if num_tokens:
            obs.mean_step_time_s += LATENCY_ALPHA * (duration_s - obs.mean_step_time_s)

    def first_token(self, now_s: float, ttft_error_s: float, predicted_s: float = 0.0) -> None:
        """A request got its first token ``ttft_error_s`` later than its admission predicted
        (``predicted_s``, for the relative error: counted where it is at least ``QUEUE_STEPS`` mean steps)."""
        current = self.current
        current.ttft_error_p95_s = self.ttft_error.add(ttft_error_s, now_s)
        step_s = current.mean_step_time_s
        if step_s > 0.0 and predicted_s >= QUEUE_STEPS * step_s:
            current.ttft_rel_error_p95 = self.ttft_rel_error.add(ttft_error_s / predicted_s, now_s)

    def evicted(self) -> None:
        """A running request was evicted."""
        self.current.evictions_total += 1

    def completed(self, now_s: float, prompt_len: int, output_tokens: int, ttft_s: float,
                  tpot_s: float | None) -> None:
        """A request finished with ``output_tokens`` (TTFT ``ttft_s``; TPOT ``tpot_s``, None with
        one token)."""
        self.settle_completion_rates()
        self.completions.add(now_s)
        self.served.add(now_s)
        obs, a, aw = self.current, LATENCY_ALPHA, WORKLOAD_ALPHA
        obs.completed_total += 1
        if output_tokens > 1:  # one token comes with the prefill: such a request never held a slot over a step
            self.slot_completions.add(now_s)
            self.outputs.add(output_tokens)
            obs.last_completion_s = now_s
        o, p = output_tokens, prompt_len
        # exponentially weighted means corrected for their start (weights normalised to sum to 1):
        # the mean of all completions while they are few, the first one never weighs more than the rest
        self._workload_decay *= 1.0 - aw
        aw /= 1.0 - self._workload_decay
        obs.mean_prompt_tokens += aw * (p - obs.mean_prompt_tokens)
        obs.mean_output_tokens += aw * (o - obs.mean_output_tokens)
        obs.lifetime_kv_workload += aw * (p * o + (o + o * o) / 2 - obs.lifetime_kv_workload)
        keep = 1.0 - WORKLOAD_ALPHA
        self.kv_steps *= keep
        # its decodes read W - (P + D) tokens (the j-th output token over P + j - 1): the rest of its W
        self.decode_kv_steps = self.decode_kv_steps * keep + p + o
        self.kv_completions = self.kv_completions * keep + 1.0
        obs.occupied_kv_workload = self.kv_steps / self.kv_completions
        obs.decode_kv_workload = self.decode_kv_steps / self.kv_completions
        sizes = self.offered_sizes
        sizes.completed(p, o)
        obs.offered_output_tokens = sizes.output_tokens
        obs.offered_kv_workload = sizes.kv_workload
        obs.offered_kv_workload_se = sizes.kv_workload_se
        obs.offered_prompt_se = sizes.prompt_se
        obs.ttft_recent_s += a * (ttft_s - obs.ttft_recent_s)
        if tpot_s is not None:
            obs.tpot_recent_s += a * (tpot_s - obs.tpot_recent_s)


class FrontArrivals:
    """The arrivals an admission front judged before its engine counted them, in the busy period's figures.

    A server that decides arrivals in its HTTP process (``tidegate serve``, vLLM's API server with the
    plugin) judges each on the engine's latest observation, and the engine counts an arrival only when it
    next takes it in, after the step it is running: a prefill step of a second on a CPU replica. A burst
    that lands within one step would be judged on a busy period that has not seen it, and the busy
    period's witness of overload (``SloFlowController.over_busy_capacity``) would stay silent until the
    whole burst was admitted. The engine's own stats count an arrival as it comes (``ObservationStats
    .arrived``, before the controller's ``admit``); :meth:`count` makes the front's observation count the
    arrivals in transit the same way, from the times the front judged them.
    """

    def __init__(self) -> None:
        self._times: deque[float] = deque(maxlen=RATE_EVENTS)

    def judged(self, now_s: float) -> None:
        """An arrival is being judged at ``now_s`` (any clock, the same for every call)."""
        self._times.append(now_s)

    def count(self, obs: Observation, unseen: int, now_s: float) -> None:
        """Count in ``obs``, as the engine published it (its queue without the arrivals in transit), the
        ``unseen`` latest arrivals judged (the one being judged included): they join the engine's busy
        period, or start one where the engine was empty, and the busy arrival rate spans the last
        ``RATE_EVENTS`` of the period's arrivals at most up to ``now_s``, as ``ObservationStats`` counts them."""
        if unseen <= 0:
            return
        idle = obs.num_running <= 0 and obs.num_waiting <= 0
        if idle:  # a busy period starts with them: the last one's mix is not theirs (the traffic's bound judges)
            obs.busy_prompt_tokens = obs.busy_output_tokens = obs.busy_kv_workload = obs.busy_kv_workload_se = 0.0
            obs.busy_unsized_share = obs.busy_unsized_prompt_tokens = 0.0
        busy = (0 if idle else obs.busy_arrivals) + unseen
        obs.busy_arrivals = busy
        if busy >= STEADY_RATE_EVENTS:  # past them the steady rates span the busy period, and nothing reads it
            obs.busy_rate_rps = 0.0
            return
        times = self._times
        k = min(busy, len(times))
        first = times[-k] if k else now_s
        obs.busy_rate_rps = (k - 1) / (now_s - first) if k >= 2 and now_s > first else 0.0
