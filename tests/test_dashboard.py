"""The Grafana dashboard in docs/grafana queries only series the server exports, and the per-request
histograms it draws land where the dashboard looks for them."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tidegate.engine.real.model import load_model
from tidegate.engine.serve.metrics import ServerMetrics
from tests.test_server import Running

pytestmark = pytest.mark.timeout(180)

DASHBOARD = Path(__file__).resolve().parents[1] / "docs" / "grafana" / "tidegate.json"
METRIC = re.compile(r"tidegate:[a-zA-Z0-9_:]+")
# series suffixes Prometheus adds to a family of each type
SUFFIXES = {"histogram": ("_bucket", "_sum", "_count"), "counter": ("_total",), "gauge": ("",)}
# counters labelled by a cause only get a series once that cause happens
LABELLED_BY_CAUSE = {"tidegate:request_rejections_total", "tidegate:controller_fallbacks_total"}


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def queries(board: dict) -> list[str]:
    """Every PromQL expression: each panel target's and the template variables'."""
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    return exprs + [v["query"]["query"] for v in board["templating"]["list"] if v["type"] == "query"]


def queried_series(board: dict) -> set[str]:
    return {name for expr in queries(board) for name in METRIC.findall(expr)}


def exported(text: str) -> tuple[set[str], set[str]]:
    """(series names each exported family stands for, by its type; series names with a sample)."""
    by_type, sampled = set(), set()
    for family in text_string_to_metric_families(text):
        by_type.update(family.name + suffix for suffix in SUFFIXES.get(family.type, ("",)))
        sampled.update(s.name for s in family.samples)
    return by_type, sampled


def test_the_dashboard_is_a_grafana_dashboard_over_a_prometheus_input():
    board = dashboard()
    assert board["schemaVersion"] >= 39 and board["uid"] == "tidegate"
    assert [i["name"] for i in board["__inputs"]] == ["DS_PROMETHEUS"]
    assert {v["name"] for v in board["templating"]["list"]} == {"DS_PROMETHEUS", "model_name"}
    data_panels = [p for p in board["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in board["panels"]}) == len(board["panels"])
    for p in data_panels:
        assert p["datasource"]["uid"] == "${DS_PROMETHEUS}" and p["targets"], p["title"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${DS_PROMETHEUS}", p["title"]
            # every series is selected for the chosen model
            for m in METRIC.finditer(t["expr"]):
                assert t["expr"].startswith('{model_name="$model_name"}', m.end()), (p["title"], m.group())


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny", "cpu", "float32")


def test_every_series_the_dashboard_queries_is_exported_by_a_running_server(tiny):
    s = Running(tiny, controller="learned")
    try:
        for prompt in ("dash", "board"):
            s.client.completions.create(model="tiny", prompt=prompt, max_tokens=4, extra_body={"ignore_eos": True})
        by_type, sampled = exported(httpx.get(s.url + "/metrics").text)
        s.wait_idle()
    finally:
        s.close()
    queried = queried_series(dashboard())
    assert len(queried) > 20
    assert queried <= by_type, sorted(queried - by_type)
    # all but the cause-labelled counters show 0 rather than "No data" before anything happened
    assert queried - LABELLED_BY_CAUSE <= sampled, sorted(queried - LABELLED_BY_CAUSE - sampled)


def values(metrics: ServerMetrics) -> dict[tuple[str, tuple], float]:
    text = generate_latest(metrics.registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def sample(v: dict, name: str, **labels) -> float:
    return v[(name, tuple(sorted({"model_name": "m", **labels}.items())))]


def test_request_finished_observes_every_per_request_histogram():
    m = ServerMetrics("m")
    m.request_finished(reason="length", prompt_tokens=30, generation_tokens=11, max_tokens=11, e2e_s=1.5,
                       queue_s=0.25, prefill_s=0.2, decode_s=1.0)
    v = values(m)
    t = "tidegate:"
    for name, total in (("e2e_request_latency_seconds", 1.5), ("request_queue_time_seconds", 0.25),
                        ("request_prefill_time_seconds", 0.2), ("request_decode_time_seconds", 1.0),
                        ("request_inference_time_seconds", 1.2), ("request_time_per_output_token_seconds", 0.1),
                        ("request_prompt_tokens", 30), ("request_generation_tokens", 11),
                        ("request_max_num_generation_tokens", 11), ("request_params_max_tokens", 11)):
        assert sample(v, f"{t}{name}_count") == 1, name
        assert sample(v, f"{t}{name}_sum") == pytest.approx(total), name
    assert sample(v, t + "request_prompt_tokens_bucket", le="20.0") == 0
    assert sample(v, t + "request_prompt_tokens_bucket", le="50.0") == 1
    assert sample(v, t + "request_success_total", finished_reason="length") == 1
    assert sample(v, t + "request_success_total", finished_reason="stop") == 0


def test_a_cancelled_request_is_an_abort_and_phases_it_never_reached_are_not_observed():
    m = ServerMetrics("m")
    m.request_finished(reason="cancelled", prompt_tokens=7, generation_tokens=0, max_tokens=None, e2e_s=0.3,
                       queue_s=None, prefill_s=None, decode_s=None)
    m.finished("cancelled")
    v = values(m)
    t = "tidegate:"
    assert sample(v, t + "request_success_total", finished_reason="abort") == 2
    assert not any(labels and dict(labels).get("finished_reason") == "cancelled" for _, labels in v)
    assert sample(v, t + "e2e_request_latency_seconds_count") == 1
    assert sample(v, t + "request_generation_tokens_count") == 1
    for name in ("request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
                 "request_inference_time_seconds", "request_time_per_output_token_seconds",
                 "request_params_max_tokens"):
        assert sample(v, f"{t}{name}_count") == 0, name
