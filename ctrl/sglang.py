"""SGLang's scheduler (``schedule_conservativeness``): reserve ``new_token_ratio`` x the remaining
max_tokens of every running request when activating; after a retraction (eviction) the ratio
jumps back up, otherwise it decays linearly towards a floor."""

from __future__ import annotations

from typing import ClassVar

from tidegate.ctrl.base import UNLIMITED, Controller, Decision, Observation


class SGLangController(Controller):
    """:param init_new_token_ratio: starting ratio (SGLang: 0.7 x schedule_conservativeness).
    :param min_new_token_ratio: floor the ratio decays to.
    :param decay_steps: steps to decay from the initial ratio to the floor (SGLang: 600).
    :param max_num_seqs: most running requests.
    :param max_num_batched_tokens: most new tokens per step (SGLang's chunked_prefill_size).
    """

    name: ClassVar[str] = "sglang"

    def __init__(self, init_new_token_ratio: float = 0.7, min_new_token_ratio: float = 0.1,
                 decay_steps: int = 600, max_num_seqs: int = 256, max_num_batched_tokens: int = 8192,
                 max_waiting: int | None = None,
                 queue_timeout_s: float | None = None) -> None:
        super().__init__(max_waiting=max_waiting, queue_timeout_s=queue_timeout_s)
        if not 0 <= min_new_token_ratio <= init_new_token_ratio <= 1:
            raise ValueError("need 0 <= min_new_token_ratio <= init_new_token_ratio <= 1")
        if decay_steps < 1:
            raise ValueError("decay_steps must be >= 1")
        self.init_ratio = init_new_token_ratio
        self.min_ratio = min_new_token_ratio
        self.decay = (init_new_token_ratio - min_new_token_ratio) / decay_steps
        self.ratio = init_new_token_ratio
        self._decision = Decision(UNLIMITED, max_num_batched_tokens, max_num_seqs, kv_reserve_ratio=self.ratio)

    def reset(self) -> None:
        self.ratio = self.init_ratio

    def decide(self, obs: Observation) -> Decision:
        if obs.evicted_last_step:
            self.ratio = 1.0  # retracted: reserve fully until the pressure has gone
        elif self.ratio > self.min_ratio:
            self.ratio = max(self.min_ratio, self.ratio - self.decay)
        self._decision.kv_reserve_ratio = self.ratio
        return self._decision
