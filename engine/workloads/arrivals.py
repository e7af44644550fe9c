"""What every workload turns into: `Arrival`s, the `WorkloadError` for bad input, `trace_stats`,
and the option checks and length rescaling shared by the trace readers and synthetic workloads.

Nothing downstream knows which file a workload came from: every reader returns arrivals sorted
by time, with ``output_tokens <= max_tokens``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from tidegate.ctrl.theory import workload_moments

__all__ = ["DEFAULT_MAX_TOKENS", "Arrival", "WorkloadError", "check_options", "is_int", "scale_tokens",
           "scale_token_array", "trace_stats"]

#: every request's ``max_tokens`` unless a workload or the ``max_tokens_cap`` option says otherwise
DEFAULT_MAX_TOKENS = 2048


@dataclass(frozen=True, slots=True)
class Arrival:
    """One request of a workload, before the engine turns it into a `Request`.

    :param arrival_time_s: seconds from the workload's start (traces start at 0; a synthetic
        workload's first request arrives at its own, random time).
    :param prompt_tokens: prompt length in tokens (>= 1).
    :param output_tokens: the output length the request really produced (>= 1), already capped
        at ``max_tokens``.
    :param max_tokens: the request's ``max_tokens`` (>= ``output_tokens``).
    :param class_id: workload class: the class's index in a synthetic workload, 0 for traces.
    :param prefix_ids: what the prompt holds, for the prefix cache: one content id for each run of
        ``prefix_block_tokens`` prompt tokens, in order, equal ids for equal content (a Mooncake
        trace's ``hash_ids``); empty when the workload does not say.
    :param prefix_block_tokens: prompt tokens per content id.
    """

    arrival_time_s: float
    prompt_tokens: int
    output_tokens: int
    max_tokens: int
    class_id: int = 0
    prefix_ids: tuple[int, ...] = ()
    prefix_block_tokens: float = 0.0

    @property
    def prefix(self) -> tuple[tuple[int, ...], float] | None:
        """``(prefix_ids, prefix_block_tokens)`` as a `Request` takes it; None without ids."""
        return (self.prefix_ids, self.prefix_block_tokens) if self.prefix_ids else None

    def __post_init__(self) -> None:
        if not (self.arrival_time_s >= 0 and self.prompt_tokens >= 1
                and 1 <= self.output_tokens <= self.max_tokens):
            raise ValueError(f"invalid arrival {self}: expected arrival_time_s >= 0, "
                             f"prompt_tokens >= 1 and 1 <= output_tokens <= max_tokens")


class WorkloadError(ValueError):
    """A workload file or option the user got wrong; the message is one line naming it."""


def trace_stats(arrivals: list[Arrival]) -> dict[str, float]:
    """Summary numbers of a workload, including the lifetime-KV figures of the fluid bound.

    ``mean_tokens_per_request`` is S = E[P] + E[D] and ``lifetime_kv_workload`` is
    W = E[P·D] + E[D(D+1)]/2 (token-steps of KV a request holds over its life), with P the
    prompt and D the output length.

    :param arrivals: a non-empty workload.
    :return: requests, span_s, mean_rate_rps, prompt and output mean and max, S and W.
    """
    if not arrivals:
        raise ValueError("trace_stats needs at least one arrival")
    t = np.array([a.arrival_time_s for a in arrivals])
    p = np.array([a.prompt_tokens for a in arrivals], dtype=np.float64)
    d = np.array([a.output_tokens for a in arrivals], dtype=np.float64)
    s, w = workload_moments(p, d)
    span_s = float(t.max() - t.min())
    return {
        "requests": len(arrivals),
        "span_s": span_s,
        "mean_rate_rps": len(arrivals) / span_s if span_s > 0 else 0.0,
        "prompt_tokens_mean": float(p.mean()),
        "prompt_tokens_max": int(p.max()),
        "output_tokens_mean": float(d.mean()),
        "output_tokens_max": int(d.max()),
        "mean_tokens_per_request": s,
        "lifetime_kv_workload": w,
    }


# ---------------------------------------------------------------------------------------------
# Shared by the trace readers and synthetic workloads

def check_options(rate_scale: float, length_scale: float, max_tokens_cap: int | None) -> None:
    """Raise a `WorkloadError` for a bad ``rate_scale``, ``length_scale`` or ``max_tokens_cap``."""
    if not (isinstance(rate_scale, (int, float)) and 0 < rate_scale < math.inf):
        raise WorkloadError(f"rate_scale must be a positive number, got {rate_scale!r}")
    if not (isinstance(length_scale, (int, float)) and 0 < length_scale < math.inf):
        raise WorkloadError(f"length_scale must be a positive number, got {length_scale!r}")
    if max_tokens_cap is not None and not (is_int(max_tokens_cap) and max_tokens_cap >= 1):
        raise WorkloadError(f"max_tokens_cap must be an integer of at least 1, "
                            f"got {max_tokens_cap!r}")


def scale_tokens(tokens: int, length_scale: float) -> int:
    """A length times ``length_scale``, rounded, at least 1 (unchanged at scale 1)."""
    if length_scale == 1.0:
        return tokens
    return max(1, round(tokens * length_scale))


def scale_token_array(tokens: np.ndarray, length_scale: float) -> np.ndarray:
    """`scale_tokens` for an array of lengths."""
    if length_scale == 1.0:
        return tokens
    return np.maximum(1, np.rint(tokens * length_scale)).astype(np.int64)


def is_int(value: Any) -> bool:
    """An integer (Python or NumPy), not a bool."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)
