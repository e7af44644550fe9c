"""Latency of a finished request and whether it met the service level objectives.

The one definition of TTFT, TPOT and "met the SLO": the run summary's goodput, the env's
reward, the twin check and the engine's own latency estimates all call these.
"""

from __future__ import annotations

import math

from tidegate.engine.core.request import Request


def time_to_first_token_s(r: Request) -> float:
    """Seconds from arrival to the first output token (NaN before it)."""
    if r.first_token_time_s is None:
        return math.nan
    return r.first_token_time_s - r.arrival_time_s


def time_per_output_token_s(r: Request, end_s: float | None = None) -> float | None:
    """Mean seconds between output tokens after the first; None with fewer than two tokens.

    :param end_s: the time of the last token (default: the request's finish time).
    """
    n = r.num_output_tokens
    end = r.finish_time_s if end_s is None else end_s
    if n < 2 or end is None or r.first_token_time_s is None:
        return None
    return (end - r.first_token_time_s) / (n - 1)


def met_slo(r: Request, ttft_slo_s: float, tpot_slo_s: float) -> bool:
    """True when ``r`` finished with TTFT and TPOT within their SLOs (DistServe's goodput).

    A request with a single output token has no TPOT and meets it trivially.
    """
    if r.first_token_time_s is None or r.finish_time_s is None:
        return False
    tpot = time_per_output_token_s(r)
    return time_to_first_token_s(r) <= ttft_slo_s and (tpot is None or tpot <= tpot_slo_s)
