"""Flow-control theory of Dong & Cao (arXiv 2604.11001) and the fluid throughput bound.

Time is counted in steps (slots); a request with prompt l holds l + j KV entries after its
j-th output token.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from tidegate.ctrl.base import STEADY_RATE_EVENTS, Observation, ReplicaProfile


def lifetime_kv_workload(prompt_tokens, output_tokens):
    """w = l*o + (o + o^2)/2: the KV token-steps a request occupies over its life."""
    l = np.asarray(prompt_tokens, dtype=float)
    o = np.asarray(output_tokens, dtype=float)
    w = l * o + (o + o * o) / 2
    return float(w) if w.ndim == 0 else w


def estimated_kv_workload(obs: Observation, prior_output_tokens: int) -> float:
    """w_hat: the engine's running estimate of the lifetime KV workload once requests have
    completed; before that (or when the estimate is not a positive number) the queue head's
    prompt (or the mean prompt) with ``prior_output_tokens`` of output."""
    w = obs.lifetime_kv_workload
    if obs.completed_total > 0 and w > 0:
        return w
    l = obs.head_prompt_tokens or obs.mean_prompt_tokens or 1.0
    return float(lifetime_kv_workload(l, prior_output_tokens))


def prior_output(obs: Observation, prior_output_tokens: int, longest_allowed: int) -> int:
    """The output length assumed before the first completion: ``prior_output_tokens``, or the largest
    ``max_tokens`` of the arrivals judged so far (``longest_allowed``, 0 before any) where that is less. No output
    runs past its ``max_tokens``, so the smaller still overstates every request's output. The largest, not the
    mean: a spell of one-token probes must not make the requests that follow it look short."""
    if obs.completed_total > 0 or not longest_allowed > 0:
        return prior_output_tokens
    return min(prior_output_tokens, longest_allowed)


#: a burst of activations may fill the KV up to this fraction of rho M at once (requests of the mean
#: size, counted at their peak); above it, only the memory-safe rate: a burst at light load starts
#: at once, as under a greedy scheduler, while an overloaded replica, whose KV sits near rho M, is
#: paced by the rate (its evictions stay rare whatever the tail of output lengths)
BURST_USAGE = 1.0


def headroom_activations(obs: Observation, target_usage: float, prior_output_tokens: int) -> int:
    """How many more requests of the mean size fit at their peak (prompt plus output) into the KV
    below ``target_usage`` x M right now, the running requests counted at their mean peak too:
    ``(rho M - used - growth) / (E[P] + E[D])``, 0 when nothing is left.

    The memory-safe *rate* of flow control bounds the steady state; this bounds a burst: while the
    memory is mostly free, a burst of arrivals can start at once instead of at the steady rate.
    ``growth`` is what the running requests still need to reach the mean output each:
    ``num_running`` E[D] less the output they hold (the KV beyond their prompts,
    ``running_prompt_tokens``), never below 0. A burst that fits only into memory the running
    requests are about to take is no burst the memory can hold: at the onset of an overload of
    long outputs it filled the KV and the running requests were evicted as they grew."""
    free = target_usage * obs.kv_capacity_tokens - obs.kv_used_tokens
    if free <= 0:
        return 0
    if obs.completed_total > 0 and obs.mean_output_tokens > 0:
        p, d = obs.mean_prompt_tokens, obs.mean_output_tokens
    else:
        p = obs.head_prompt_tokens or obs.mean_prompt_tokens or 1.0
        d = float(prior_output_tokens)
    held = max(obs.kv_used_tokens - obs.running_prompt_tokens, 0)
    free -= max(obs.num_running * d - held, 0.0)
    if free <= 0:
        return 0
    return int(free / max(p + d, 1.0))


def pacing_kv_workload(obs: Observation, prior_output_tokens: int, occupied: bool = False) -> float:
    """The w_hat the activation rates are paced by: :func:`estimated_kv_workload`, or with ``occupied`` the larger
    of it and the KV token-steps held per completion (``Observation.occupied_kv_workload``), which counts the
    requests still running: sound from the start on long-output traffic; in steady state it also counts the
    memory long prompts hold while they prefill."""
    w = estimated_kv_workload(obs, prior_output_tokens)
    if occupied and obs.completed_total > 0 and obs.occupied_kv_workload > w:
        w = obs.occupied_kv_workload
    return w


def safe_activation_rate(obs: Observation, target_usage: float, prior_output_tokens: int,
                         occupied: bool = False) -> float:
    """``b_safe = rho * M / w_hat``: activations per step whose steady KV demand is rho * M (w_hat:
    :func:`pacing_kv_workload`)."""
    return target_usage * obs.kv_capacity_tokens / pacing_kv_workload(obs, prior_output_tokens, occupied)


def arrivals_seen(obs: Observation) -> int:
    """Arrivals so far, as far as the Observation tells: completed, refused, waiting or running."""
    return obs.completed_total + obs.rejections_total + obs.num_waiting + obs.num_running


#: standard errors of the demand's rate by which :func:`stable_activation_rate` widens the stable band
DEMAND_Z = 2.0
#: steady arrivals above 1 + this times the steady completions overrule the capacity witness (slo-flow) and keep
#: the stable band from reaching past M: three standard errors of the ratio of two independent 256-event Poisson
#: rates (sqrt(2 / 256), about 9%). The test runs at every arrival, so a margin of 1.7 standard errors (1.15,
#: earlier) fired by chance at light load; it is there for an overload the bound does not show, and the bound now
#: counts the long outputs still running (``Observation.decode_kv_workload``)
STEADY_OVERLOAD = 3.0 * math.sqrt(2.0 / STEADY_RATE_EVENTS)


def stable_activation_rate(obs: Observation, target_usage: float, prior_output_tokens: int,
                           occupied: bool = False) -> float:
    """The memory-safe rate, raised to Dong & Cao's Algorithm 1 where the offered traffic is stable on the memory.

    ``b_safe = rho M / w_hat`` (:func:`safe_activation_rate`) holds the steady KV demand at rho M, so it is slower
    than the arrivals once they ask more than rho M of the memory: a load between rho and 1 of the memory's bound
    then queues without end, though Algorithm 1 serves it (a budget b with ``b w <= M`` is stable for arrivals
    below b). Where the steady arrivals per step (``Observation.offered_rate_rps`` x the mean step, refused
    arrivals counted, so refusing cannot hide them) ask between rho M and M (``rho M < lambda w_hat <= M``:
    Algorithm 1's memory condition, the traffic taken as one class of the mean W), the rate is Algorithm 1's
    largest budget, ``M / w_hat``: the queue drains, and the steady KV demand is the arrivals' own, at most M.
    Elsewhere it is ``b_safe``: below rho M it already outpaces the arrivals, and beyond M (overload) no rate
    serves them all, so the memory stays at rho M and admission refuses the excess. Before the steady rate spans
    ``STEADY_RATE_EVENTS`` arrivals and W a completion, ``b_safe``: a rate from a few arrivals can read an
    overload as a stable load (at 3 x the memory's bound, the first rates read 0.2 x), and a queue cannot have
    grown much yet.

    The demand is an estimate: the rate is Algorithm 1's wherever ``DEMAND_Z`` standard errors of a count of
    ``STEADY_RATE_EVENTS`` arrivals put the demand between rho M and M. A stable load near the bound whose estimate
    reads a few percent beyond M is not an overload (three classes at 0.96 of the slot model's bound read up to 1.007
    M, and the rate fell to b_safe, 11% below the arrivals, with the KV at 84% and 130 requests waiting). Choosing
    ``M / w_hat`` in error costs little: below rho M the arrivals, not the rate, bound the activations, and a slight
    overload runs the memory near M while admission refuses the excess. Past M the band reaches only while the steady
    completions keep up with the arrivals (within ``STEADY_OVERLOAD``): a replica whose steps bind before its memory
    (the tiny CPU one at 3 x lambda_max) reads its demand near M while it falls behind, and there filling the memory
    cost the learned controller 0.927 -> 0.897 of the best heuristic on bursty traffic. The W's own error is left
    out of the band: on heavy-tailed sizes it spans tens of percent (with it: 0.884 there).
    """
    memory = float(obs.kv_capacity_tokens)
    w = pacing_kv_workload(obs, prior_output_tokens, occupied)
    b_safe = target_usage * memory / w
    step_s = obs.mean_step_time_s
    if not (step_s > 0 and obs.completed_total > 0 and arrivals_seen(obs) >= STEADY_RATE_EVENTS):
        return b_safe
    demand = obs.offered_rate_rps * step_s * w
    margin = DEMAND_Z / math.sqrt(STEADY_RATE_EVENTS)
    if demand * (1.0 + margin) > target_usage * memory and (
            demand <= memory
            or (demand * (1.0 - margin) <= memory
                and obs.offered_rate_rps <= obs.served_rate_rps * (1.0 + STEADY_OVERLOAD))):
        return memory / w
    return b_safe


def necessary_rate_bound(lifetime_kv: float, kv_capacity_tokens: int) -> float:
    """The largest arrival rate (requests per step) any stable scheduler can sustain for one
    class: lambda * w <= M."""
    return kv_capacity_tokens / lifetime_kv


def class_budgets_feasible(budgets, lifetime_kv, kv_capacity_tokens: int) -> bool:
    """Algorithm 1's memory condition: sum_k b_k * w_k <= M."""
    return float(np.dot(budgets, lifetime_kv)) <= kv_capacity_tokens


@dataclass(frozen=True)
class Capacity:
    """What a workload asks of one replica, and what the replica can give."""

    mean_tokens_per_request: float   # S = E[P] + E[D]
    lifetime_kv_workload: float      # W = E[P*D] + E[D(D+1)]/2
    kv_capacity_tokens: int          # M
    memory_bound_rps: float          # M / (W * step time at full memory): the necessary condition in seconds
    lambda_max_rps: float            # fluid bound 1 / (a W / M + c W + b S)

    def as_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)

    def __reduce__(self) -> tuple[type[Capacity], tuple[float, float, int, float, float]]:
        """Pickled by its fields (a compiled frozen dataclass's default would set them one by one)."""
        return type(self), (self.mean_tokens_per_request, self.lifetime_kv_workload, self.kv_capacity_tokens,
                          self.memory_bound_rps, self.lambda_max_rps)


def capacity(prompt_tokens, output_tokens, profile: ReplicaProfile) -> Capacity:
    """The fluid throughput bound for a workload on a profile.

    With step time t = a + b*T + c*K (T new tokens, K KV tokens read), N requests need
    N*S tokens of compute, and occupy N*W token-steps of KV; at most M are held per step, so
    at least N*W/M steps, each costing a, with the attention reading N*W tokens in total:
    time >= N*(a*W/M + c*W + b*S), hence lambda_max = 1 / (a*W/M + c*W + b*S).
    """
    s, w = workload_moments(prompt_tokens, output_tokens)
    d = float(np.mean(np.asarray(output_tokens, dtype=float)))
    m = profile.kv_capacity_tokens
    full_step_s = profile.base_s + profile.per_kv_token_s * m
    return Capacity(
        mean_tokens_per_request=s,
        lifetime_kv_workload=w,
        kv_capacity_tokens=m,
        memory_bound_rps=m / (w * full_step_s),
        lambda_max_rps=fluid_lambda_max(s, w, profile, mean_output_tokens=d),
    )


def workload_moments(prompt_tokens, output_tokens) -> tuple[float, float]:
    """(S, W) of a workload: S = E[P] + E[D] tokens per request and lifetime KV workload
    W = E[P*D] + E[D(D+1)]/2."""
    p = np.asarray(prompt_tokens, dtype=float)
    d = np.asarray(output_tokens, dtype=float)
    return float(p.mean() + d.mean()), float(np.mean(p * d) + np.mean(d * (d + 1)) / 2)


def fluid_lambda_max(mean_tokens_per_request: float, lifetime_kv_workload: float, profile: ReplicaProfile,
                     kv_capacity_tokens: float | None = None, mean_output_tokens: float = 0.0,
                     max_num_seqs: float | None = None) -> float:
    """``1 / (a*W/M + c*W + b*S)`` requests per second: the fluid bound for requests of S tokens
    and lifetime KV workload W on a replica with step time a + b*T + c*K and KV capacity M. On a
    profile with its own decode cost b_d, ``b*S`` is ``b*(S - D) + b_d*D`` with D the mean output;
    with step noise, every term is the mean step's (``mean_step_factor``); a profile's fixed costs
    per prefill chunk and per first decode count once per request, and so does the after-cost of
    one prefill step over the steps after it (``(per_after_prefill_s + per_after_prefill_token_s *
    (S - D)) / (1 - after_prefill_decay)``).

    With ``max_num_seqs`` N, the running slots bound it too: a request holds a slot for its D steps
    at least (its prefill gives the first token, each decode one more), N slots are held per step,
    so at least ``λ·D/N`` steps a second, each costing a: ``W/M`` becomes ``max(W/M, D/N)``. An
    engine with a large KV cache and few slots (vLLM's ``max_num_seqs``) is bound by its slots
    long before its memory.

    :param kv_capacity_tokens: M (default: the profile's).
    :param mean_output_tokens: D, the decode tokens among S (used with a separate decode cost, and
        by the slot bound).
    :param max_num_seqs: N, the most requests that run at once (None: no slot bound).
    """
    m = kv_capacity_tokens or profile.kv_capacity_tokens
    w, s = lifetime_kv_workload, mean_tokens_per_request
    occupancy = w / m
    if max_num_seqs and mean_output_tokens > 0:
        occupancy = max(occupancy, mean_output_tokens / max_num_seqs)
    tokens_s = profile.per_token_s * s + (decode_token_s(profile) - profile.per_token_s) * min(mean_output_tokens, s)
    tokens_s += getattr(profile, "per_prefill_s", 0.0) or 0.0  # a request prefills in one chunk at least
    tokens_s += getattr(profile, "per_first_decode_s", 0.0) or 0.0  # and has one first decode at most
    # (per_prefill_alone_s not at all: at the load this bound is about, decodes run beside every prefill)
    # a prefill step's after-cost, summed over the steps that follow it: c / (1 - decay)
    # (and its prompt's tokens' after-cost: the prompt is S - D tokens, S when D is not given)
    after_s = (getattr(profile, "per_after_prefill_s", 0.0) or 0.0) + (
        getattr(profile, "per_after_prefill_token_s", 0.0) or 0.0) * max(s - mean_output_tokens, 0.0)
    tokens_s += after_s / (1.0 - (getattr(profile, "after_prefill_decay", 0.0) or 0.0))
    return 1.0 / ((profile.base_s * occupancy + profile.per_kv_token_s * w + tokens_s) * mean_step_factor(profile))


def mean_step_factor(profile: ReplicaProfile) -> float:
    """The mean over the median step time: ``exp(noise_sigma^2 / 2)`` on a profile with log-normal
    step noise (the formula is its median step), 1 without; with a sigma ``b`` below the median and
    ``a`` above, ``exp(a^2 / 2) Phi(a) + exp(b^2 / 2) Phi(-b)``. That of the steps up to the
    noise's knee (``noise_knee_s``): longer ones, whose sigmas are smaller, have a smaller factor,
    so the bound it enters errs low."""
    sigma = getattr(profile, "noise_sigma", 0.0) or 0.0
    if not sigma:
        return 1.0
    below = getattr(profile, "noise_sigma_below", None)
    if below is None:
        return math.exp(sigma * sigma / 2.0)
    return math.exp(sigma * sigma / 2.0) * _normal_cdf(sigma) + math.exp(below * below / 2.0) * _normal_cdf(-below)


def _normal_cdf(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


def decode_token_s(profile: ReplicaProfile) -> float:
    """Seconds per decode token: the profile's ``per_decode_token_s`` if it has one, else ``per_token_s``."""
    split = getattr(profile, "per_decode_token_s", None)
    return profile.per_token_s if split is None else split


def shrunk_lambda_max(obs: Observation, profile: ReplicaProfile, prior_output_tokens: int = 128,
                      prior_weight: float = 32.0) -> float:
    """:func:`lambda_max_estimate` of the offered traffic, for judging whether a replica is
    offered more than it can serve, sound from the first arrival on.

    The mean prompt is that of every arrival (``offered_prompt_tokens``, known at arrival); the
    output and W moments are the offered requests' (``offered_output_tokens``,
    ``offered_kv_workload``: the completed ones reweighted so that refusals do not bias them),
    W at least the decodes' KV reads per completion (``decode_kv_workload``), which count the
    long outputs still running.
    Those are a poor sample while completions are few: the short requests complete first, and
    one long one can dominate. So they are shrunk towards a prior with the weight of
    ``prior_weight`` completions: with n completed, a moment is (n m_c + k m_0) / (n + k), with
    ``prior_output_tokens`` D_0 as the prior output (W_0 = P D_0 + D_0 (D_0 + 1) / 2). Before any
    arrival, :func:`lambda_max_estimate`."""
    return shrunk_lambda_max_interval(obs, profile, prior_output_tokens, prior_weight)[0]


def shrunk_lambda_max_interval(obs: Observation, profile: ReplicaProfile, prior_output_tokens: int = 128,
                               prior_weight: float = 32.0) -> tuple[float, float]:
    """:func:`shrunk_lambda_max` and its relative standard error from the sampling errors of the
    traffic's means, each shrunk with its mean: of W (``Observation.offered_kv_workload_se``), the
    memory's side of the bound, and of the prompt P (``Observation.offered_prompt_se``, the
    completed requests' sample, weighted as W's), the compute's. The bound is ``1 / (k W + b S)``
    with S = P + D: an error of W moves it by the share of k W in the denominator, one of P by the
    share of its tokens' cost, and the two are added in quadrature (W grows with P, so their common
    part counts twice: a margin, never a shortfall). D, a mean of lighter-tailed outputs, is taken
    as exact. Where every prompt costs about the same and the memory binds, only W's error counts;
    where compute binds on prompts of tens to ten thousands of tokens, a mean prompt over a few
    hundred completions is good to +-10-15%, and a bound that took it as exact ran 15% under the
    true one while it claimed 2-4% (arrivals at 0.7 x read as over capacity). 0 before two
    completions (the prior's own error is unknown; the caller's other margins cover the start:
    taken from the arrivals' prompts instead, the error widened the early witness's margin so far
    that steps to 3 x at the start went unwitnessed on the vLLM-fitted profile). The bound counts
    the replica's running slots (``profile.max_num_seqs``, :func:`fluid_lambda_max`)."""
    p = obs.offered_prompt_tokens
    if not p > 0:
        return lambda_max_estimate(obs, profile, prior_output_tokens), 0.0
    share, d, w = shrunk_moments(obs, prior_output_tokens, prior_weight)
    m = obs.kv_capacity_tokens or profile.kv_capacity_tokens
    slots = profile.max_num_seqs
    bound = fluid_lambda_max(p + d, w, profile, m, d, slots)
    if not (bound > 0 and w > 0):
        return bound, 0.0
    # the denominator is linear in W and in S: the bound at the mean plus its error is lower by the relative error
    se_w = share * max(obs.offered_kv_workload_se, 0.0)
    se_p = share * max(obs.offered_prompt_se, 0.0)
    rse_w = bound / fluid_lambda_max(p + d, w + se_w, profile, m, d, slots) - 1.0 if se_w > 0 else 0.0
    rse_p = bound / fluid_lambda_max(p + se_p + d, w, profile, m, d, slots) - 1.0 if se_p > 0 else 0.0
    return bound, math.hypot(rse_w, rse_p)


def shrunk_moments(obs: Observation, prior_output_tokens: int = 128, prior_weight: float = 32.0
                   ) -> tuple[float, float, float]:
    """(share, D, W) of the offered traffic, shrunk towards the prior with the weight of
    ``prior_weight`` completions (:func:`shrunk_lambda_max`): ``share`` is the completions' weight,
    D the mean output, W the lifetime KV workload (the prompt is ``offered_prompt_tokens``)."""
    p = obs.offered_prompt_tokens
    d0 = float(prior_output_tokens)
    n = obs.completed_total if obs.offered_kv_workload > 0 else 0
    share = n / (n + prior_weight)
    d = share * obs.offered_output_tokens + (1 - share) * d0
    # the completed requests' W leaves out the long outputs still running; the decodes' KV reads
    # per completion count them (and not what admission refused): the larger is the sounder
    w_seen = max(obs.offered_kv_workload, obs.decode_kv_workload)
    w = share * w_seen + (1 - share) * (p * d0 + d0 * (d0 + 1) / 2)
    return share, d, w


#: standard errors of margin on the prefills that land in a request's steps (:func:`tpot_running_cap`)
TPOT_Z = 2.0


def tpot_running_cap(obs: Observation, profile: ReplicaProfile, tpot_slo_s: float,
                     prior_output_tokens: int = 128, z: float = TPOT_Z) -> float:
    """The most requests that can run at once with a request's TPOT within ``tpot_slo_s``, from the
    profile's step model and the offered traffic's moments (:func:`shrunk_moments`); ``inf`` where
    no number of running requests is too many (no per-token cost) or none is few enough (one
    step alone costs more than the SLO: fewer requests would only serve fewer).

    A request's TPOT is the mean of the steps it decodes in. With n requests running, each living
    D steps, the fluid bound's time per request R (:func:`fluid_lambda_max` without its base
    cost: prefill, decodes and KV reads) falls in those D steps n times over, so the mean step is
    ``T(n) = f a + R n / D`` (f the step noise's mean factor), the bound at n slots read per
    step. Throughput ``n / (D T(n))`` rises with n towards ``1 / R``, while T(n) rises without
    bound: past the cap, more running requests buy little throughput and cost every request's TPOT
    (on a CPU, where a decode costs about what a prompt token does, doubling the running requests
    from 30 to 60 doubled TPOT for 6% more throughput). The prefills landing in a request's D
    steps are about n, and their count varies: ``z`` standard errors of a Poisson count of n,
    each a mean prompt's prefill cost, are added. The cap is the largest n with
    ``f a + (R n + z sqrt(n) R_p) / D <= tpot_slo_s``."""
    p = obs.offered_prompt_tokens or obs.head_prompt_tokens or obs.mean_prompt_tokens
    if not p > 0:
        return math.inf
    _, d, w = shrunk_moments(obs, prior_output_tokens)
    if not d > 0:
        return math.inf
    factor = mean_step_factor(profile)
    base = factor * profile.base_s
    try:
        per_request = 1.0 / fluid_lambda_max(p + d, w, profile, math.inf, d)  # R: no base cost with M = inf
    except ZeroDivisionError:  # a profile without per-token costs (the slot model)
        return math.inf
    prefill = factor * profile.per_token_s * p  # R_p
    room = tpot_slo_s - base
    if not (per_request > 0 and room > 0):
        return math.inf
    k, j = per_request / d, z * prefill / d
    root = (-j + math.sqrt(j * j + 4.0 * k * room)) / (2.0 * k)
    return max(math.floor(root * root), 1.0)


def prefill_time_s(obs: Observation, prefill_tokens: int, token_budget: float, profile: ReplicaProfile) -> float:
    """Seconds the profile's step model takes to prefill the prompt tokens ahead of an arrival (the running
    requests' and the queue's) and its own ``prefill_tokens``, in chunks of the token budget less one decode
    per running request: every prompt token's cost, plus each chunk's step overhead (base cost, the running
    requests' decodes and their KV reads), times the mean step's noise factor. A compute bound: it holds
    however the steps are composed, where a count of steps at the mean step time does not (prefill steps
    are the long ones: on the A100 preset, a 1,024-token chunk takes three times a decode step)."""
    tokens = float(obs.running_prefill_tokens + obs.waiting_prompt_tokens + prefill_tokens)
    running = float(obs.num_running)
    steps = max(tokens / max(float(token_budget) - running, 1.0), 1.0)
    overhead = profile.base_s + decode_token_s(profile) * running + profile.per_kv_token_s * obs.kv_used_tokens
    return (profile.per_token_s * tokens + steps * overhead) * mean_step_factor(profile)


def lambda_max_estimate(obs: Observation, profile: ReplicaProfile, prior_output_tokens: int = 128) -> float:
    """The fluid bound ``1 / (a W / M + c W + b S)`` (``ctrl.theory.fluid_lambda_max``) of the traffic
    seen so far: S and W from the engine's running estimates over completed requests; before the
    first completion, the queue head's prompt (else the mean prompt seen, else the token budget)
    with ``prior_output_tokens``. a, b, c from the profile, M the engine's own KV capacity. Always
    finite and positive: a cold or idle server gets the bound of requests as large as one step's
    token budget, never one of empty requests."""
    # a completed request has at least a prompt token: means below one are not a sample's
    # floats throughout (int-valued where they come from token counts), so that a compiled core
    # (``tidegate compile``) types them as the interpreter computes them
    s: float = obs.mean_prompt_tokens + obs.mean_output_tokens
    w: float
    d: float
    if obs.completed_total > 0 and obs.lifetime_kv_workload > 0 and s >= 1:
        w = obs.lifetime_kv_workload
        d = obs.mean_output_tokens
    else:
        prompt: float = obs.head_prompt_tokens or obs.mean_prompt_tokens or profile.max_num_batched_tokens
        s = prompt + prior_output_tokens
        d = float(prior_output_tokens)
        w = estimated_kv_workload(obs, prior_output_tokens) if (obs.head_prompt_tokens or obs.mean_prompt_tokens) \
            else prompt * prior_output_tokens + prior_output_tokens * (prior_output_tokens + 1) / 2
    return fluid_lambda_max(s, w, profile, obs.kv_capacity_tokens or profile.kv_capacity_tokens, d)
