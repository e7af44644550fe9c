"""Fuzz the server's request bodies against its own OpenAPI schema: no input may cause a 5xx."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.test_server import Running

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def running():
    from tidegate.engine.real.model import load_model

    s = Running(load_model("tiny", "cpu", "float32"), controller="greedy", default_max_tokens=8)
    yield s
    s.close()


#: parameters of features the server refuses by design, and constraints whose generated values do not compile:
#: dropped by the "served" tweak, which reaches the engine with every other parameter as generated
UNSERVED = ("suffix", "response_format", "tools", "tool_choice", "functions", "function_call", "guided_json",
            "guided_regex", "guided_choice", "guided_grammar", "structured_outputs")


def _tweak(body: dict, tweak: str) -> None:
    if tweak == "as-is":
        return
    body["model"] = "tiny"  # reach past the model check into the engine
    if tweak == "tiny-model":
        return
    body["max_tokens"] = 4
    body.pop("max_completion_tokens", None)
    if tweak == "served":
        for name in UNSERVED:
            body.pop(name, None)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            body["prompt"] = [t % 259 for t in prompt]  # within the tiny vocabulary


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_no_request_body_causes_a_server_error(running, path):
    schema = schemathesis.openapi.from_url(running.url + "/openapi.json")
    operation = schema[path]["POST"]
    seen = {"4xx": 0, "2xx": 0}

    @given(case=operation.as_strategy(), tweak=st.sampled_from(["as-is", "tiny-model", "short", "served"]))
    @settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    def fuzz(case, tweak):
        if isinstance(case.body, dict):
            _tweak(case.body, tweak)
        response = case.call(timeout=60)
        assert response.status_code < 500, f"{path} {case.body!r} -> {response.status_code}: {response.text[:300]}"
        seen["2xx" if response.status_code < 300 else "4xx"] += 1

    fuzz()
    assert seen["4xx"] > 0 and seen["2xx"] > 0, seen
    running.wait_idle(30)
