"""Prometheus metrics of the server, named after vLLM's where the meaning matches."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0)
_DECISION_BUCKETS = (1e-6, 2e-6, 5e-6, 1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 1e-2)


class ServerMetrics:
    """One registry per server, so several servers (tests) can live in one process."""

    def __init__(self, model_name: str) -> None:
        self.registry = r = CollectorRegistry()
        labels = ["model_name"]
        self.model_name = model_name

        def gauge(name, doc):
            return Gauge(f"tidegate:{name}", doc, labels, registry=r).labels(model_name)

        def counter(name, doc):
            return Counter(f"tidegate:{name}", doc, labels, registry=r).labels(model_name)

        def histogram(name, doc, buckets=_LATENCY_BUCKETS):
            return Histogram(f"tidegate:{name}", doc, labels, buckets=buckets, registry=r).labels(model_name)

        self.running = gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to start.")
        self.kv_usage = gauge("kv_cache_usage_perc", "KV cache usage: 1 means full.")
        self.in_flight = gauge("num_requests_in_flight", "HTTP requests admitted and not yet answered.")
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.")
        self.itl = histogram("inter_token_latency_seconds", "Time between two streamed tokens.")
        self.ttft_prediction_error = histogram(
            "ttft_prediction_abs_error_seconds",
            "|realised - predicted| time to first token, the prediction made when the request was admitted.")
        self.ttft_prediction_wrong_side = counter(
            "ttft_prediction_wrong_side_total",
            "Requests whose TTFT prediction at admission was on the other side of the TTFT SLO than the realised TTFT.")
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to last token.")
        self.queue_time = histogram("request_queue_time_seconds", "Arrival to first activation.")
        self.prompt_tokens = counter("prompt_tokens_total", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("generation_tokens_total", "Generated tokens.")
        self.evictions = counter("num_preemptions_total",
                                 "Requests evicted (KV freed; prompt and output re-prefilled when they run again).")
        self.shield_interventions = counter("shield_interventions_total",
                                            "Steps where the shield changed the controller's action.")
        self.guard_switches = counter("controller_guard_switches_total",
                                      "Times the runtime twin guard handed control from the learned policy to "
                                      "the slo-flow heuristic.")
        self.guarded = gauge("controller_guarded", "1 while the runtime twin guard has handed control to the "
                             "slo-flow heuristic.")
        self.degraded = gauge("controller_degraded", "1 while the learned policy's fallback (the slo-flow heuristic) "
                              "decides because the policy failed, was late or is backing off.")
        self.engine_up = gauge("engine_up", "1 while the engine process serves.")
        self.engine_restarts = counter("engine_restarts_total", "Times a new engine process replaced one that "
                                       "died or stopped answering.")
        self._fallbacks = Counter("tidegate:controller_fallbacks_total", "Control intervals the learned policy's "
                                  "fallback decided instead of the policy, by cause.", labels + ["cause"], registry=r)
        self.decision_time = histogram("controller_decision_seconds", "Time of one controller decision.",
                                       _DECISION_BUCKETS)
        self._rejections = Counter("tidegate:request_rejections_total", "Requests answered 429/503, by reason.",
                                   labels + ["reason"], registry=r)
        self._finished = Counter("tidegate:request_success_total", "Requests that ended, by finish reason.",
                                 labels + ["finished_reason"], registry=r)

    def rejected(self, reason: str) -> None:
        self._rejections.labels(self.model_name, reason).inc()

    def fallback(self, cause: str, count: int = 1) -> None:
        self._fallbacks.labels(self.model_name, cause).inc(count)

    def finished(self, reason: str) -> None:
        self._finished.labels(self.model_name, reason).inc()
