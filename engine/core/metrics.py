"""Run metrics: per-request latencies, per-step KV usage, and the summary every command prints."""

from __future__ import annotations

import math
from array import array

import numpy as np

from tidegate.engine.core.request import Request, RequestState
from tidegate.engine.core.slo import met_slo, time_per_output_token_s, time_to_first_token_s


class EngineMetrics:
    """Collects what happened in a run; ``summary`` turns it into plain numbers.

    Figures are kept as they happen: running sums, counts by terminal state, and for each finished
    request the few numbers its latencies need (in compact arrays), so no step looks back over the
    requests that ended and they need not stay in memory.

    :param record_steps: keep per-step traces (the ``step_*`` arrays).
    :param keep_requests: keep every request that ended in ``terminal``; without it a finished
        request costs the summary 40 bytes and the others nothing.
    """

    def __init__(self, record_steps: bool = True, keep_requests: bool = True) -> None:
        self.record_steps = record_steps
        self.keep_requests = keep_requests
        self.arrived = 0
        self.first_arrival_s: float | None = None
        #: the requests that ended, in order (only with ``keep_requests``)
        self.terminal: list[Request] = []
        self.ended_by_state = dict.fromkeys(RequestState, 0)
        # one entry per finished request, in the order they finished; NaN where a time is None.
        # Raw times rather than latencies, so the summary applies the slo module's definitions.
        self.finished_arrival_s = array("d")
        self.finished_first_token_s = array("d")
        self.finished_at_s = array("d")
        self.finished_output_tokens = array("q")
        self.finished_predicted_ttft_s = array("d")
        self.evictions = 0
        #: KV entries evictions discarded: recomputed by prefill (recompute eviction), or lost with
        #: the request's progress (reset eviction)
        self.wasted_tokens = 0
        #: tokens computed by prefill (prompts, and sequences recomputed after an eviction)
        self.prefill_tokens = 0
        #: prompt tokens taken from the prefix cache instead of computed, at every start
        self.cached_prompt_tokens = 0
        self.steps = 0
        self.busy_time_s = 0.0
        self.kv_time_product = 0.0
        self.kv_sq_time_product = 0.0
        self.waiting_time_product = 0.0
        self.kv_peak_tokens = 0
        self.last_time_s = 0.0
        self.step_time_s = array("d")
        self.step_duration_s = array("d")
        self.step_kv_tokens = array("q")
        self.step_waiting = array("q")
        self.step_running = array("q")
        self.step_tokens = array("q")

    def retain(self, max_requests: int) -> None:
        """Keep only the last ``max_requests`` ended requests (and finished ones' figures), once
        twice as many have piled up: a long-running server's memory stays bounded, and the summary
        then covers the recent requests (the counts by end state still cover all)."""
        if len(self.terminal) > 2 * max_requests:
            del self.terminal[:-max_requests]
        if len(self.finished_at_s) > 2 * max_requests:
            for figures in (self.finished_arrival_s, self.finished_first_token_s, self.finished_at_s,
                            self.finished_output_tokens, self.finished_predicted_ttft_s):
                del figures[:-max_requests]

    def on_arrival(self, r: Request) -> None:
        self.arrived += 1
        if self.first_arrival_s is None:
            self.first_arrival_s = r.arrival_time_s

    def on_eviction(self, wasted_tokens: int) -> None:
        self.evictions += 1
        self.wasted_tokens += wasted_tokens

    def on_terminal(self, r: Request) -> None:
        self.ended_by_state[r.state] += 1
        if self.keep_requests:
            self.terminal.append(r)
        if r.state is not RequestState.FINISHED:
            return
        self.finished_arrival_s.append(r.arrival_time_s)
        self.finished_first_token_s.append(_or_nan(r.first_token_time_s))
        self.finished_at_s.append(_finished_at(r))
        self.finished_output_tokens.append(r.num_output_tokens)
        self.finished_predicted_ttft_s.append(_or_nan(r.predicted_ttft_s))

    def on_step(self, end_s: float, duration_s: float, kv_tokens: int, waiting: int, running: int,
                tokens: int) -> None:
        self.steps += 1
        self.busy_time_s += duration_s
        self.kv_time_product += kv_tokens * duration_s
        self.kv_sq_time_product += kv_tokens * kv_tokens * duration_s
        self.waiting_time_product += waiting * duration_s
        if kv_tokens > self.kv_peak_tokens:
            self.kv_peak_tokens = kv_tokens
        self.last_time_s = end_s
        if self.record_steps:
            self.step_time_s.append(end_s)
            self.step_duration_s.append(duration_s)
            self.step_kv_tokens.append(kv_tokens)
            self.step_waiting.append(waiting)
            self.step_running.append(running)
            self.step_tokens.append(tokens)

    def summary(self, kv_capacity_tokens: int, ttft_slo_s: float, tpot_slo_s: float,
                final_waiting: int = 0) -> dict[str, float]:
        """The run's figures. Goodput (DistServe): finished requests per second that met both
        the TTFT and the TPOT SLO; rejected, expired, cancelled and failed requests count as missed.
        """
        counts = self.ended_by_state
        ttft, tpot_or_nan, good = self._latencies(ttft_slo_s, tpot_slo_s)
        tpot = tpot_or_nan[~np.isnan(tpot_or_nan)]
        e2e = np.array(self.finished_at_s, dtype=float) - np.array(self.finished_arrival_s, dtype=float)
        outs = np.array(self.finished_output_tokens, dtype=float)
        start = self.first_arrival_s or 0.0
        span = max(self.last_time_s - start, 1e-12)
        busy = self.busy_time_s if self.busy_time_s > 0 else 1e-12
        kv_mean = self.kv_time_product / busy
        kv_var = max(self.kv_sq_time_product / busy - kv_mean * kv_mean, 0.0)

        def pct(x: np.ndarray, q: float) -> float:
            return float(np.percentile(x, q)) if x.size else float("nan")

        return {
            "requests": self.arrived,
            "completed": len(ttft),
            "rejected": counts[RequestState.REJECTED],
            "expired": counts[RequestState.EXPIRED],
            "cancelled": counts[RequestState.CANCELLED],
            "failed": counts[RequestState.FAILED],
            "evictions": self.evictions,
            "wasted_tokens": self.wasted_tokens,
            "prefill_tokens": self.prefill_tokens,
            "cached_prompt_tokens": self.cached_prompt_tokens,
            "throughput_rps": len(ttft) / span,
            "output_tps": float(outs.sum()) / span,
            "goodput_rps": good / span,
            "slo_attainment": good / self.arrived if self.arrived else float("nan"),
            "ttft_p50_s": pct(ttft, 50),
            "ttft_p99_s": pct(ttft, 99),
            "tpot_p50_s": pct(tpot, 50),
            "tpot_p99_s": pct(tpot, 99),
            "e2e_p50_s": pct(e2e, 50),
            "e2e_p99_s": pct(e2e, 99),
            "kv_usage_mean": kv_mean / kv_capacity_tokens,
            "kv_usage_std": kv_var ** 0.5 / kv_capacity_tokens,
            "kv_peak_tokens": self.kv_peak_tokens,
            "kv_capacity_tokens": kv_capacity_tokens,
            "mean_waiting": self.waiting_time_product / busy,
            "final_waiting": final_waiting,
            "steps": self.steps,
            "sim_time_s": span,
            **ttft_calibration(np.array(self.finished_predicted_ttft_s, dtype=float), ttft, ttft_slo_s),
        }

    def _latencies(self, ttft_slo_s: float, tpot_slo_s: float) -> tuple[np.ndarray, np.ndarray, int]:
        """The TTFT and TPOT (NaN with fewer than two tokens) of each finished request, and how many
        met both SLOs: the slo module's own functions, applied to a stand-in request that carries
        each finished request's recorded times in turn."""
        probe = Request("", 0.0, 1, 1)
        ttft, tpot = array("d"), array("d")
        good = 0
        for arrival_s, first_s, end_s, n in zip(self.finished_arrival_s, self.finished_first_token_s,
                                                self.finished_at_s, self.finished_output_tokens):
            probe.arrival_time_s, probe.finish_time_s, probe.num_output_tokens = arrival_s, end_s, n
            probe.first_token_time_s = None if first_s != first_s else first_s
            ttft.append(time_to_first_token_s(probe))
            t = time_per_output_token_s(probe)
            tpot.append(math.nan if t is None else t)
            good += met_slo(probe, ttft_slo_s, tpot_slo_s)
        return np.array(ttft, dtype=float), np.array(tpot, dtype=float), good


def ttft_calibration(predicted_ttft_s: np.ndarray, ttft_s: np.ndarray, ttft_slo_s: float) -> dict[str, float]:
    """How well the TTFT predicted at admission (``Request.predicted_ttft_s``) matched the realised
    one, over finished requests: mean absolute error and bias (realised minus predicted) in seconds,
    and the fraction of requests on the wrong side of the TTFT SLO (predicted within it and missed
    it, or the reverse): the error rate of an admission rule that refuses on the prediction.

    :param predicted_ttft_s: the prediction of each finished request, NaN where there was none.
    :param ttft_s: the realised TTFT of the same requests.
    """
    has_prediction = ~np.isnan(predicted_ttft_s)
    predicted, realised = predicted_ttft_s[has_prediction], ttft_s[has_prediction]
    if not predicted.size:
        nan = float("nan")
        return {"ttft_pred_mae_s": nan, "ttft_pred_bias_s": nan, "ttft_pred_wrong_side": nan}
    err = realised - predicted
    wrong = (predicted <= ttft_slo_s) != (realised <= ttft_slo_s)
    return {"ttft_pred_mae_s": float(np.abs(err).mean()), "ttft_pred_bias_s": float(err.mean()),
            "ttft_pred_wrong_side": float(wrong.mean())}


def _or_nan(x: float | None) -> float:
    return math.nan if x is None else x


def _finished_at(r: Request) -> float:
    assert r.finish_time_s is not None, "a terminal request has a finish time"
    return r.finish_time_s
