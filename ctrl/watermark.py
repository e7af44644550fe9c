"""Memory-watermark backpressure with adaptive batching.

Arrivals are refused with 429 and a retry-after while KV usage is above a watermark or the
queue is deeper than a limit. The step token budget grows additively while the last step ran
within the TPOT SLO and halves when it did not (AIMD), so long prefills cannot stall decodes.
"""

from __future__ import annotations

from typing import ClassVar

from tidegate.ctrl.base import UNLIMITED, AimdTokenBudget, Controller, Decision, Observation, Rejection, retry_after_s


class WatermarkController(Controller):
    """:param watermark: KV usage fraction above which arrivals are rejected (0.9).
    :param queue_limit: waiting requests at which arrivals are rejected (100).
    :param tpot_slo_s: step-time target for the AIMD token budget.
    :param min_token_budget: floor of the budget (default: 256, or the ceiling if lower).
    :param max_num_batched_tokens: ceiling of the budget, also its start.
    :param additive_tokens: budget increase per step within the SLO.
    :param backoff: multiplicative decrease when a step exceeded the SLO.
    :param max_num_seqs: most running requests.
    """

    name: ClassVar[str] = "watermark"

    def __init__(self, watermark: float = 0.9, queue_limit: int = 100, tpot_slo_s: float = 0.1,
                 min_token_budget: int | None = None, max_num_batched_tokens: int = 8192,
                 additive_tokens: int = 64, backoff: float = 0.5, max_num_seqs: int = 256,
                 max_waiting: int | None = None,
                 queue_timeout_s: float | None = None) -> None:
        super().__init__(max_waiting=max_waiting, queue_timeout_s=queue_timeout_s)
        if not 0 < watermark <= 1:
            raise ValueError(f"watermark must be in (0, 1], got {watermark}")
        if queue_limit < 0:
            raise ValueError(f"queue_limit must be >= 0, got {queue_limit}")
        self.watermark = watermark
        self.queue_limit = queue_limit
        self.tpot_slo_s = tpot_slo_s
        self.aimd = AimdTokenBudget(max_num_batched_tokens, tpot_slo_s, min_token_budget, additive_tokens, backoff)
        self._decision = Decision(UNLIMITED, max_num_batched_tokens, max_num_seqs)

    @property
    def token_budget(self) -> float:
        return self.aimd.value

    def reset(self) -> None:
        self.aimd.reset()

    def admit(self, obs: Observation, prompt_tokens: int, max_tokens: int) -> Rejection | None:
        if obs.kv_usage > self.watermark:
            return Rejection(f"KV usage {obs.kv_usage:.0%} is above the {self.watermark:.0%} watermark",
                             retry_after_s(obs, obs.num_waiting + obs.num_running))
        if obs.num_waiting >= self.queue_limit:
            return Rejection(f"queue is full ({obs.num_waiting} waiting)", retry_after_s(obs))
        return super().admit(obs, prompt_tokens, max_tokens)

    def decide(self, obs: Observation) -> Decision:
        self._decision.token_budget = int(self.aimd.update(obs))
        return self._decision
