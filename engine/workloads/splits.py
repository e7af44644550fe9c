"""The train/eval split of the traces, shared by the Gymnasium env and the evaluation.

``train`` is the first `TRAIN_FRACTION` (by request) of each trace; ``eval`` the rest, plus all of
splitwise_code by default. A split is a list of `Segment`s, stretches of a trace as arrays with
their fluid capacity (`ctrl.theory.capacity`); `augment_segments` adds copies with rescaled
request lengths.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tidegate.ctrl.theory import capacity
from tidegate.engine.workloads.arrivals import Arrival
from tidegate.engine.workloads.registry import resolve_trace
from tidegate.engine.workloads.traces import read_trace

__all__ = ["TRAIN_FRACTION", "Segment", "augment_segments", "split_segments"]

TRAIN_FRACTION = 0.7


@dataclass
class Segment:
    """A stretch of a trace as arrays; replayed cyclically from a random start."""

    name: str
    times_s: np.ndarray
    prompts: list
    outputs: list
    max_tokens: list
    lambda_max_rps: float
    mean_rate_rps: float
    span_s: float


def _segment(name: str, arrivals: list[Arrival], profile) -> Segment:
    if len(arrivals) < 2:
        raise ValueError(f"workload {name!r} needs at least two requests, got {len(arrivals)}")
    times = np.array([a.arrival_time_s for a in arrivals])
    times -= times[0]
    span = float(times[-1]) + float(times[-1]) / (len(arrivals) - 1)  # one mean gap before wrapping
    cap = capacity([a.prompt_tokens for a in arrivals], [a.output_tokens for a in arrivals], profile)
    return Segment(name, times, [a.prompt_tokens for a in arrivals], [a.output_tokens for a in arrivals],
                   [a.max_tokens for a in arrivals], cap.lambda_max_rps, (len(arrivals) - 1) / float(times[-1]),
                   span)


def augment_segments(segments: list[Segment], scales, profile) -> list[Segment]:
    """The segments followed by a copy of each per (prompt_scale, output_scale) pair other than
    (1, 1): prompt and output lengths scaled (at least 1 token, outputs within max_tokens), lambda_max
    recomputed. Domain randomisation over request shape (e.g. long prompts, short outputs)."""
    out = list(segments)
    for ps, os_ in scales or ():
        ps, os_ = float(ps), float(os_)
        if not (ps > 0 and os_ > 0):
            raise ValueError(f"augment scales must be > 0, got {(ps, os_)}")
        if ps == 1.0 and os_ == 1.0:
            continue
        for seg in segments:
            arrivals = [Arrival(float(t), max(1, round(p * ps)), min(m, max(1, round(o * os_))), m)
                        for t, p, o, m in zip(seg.times_s, seg.prompts, seg.outputs, seg.max_tokens)]
            out.append(_segment(f"{seg.name}x{ps:g}/{os_:g}", arrivals, profile))
    return out


def split_segments(trace, split: str, profile, max_tokens_cap: int | None = None) -> list[Segment]:
    """The workload segments of a split.

    ``train``: the first 70% (by request) of each trace (default splitwise_conv). ``eval``: the last
    30% of splitwise_conv and all of splitwise_code by default; a trace given explicitly uses its
    last 30%. A list of ``Arrival``s is used whole in either split.
    """
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    if trace is None:
        names = ["splitwise_conv"] if split == "train" else ["splitwise_conv", "splitwise_code"]
    elif isinstance(trace, (str, Path)):
        names = [trace]
    elif trace and isinstance(trace[0], Arrival):
        return [_segment("workload", list(trace), profile)]
    else:
        names = list(trace)
    segments = []
    for name in names:
        arrivals = read_trace(resolve_trace(name), max_tokens_cap=max_tokens_cap)
        stem = Path(str(name)).stem
        cut = int(len(arrivals) * TRAIN_FRACTION)
        if split == "train":
            part = arrivals[:cut]
        elif trace is None and stem == "splitwise_code":
            part = arrivals
        else:
            part = arrivals[cut:]
        segments.append(_segment(f"{stem}[{split}]", part, profile))
    return segments
