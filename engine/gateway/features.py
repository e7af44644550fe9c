"""What a fleet admission policy sees: the gateway's state as a vector of ratios.

Every feature is read from the gateway's own pieces (``Gate``: its queue, its drain admission, its
replica views) and from what ended in the last control interval, and is a ratio of like things: none
needs the replicas' profiles, the fleet's size or its fluid bound, so one policy serves any fleet
behind the gateway, and the HTTP gateway computes the vector exactly as the fleet twin does.
"""

from __future__ import annotations

import math

import numpy as np

from tidegate.engine.gateway.gate import Gate

#: the vector's entries, in order (docs/ENV.md, "The fleet env")
FLEET_FEATURES = (
    "predicted_wait_slos",  # the queue wait admission predicts for an arrival now, over the TTFT SLO
    "queue_per_limit",      # requests in the gateway's queue over the replicas' concurrency limits summed
    "arrival_over_drain",   # the interval's arrivals per second over the measured drain rate (0 until it is trusted)
    "drain_trusted",        # 1 once the drain rate is measured, else 0
    "refused_share",        # the interval's refusals at the gateway over its arrivals
    "good_share",           # the interval's requests that met both SLOs over those that ended served or late
    "first_byte_slos",      # the 90th percentile of the replicas' dispatch-to-first-byte, over the TTFT SLO
    "late_slos",            # the 90th percentile of how much longer than predicted requests waited, over the SLO
    "room_share",           # the share of replicas that may take a request now
    "in_flight_frac",       # the gateway's requests on the replicas over their concurrency limits
    "queued_frac",          # the replicas' own queues (their last gauges) over their concurrency limits
    "stale_share",          # the share of replicas whose gauges are stale
    "last_action",          # the action that ran the interval
)
FLEET_OBS_DIM = len(FLEET_FEATURES)
#: every feature is clipped to [-FEATURE_CLIP, FEATURE_CLIP]
FEATURE_CLIP = 10.0
#: the admission budget's range: ``BUDGET_BASE ** action``, action in [-1, 1]
BUDGET_BASE = 2.0


def budget_scale(action: float) -> float:
    """The admission budget's multiple (``DrainAdmission.budget_scale``) for an action in [-1, 1]; a
    non-finite action is 0 (the gateway's own rule)."""
    a = float(action)
    if not math.isfinite(a):
        return 1.0
    return BUDGET_BASE ** max(-1.0, min(1.0, a))


def load_fleet_policy(path: str):
    """The fleet admission policy at ``path`` (an ONNX file of ``tidegate export``), run by numpy.

    :raises ValueError: in one sentence, when the file cannot be read as a policy or is not one of the
        fleet's (its observation is not ``FLEET_FEATURES``, or it answers more than one action)
    """
    from tidegate.ctrl.policy import NumpyPolicy

    try:
        policy = NumpyPolicy(path)
    except FileNotFoundError:
        raise ValueError(f"the admission policy {path!r} does not exist") from None
    except Exception as exc:  # onnx raises whatever its parser does on a foreign file
        raise ValueError(f"the admission policy {path!r} is not a policy file of tidegate export "
                         f"({type(exc).__name__})") from None
    obs_dim, actions = policy.mean.shape[0], policy.action[1].shape[0]
    if obs_dim != FLEET_OBS_DIM or actions != 1:
        raise ValueError(f"the admission policy {path!r} reads {obs_dim} features and answers {actions} actions; "
                         f"a fleet admission policy reads {FLEET_OBS_DIM} and answers 1 (tidegate train --env fleet)")
    return policy


class FleetFeatures:
    """Counts what arrives and ends between two reads, and reads the gateway into a vector.

    :param ttft_slo_s: the TTFT SLO the gateway admits for
    """

    def __init__(self, ttft_slo_s: float) -> None:
        self.ttft_slo_s = ttft_slo_s
        self.arrived = self.refused = self.good = self.late = 0
        self._since = 0.0

    def reset(self, now: float) -> None:
        self.arrived = self.refused = self.good = self.late = 0
        self._since = now

    def on_arrival(self, refused: bool) -> None:
        self.arrived += 1
        self.refused += refused

    def on_end(self, good: bool) -> None:
        """A request the gateway admitted ended served (``good``: within both SLOs) or late or failed."""
        if good:
            self.good += 1
        else:
            self.late += 1

    def read(self, gate: Gate, now: float, action: float) -> np.ndarray:
        """The vector over the interval since the last read (or ``reset``), then counting starts anew."""
        slo = self.ttft_slo_s
        admission = gate.admission
        views = gate.views
        n = max(len(views), 1)
        limits = max(sum(max(v.limit, 1.0) for v in views), 1.0)
        queue = len(gate.queue)
        rate = admission.rate(now)
        span = max(now - self._since, 1e-9)
        ended = self.good + self.late
        x = np.array([
            admission.predicted_wait_s(now, queue) / slo,
            queue / limits,
            self.arrived / span / rate if rate > 0.0 else 0.0,
            1.0 if rate > 0.0 else 0.0,
            self.refused / self.arrived if self.arrived else 0.0,
            self.good / ended if ended else 1.0,
            admission.first_byte_s / slo,
            admission.late_s / slo,
            len(gate.candidates(now)) / n,
            sum(v.in_flight for v in views) / limits,
            sum(v.queued(now) for v in views) / limits,
            sum(v.stale(now) for v in views) / n,
            action,
        ], dtype=np.float64)
        self.reset(now)
        return np.clip(np.nan_to_num(x, nan=0.0, posinf=FEATURE_CLIP, neginf=-FEATURE_CLIP), -FEATURE_CLIP,
                       FEATURE_CLIP).astype(np.float32)
