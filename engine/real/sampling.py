"""SamplingParams: how a request picks its tokens.

Plain data with no torch import, so the server's protocol layer can build and check it without
loading the model stack; ``TorchExecutor`` does the sampling.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """How a request picks its tokens (``max_tokens`` lives on the Request).

    :param temperature: 0 (or below 1e-5) is greedy; otherwise logits are divided by it before sampling.
    :param top_p: nucleus sampling: keep the smallest set of tokens with this much probability.
    :param top_k: keep the k most likely tokens; 0 keeps all.
    :param seed: seeds the request's own generator, so its samples reproduce (also across an
        eviction: the generator keeps its state while the request recomputes its KV); None uses
        the executor's generator.
    :param stop_token_ids: token ids that end the request (the token is kept in the output).
    :param stop: strings that end the request once the output text contains one.
    :param ignore_eos: keep generating past EOS (up to ``max_tokens``).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise ValueError(f"seed must be a 64-bit integer, got {self.seed}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        # Below this temperature logits / temperature overflows to inf: the limit is argmax anyway.
        return self.temperature < 1e-5 or self.top_k == 1

