"""SLO-aware flow control: the robust heuristic under the learned controller, and its fallback.

Five rules, each with a worst case that can be argued on its own:

- **Activation** at the memory-safe rate of Dong & Cao's flow control: a waiting request starts
  while the activation credit, refilled by ``b_safe = rho * M / w_hat`` per step (the rate whose
  steady KV demand is rho * M, Little's law on KV), allows it, or while requests of the mean size
  still fit at their peak into the free KV below rho * M, once the running requests have grown to
  the mean output (``ctrl.theory.headroom_activations``: a burst into free memory starts at
  once). Under any overload the KV demand stays near rho * M, so evictions stay rare; at light
  load every request starts at the next step. Where the steady arrivals ask between rho M and M of
  the memory, ``b_safe`` is slower than they are and the queue would grow without end; there the
  credit is refilled at Algorithm 1's budget ``M / w_hat``, stable for any arrivals within the
  memory (``ctrl.theory.stable_activation_rate``).
- **Token budget** by AIMD on the TPOT SLO (as ``watermark``): it grows while steps run within
  the SLO and halves when one did not, so long prefills cannot stall running decodes.
- **Admission** on a calibrated prediction (:func:`predicted_ttft_s`): an arrival is refused with
  429 only in overload, when work is queued ahead of it (requests waiting, the running cap reached,
  or prefill of running requests beyond one step's budget) *and* its predicted TTFT, counting that
  work, the running requests' decodes and its own prefill (with a profile, at least the profile's compute time
  for the prompt tokens ahead and its own, ``ctrl.theory.prefill_time_s``: prefill steps are the long ones, so
  a count of steps at the mean step time runs short where prompts are long), plus how late recent predictions
  ran (the engine's 95th percentile of realised minus predicted TTFT over its rate window,
  ``Observation.ttft_error_p95_s``: a burst that has passed no longer counts, so its errors cannot keep
  refusing at light load), or times one plus their 95th percentile relative to the predictions of a queue's
  wait (``Observation.ttft_rel_error_p95``) where that is more, exceeds ``reject_above`` x SLO. Overload
  has two witnesses, and neither can be defeated by refusing: arrivals outpace completions (u = arrival
  rate / completion rate above ``1 + overload_margin``; refusals shorten the queue, never the arrival
  rate), or the KV sits at rho M (the memory is the bottleneck, and what waits, waits for memory; u is
  then 1). A refused arrival
  would most likely have missed its SLO anyway, and in overload it would have taken capacity from
  those that can still meet theirs; the error term is a measured margin, not an assumed one.
  (``overload_power`` p > 0 divides the threshold by u^p, a shorter queue the deeper the overload;
  off by default: a burst inflates u and would then refuse requests its drain serves in time.)
  Without overload nothing is refused: a burst at light load drains by itself, and a late answer
  serves a user better than a 429. With nothing ahead of an arrival it is never refused, whatever
  the machine's speed. Both witnesses fire on noise at light load, so a third, the **capacity
  witness**, overrules them while the steady arrival rate stays under ``min_load`` x the replica's
  fluid bound (:meth:`SloFlowController.under_capacity`). Before the engine's rates span enough events, a
  fourth, :meth:`SloFlowController.over_capacity`, witnesses overload from the start: the arrival rate above
  the fluid bound by more than its own sampling error (a burst at start-up is then refused before any
  request has completed, instead of queued for a request's lifetime). The rates span 64 and 256 events,
  so a step in load after an idle spell reads as the idle spell for that many arrivals; the **busy period's
  witness** is the early one for every start (:meth:`SloFlowController.over_busy_capacity`): the arrivals
  since the engine was last empty, above the fluid bound by three standard errors. The **queue
  witness** needs no rate: with requests waiting, an arrival is refused when the predicted start of the
  work ahead of it alone, without its own prefill, the error margin or the residual, is past the
  threshold. By default (``loaded_queue_witness``) it judges only where the capacity witness cannot say
  the load is under capacity: a steady overload of a tenth of the bound passes the rate witness's margin,
  and its queue grows in bursts. Everywhere (``queue_witness``) it would also refuse at light load where
  long prompts queue, and without overload nothing is refused.
- **Running cap** (with a profile, ``tpot_cap``): in overload, the running requests are capped at the most
  whose mean step still meets the TPOT SLO with ``TPOT_Z`` standard errors of the batch's per-token cost to
  spare (:func:`ctrl.theory.tpot_running_cap`). Without overload the engine's own limit stands, so a cap
  cannot slow a load the replica serves.
- **Prefill order**: requests that already missed their TTFT SLO prefill after those that can
  still meet theirs (``Decision.late_after_s``), which serves at moderate load what refusals
  used to buy.

Three multipliers (:meth:`SloFlowController.set_residual`, all 1 by default) scale the activation
rate, the token budget and the admission threshold: the learned policy sets them, and at
multipliers 1 (its action 0) it is exactly this heuristic.
"""

from __future__ import annotations

import math
from typing import ClassVar

from tidegate.ctrl.base import (
    RATE_EVENTS, STEADY_RATE_EVENTS, UNLIMITED, AimdTokenBudget, Controller, Decision, Observation, Rejection,
    ReplicaProfile, retry_after_s,
)
from tidegate.ctrl.theory import (
    BURST_USAGE, STEADY_OVERLOAD, arrivals_seen, fluid_lambda_max, headroom_activations, prior_output,
    safe_activation_rate, shrunk_lambda_max_interval, prefill_time_s, stable_activation_rate, tpot_running_cap,
)

#: nothing is refused before this many arrivals: the engine's rate estimates span 64 events, and
#: over the first ones completions lag arrivals by a request's lifetime
EVIDENCE_ARRIVALS = 64
#: arrivals at this multiple of the completions (over the 64-event rates, whose ratio is within about
#: 18% at a steady load) witness overload even against the capacity witness
STRONG_OVERLOAD = 3.0
#: standard errors of margin on the capacity witness's steady arrival rate
CAPACITY_Z = 2.0
#: standard errors of margin on the capacity witness's recent arrival rate: tested at every arrival
#: over windows of 64, a run of 1,500 arrivals holds some 20 independent ones, so two (2.3% one-sided
#: each) would be crossed by chance at light load; three (0.13%) keep the run's chance near 3%
RECENT_Z = 3.0
#: the early witness (:meth:`SloFlowController.over_capacity`) judges from this many arrivals on:
#: at 3 x the bound, a Poisson count of 8 is above it by more than 2 standard errors
EARLY_ARRIVALS = 8


def predicted_ttft_s(obs: Observation, prompt_tokens: int, token_budget: float, target_usage: float = 0.9,
                     prior_output_tokens: int = 128, occupied: bool = True, running_cap: float = math.inf,
                     stable_rate: bool = True, profile: ReplicaProfile | None = None) -> float:
    """Seconds until the first token of an arrival with ``prompt_tokens``, from ``Observation`` only.

    The larger of two bounds, plus the step that produces the token:

    - **activation**: the ``num_waiting`` requests ahead, less those that fit into the free memory at
      once, start at the memory-safe rate while KV usage is under ``target_usage``; above it, only
      as running requests complete (the observed completion rate, or before any completion
      ``num_running`` per mean lifetime, Little's law); and whatever the memory, once the queue
      ahead and the arrival itself outnumber the slots ``running_cap`` leaves free, the rest start
      only as running requests complete (an engine's limit on running requests, vLLM's
      ``max_num_seqs``, binds before its memory does). Completions come in waves where the running
      requests started together (a burst, the start of a run, and its echo a lifetime later): after a
      silence longer than the mean gap the completion rate implies, the next completion is expected no
      sooner than the silence lasted (``Observation.last_completion_s``), so an arrival that needs a slot
      is not promised one in the middle of a wave's gap. Nor is the first slot expected free before the
      most advanced running request has decoded the short end of the recent outputs longer than any running
      request has yet (``Observation.short_output_tokens``): where all running requests are young (a wave
      that has just started), the rate of the completions before them says nothing of when theirs begin.
      Nor the k-th slot before the k-th most advanced has (``Observation.leading_outputs``; the last of them
      for any k beyond): a few old requests among a young wave free their slots soon, the wave's later;
    - **prefill**: the prompt tokens still to prefill of the running requests, of the queue ahead and
      its own, at the step's token budget less one token for each running request's decode.

    Step time is the engine's running mean. 0 before the first step was timed: no evidence of delay.
    With a ``profile``, the result is at least the profile's compute time for the prefill ahead and the
    arrival's own (``ctrl.theory.prefill_time_s``), from the first arrival on.

    :param occupied: the memory-safe rate is paced by the KV held per completion where that W is
        larger (``ctrl.theory.safe_activation_rate``), as slo-flow activates by default.
    :param running_cap: the most requests that run at once (the applied Decision's ``running_cap``).
    :param stable_rate: the rate is raised to Algorithm 1's where the arrivals are stable on the memory
        (``ctrl.theory.stable_activation_rate``), as slo-flow activates by default.
    :param profile: the replica's step model, for the compute bound on prefill (None: no bound).
    """
    bound = 0.0 if profile is None else prefill_time_s(obs, prompt_tokens, token_budget, profile)
    step_s = obs.mean_step_time_s or obs.last_step_time_s
    if not step_s > 0:
        return bound
    per_step = max(float(token_budget) - obs.num_running, 1.0)
    prefill_steps = (obs.running_prefill_tokens + obs.waiting_prompt_tokens + prompt_tokens) / per_step
    queue_steps = 0.0
    if obs.num_running > 0:
        # completions per step of requests that held a slot (a one-token answer frees only its own): the
        # observed rate, or before any completion Little's law
        done = obs.slot_completion_rate_rps * step_s
        if not done > 0:
            done = obs.num_running / (obs.mean_output_tokens or prior_output_tokens)
        if obs.num_waiting > 0:
            ahead = float(obs.num_waiting)
            if obs.kv_usage < target_usage:
                pace = stable_activation_rate if stable_rate else safe_activation_rate
                rate = pace(obs, target_usage, prior_output_tokens, occupied)
                # those that fit into the free memory start at once (the controller's burst)
                ahead = max(ahead - headroom_activations(obs, BURST_USAGE * target_usage, prior_output_tokens), 0.0)
            else:
                rate = done
            queue_steps = ahead / max(rate, 1e-9)
        # slots it waits for: the running requests past the cap (one it was lowered to) end before any starts
        short = obs.num_waiting + 1 - (running_cap - obs.num_running)
        if short > 0:
            if obs.last_completion_s >= 0.0:
                # completions come in waves where requests started together (a burst, the start): after a
                # silence longer than the rate's mean gap, the next is expected no sooner than the silence says
                silence = (obs.now_s - obs.last_completion_s) / step_s
                if silence * done > 1.0:
                    done = 1.0 / silence
            # nor before the most advanced running request reaches the short end of the outputs they can
            # still have: the first slot frees then at the earliest, the rest at the rate; and the k-th slot
            # not before the k-th most advanced reaches it (a wave started together ends together)
            first = max(obs.short_output_tokens - obs.most_output_tokens, 0)
            wave = first + max(short - 1.0, 0.0) / max(done, 1e-9)
            lead = obs.leading_outputs
            k = math.ceil(short)
            if lead and k <= obs.num_running:
                wave = max(wave, obs.short_output_tokens - lead[min(k, len(lead)) - 1])
            queue_steps = max(queue_steps, short / max(done, 1e-9), wave)
    return max((max(queue_steps, prefill_steps) + 1.0) * step_s, bound)


class SloFlowController(Controller):
    """:param ttft_slo_s: the TTFT SLO of the admission rule.
    :param tpot_slo_s: the step-time target of the AIMD token budget.
    :param reject_above: in overload, refuse an arrival whose predicted TTFT (plus the recent
        prediction error) exceeds ``reject_above`` x SLO / u^``overload_power``; ``inf`` never
        refuses on delay.
    :param overload_margin: arrivals may outpace completions by this fraction before anything is
        refused on that witness (the noise of two rate estimates over one window).
    :param overload_power: p of the threshold's 1 / u^p with the depth of overload u (0: none).
    :param memory_witness: a KV at ``target_usage`` witnesses overload too.
    :param min_completions: nothing is refused before this many requests have completed (no
        completion rate before; the shield's queue limit and timeout protect until then).
    :param profile: the replica's step-time coefficients and KV size, for the capacity witness.
    :param min_load: with a ``profile``, nothing is refused while the steady arrival rate is below
        this multiple of the fluid bound of the traffic seen so far (:meth:`under_capacity`): a
        replica offered less than it can serve is not overloaded, whatever a burst does to the
        other witnesses. Below 1 because the bound, estimated from the requests that completed,
        runs high while admission refuses the largest (3-13% at 1.2 x on summarisation lengths).
        0 turns the capacity witness off.
    :param steady_overload: steady arrivals above 1 + this times the steady completions overrule
        the capacity witness once ``STEADY_RATE_EVENTS`` arrived.
    :param size_error: the capacity witness's margin counts the sampling error of the traffic's
        mean KV workload besides that of the arrival rate.
    :param recent_rate: once more than ``RATE_EVENTS`` arrived (the recent rate spans fewer than all of them), the
        capacity witness also judges the recent arrival rate (over ``RATE_EVENTS``), with a margin of ``RECENT_Z``
        standard errors of that count and ``CAPACITY_Z`` of the bound's, in root sum of squares: the steady rate
        spans hundreds of arrivals, and a rise in the arrivals (a diurnal peak, a ramp) stays under it for as long.
    :param occupied_pacing: the memory-safe activation rate divides by the larger of the completed
        requests' W and the KV token-steps held per completion (``Observation.occupied_kv_workload``):
        while long outputs still run, the completed requests are the short ones, and a rate paced
        by their W overfills the KV (828 evictions against 354 in four draws of decode-heavy
        traffic at 2 x lambda_max).
    :param late_last: prefill the requests that can still meet the TTFT SLO before those that
        already missed it (``Decision.late_after_s``); off, in activation order.
    :param tpot_cap: with a ``profile``, in overload (the admission rule's witnesses), cap the running
        requests where more would take a request's TPOT past ``tpot_slo_s``
        (``ctrl.theory.tpot_running_cap``); off, and without overload, only ``max_num_seqs`` caps
        them: a burst at light load drains by itself, and a cap would only make it wait.
    :param stable_rate: where the steady arrivals ask between rho M and M of the memory, activate at Dong &
        Cao's Algorithm 1 budget ``M / w_hat`` instead of ``rho M / w_hat``, which is slower than them
        (``ctrl.theory.stable_activation_rate``); off, always ``rho M / w_hat`` (the shield's bound).
    :param prefill_bound: with a ``profile``, the admission rule's predicted TTFT is at least the profile's
        compute time for the prompt tokens ahead and the arrival's own (``ctrl.theory.prefill_time_s``): the
        engine's mean step is mostly decode steps, and a queue of long prompts prefills in steps several times
        as long; off, only the count of steps at the mean step time. The engine records the bounded
        prediction (``EngineCore``'s ``ttft_profile``), so the error term measures the errors of the
        prediction it corrects; with the bound off, it measures those of a higher one.
    :param relative_error: the predicted TTFT is also corrected in proportion, times one plus the 95th
        percentile of recent errors relative to the predictions of at least ``QUEUE_STEPS`` mean steps
        (``Observation.ttft_rel_error_p95``), where that is more than the error in seconds: a queue's wait is
        mispredicted in proportion to its length (a slot frees in lumps on a replica whose KV holds a few
        requests), while the error in seconds is mostly that of requests with nothing ahead.
    :param busy_witness: with a ``profile``, arrivals above the fluid bound within the current busy period witness
        overload too (:meth:`SloFlowController.over_busy_capacity`), until its arrivals outnumber the steady
        rate's span: the other witnesses' rates reach back past an idle spell.
    :param busy_mix: the busy period's witness judges its arrivals against the fluid bound of their own mix of
        sizes (:meth:`SloFlowController.busy_bound`), not the traffic's so far.
    :param queue_witness: with requests waiting and no other witness of overload, refuse an arrival when the
        predicted TTFT of the work ahead of it alone (``predict_ttft_s`` of a prompt of 0 tokens: no error
        margin, no residual, not its own prefill) exceeds ``reject_above`` x SLO. The rates the other
        witnesses read span 64 and 256 events, and a step in load after an idle spell reads as the spell for
        that many arrivals (on the twin of a vLLM CPU replica stepping to 3 x its capacity after a pause, 224
        of the 270 requests that missed their TTFT arrived in the step's first 15 s; 108 with the witness).
        Off by default: on the A100 preset's long-context and multi-class traffic at 0.5-0.7 x lambda_max it
        refused up to 31 of 800 requests a draw (goodput -0.4% to +5.3%), where nothing is to be refused.
    :param loaded_queue_witness: with a ``profile``, once ``EVIDENCE_ARRIVALS`` arrived, the queue witness judges where
        the capacity witness cannot say the load is under capacity (:meth:`under_capacity`), as it judges everywhere
        with ``queue_witness``: the
        offered rate near or past the bound, but arrivals outpacing completions by less than ``overload_margin``
        over 64 events, which a steady overload by a tenth of the bound does (on vLLM's CPU build at 1.12 x what
        it served within the SLOs, a burst queued 13 requests for 3.5 s before the rate witness fired, and 8
        first tokens were late). Where the load reads as under capacity, as light load does, it does not judge.
    :param backlog_witness: with ``loaded_queue_witness``, once ``EVIDENCE_ARRIVALS`` arrived, where the load does not
        read as under capacity (:meth:`under_capacity`) and work is ahead of an arrival (requests waiting, or more
        prefill left to the running requests than one step's token budget), arrivals are judged as in overload:
        refused where their predicted TTFT with the measured error is past ``reject_above`` x SLO (no residual, as
        the queue witness: a policy cannot make it refuse). Chunked prefill
        activates arrivals at once, so a queue can sit inside the running requests, where the queue witness (which
        judges requests waiting) does not see it: on the twin of a vLLM CPU replica at 1.12 x what it serves within
        the SLOs, with the token budget held near its floor by steps past the TPOT SLO, four prompts' prefill waited
        in the running set with nothing queued and no rate witness firing, and 1.1% of first tokens were late.
    :param prior_weight: the completions' worth of the prior (``prior_output_tokens`` as every request's output)
        that the traffic's size moments are shrunk towards (:meth:`traffic_bound`). The prior is a guess about
        the outputs, right for no traffic in particular: it pulls the bound up where the outputs are longer and
        down where they are shorter, and with the weight of 32 completions it still held a quarter of the
        estimate after a hundred (on tiny-cpu's chat, outputs of 353 tokens, the bound read 1.3 x the true one,
        so that 1.24 x of it read as under capacity and 101 admitted requests missed their TTFT in one draw).
        The decodes' KV reads per completion already count the long outputs still running, which completions
        leave out at the start.

    :param target_usage: rho of the memory-safe activation rate.
    :param prior_output_tokens: output length assumed before any request completed.
    :param max_num_batched_tokens: ceiling (and start) of the token budget.
    :param min_token_budget: floor of the token budget (default: 256, or the ceiling if lower).
    :param additive_tokens: token budget increase per step within the SLO.
    :param backoff: multiplicative decrease when a step exceeded the SLO.
    :param max_num_seqs: most running requests.
    """

    name: ClassVar[str] = "slo-flow"

    def __init__(self, ttft_slo_s: float = 2.0, tpot_slo_s: float = 0.1, reject_above: float = 1.0,
                 overload_margin: float = 0.2, min_completions: int = 1,
                 target_usage: float = 0.9, prior_output_tokens: int = 128, max_num_batched_tokens: int = 8192,
                 min_token_budget: int | None = None, additive_tokens: int = 64, backoff: float = 0.5,
                 max_num_seqs: int = 256, overload_power: float = 0.0, memory_witness: bool = True,
                 profile: ReplicaProfile | None = None, min_load: float = 0.85, late_last: bool = True,
                 steady_overload: float = STEADY_OVERLOAD, size_error: bool = True, occupied_pacing: bool = True,
                 tpot_cap: bool = True, stable_rate: bool = True, recent_rate: bool = True, prefill_bound: bool = True,
                 relative_error: bool = True, busy_witness: bool = True, busy_mix: bool = True,
                 queue_witness: bool = False, prior_weight: float = 8.0, max_waiting: int | None = None,
                 queue_timeout_s: float | None = None, loaded_queue_witness: bool = True,
                 backlog_witness: bool = True) -> None:
        super().__init__(max_waiting=max_waiting, queue_timeout_s=queue_timeout_s)
        if not (ttft_slo_s > 0 and tpot_slo_s > 0 and reject_above > 0 and overload_margin >= 0
                and overload_power >= 0 and min_load >= 0 and steady_overload >= 0 and prior_weight > 0):
            raise ValueError("need ttft_slo_s > 0, tpot_slo_s > 0, reject_above > 0, overload_margin >= 0, "
                             "overload_power >= 0, min_load >= 0, steady_overload >= 0 and prior_weight > 0")
        if not 0 < target_usage <= 1 or prior_output_tokens < 1:
            raise ValueError("need 0 < target_usage <= 1 and prior_output_tokens >= 1")
        self.aimd = AimdTokenBudget(max_num_batched_tokens, tpot_slo_s, min_token_budget, additive_tokens, backoff)
        self.ttft_slo_s = ttft_slo_s
        self.tpot_slo_s = tpot_slo_s
        self.reject_above = reject_above
        self.overload_margin = overload_margin
        self.min_completions = max(1, int(min_completions))
        self.target_usage = target_usage
        self.prior_output_tokens = prior_output_tokens
        self.prior_weight = float(prior_weight)
        self.max_budget = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.overload_power = overload_power
        self.memory_witness = memory_witness
        self.profile = profile
        self.steady_overload = steady_overload
        self.size_error = size_error
        self.recent_rate = recent_rate
        self.occupied_pacing = occupied_pacing
        self.min_load = min_load if profile is not None else 0.0
        self.tpot_cap = tpot_cap and profile is not None
        self.stable_rate = stable_rate
        self.prefill_bound = prefill_bound and profile is not None
        self.relative_error = relative_error
        self.busy_witness = busy_witness and profile is not None
        self.busy_mix = busy_mix
        self.queue_witness = queue_witness
        self.loaded_queue_witness = loaded_queue_witness and self.min_load > 0
        self.backlog_witness = backlog_witness
        self._decision = Decision(0, max_num_batched_tokens, max_num_seqs,
                                  late_after_s=float(ttft_slo_s) if late_last else None)
        self.reset()

    def reset(self) -> None:
        self.set_residual()
        self.aimd.reset()
        self._credit = 0.0
        self._longest_allowed = 0
        self._decision.token_budget = self.max_budget
        self._decision.running_cap = self.max_num_seqs

    def output_prior(self, obs: Observation) -> int:
        """The output length assumed before the first completion: ``prior_output_tokens``, or the largest
        ``max_tokens`` of any arrival judged so far where that is less. No output runs past its ``max_tokens``, so
        while every arrival asked for fewer tokens than the prior, the prior overstates every output, and with it
        the memory each request holds and how long its slot is held (on Dong & Cao's slot model, outputs of 20
        tokens against the prior's 128 made the bound read 0.7 x its load as over capacity, and 21 of 4,590
        arrivals were refused before the first completion). The largest, not the mean: a spell of one-token probes
        must not make the requests that follow it look short. From the first completion on, the traffic's sizes are
        shrunk towards ``prior_output_tokens`` itself (``prior_weight``): a margin while few outputs are known
        (with the prior at the outputs' own 64 tokens, a step to 3 x after an idle spell had 2-5 fewer of ~95
        requests within the SLOs in six draws out of six)."""
        return prior_output(obs, self.prior_output_tokens, self._longest_allowed)

    def set_residual(self, activation_scale: float = 1.0, token_scale: float = 1.0,
                     reject_scale: float = 1.0) -> None:
        """Multiply the activation rate, the token budget and the admission threshold (all > 0)."""
        self.activation_scale = activation_scale
        self.token_scale = token_scale
        self.reject_scale = reject_scale

    def admission_state(self) -> tuple[float, int, int]:
        """What ``admit`` reads besides the Observation: the admission residual, the token budget and the
        running cap (a twin deciding arrivals in another process never runs ``decide``, and without the cap
        it predicts the queue to start at the memory's rate while it waits for the cap's slots)."""
        return self.reject_scale, self._decision.token_budget, self._decision.running_cap

    def set_admission_state(self, state) -> None:
        if state is not None:
            self.reject_scale, self._decision.token_budget, self._decision.running_cap = state

    def reject_delay_s(self, obs: Observation) -> float:
        """The predicted TTFT above which arrivals are refused: ``inf`` without overload; in
        overload ``reject_above`` x SLO / u^``overload_power`` (times the residual).

        Overload has two witnesses: arrivals outpace completions by more than ``overload_margin``
        (times the residual where it is above 1; u = arrival rate / completion rate), or the KV is
        at ``target_usage`` (the memory is the bottleneck, so whatever waits, waits for memory; u
        is then taken as 1). Either is overruled by the capacity witness (:meth:`under_capacity`),
        except arrivals at ``STRONG_OVERLOAD`` times the completions or more. Before
        ``EVIDENCE_ARRIVALS`` arrivals, nothing is judged."""
        done = obs.completion_rate_rps
        limit = self.reject_above * self.reject_scale * self.ttft_slo_s
        if obs.completed_total < self.min_completions or arrivals_seen(obs) < EVIDENCE_ARRIVALS:
            # the rates cannot witness yet (the first completion comes a request's life after the
            # first arrival); arrivals beyond the fluid bound can
            return limit if self.over_capacity(obs) or self.over_busy_capacity(obs) else math.inf
        if self.over_busy_capacity(obs):
            return limit
        # the residual may widen the margin, never narrow it: without overload nothing is refused,
        # whatever a policy asks
        margin = self.overload_margin * max(self.reject_scale, 1.0)
        if done > 0 and obs.arrival_rate_rps > done * (1.0 + margin):
            u = obs.arrival_rate_rps / done
            if u >= STRONG_OVERLOAD or not self.under_capacity(obs):
                return limit / u ** self.overload_power
            return math.inf
        if self.memory_witness and obs.kv_usage >= self.target_usage and not self.under_capacity(obs):
            return limit
        return math.inf

    def under_capacity(self, obs: Observation) -> bool:
        """The capacity witness: the replica is offered less than it can serve, so it is not
        overloaded, whatever a burst does to the other witnesses. Off without a profile.

        - The steady arrival rate (``Observation.offered_rate_rps``) is below ``min_load`` x the
          fluid bound of the traffic offered so far (``ctrl.theory.shrunk_lambda_max_interval``),
          with ``CAPACITY_Z`` standard errors of margin: the threshold is ``min_load`` (1 + z se),
          se^2 = 1 / n for the n <= 256 arrivals the rate spans (a Poisson count) plus the bound's
          relative error from the sampling error of W (``size_error``). The fluid bound is what
          no controller can serve more of, and the load is judged against it, not against the
          completions: at 0.7 x the bound, a backlog left by a burst drains by itself.
        - *and*, once more than ``RATE_EVENTS`` arrived, the recent arrival rate
          (``Observation.arrival_rate_rps``, over ``RATE_EVENTS``) is below ``min_load`` x the bound with a
          margin of ``RECENT_Z`` standard errors of its own count and ``CAPACITY_Z`` of the bound's, in root
          sum of squares (``recent_rate``): the steady rate averages over hundreds of arrivals, so a peak
          that lasts fewer (a diurnal peak on a slow replica, at 1.3-1.7 x its bound for minutes while the
          steady rate read 0.8 x) would otherwise be queued without refusal until it had passed. The count's
          error is tested anew at every arrival (hence three standard errors); the bound's is one error that
          every test shares (hence two, as the steady test's). Before ``RATE_EVENTS`` arrivals the recent
          rate spans every arrival, as the steady one does; from then on the steady one still spans every
          arrival up to ``STEADY_RATE_EVENTS``, which on a replica that serves a few tenths of a request a
          second is ten minutes.
        - *and* the steady rates (over ``STEADY_RATE_EVENTS`` events, once that many arrived)
          show arrivals at most ``1 + steady_overload`` x completions: the bound's sizes are
          estimates, too high while the longest requests of a heavy tail have not been sampled;
          a backlog that grows over hundreds of arrivals shows the overload anyway.
        """
        if not self.min_load > 0:
            return False
        seen = arrivals_seen(obs)
        if seen >= STEADY_RATE_EVENTS and obs.offered_rate_rps > obs.served_rate_rps * (1.0 + self.steady_overload):
            return False
        assert self.profile is not None
        bound, rse = self.traffic_bound(obs)
        if not self.size_error:
            rse = 0.0
        se = math.sqrt(1.0 / max(min(seen, STEADY_RATE_EVENTS), 1) + rse * rse)
        if not obs.offered_rate_rps / bound < self.min_load * (1.0 + CAPACITY_Z * se):
            return False
        if self.recent_rate and seen > RATE_EVENTS:  # before, the recent rate spans every arrival, as the steady one
            # the count's error is tested at every arrival (RECENT_Z), the bound's is one error shared by every test
            margin = math.hypot(RECENT_Z / math.sqrt(RATE_EVENTS), CAPACITY_Z * rse)
            return obs.arrival_rate_rps / bound < self.min_load * (1.0 + margin)
        return True

    def over_capacity(self, obs: Observation) -> bool:
        """The early witness of overload, for the start, before completions can witness it: at least
        ``EARLY_ARRIVALS`` arrived, and the steady arrival rate is above the fluid bound of the
        traffic offered so far by ``CAPACITY_Z`` standard errors of a Poisson count of the arrivals
        (1 / sqrt(n)) and of the bound (:meth:`under_capacity`). Off without a profile. Before any
        completion the bound takes the prior output length; an output longer than the prior makes
        the bound too high, and then this witness silent, never wrong."""
        seen = arrivals_seen(obs)
        if not (self.min_load > 0 and seen >= EARLY_ARRIVALS):
            return False
        assert self.profile is not None
        bound, rse = self.traffic_bound(obs)
        se = math.sqrt(1.0 / min(seen, STEADY_RATE_EVENTS) + (rse * rse if self.size_error else 0.0))
        return obs.offered_rate_rps > bound * (1.0 + CAPACITY_Z * se)

    def over_busy_capacity(self, obs: Observation) -> bool:
        """The busy period's witness of overload (``busy_witness``): the current busy period's last ``RATE_EVENTS``
        arrivals at most (``Observation.busy_rate_rps``) came faster than the fluid bound (raised by ``RECENT_Z``
        standard errors of its own, ``ctrl.theory.shrunk_lambda_max_interval``) brings them, by more than
        ``RECENT_Z`` standard errors of a Poisson count: the gaps after the window's first arrival, against the
        arrivals the bound brings in the time they took, by Wilson and Hilferty's cube root of Poisson's upper
        tail. From ``EARLY_ARRIVALS`` arrivals of the busy period to ``STEADY_RATE_EVENTS``: before, too few; after,
        the steady rates span the busy period alone, and the other witnesses judge it.

        The other witnesses' rates span 64 and 256 arrivals and a 10-second average, so after an idle spell
        they read the spell for that long: on the twin of a vLLM CPU replica stepping from idle to 3 x its
        capacity, nine in ten late first tokens of the step came in its first 15 s. The test's threshold is
        about 4.5 x the bound over 7 gaps, 2.5 x over 15 and 1.5 x over 63; a Poisson stream at the bound crosses
        it with a chance of about 0.13% per window, and at 0.7 x the bound with 1.4e-4 over 7 gaps, 3e-5 over 15
        and 4e-8 over 63. The rate's own normal error (a Wald test) understates Poisson's upper tail for few
        gaps: at three of them it fired on clusters of 16 arrivals at 2.1 x the bound, a chance of 2% at the
        bound, and refused at 0.7 x on the CPU profiles. Even when it fires, only arrivals whose predicted TTFT
        is past the SLO are refused."""
        n = obs.busy_arrivals
        if not (self.busy_witness and EARLY_ARRIVALS <= n < STEADY_RATE_EVENTS):
            return False
        assert self.profile is not None
        # the lower of the bounds of the busy period's mix and of the traffic so far: the first follows a change
        # of sizes at once, the second counts the long outputs still running, which completions leave out
        traffic = self.traffic_bound(obs)
        mix = self.busy_bound(obs, traffic)
        high = math.inf
        for bound, rse in (mix, traffic) if mix is not traffic else (traffic,):
            high = min(high, bound * (1.0 + RECENT_Z * rse) if self.size_error else bound)
        rate = obs.busy_rate_rps
        if not rate > high:
            return False
        # the arrivals after the window's first, against what the bound brings in the time they took: Poisson's
        # upper tail by the Wilson-Hilferty cube root (a rate's normal error understates that tail for few gaps)
        gaps = min(n, RATE_EVENTS) - 1
        expected = gaps * high / rate
        return 3.0 * math.sqrt(gaps) * (1.0 - 1.0 / (9.0 * gaps) - (expected / gaps) ** (1.0 / 3.0)) > RECENT_Z

    def traffic_bound(self, obs: Observation) -> tuple[float, float]:
        """The fluid bound of the traffic offered so far and its relative standard error
        (``ctrl.theory.shrunk_lambda_max_interval``, shrunk towards the prior with ``prior_weight`` completions)."""
        assert self.profile is not None
        return shrunk_lambda_max_interval(obs, self.profile, self.output_prior(obs), self.prior_weight)

    def busy_bound(self, obs: Observation, traffic: tuple[float, float] | None = None) -> tuple[float, float]:
        """The fluid bound of the busy period's own arrivals and its relative standard error: their mean prompt,
        expected output and W (``Observation.busy_kv_workload``, each arrival's output expected from the recent
        completions of its prompt's size), the error of their mean W over the arrivals counted; the traffic
        offered so far (``ctrl.theory.shrunk_lambda_max_interval``) before any output can be expected. The
        rate the witness judges is these arrivals' rate, so the bound is their mix's: after an idle spell of
        one-token probes the offered output had fallen to half the long answers' that followed, and the
        bound of the traffic so far to twice theirs, which hid the step.

        :param traffic: the traffic's bound, where the caller has it already (returned as it is in its place)."""
        assert self.profile is not None
        w, share = obs.busy_kv_workload, obs.busy_unsized_share
        if not (self.busy_mix and (w > 0.0 or share > 0.0)):
            return traffic or self.traffic_bound(obs)
        p, d, se = obs.busy_prompt_tokens, obs.busy_output_tokens, obs.busy_kv_workload_se
        if share > 0.0:  # arrivals of sizes none completed of: the prior's output (its error is not known)
            d0 = float(self.output_prior(obs))
            unsized_p = obs.busy_unsized_prompt_tokens
            p, d = (1.0 - share) * p + share * unsized_p, (1.0 - share) * d + share * d0
            w = (1.0 - share) * w + share * (unsized_p * d0 + d0 * (d0 + 1.0) / 2.0)
            se *= 1.0 - share
        m = obs.kv_capacity_tokens or self.profile.kv_capacity_tokens
        bound = fluid_lambda_max(p + d, w, self.profile, m, d, self.profile.max_num_seqs)
        return bound, se / w

    def predict_ttft_s(self, obs: Observation, prompt_tokens: int) -> float:
        """:func:`predicted_ttft_s` with this controller's token budget and rho."""
        return predicted_ttft_s(obs, prompt_tokens, self._decision.token_budget, self.target_usage,
                                self.output_prior(obs), self.occupied_pacing, self._decision.running_cap,
                                self.stable_rate, self.profile if self.prefill_bound else None)

    def reads_slot_wait(self) -> bool:
        return True

    def nothing_ahead(self, obs: Observation) -> bool:
        """No request waits, a slot is free under the running cap, and the running requests' prefill fits
        into the next step: an arrival starts at once, so refusing it would shorten nobody's wait. (With
        the running cap reached, it waits for a running request to complete: that is ahead of it.)"""
        return (obs.num_waiting <= 0 and obs.num_running < self._decision.running_cap
                and obs.running_prefill_tokens <= self._decision.token_budget)

    def admit(self, obs: Observation, prompt_tokens: int, max_tokens: int) -> Rejection | None:
        self._longest_allowed = max(self._longest_allowed, max_tokens)
        rejection = super().admit(obs, prompt_tokens, max_tokens)
        if rejection is not None or self.nothing_ahead(obs):
            return rejection
        limit = self.reject_delay_s(obs)
        if not limit < math.inf:
            # no rate witnessed overload: work ahead (requests waiting; with the backlog witness, prefill left to the
            # running requests past one step too) where the load does not read as under capacity is judged on
            waiting = obs.num_waiting > 0
            ahead = waiting or (self.backlog_witness and obs.running_prefill_tokens > self._decision.token_budget)
            loaded = (self.loaded_queue_witness and ahead and arrivals_seen(obs) >= EVIDENCE_ARRIVALS
                      and not self.under_capacity(obs))
            if loaded and self.backlog_witness:
                # the backlog witness: judged as in overload below (no residual: a policy cannot make it refuse)
                limit = self.reject_above * self.ttft_slo_s
            else:
                if waiting and (self.queue_witness or loaded):
                    # the queue witness: the work ahead alone, by the prediction alone (no error margin, no
                    # residual: a policy cannot make it refuse), starts this arrival past the threshold; by
                    # default only where the load does not read as under capacity
                    threshold = self.reject_above * self.ttft_slo_s
                    queue = self.predict_ttft_s(obs, 0)
                    if queue > threshold:
                        return Rejection(f"queue ahead predicted to take {queue:.3g} s, past {threshold:.3g} s",
                                         retry_after_s(obs))
                return None
        predicted = self.predict_ttft_s(obs, prompt_tokens)
        delay = predicted + max(obs.ttft_error_p95_s, 0.0)
        if self.relative_error:
            delay = max(delay, predicted * (1.0 + max(obs.ttft_rel_error_p95, 0.0)))
        if delay > limit:
            return Rejection(f"predicted TTFT {delay:.3g} s exceeds {limit:.3g} s in overload", retry_after_s(obs))
        return None

    def decide(self, obs: Observation) -> Decision:
        d = self._decision
        d.token_budget = max(1, min(self.max_budget, int(self.aimd.update(obs) * self.token_scale)))
        if self.tpot_cap:
            if self.reject_delay_s(obs) < math.inf:  # overload: what runs past the cap would miss its TPOT
                assert self.profile is not None
                cap = int(min(self.max_num_seqs, tpot_running_cap(obs, self.profile, self.tpot_slo_s,
                                                                  self.output_prior(obs))))
                # lowered in overload, it strands none of the requests admitted into a free slot of the cap
                # before (one would wait behind a wave of running requests for their lifetime: 5-17 s in the twin
                # of a vLLM CPU replica at 3 x, where the cap moves by a slot or two with its estimates): where the
                # cap before held every running and waiting request, it falls to the new one as they end. Where
                # requests queued past it, they were promised a wait for slots, and where overload begins the
                # cap applies at once: what runs past it would miss its TPOT
                held, holding = d.running_cap, obs.num_running + obs.num_waiting
                if holding <= held < self.max_num_seqs:
                    cap = max(cap, holding)
                d.running_cap = cap
            else:
                d.running_cap = self.max_num_seqs
        pace = stable_activation_rate if self.stable_rate else safe_activation_rate
        rate = self.activation_scale * pace(obs, self.target_usage, self.output_prior(obs),
                                            occupied=self.occupied_pacing)
        credit = self._credit + rate
        burst = int(self.activation_scale * headroom_activations(obs, BURST_USAGE * self.target_usage,
                                                                 self.output_prior(obs)))
        n = min(max(int(credit), burst), obs.num_waiting) if credit < UNLIMITED else obs.num_waiting
        if n == 0 and obs.num_running == 0 and obs.num_waiting > 0:
            n = 1  # liveness: an idle engine always starts the queue head
        # unused credit does not pile up into a burst while the queue is short
        self._credit = min(max(credit - n, 0.0), max(rate, 1.0))
        d.activation_budget = n
        return d
