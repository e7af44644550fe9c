"""Dong & Cao (arXiv 2604.11001) Algorithm 2: output lengths unknown. Each step a global
activation budget B_t (fixed, or drawn from a distribution) lets up to B_t waiting requests
start, FIFO; while the KV demand exceeds M the engine evicts the most recently activated
request (LIFO; the paper discards its progress, the engine's ``eviction="reset"``; by default it
keeps its tokens and recomputes their KV). A huge budget is greedy admission.

Adaptive mode sets the mean budget every step from online estimates:

    b_safe   = rho * M / w_hat                       (memory: sum b*w <= rho*M)
    b_demand = (1 + eta) * lambda_hat * t_step + waiting / drain_steps
    b        = min(b_safe, b_demand)

w_hat is the running estimate of the lifetime KV workload l*o + (o + o^2)/2 of completed
requests (before any completion: the queue head's prompt with ``prior_output_tokens``),
lambda_hat the arrival rate and t_step the mean step time. So the engine follows the
arrivals with headroom eta, drains a backlog over ``drain_steps``, and never activates faster
than memory can hold in steady state.
"""

from __future__ import annotations

import math
from typing import ClassVar

import numpy as np

from tidegate.ctrl.base import UNLIMITED, Controller, Decision, Observation
from tidegate.ctrl.theory import safe_activation_rate


class FlowController(Controller):
    """:param budget: mean activations per step (fixed mode; default 1).
    :param dist: how B_t is drawn around the mean: ``fixed`` (fractions carry over as credit),
        ``poisson`` or ``bernoulli`` (floor plus a coin for the fraction).
    :param adaptive: set the mean from online estimates instead of ``budget`` (default: adaptive
        unless a ``budget`` is given).
    :param target_usage: rho, the KV fraction the adaptive budget aims at.
    :param headroom: eta, activation rate above the arrival rate.
    :param drain_steps: steps over which a backlog is activated.
    :param prior_output_tokens: output length assumed before any request completed.
    :param max_num_batched_tokens: most new tokens per step.
    :param max_num_seqs: most running requests.
    :param seed: seed of the budget draws.
    """

    name: ClassVar[str] = "flow"
    DISTS: ClassVar[tuple[str, ...]] = ("fixed", "poisson", "bernoulli")

    def __init__(self, budget: float | None = None, dist: str = "fixed", adaptive: bool | None = None,
                 target_usage: float = 1.0, headroom: float = 0.2, drain_steps: float = 20.0,
                 prior_output_tokens: int = 128, max_num_batched_tokens: int = 8192,
                 max_num_seqs: int = UNLIMITED, seed: int = 0, max_waiting: int | None = None,
                 queue_timeout_s: float | None = None) -> None:
        super().__init__(max_waiting=max_waiting, queue_timeout_s=queue_timeout_s)
        if dist not in self.DISTS:
            raise ValueError(f"dist must be one of {', '.join(self.DISTS)}, got {dist!r}")
        if adaptive is None:
            adaptive = budget is None
        if budget is None:
            budget = 1.0
        if budget < 0 or not math.isfinite(budget):
            raise ValueError(f"budget must be a finite number >= 0, got {budget}")
        if not 0 < target_usage <= 1 or headroom < 0 or drain_steps <= 0:
            raise ValueError("need 0 < target_usage <= 1, headroom >= 0 and drain_steps > 0")
        self.budget = budget
        self.dist = dist
        self.adaptive = adaptive
        self.target_usage = target_usage
        self.headroom = headroom
        self.drain_steps = drain_steps
        self.prior_output_tokens = prior_output_tokens
        self.seed = seed
        self.rng = np.random.default_rng(seed)
        self.credit = 0.0
        self.mean_budget = budget
        self._decision = Decision(0, max_num_batched_tokens, max_num_seqs)

    def reset(self) -> None:
        self.rng = np.random.default_rng(self.seed)
        self.credit = 0.0

    def safe_budget(self, obs: Observation) -> float:
        """rho * M / w_hat: the activation rate whose steady KV demand is rho * M."""
        return safe_activation_rate(obs, self.target_usage, self.prior_output_tokens)

    def adaptive_budget(self, obs: Observation) -> float:
        step_s = obs.mean_step_time_s or obs.last_step_time_s
        demand = (1 + self.headroom) * obs.arrival_rate_rps * step_s + obs.num_waiting / self.drain_steps
        return min(self.safe_budget(obs), demand)

    def decide(self, obs: Observation) -> Decision:
        mean = self.adaptive_budget(obs) if self.adaptive else self.budget
        self.mean_budget = mean
        if self.dist == "fixed":
            c = self.credit + mean
            n = int(c)
            self.credit = c - n
        elif self.dist == "poisson":
            n = int(self.rng.poisson(mean))
        else:
            n = int(mean) + int(self.rng.random() < mean - int(mean))
        self._decision.activation_budget = n
        return self._decision
