"""TGI / TensorRT-LLM ``GUARANTEED_NO_EVICT``: a request is activated only if the KV of every
running request, grown to its prompt plus max_tokens, still fits; so no request is ever evicted."""

from __future__ import annotations

from typing import ClassVar

from tidegate.ctrl.base import UNLIMITED, Controller, Decision, Observation


class NoEvictController(Controller):
    """:param max_num_seqs: most running requests.
    :param max_num_batched_tokens: most new tokens per step.
    """

    name: ClassVar[str] = "no-evict"

    def __init__(self, max_num_seqs: int = 256, max_num_batched_tokens: int = 8192, max_waiting: int | None = None,
                 queue_timeout_s: float | None = None) -> None:
        super().__init__(max_waiting=max_waiting, queue_timeout_s=queue_timeout_s)
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        self._decision = Decision(UNLIMITED, max_num_batched_tokens, max_num_seqs, kv_reserve_ratio=1.0)

    def decide(self, obs: Observation) -> Decision:
        return self._decision

    def steady_decision(self) -> Decision:
        return self._decision
