"""Dong & Cao (arXiv 2604.11001) Algorithm 1: output lengths known, one activation budget
b_k per class per step, FIFO within a class, no memory check of its own.

Memory stays within M when sum_k b_k * w_k <= M; each queue is stable when b_k > lambda_k.
Fractional budgets are paid out by a credit that keeps only the fraction below one activation,
so over any n steps a class activates at most b_k * n + 1 requests (never a saved-up burst).
"""

from __future__ import annotations

import math
from typing import ClassVar

from tidegate.ctrl.base import UNLIMITED, Controller, Decision, Observation


class ClassBudgetsController(Controller):
    """:param budgets: activations per step for each class, in class order.
    :param max_num_batched_tokens: most new tokens per step.
    """

    name: ClassVar[str] = "class-budgets"

    def __init__(self, budgets: list[float], max_num_batched_tokens: int = UNLIMITED, max_waiting: int | None = None,
                 queue_timeout_s: float | None = None) -> None:
        super().__init__(max_waiting=max_waiting, queue_timeout_s=queue_timeout_s)
        if not budgets or any(b < 0 or not math.isfinite(b) for b in budgets):
            raise ValueError("budgets must be a non-empty list of finite numbers >= 0")
        self.budgets = [float(b) for b in budgets]
        self.credit = [0.0] * len(budgets)
        self.token_budget = max_num_batched_tokens

    @classmethod
    def from_classes(cls, rates_per_step, lifetime_kv, max_request_tokens, kv_capacity_tokens: int,
                     **kwargs) -> "ClassBudgetsController":
        """Budgets proportional to the arrival rates, scaled as high as memory allows.

        Picks b_k = s * lambda_k with the largest s such that
        sum_k b_k w_k <= M - sum_k (l_k + o_k), the slack covering the one extra activation per
        class that credit rounding can bring into a window.

        :param rates_per_step: lambda_k, arrivals per step of each class.
        :param lifetime_kv: w_k, mean lifetime KV workload of each class.
        :param max_request_tokens: l_k + o_k, the largest prompt plus output of each class.
        """
        load = sum(r * w for r, w in zip(rates_per_step, lifetime_kv))
        if load <= 0:
            raise ValueError("class arrival rates must be positive")
        scale = max(kv_capacity_tokens - sum(max_request_tokens), 0) / load
        return cls([scale * r for r in rates_per_step], **kwargs)

    def reset(self) -> None:
        self.credit = [0.0] * len(self.budgets)

    def decide(self, obs: Observation) -> Decision:
        allowances = {}
        for k, b in enumerate(self.budgets):
            c = self.credit[k] + b
            n = int(c)
            self.credit[k] = c - n
            if n:
                allowances[k] = n
        return Decision(token_budget=self.token_budget, class_budgets=allowances)
