"""The controller interface: an Observation in, a Decision out.

Controllers never touch engine internals; the same object runs in the simulator, the
Gymnasium env, the real engine and the server.
"""

from __future__ import annotations

from typing import ClassVar, Protocol

from mypy_extensions import mypyc_attr

UNLIMITED = 1 << 60
#: the most advanced running requests whose outputs an Observation carries (``Observation.leading_outputs``)
LEADING_OUTPUTS = 16
#: events the steady rate estimates span at least (``Observation.offered_rate_rps`` and
#: ``served_rate_rps``): a Poisson rate within about 6%
STEADY_RATE_EVENTS = 256
#: events the recent rate estimates span at least (``Observation.arrival_rate_rps`` and
#: ``completion_rate_rps``): a Poisson rate within about 12%, that follows a change within 64 events
RATE_EVENTS = 64
#: a TTFT prediction of at least this many mean steps is about a queue, and its relative error enters
#: ``Observation.ttft_rel_error_p95``; shorter ones are about one step's noise
QUEUE_STEPS = 4


class _RateSource(Protocol):
    """An events-per-second estimate (``engine.core.engine_core.RateEstimator``)."""

    def rate(self, now_s: float) -> float: ...


class ReplicaProfile(Protocol):
    """What controllers read of a replica's profile (``engine.core.profile.Profile`` has it all):
    the step-time model ``base_s + per_token_s * T + per_kv_token_s * K`` (a profile may add a
    separate decode cost ``per_decode_token_s`` and step noise ``noise_sigma``, read with
    ``getattr`` by ``ctrl.theory``), the KV capacity, the SLOs and the batch limits. ``ctrl``
    never imports the engine; callers hand a profile in."""

    @property
    def base_s(self) -> float: ...
    @property
    def per_token_s(self) -> float: ...
    @property
    def per_kv_token_s(self) -> float: ...
    @property
    def kv_capacity_tokens(self) -> int: ...
    @property
    def ttft_slo_s(self) -> float: ...
    @property
    def tpot_slo_s(self) -> float: ...
    @property
    def max_num_seqs(self) -> int: ...
    @property
    def max_num_batched_tokens(self) -> int: ...


class Observation:
    """Plain numbers describing the engine at the start of a step.

    Made by ``tidegate.engine.core.stats.ObservationStats`` from engine events; a controller gets
    a fresh copy at every step and every arrival, so what it writes into one changes nothing else.
    """

    #: the fields, in order
    FIELDS: ClassVar[tuple[str, ...]] = (
        "now_s", "step_index", "kv_used_tokens", "kv_capacity_tokens", "block_size",
        "num_waiting", "num_running", "waiting_prompt_tokens", "head_prompt_tokens",
        "arrival_rate_rps", "offered_rate_rps", "completion_rate_rps", "served_rate_rps", "last_step_time_s",
        "last_step_tokens",
        "ttft_recent_s", "tpot_recent_s", "evictions_total", "evicted_last_step",
        "rejections_total", "completed_total", "mean_prompt_tokens", "offered_prompt_tokens", "mean_output_tokens",
        "lifetime_kv_workload", "occupied_kv_workload", "decode_kv_workload", "offered_output_tokens",
        "offered_kv_workload", "offered_kv_workload_se", "offered_prompt_se", "mean_step_time_s",
        "running_prefill_tokens",
        "running_prompt_tokens", "ttft_error_p95_s", "ttft_rel_error_p95", "last_completion_s",
        "most_output_tokens", "short_output_tokens", "busy_arrivals", "busy_rate_rps", "busy_prompt_tokens",
        "busy_output_tokens", "busy_kv_workload", "busy_kv_workload_se", "busy_unsized_share",
        "busy_unsized_prompt_tokens", "slot_completion_rate_rps",
    )
    __slots__ = (
        "now_s", "step_index", "kv_used_tokens", "kv_capacity_tokens", "block_size",
        "num_waiting", "num_running", "waiting_prompt_tokens", "head_prompt_tokens",
        "_arrival_rate_rps", "_offered_rate_rps", "_completion_rate_rps", "_served_rate_rps",
        "_slot_completion_rate_rps", "_arrival_sources", "_completion_sources",
        "last_step_time_s", "last_step_tokens",
        "ttft_recent_s", "tpot_recent_s", "evictions_total", "evicted_last_step",
        "rejections_total", "completed_total", "mean_prompt_tokens", "offered_prompt_tokens", "mean_output_tokens",
        "lifetime_kv_workload", "occupied_kv_workload", "decode_kv_workload", "offered_output_tokens",
        "offered_kv_workload", "offered_kv_workload_se", "offered_prompt_se", "mean_step_time_s",
        "running_prefill_tokens",
        "running_prompt_tokens", "ttft_error_p95_s", "ttft_rel_error_p95", "last_completion_s",
        "most_output_tokens", "short_output_tokens", "leading_outputs", "busy_arrivals", "busy_rate_rps",
        "busy_prompt_tokens", "busy_output_tokens", "busy_kv_workload", "busy_kv_workload_se", "busy_unsized_share",
        "busy_unsized_prompt_tokens",
    )

    def __init__(self, kv_capacity_tokens: int = 0, block_size: int = 16) -> None:
        self.now_s = 0.0
        self.step_index = 0
        self.kv_used_tokens = 0
        self.kv_capacity_tokens = kv_capacity_tokens
        self.block_size = block_size
        self.num_waiting = 0
        self.num_running = 0
        #: tokens waiting requests must prefill (an evicted request's kept output included)
        self.waiting_prompt_tokens = 0
        self.head_prompt_tokens = 0
        self._arrival_sources: tuple[_RateSource, _RateSource] | None = None
        self._completion_sources: tuple[_RateSource, _RateSource, _RateSource] | None = None
        self._arrival_rate_rps = 0.0
        self._offered_rate_rps = 0.0
        self._completion_rate_rps = 0.0
        self._served_rate_rps = 0.0
        self._slot_completion_rate_rps = 0.0
        self.last_step_time_s = 0.0
        self.last_step_tokens = 0
        self.ttft_recent_s = 0.0
        self.tpot_recent_s = 0.0
        self.evictions_total = 0
        self.evicted_last_step = 0
        self.rejections_total = 0
        self.completed_total = 0
        self.mean_prompt_tokens = 0.0
        #: mean prompt of the arrivals, refused ones included (``mean_prompt_tokens`` is that of the
        #: completed requests: what admission let through, and the short ones first)
        self.offered_prompt_tokens = 0.0
        self.mean_output_tokens = 0.0
        self.lifetime_kv_workload = 0.0
        #: KV token-steps held per completed request (Little's law on the KV: the KV in use summed
        #: over steps, over the completions, both weighted as the size means; 0 before the first
        #: completion). Unlike ``lifetime_kv_workload`` it counts the requests still running: the
        #: completed ones are the short ones while the long ones hold the memory, and on long
        #: outputs their W reads 2-3 x too low for the first minutes. It counts what the memory
        #: held at each step's start (prefill steps and block rounding in, the step's new token
        #: out): in steady state within 1-6% of the completed requests' W on chat and long-output
        #: traffic, 1.4 x on long prompts, whose blocks are held through a prefill of many steps
        self.occupied_kv_workload = 0.0
        #: KV tokens read by decodes per completed request, summed over steps and weighted as
        #: ``occupied_kv_workload`` (0 before the first completion). The decode of a request's
        #: j-th output token reads P + j - 1 tokens, and its completion adds the P + D its
        #: decodes did not read, so a request counts W = sum_j (P + j) over its life: this is
        #: Little's law on the W of the fluid bound. Unlike ``lifetime_kv_workload`` it counts the
        #: requests still running, whose long outputs the completed short ones do not show
        #: (heavy-tailed outputs: the completed requests' W read 25-35% low after 700
        #: completions); unlike ``occupied_kv_workload`` it leaves out the memory prompts hold
        #: while they prefill
        self.decode_kv_workload = 0.0
        #: the offered requests' mean output and lifetime KV workload W, refused ones included:
        #: the completed requests weighted by the inverse of the share admitted among arrivals of
        #: their prompt's size (``engine.core.offered``), so admission that refuses the largest
        #: prompts does not make the traffic look smaller than it is; equal to the completed
        #: requests' means where nothing is refused
        self.offered_output_tokens = 0.0
        self.offered_kv_workload = 0.0
        #: the standard error of ``offered_kv_workload`` as an estimate of the mean (0 before two
        #: completions): heavy-tailed traffic has a W mean no better than +-10-25% after
        #: hundreds of completions, and a judgement of the load must know that
        self.offered_kv_workload_se = 0.0
        #: the standard error of the offered requests' mean prompt, from the completed ones weighted as
        #: ``offered_kv_workload`` (0 before two completions): the compute side of the fluid bound, whose
        #: prompts are as heavy-tailed as W
        self.offered_prompt_se = 0.0
        self.mean_step_time_s = 0.0
        #: tokens of running requests still to prefill, prompt or re-prefilled output (after the last step)
        self.running_prefill_tokens = 0
        #: prompt tokens of the running requests (the KV they hold beyond these is their output so
        #: far, rounded up to blocks)
        self.running_prompt_tokens = 0
        #: the 95th percentile (the engine's ``TTFT_ERROR_QUANTILE``) of realised minus predicted TTFT over the
        #: last 64 requests that got their first token within the engine's rate window (0 when none did): how late the
        #: admission predictions run now, not during a burst that has passed. Under late-last
        #: prefill (``Decision.late_after_s``) a request's realised TTFT counts up to the later of
        #: that bound and its activation: past it, a running request waits by the controller's
        #: choice of order, which no prediction at arrival is meant to foresee
        self.ttft_error_p95_s = 0.0
        #: the 95th percentile of the same errors relative to their prediction, over the predictions of at
        #: least ``QUEUE_STEPS`` mean steps (a queue's, not a step's) within the rate window: predictions of
        #: a queue's wait run late in proportion to the wait, which an error in seconds, mostly of requests
        #: with nothing ahead, understates for the long ones
        self.ttft_rel_error_p95 = 0.0
        #: when the latest request with more than one output token completed (one that held a slot over a
        #: step, as ``slot_completion_rate_rps`` counts), or when the current busy period started (an
        #: arrival with nothing running or waiting) if that is later: the silence since then tells how
        #: soon the next slot can be expected to free. -1 before the first arrival (and in an
        #: Observation an engine did not make): unknown
        self.last_completion_s = -1.0
        #: the most output tokens so far of any running request (0 when none runs). An engine may leave
        #: this and ``short_output_tokens`` 0 where no arrival would wait for a slot (fewer running and
        #: waiting requests than its running cap) and in the observations of its steps: admission's TTFT
        #: prediction reads them only where an arrival would wait
        self.most_output_tokens = 0
        #: the 10th percentile of the outputs of the last 64 completions of more than one token that are longer
        #: than the least output so far of any running request with a token (0 before the first, or where none
        #: is longer): every running request's output will be longer than what it has, so nine in ten of them
        #: run to at least this many tokens, and no slot is likely to free before the most advanced has decoded
        #: it. A one-token answer comes with its prefill and never holds a slot over a step, and a request still
        #: prefilling says nothing of its output: both would make this the shortest output of all (a probe's
        #: one token every 0.5 s left nothing else among the last 64 after an idle spell, and no bound)
        self.short_output_tokens = 0
        #: the outputs so far of the ``LEADING_OUTPUTS`` most advanced running requests at most, most first (filled
        #: where ``most_output_tokens`` is): the k-th slot to free is not likely to free before the k-th of them has
        #: decoded ``short_output_tokens``. Requests admitted together (a burst, and its echo a lifetime later)
        #: complete together, and an arrival that needs one of their slots waits for the wave, however fast the
        #: completions before it came (not in ``FIELDS``: a tuple)
        self.leading_outputs: tuple[int, ...] = ()
        #: arrivals since the current busy period began (the latest arrival that found nothing running or
        #: waiting), that one included; 0 before the first arrival
        self.busy_arrivals = 0
        #: arrivals per second over the busy period's last ``RATE_EVENTS`` arrivals at most: the gaps between
        #: them over the time from the first of them to now (0 before two, and past the busy period's first
        #: ``STEADY_RATE_EVENTS``, where the steady rates span it alone). Unlike ``arrival_rate_rps`` it
        #: never reaches back past an idle spell, so a step in load after one shows at once
        self.busy_rate_rps = 0.0
        #: the busy period's arrivals' mean prompt, expected output and expected lifetime KV workload W, each
        #: arrival's output expected from the completed requests of its prompt's size (``OfferedSizes``,
        #: ``output_for``): the mix of what arrives now, where ``offered_*`` remember a hundred completions of
        #: what arrived before (a step from one-token probes to long answers showed at once here, and halved
        #: ``offered_output_tokens`` for a minute). Over the busy period's first ``STEADY_RATE_EVENTS`` arrivals
        #: (after them the steady rates span it alone); 0 until an arrival's output can be expected (a completion)
        self.busy_prompt_tokens = 0.0
        self.busy_output_tokens = 0.0
        self.busy_kv_workload = 0.0
        #: the standard error of ``busy_kv_workload`` as the mean of the busy period's arrivals' W (0 before two)
        self.busy_kv_workload_se = 0.0
        #: the share of the busy period's arrivals (its first ``STEADY_RATE_EVENTS``) of a prompt size no
        #: completion of which is remembered, and their mean prompt: no output can be expected of them from
        #: the traffic (the ``busy_*`` means above leave them out), and a controller takes its own prior. The
        #: offered requests' mean output, which an engine could take instead, is another size's: after an idle
        #: spell of one-token probes it read one token for the long answers of a first step in load
        self.busy_unsized_share = self.busy_unsized_prompt_tokens = 0.0

    # The five rates are computed when first read, not at every step: most controllers read none
    # of them, and the estimates are a tenth of a simulated step. ``defer_rates`` hands the
    # estimators in at the step's start; the first read, write or copy of a rate computes it and
    # its pair's at ``now_s``. The engine settles a pair before it adds an event to its
    # estimators, so a late read sees what an eager one would have.
    def defer_rates(self, arrivals: _RateSource, offered: _RateSource, completions: _RateSource,
                    served: _RateSource, slot_completions: _RateSource) -> None:
        """Compute the five rates from these estimators at ``now_s`` when first read."""
        self._arrival_sources = (arrivals, offered)
        self._completion_sources = (completions, served, slot_completions)

    def settle_arrival_rates(self) -> None:
        """Compute ``arrival_rate_rps`` and ``offered_rate_rps`` now, if they are deferred."""
        sources = self._arrival_sources
        if sources is not None:
            self._arrival_sources = None
            self._arrival_rate_rps = sources[0].rate(self.now_s)
            self._offered_rate_rps = sources[1].rate(self.now_s)

    def settle_completion_rates(self) -> None:
        """Compute ``completion_rate_rps``, ``served_rate_rps`` and ``slot_completion_rate_rps`` now, if they
        are deferred."""
        sources = self._completion_sources
        if sources is not None:
            self._completion_sources = None
            self._completion_rate_rps = sources[0].rate(self.now_s)
            self._served_rate_rps = sources[1].rate(self.now_s)
            self._slot_completion_rate_rps = sources[2].rate(self.now_s)

    @property
    def arrival_rate_rps(self) -> float:
        """Arrivals per second (``engine.core.engine_core.RateEstimator``)."""
        if self._arrival_sources is not None:
            self.settle_arrival_rates()
        return self._arrival_rate_rps

    @arrival_rate_rps.setter
    def arrival_rate_rps(self, value: float) -> None:
        self.settle_arrival_rates()
        self._arrival_rate_rps = value

    @property
    def offered_rate_rps(self) -> float:
        """Arrivals per second over at least the last ``STEADY_RATE_EVENTS`` arrivals: steadier
        than ``arrival_rate_rps`` (a Poisson rate within about 6%), slower to follow a change."""
        if self._arrival_sources is not None:
            self.settle_arrival_rates()
        return self._offered_rate_rps

    @offered_rate_rps.setter
    def offered_rate_rps(self, value: float) -> None:
        self.settle_arrival_rates()
        self._offered_rate_rps = value

    @property
    def completion_rate_rps(self) -> float:
        """Completions per second."""
        if self._completion_sources is not None:
            self.settle_completion_rates()
        return self._completion_rate_rps

    @completion_rate_rps.setter
    def completion_rate_rps(self, value: float) -> None:
        self.settle_completion_rates()
        self._completion_rate_rps = value

    @property
    def served_rate_rps(self) -> float:
        """Completions per second over at least the last ``STEADY_RATE_EVENTS`` completions."""
        if self._completion_sources is not None:
            self.settle_completion_rates()
        return self._served_rate_rps

    @served_rate_rps.setter
    def served_rate_rps(self, value: float) -> None:
        self.settle_completion_rates()
        self._served_rate_rps = value

    @property
    def slot_completion_rate_rps(self) -> float:
        """Completions per second of requests that held a slot over a step: those with more than one output
        token (one token comes with the prefill). The rate at which running requests free their slots and
        memory for the queue: a one-token answer frees only the slot it took itself, and a stream of them
        (a health probe, a classifier) would otherwise read as capacity."""
        if self._completion_sources is not None:
            self.settle_completion_rates()
        return self._slot_completion_rate_rps

    @slot_completion_rate_rps.setter
    def slot_completion_rate_rps(self, value: float) -> None:
        self.settle_completion_rates()
        self._slot_completion_rate_rps = value

    @property
    def kv_usage(self) -> float:
        return self.kv_used_tokens / self.kv_capacity_tokens if self.kv_capacity_tokens else 0.0

    def as_dict(self) -> dict[str, float]:
        return {name: getattr(self, name) for name in self.FIELDS}

    def copy(self, into: Observation | None = None, deferred: bool = False) -> Observation:
        """A copy of every field, written into ``into`` when given (no allocation) or a new Observation.

        One plain assignment per slot, many times faster than ``copy.copy``: the engine hands its
        controller a copy at every step and every arrival, the shield its inner controller another.

        :param deferred: rates not yet computed stay deferred in the copy (computed from the same
            estimators when first read); the owner of the estimators settles both before it adds an
            event. Otherwise they are computed now."""
        o = Observation.__new__(Observation) if into is None else into
        if deferred:
            o._arrival_sources = self._arrival_sources
            o._completion_sources = self._completion_sources
        else:
            o._arrival_sources = o._completion_sources = None
            if self._arrival_sources is not None:
                self.settle_arrival_rates()
            if self._completion_sources is not None:
                self.settle_completion_rates()
        o.now_s = self.now_s
        o.step_index = self.step_index
        o.kv_used_tokens = self.kv_used_tokens
        o.kv_capacity_tokens = self.kv_capacity_tokens
        o.block_size = self.block_size
        o.num_waiting = self.num_waiting
        o.num_running = self.num_running
        o.waiting_prompt_tokens = self.waiting_prompt_tokens
        o.head_prompt_tokens = self.head_prompt_tokens
        o._arrival_rate_rps = self._arrival_rate_rps
        o._offered_rate_rps = self._offered_rate_rps
        o._completion_rate_rps = self._completion_rate_rps
        o._served_rate_rps = self._served_rate_rps
        o._slot_completion_rate_rps = self._slot_completion_rate_rps
        o.last_step_time_s = self.last_step_time_s
        o.last_step_tokens = self.last_step_tokens
        o.ttft_recent_s = self.ttft_recent_s
        o.tpot_recent_s = self.tpot_recent_s
        o.evictions_total = self.evictions_total
        o.evicted_last_step = self.evicted_last_step
        o.rejections_total = self.rejections_total
        o.completed_total = self.completed_total
        o.mean_prompt_tokens = self.mean_prompt_tokens
        o.offered_prompt_tokens = self.offered_prompt_tokens
        o.mean_output_tokens = self.mean_output_tokens
        o.lifetime_kv_workload = self.lifetime_kv_workload
        o.occupied_kv_workload = self.occupied_kv_workload
        o.decode_kv_workload = self.decode_kv_workload
        o.offered_output_tokens = self.offered_output_tokens
        o.offered_kv_workload = self.offered_kv_workload
        o.offered_kv_workload_se, o.offered_prompt_se = self.offered_kv_workload_se, self.offered_prompt_se
        o.mean_step_time_s = self.mean_step_time_s
        o.running_prefill_tokens = self.running_prefill_tokens
        o.running_prompt_tokens = self.running_prompt_tokens
        o.ttft_error_p95_s = self.ttft_error_p95_s
        o.ttft_rel_error_p95 = self.ttft_rel_error_p95
        o.last_completion_s = self.last_completion_s
        o.most_output_tokens, o.short_output_tokens, o.leading_outputs = (self.most_output_tokens,
                                                                          self.short_output_tokens,
                                                                          self.leading_outputs)
        o.busy_arrivals, o.busy_rate_rps, o.busy_prompt_tokens, o.busy_output_tokens, o.busy_kv_workload, \
            o.busy_kv_workload_se, o.busy_unsized_share, o.busy_unsized_prompt_tokens = (
                self.busy_arrivals, self.busy_rate_rps, self.busy_prompt_tokens, self.busy_output_tokens,
                self.busy_kv_workload, self.busy_kv_workload_se, self.busy_unsized_share,
                self.busy_unsized_prompt_tokens)
        return o


class Decision:
    """What the engine may do this step.

    :param activation_budget: at most this many waiting requests become running.
    :param token_budget: at most this many new tokens (decodes plus prefill chunks) in the step.
    :param running_cap: at most this many running requests after activation.
    :param kv_reserve_ratio: None: activate while the pool holds the prompt. A ratio r: activate
        only while every running request's KV plus r x its remaining max_tokens, and the same
        for the candidate, fits in the pool (r = 1 never evicts).
    :param class_budgets: per-class activation allowances for this step (class id -> count);
        when set, it replaces ``activation_budget``.
    :param late_after_s: None: prefill chunks go to running requests in activation order. A time
        t: a request without its first token t seconds after its arrival is late (its TTFT SLO is
        missed whatever happens next), and its prefill chunks come after those of the requests
        that can still meet theirs; decodes are never delayed by it.
    """

    __slots__ = ("activation_budget", "token_budget", "running_cap", "kv_reserve_ratio",
                 "class_budgets", "late_after_s")

    def __init__(
        self,
        activation_budget: int = UNLIMITED,
        token_budget: int = UNLIMITED,
        running_cap: int = UNLIMITED,
        kv_reserve_ratio: float | None = None,
        class_budgets: dict[int, int] | None = None,
        late_after_s: float | None = None,
    ) -> None:
        self.activation_budget = activation_budget
        self.token_budget = token_budget
        self.running_cap = running_cap
        self.kv_reserve_ratio = kv_reserve_ratio
        self.class_budgets = class_budgets
        self.late_after_s = late_after_s

    def __repr__(self) -> str:
        return (f"Decision(activation_budget={self.activation_budget}, token_budget={self.token_budget}, "
                f"running_cap={self.running_cap}, kv_reserve_ratio={self.kv_reserve_ratio}, "
                f"class_budgets={self.class_budgets}, late_after_s={self.late_after_s})")


class Rejection:
    """A refused arrival: the server answers 429 with ``Retry-After``."""

    __slots__ = ("reason", "retry_after_s")

    def __init__(self, reason: str, retry_after_s: float) -> None:
        self.reason = reason
        self.retry_after_s = retry_after_s

    def __repr__(self) -> str:
        return f"Rejection({self.reason!r}, retry_after_s={self.retry_after_s:.3g})"


#: Retry-After is always within these bounds (seconds): at least one second, and never so long
#: that a client gives up on the server (the openai client's default timeout is 600 s, its retries
#: stop waiting past 60 s)
RETRY_AFTER_MIN_S = 1.0
RETRY_AFTER_MAX_S = 60.0


def retry_after_s(obs: Observation, backlog: float | None = None) -> float:
    """Seconds until the backlog ahead of a new request drains at the observed completion rate,
    within [``RETRY_AFTER_MIN_S``, ``RETRY_AFTER_MAX_S``].

    :param backlog: requests ahead of a new one; defaults to the waiting queue plus one.
    """
    if backlog is None:
        backlog = obs.num_waiting + 1
    rate = obs.completion_rate_rps
    if rate > 0.0:
        wait = backlog / rate
    else:
        # Nothing has completed recently: one mean request lifetime.
        wait = obs.mean_output_tokens * obs.mean_step_time_s
    if not wait >= RETRY_AFTER_MIN_S:  # also NaN
        return RETRY_AFTER_MIN_S
    return min(wait, RETRY_AFTER_MAX_S)


@mypyc_attr(allow_interpreted_subclasses=True)  # controllers are the plug-in point, compiled or not
class Controller:
    """Base class: accepts every arrival (unless the queue limit is hit) and lets everything run.

    Every controller takes two overload options:

    :param max_waiting: reject arrivals while this many requests wait (None: no limit).
    :param queue_timeout_s: a request that waited this long without starting expires
        (None: never).
    """

    name: ClassVar[str] = "base"

    def __init__(self, max_waiting: int | None = None, queue_timeout_s: float | None = None) -> None:
        if max_waiting is not None and max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {max_waiting}")
        if queue_timeout_s is not None and queue_timeout_s <= 0:
            raise ValueError(f"queue_timeout_s must be > 0, got {queue_timeout_s}")
        self.max_waiting = max_waiting
        self.queue_timeout_s = queue_timeout_s

    def admit(self, obs: Observation, prompt_tokens: int, max_tokens: int) -> Rejection | None:
        """Decide on an arrival: None accepts it, a Rejection refuses it."""
        if self.max_waiting is not None and obs.num_waiting >= self.max_waiting:
            return Rejection(f"queue is full ({obs.num_waiting} waiting)", retry_after_s(obs))
        return None

    def decide(self, obs: Observation) -> Decision:
        """The Decision for the next step."""
        raise NotImplementedError

    def reads_slot_wait(self) -> bool:
        """Whether ``admit`` reads ``Observation.most_output_tokens`` and ``short_output_tokens`` (the
        TTFT prediction's wait for a slot): an engine may fill them only in the observations of arrivals
        for a controller that does."""
        return False

    def steady_decision(self) -> Decision | None:
        """The Decision ``decide`` returns, with no other effect, whatever the observation: the
        engine may then run the steps in which only decodes can happen without asking
        (``tidegate.engine.sim.steady.run_steady``). None (the default): ask at every step."""
        return None

    def reset(self) -> None:
        """Forget per-run state (called when an engine starts a new run)."""

    def use_wall_clock(self) -> None:
        """Called once by an engine on a wall clock (the real engine, the server): a controller with
        a wall-time budget enforces it from then on. Simulations never call it, so their results
        never depend on how fast the machine runs the controller."""

    def admission_state(self):
        """What ``admit`` reads besides the Observation and the constructor's options, as a small
        picklable value (None: nothing). A server that decides arrivals in another process copies it
        from the engine's controller into its own twin of the controller after every step."""
        return None

    def set_admission_state(self, state) -> None:
        """Take a value ``admission_state()`` returned on a twin of this controller."""


class AimdTokenBudget:
    """A step token budget by AIMD on the step time: ``additive`` tokens more after every step
    within ``tpot_slo_s``, times ``backoff`` after one that exceeded it, within
    [``min_budget``, ``max_budget``]; it starts at the ceiling. Long prefills then cannot stall
    the running requests' decodes for long.

    :param max_budget: the ceiling (``max_num_batched_tokens``).
    :param tpot_slo_s: the step-time target.
    :param min_budget: the floor (default: 256, or the ceiling if lower).
    :param additive: tokens added per step within the target.
    :param backoff: the factor after a step over the target.
    """

    __slots__ = ("max_budget", "tpot_slo_s", "min_budget", "additive", "backoff", "value")

    def __init__(self, max_budget: int, tpot_slo_s: float, min_budget: int | None = None, additive: int = 64,
                 backoff: float = 0.5) -> None:
        if min_budget is None:
            min_budget = min(256, max_budget)
        if not 1 <= min_budget <= max_budget:
            raise ValueError("need 1 <= min_token_budget <= max_num_batched_tokens")
        if not 0 < backoff < 1 or not tpot_slo_s > 0:
            raise ValueError("need 0 < backoff < 1 and tpot_slo_s > 0")
        self.max_budget = max_budget
        self.tpot_slo_s = tpot_slo_s
        self.min_budget = min_budget
        self.additive = additive
        self.backoff = backoff
        self.value = float(max_budget)

    def reset(self) -> None:
        self.value = float(self.max_budget)

    def update(self, obs: Observation) -> float:
        """The budget after the step ``obs`` reports (unchanged after an empty step)."""
        if obs.last_step_tokens:
            if obs.last_step_time_s <= self.tpot_slo_s:
                self.value = min(self.max_budget, self.value + self.additive)
            else:
                self.value = max(self.min_budget, self.value * self.backoff)
        return self.value
