"""Run metrics: per-request latencies, per-step KV usage, and the summary every command prints."""

from __future__ import annotations

from array import array

import numpy as np

from engine.core.request import Request, RequestState
from engine.core.slo import met_slo, time_per_output_token_s, time_to_first_token_s


class EngineMetrics:
    """Collects what happened in a run; ``summary`` turns it into plain numbers."""

    def __init__(self, record_steps: bool = True) -> None:
        self.record_steps = record_steps
        self.arrived = 0
        self.first_arrival_s: float | None = None
        self.terminal: list[Request] = []
        self.evictions = 0
        #: KV entries evictions discarded: recomputed by prefill (recompute eviction), or lost with
        #: the request's progress (reset eviction)
        self.wasted_tokens = 0
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

    def on_arrival(self, r: Request) -> None:
        self.arrived += 1
        if self.first_arrival_s is None:
            self.first_arrival_s = r.arrival_time_s

    def on_eviction(self, wasted_tokens: int) -> None:
        self.evictions += 1
        self.wasted_tokens += wasted_tokens

    def on_terminal(self, r: Request) -> None:
        self.terminal.append(r)

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
        finished = [r for r in self.terminal if r.state is RequestState.FINISHED]
        counts = {s: 0 for s in RequestState}
        for r in self.terminal:
            counts[r.state] += 1
        ttft = np.array([time_to_first_token_s(r) for r in finished], dtype=float)
        e2e = np.array([_finished_at(r) - r.arrival_time_s for r in finished], dtype=float)
        outs = np.array([r.num_output_tokens for r in finished], dtype=float)
        tpots = (time_per_output_token_s(r) for r in finished)
        tpot = np.array([t for t in tpots if t is not None], dtype=float)
        good = sum(met_slo(r, ttft_slo_s, tpot_slo_s) for r in finished)
        start = self.first_arrival_s or 0.0
        span = max(self.last_time_s - start, 1e-12)
        busy = self.busy_time_s if self.busy_time_s > 0 else 1e-12
        kv_mean = self.kv_time_product / busy
        kv_var = max(self.kv_sq_time_product / busy - kv_mean * kv_mean, 0.0)

        def pct(x: np.ndarray, q: float) -> float:
            return float(np.percentile(x, q)) if x.size else float("nan")

        return {
            "requests": self.arrived,
            "completed": len(finished),
            "rejected": counts[RequestState.REJECTED],
            "expired": counts[RequestState.EXPIRED],
            "cancelled": counts[RequestState.CANCELLED],
            "failed": counts[RequestState.FAILED],
            "evictions": self.evictions,
            "wasted_tokens": self.wasted_tokens,
            "throughput_rps": len(finished) / span,
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
            **ttft_calibration(finished, ttft_slo_s),
        }


def ttft_calibration(finished: list[Request], ttft_slo_s: float) -> dict[str, float]:
    """How well the TTFT predicted at admission (``Request.predicted_ttft_s``) matched the realised
    one, over finished requests: mean absolute error and bias (realised minus predicted) in seconds,
    and the fraction of requests on the wrong side of the TTFT SLO (predicted within it and missed
    it, or the reverse): the error rate of an admission rule that refuses on the prediction."""
    pairs = np.array([(r.predicted_ttft_s, time_to_first_token_s(r)) for r in finished
                      if r.predicted_ttft_s is not None], dtype=float).reshape(-1, 2)
    if not len(pairs):
        nan = float("nan")
        return {"ttft_pred_mae_s": nan, "ttft_pred_bias_s": nan, "ttft_pred_wrong_side": nan}
    err = pairs[:, 1] - pairs[:, 0]
    wrong = (pairs[:, 0] <= ttft_slo_s) != (pairs[:, 1] <= ttft_slo_s)
    return {"ttft_pred_mae_s": float(np.abs(err).mean()), "ttft_pred_bias_s": float(err.mean()),
            "ttft_pred_wrong_side": float(wrong.mean())}


def _finished_at(r: Request) -> float:
    assert r.finish_time_s is not None, "a terminal request has a finish time"
    return r.finish_time_s
