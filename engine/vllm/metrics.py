"""tidegate's counters on vLLM's ``/metrics``, under ``tidegate:``, read when scraped.

A collector in prometheus_client's default registry, the one vLLM's API server serves (without
``PROMETHEUS_MULTIPROC_DIR``, that is with one API server process). The API process's own counts
(refusals by reason, arrivals admitted without a usable observation) come from the admission gate;
the engine's (steps decided, decision time, shield interventions, fallbacks by cause, guard
switches, the step model's refits and its terms) from the record the engine publishes after every step (``channel``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from typing import Any

from tidegate.ctrl.theory import decode_token_s
from tidegate.engine.vllm.admission import AdmissionGate
from tidegate.engine.vllm.channel import DECISION_BUCKETS

log = logging.getLogger(__name__)
_registered: list[Any] = []


class TidegateCollector:
    """The ``tidegate:`` metrics of one vLLM server.

    :param gate: the API process's admission (None: the pass-through, whose counters stay at zero).
    :param model_name: the ``model_name`` label, as vLLM's own metrics carry it.
    """

    def __init__(self, gate: AdmissionGate | None, model_name: str) -> None:
        self.gate = gate
        self.model_name = model_name

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        refusals, fail_open, engine = self.gate.counters() if self.gate is not None else ({}, {}, None)
        labels, model = ["model_name"], [self.model_name]

        def counter(name: str, doc: str, value: float) -> Any:
            family = CounterMetricFamily(f"tidegate:{name}", doc, labels=labels)
            family.add_metric(model, value)
            return family

        def by(name: str, doc: str, label: str, values: dict[str, int]) -> Any:
            family = CounterMetricFamily(f"tidegate:{name}", doc, labels=labels + [label])
            for key, value in sorted(values.items()):
                family.add_metric(model + [key], value)
            return family

        yield by("request_rejections", "Requests answered 429 in the API process, by reason.", "reason", refusals)
        yield by("admission_fail_open", "Arrivals admitted without asking the controller, by cause (no observation "
                 "published yet, a stale one, admit raised).", "cause", fail_open)
        decisions = engine.decisions if engine is not None else 0
        yield counter("controller_decisions", "Engine steps the controller decided.", decisions)
        yield counter("shield_interventions", "Steps where the shield changed the controller's action.",
                      engine.interventions if engine is not None else 0)
        yield by("controller_fallbacks", "Steps that took a fallback decision instead of the controller's, by "
                 "cause (the plugin's conservative decision, or the learned policy's fallback).", "cause",
                 engine.fallbacks if engine is not None else {})
        yield counter("controller_guard_switches", "Times the runtime twin guard handed control from the learned "
                      "policy to the slo-flow heuristic.", engine.guard_switches if engine is not None else 0)
        for name, doc, value in (
                ("controller_guarded", "1 while the runtime twin guard has handed control to the slo-flow "
                 "heuristic.", engine.guarded if engine is not None else False),
                ("controller_degraded", "1 while the learned policy's fallback decides.",
                 engine.degraded if engine is not None else False)):
            gauge = GaugeMetricFamily(f"tidegate:{name}", doc, labels=labels)
            gauge.add_metric(model, float(value))
            yield gauge
        yield counter("profile_refits", "Times the step-time model the controller estimates with was refitted from "
                      "the replica's own steps.", engine.profile_fits if engine is not None else 0)
        fitted = engine.fitted if engine is not None else None
        if fitted is not None:
            model_terms = GaugeMetricFamily("tidegate:step_model_seconds", "The refitted step-time model: seconds "
                                            "a step takes per unit of each term.", labels=labels + ["term"])
            for term, value in (("step", fitted.base_s), ("prefill_token", fitted.per_token_s),
                                ("decode_token", decode_token_s(fitted)),
                                ("kv_token_read", fitted.per_kv_token_s), ("prefill_chunk", fitted.per_prefill_s)):
                model_terms.add_metric(model + [term], value)
            yield model_terms
        histogram = HistogramMetricFamily("tidegate:controller_decision_seconds",
                                          "Seconds one engine step waited for the controller's decision.",
                                          labels=labels)
        counts = engine.decide_buckets if engine is not None else [0] * (len(DECISION_BUCKETS) + 1)
        cumulative, buckets = 0, []
        for bound, count in zip([*map(str, DECISION_BUCKETS), "+Inf"], counts):
            cumulative += count
            buckets.append((bound, cumulative))
        histogram.add_metric(model, buckets, engine.decide_s_sum if engine is not None else 0.0)
        yield histogram


def register_metrics(gate: AdmissionGate | None, model_name: str) -> None:
    """Add the collector to prometheus_client's default registry, once per process."""
    from prometheus_client import REGISTRY

    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        log.warning("tidegate: PROMETHEUS_MULTIPROC_DIR is set (several API server processes): vLLM's /metrics "
                    "then shows no tidegate: metrics")
    for old in _registered:
        REGISTRY.unregister(old)
    _registered.clear()
    collector = TidegateCollector(gate, model_name)
    REGISTRY.register(collector)
    _registered.append(collector)
