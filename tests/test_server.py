"""The streaming server, end to end over loopback, with the official openai client."""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from tidegate.ctrl import build_controller

from tidegate.engine.serve.app import create_app
from tidegate.engine.serve.launch import ServeConfig, build_service
from tidegate.engine.serve.service import Stream
from tidegate.engine.real.model import load_model

pytestmark = pytest.mark.timeout(180)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny", "cpu", "float32")


class Running:
    """A server on loopback: the engine in a thread here (given the loaded tiny model) or, with
    ``tiny=None``, in a process of its own."""

    def __init__(self, tiny, **overrides) -> None:
        self.config = ServeConfig(port=free_port(), kv_capacity_tokens=4096, max_num_batched_tokens=256,
                                  engine_process=tiny is None, **overrides)
        self.service = build_service(self.config, tiny)
        self.server = uvicorn.Server(uvicorn.Config(create_app(self.service, self.config), host="127.0.0.1",
                                                    port=self.config.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            assert time.time() < deadline, "server did not start"
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.config.port}"
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0)

    @property
    def engine(self):
        """The engine loop (in-process servers only)."""
        return self.service.local

    @property
    def pool(self):
        return self.engine.core.pool

    def wait_idle(self, timeout_s: float = 10.0) -> None:
        deadline = time.time() + timeout_s
        while not self.service.idle():
            assert time.time() < deadline, "KV blocks were not freed"
            time.sleep(0.02)
        if self.engine is not None:
            assert self.pool.num_free_blocks == self.pool.num_blocks

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.service.stop()


@pytest.fixture(scope="module")
def server(tiny):
    s = Running(tiny, controller="greedy")
    yield s
    s.close()


def test_completion_and_chat_with_the_openai_client(server):
    c = server.client
    out = c.completions.create(model="tiny", prompt="Hello there", max_tokens=7, temperature=0,
                               extra_body={"ignore_eos": True})
    assert out.object == "text_completion" and out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 7 and out.usage.prompt_tokens == len("Hello there") + 1
    chat = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                     temperature=0, extra_body={"ignore_eos": True})
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 5


def test_streaming_matches_non_streaming(server):
    c = server.client
    kwargs = dict(model="tiny", prompt="Stream me", max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    whole = c.completions.create(**kwargs).choices[0].text
    chunks = list(c.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == whole
    assert chunks[-1].usage.completion_tokens == 12 and chunks[-1].choices == []
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    chat = list(c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                          stream=True, temperature=0, extra_body={"ignore_eos": True}))
    assert chat[0].choices[0].delta.role == "assistant"
    assert chat[-1].choices[0].finish_reason == "length"


def test_models_health_ready_and_metrics(server):
    assert server.client.models.list().data[0].id == "tiny"
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/ready").status_code == 200
    server.client.completions.create(model="tiny", prompt="m", max_tokens=3)
    text = httpx.get(server.url + "/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("tidegate:num_requests_running", "tidegate:kv_cache_usage_perc",
                 "tidegate:time_to_first_token_seconds", "tidegate:inter_token_latency_seconds",
                 "tidegate:e2e_request_latency_seconds", "tidegate:request_queue_time_seconds",
                 "tidegate:generation_tokens", "tidegate:num_preemptions", "tidegate:controller_decision_seconds",
                 "tidegate:request_rejections", "tidegate:shield_interventions"):
        assert name in families, name
    ttft = {s.name: s.value for s in families["tidegate:time_to_first_token_seconds"].samples}
    assert ttft["tidegate:time_to_first_token_seconds_count"] >= 1
    # ?name[]=...: those series alone, as the gateway asks ten times a second
    few = httpx.get(server.url + "/metrics", params=[("name[]", "tidegate:num_requests_waiting"),
                                                     ("name[]", "tidegate:num_preemptions_total")]).text
    assert {f.name for f in text_string_to_metric_families(few)} == {"tidegate:num_requests_waiting",
                                                                     "tidegate:num_preemptions"}


LONG = "x" * 3000


@pytest.mark.parametrize("body, fragment", [
    ('{"model": "tiny", "prompt": ', "not valid JSON"),
    ({"model": "tiny"}, "prompt"),
    ({"model": "tiny", "prompt": "hi", "max_tokens": "many"}, "max_tokens"),
    ({"model": "tiny", "prompt": "hi", "max_tokens": 0}, "max_tokens must be at least 1"),
    ({"model": "tiny", "prompt": "hi", "max_tokens": 5000}, "exceeds the model context"),
    ({"model": "tiny", "prompt": LONG, "max_tokens": 5}, "more than the model context"),
    ({"model": "nope", "prompt": "hi"}, "not served here"),
    ({"model": "tiny", "prompt": "hi", "n": 17}, "n"),
    ({"model": "tiny", "prompt": "hi", "temperature": -1}, "temperature"),
    ({"model": "tiny", "prompt": ""}, "prompt"),
    ({"model": "tiny", "prompt": [1, 2, 99999]}, "outside the vocabulary"),
    ({"model": "tiny", "prompt": "hi", "seed": 2**70}, "seed must be a 64-bit integer"),
    # a field of several forms: the rule the nearest form broke, or the forms it may take
    ({"model": "tiny", "prompt": []}, "prompt: List should have at least 1 item"),
    ({"model": "tiny", "prompt": [5, -1]}, "prompt.1 must be at least 0, got -1"),
    ({"model": "tiny", "prompt": [[1], []]}, "prompt.1: List should have at least 1 item"),
    ({"model": "tiny", "prompt": 5}, "prompt must be one of: str, list[str], list[int], list[list[int]]"),
    ({"model": "tiny", "prompt": "hi", "stop": ["a"] * 1000}, "stop: List should have at most"),
    ({"model": "tiny", "prompt": "hi", "stop": [1]}, "stop must be one of: str, list[str]"),
    # EOS (id 2) is the only token allowed, and min_tokens masks it: nothing could be generated
    ({"model": "tiny", "prompt": "hi", "allowed_token_ids": [2], "min_tokens": 3, "max_tokens": 5},
     "min_tokens masks every token of allowed_token_ids"),
    ({"model": "tiny", "prompt": "hi", "bad_words": [" "]}, "empty or whitespace-only words"),
])
def test_bad_input_gets_a_400_with_an_error_body(server, body, fragment):
    content = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(server.url + "/v1/completions", content=content, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert fragment in r.json()["error"]["message"]


def test_chat_bad_input(server):
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": "tiny", "messages": []})
    assert r.status_code == 400
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "wizard"}]})
    assert r.status_code == 400
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user",
                                                                                          "content": 5}]})
    assert r.status_code == 400 and "messages.0.content must be one of: str, list[" in r.json()["error"]["message"]


def test_disconnect_mid_stream_frees_blocks(server):
    body = {"model": "tiny", "prompt": "bye", "max_tokens": 1000, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: ") for line in got)
        assert server.pool.num_free_blocks < server.pool.num_blocks
    server.wait_idle()
    cancelled = [r for r in server.engine.core.metrics.terminal if r.state.value == "cancelled"]
    assert cancelled and cancelled[-1].num_output_tokens < 1000


def test_fault_in_a_step_fails_only_that_steps_requests(server):
    executor = server.engine.llm.executor
    original = executor.execute
    fired = threading.Event()

    def flaky(batch):
        if not fired.is_set() and batch.num_decodes:
            fired.set()
            raise RuntimeError("injected fault")
        return original(batch)

    executor.execute = flaky
    try:
        body = {"model": "tiny", "prompt": "fault", "max_tokens": 20, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body) as r:
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert "injected fault" in json.loads(events[-2])["error"]["message"]
    finally:
        executor.execute = original
    out = server.client.completions.create(model="tiny", prompt="after", max_tokens=4, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 4
    server.wait_idle()


def test_slow_reader_stream_is_ended_and_bounded(tiny):
    s = Running(tiny, controller="greedy", stream_buffer_chunks=4)
    try:
        import asyncio

        loop = asyncio.new_event_loop()
        stream = Stream(loop, limit=4)
        stream.admitted = True
        ids = s.service.tokenizer.encode("slow")
        from tidegate.engine.real.sampling import SamplingParams
        s.service.submit(stream, ids, SamplingParams(ignore_eos=True), 200)  # nobody reads this stream
        deadline = time.time() + 30
        while stream.result is None:
            assert time.time() < deadline
            time.sleep(0.02)
        s.wait_idle()
        assert stream.overflowed and len(stream.chunks) <= 5
        assert stream.result.state.value == "cancelled" and stream.result.completion_tokens < 200
        loop.close()
    finally:
        s.close()


def test_429_with_retry_after_when_the_controller_refuses(tiny):
    s = Running(tiny, controller="watermark:watermark=0.01")
    try:
        body = {"model": "tiny", "prompt": "a" * 200, "max_tokens": 300, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", s.url + "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            next(lines)
            time.sleep(0.2)
            t = time.perf_counter()
            refused = httpx.post(s.url + "/v1/completions", json={"model": "tiny", "prompt": "b", "max_tokens": 3})
            latency = time.perf_counter() - t
        assert refused.status_code == 429
        assert int(refused.headers["Retry-After"]) >= 1
        assert "watermark" in refused.json()["error"]["message"]
        assert latency < 1.0
        with pytest.raises(openai.RateLimitError):
            with httpx.stream("POST", s.url + "/v1/completions", json=body) as r2:
                lines2 = r2.iter_lines()
                next(lines2)
                s.client.completions.create(model="tiny", prompt="c", max_tokens=2)
        s.wait_idle()
        rejected = [r for r in s.engine.core.metrics.terminal if r.state.value == "rejected"]
        assert len(rejected) >= 2  # the engine's accounting saw the early answers too
    finally:
        s.close()


def test_an_idle_server_admits_an_arrival_of_many_copies(tiny):
    """An arrival is judged once, as a whole: judged copy by copy, each of n=8 copies of a long prompt found the
    earlier ones queued ahead of it, and an idle server refused the request as overloaded (a 429 that no retry
    could ever turn into an answer)."""
    s = Running(tiny, controller="slo-flow")
    try:
        many = s.client.completions.create(model="tiny", prompt="x" * 1500, max_tokens=5, n=8,
                                           extra_body={"ignore_eos": True})
        assert len(many.choices) == 8 and many.usage.completion_tokens == 40
        batch = s.client.completions.create(model="tiny", prompt=["y" * 200] * 64, max_tokens=2,
                                            extra_body={"ignore_eos": True})
        assert len(batch.choices) == 64
        s.wait_idle()
    finally:
        s.close()


def test_queue_timeout_ends_a_waiting_request_with_503(tiny):
    s = Running(tiny, controller="greedy:max_num_seqs=1", queue_timeout_s=0.3)
    try:
        body = {"model": "tiny", "prompt": "first", "max_tokens": 600, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", s.url + "/v1/completions", json=body) as r:
            lines = r.iter_lines()  # keep the iterator: dropping it closes the connection
            next(lines)
            waited = httpx.post(s.url + "/v1/completions", json={"model": "tiny", "prompt": "second", "max_tokens": 3},
                                timeout=30)
        assert waited.status_code == 503
        assert "past the queue timeout of 0.3 s" in waited.json()["error"]["message"]
        s.wait_idle()
    finally:
        s.close()


def test_sigterm_drains_in_flight_requests_then_exits(tmp_path):
    port = free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "tidegate", "serve", "--port", str(port),
                             "--kv-capacity-tokens", "4096", "--drain-timeout-s", "20"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 60
        while True:
            try:
                if httpx.get(url + "/ready").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.time() < deadline and proc.poll() is None, "server did not start"
            time.sleep(0.1)
        result = {}

        def long_request():
            result["r"] = httpx.post(url + "/v1/completions", timeout=60, json={
                "model": "tiny", "prompt": "drain", "max_tokens": 800, "ignore_eos": True})
        t = threading.Thread(target=long_request)
        t.start()
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        refused = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "late", "max_tokens": 2})
        assert refused.status_code == 503 and refused.headers["Retry-After"]
        t.join(60)
        assert result["r"].status_code == 200
        assert result["r"].json()["usage"]["completion_tokens"] == 800
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_loadgen_against_the_server(server, tmp_path):
    from click.testing import CliRunner

    from tidegate.engine.cli import main

    out = tmp_path / "run.json"
    res = CliRunner().invoke(main, ["loadgen", "--url", server.url, "--dataset", "random", "--num-requests", "12",
                                    "--rate", "40", "--input-len", "20", "--output-len", "6", "--max-concurrency", "8",
                                    "--goodput", "ttft:5000", "--goodput", "tpot:1000", "--out", str(out)])
    assert res.exit_code == 0, res.output
    summary = json.loads(out.read_text())["summary"]
    assert summary["sent"] == 12 and summary["completed"] == 12 and summary["server_errors_5xx"] == 0
    assert summary["ttft_p50_ms"] > 0 and summary["goodput_rps"] > 0
    assert all(r["output_tokens"] == 6 for r in json.loads(out.read_text())["requests"])
    bad = CliRunner().invoke(main, ["loadgen", "--url", server.url, "--dataset", "random", "--num-requests", "1",
                                    "--goodput", "latency:5"])
    assert bad.exit_code == 2 and "expected ttft:MS or tpot:MS" in bad.output
    server.wait_idle()


def test_the_learned_server_runs_the_shielded_policy(tiny):
    s = Running(tiny, controller="learned")
    try:
        assert type(s.engine.core.controller._inner).__name__ == "ShieldedController"
        outs = [s.client.completions.create(model="tiny", prompt=f"p{i}", max_tokens=5,
                                            extra_body={"ignore_eos": True}) for i in range(3)]
        assert all(o.usage.completion_tokens == 5 for o in outs)
        text = httpx.get(s.url + "/metrics").text
        assert "tidegate:shield_interventions_total" in text
        s.wait_idle()
    finally:
        s.close()


def test_admission_recovers_once_a_burst_has_drained(tiny):
    s = Running(tiny, controller="watermark:queue_limit=2", max_num_seqs=1)
    try:
        from concurrent.futures import ThreadPoolExecutor

        body = {"model": "tiny", "prompt": "burst", "max_tokens": 30, "ignore_eos": True}
        with ThreadPoolExecutor(8) as pool:
            codes = list(pool.map(lambda _: httpx.post(s.url + "/v1/completions", json=body, timeout=60).status_code,
                                  range(8)))
        assert 429 in codes and 200 in codes
        s.wait_idle()
        time.sleep(0.2)
        after = [httpx.post(s.url + "/v1/completions", json=body, timeout=60).status_code for _ in range(3)]
        assert after == [200, 200, 200]
    finally:
        s.close()


def _stream_lines(url: str, body: dict, out: dict) -> None:
    """Read a streamed completion to its end; ``out`` gets its data lines and when it ended."""
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            out["status"] = r.status_code
            out["lines"] = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    except httpx.HTTPError as exc:
        out["error"] = repr(exc)
    out["ended"] = time.monotonic()


def _wait_ready(url: str, timeout_s: float) -> float:
    start = time.monotonic()
    while httpx.get(url + "/ready").status_code != 200:
        assert time.monotonic() - start < timeout_s, "the server did not get ready again"
        time.sleep(0.1)
    return time.monotonic() - start


@pytest.mark.parametrize("how", ["killed", "hung"])
def test_a_dead_or_hung_engine_process_ends_open_streams_and_is_replaced(how):
    s = Running(None, controller="greedy", engine_timeout_s=2.0)
    try:
        pid = httpx.get(s.url + "/health").json()["engine_pid"]
        assert pid and pid != os.getpid()
        outs = [{} for _ in range(3)]
        body = {"model": "tiny", "prompt": "long", "max_tokens": 2000, "stream": True, "ignore_eos": True}
        threads = [threading.Thread(target=_stream_lines, args=(s.url, body, o)) for o in outs]
        for t in threads:
            t.start()
        time.sleep(1.0)
        os.kill(pid, signal.SIGKILL if how == "killed" else signal.SIGSTOP)
        stopped = time.monotonic()
        for t in threads:
            t.join(30)
        for o in outs:  # every open stream ended, with an error event then [DONE]
            assert o["status"] == 200 and o["lines"][-1] == "[DONE]", o
            error = json.loads(o["lines"][-2])["error"]
            assert error["code"] == 503 and "engine" in error["message"]
        ended = max(o["ended"] for o in outs) - stopped
        assert ended < (10 if how == "killed" else 15)
        _wait_ready(s.url, 90)
        new_pid = httpx.get(s.url + "/health").json()["engine_pid"]
        assert new_pid != pid
        out = s.client.completions.create(model="tiny", prompt="again", max_tokens=4, extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 4
        metrics = httpx.get(s.url + "/metrics").text
        assert 'tidegate:engine_restarts_total{model_name="tiny"} 1.0' in metrics
    finally:
        if how == "hung":
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        s.close()


def _engine_nice_above_ours(pid: int) -> int:
    return os.getpriority(os.PRIO_PROCESS, pid) - os.getpriority(os.PRIO_PROCESS, 0)


def test_arrivals_while_the_engine_is_down_get_503():
    s = Running(None, controller="greedy")
    try:
        pid = httpx.get(s.url + "/health").json()["engine_pid"]
        # the engine process yields the CPU to the HTTP side, so a refusal never waits for a step
        expected = min(s.config.engine_nice, 19 - os.getpriority(os.PRIO_PROCESS, 0))
        assert expected > 0 and _engine_nice_above_ours(pid) == expected
        os.kill(pid, signal.SIGKILL)
        deadline = time.time() + 10
        while s.service.alive:
            assert time.time() < deadline
            time.sleep(0.02)
        refused = httpx.post(s.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2})
        assert refused.status_code == 503 and refused.headers["Retry-After"]
        assert httpx.get(s.url + "/ready").status_code == 503
        assert httpx.get(s.url + "/health").status_code == 503
        _wait_ready(s.url, 90)
        new_pid = httpx.get(s.url + "/health").json()["engine_pid"]
        assert new_pid != pid and _engine_nice_above_ours(new_pid) == expected  # a new engine, too
    finally:
        s.close()


def test_max_waiting_holds_under_a_flood(tiny):
    limit = 3
    s = Running(tiny, controller=f"greedy:max_waiting={limit},max_num_seqs=1")
    try:
        seen = []
        done = threading.Event()

        def watch():
            while not done.is_set():
                seen.append(len(s.engine.core.waiting))
                time.sleep(0.001)

        watcher = threading.Thread(target=watch)
        watcher.start()
        body = {"model": "tiny", "prompt": "flood", "max_tokens": 40, "ignore_eos": True}
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(24) as pool:
            codes = list(pool.map(lambda _: httpx.post(s.url + "/v1/completions", json=body, timeout=120).status_code,
                                  range(24)))
        done.set()
        watcher.join()
        assert max(seen) <= limit
        assert set(codes) <= {200, 429} and 429 in codes and 200 in codes
        s.wait_idle(30)
    finally:
        s.close()


def test_the_server_queue_timeout_never_loosens_the_controllers():
    from tidegate.engine.serve.engine_proc import apply_queue_timeout

    controller = build_controller("greedy:queue_timeout_s=0.5")
    apply_queue_timeout(controller, 30.0)
    assert controller.queue_timeout_s == 0.5
    apply_queue_timeout(controller, 0.2)
    assert controller.queue_timeout_s == 0.2
    for bad in (math.inf, math.nan, 0.0, -1.0):
        with pytest.raises(ValueError, match="queue_timeout_s"):
            ServeConfig(queue_timeout_s=bad)


def test_health_says_degraded_while_the_learned_policys_fallback_decides(tiny, tmp_path):
    import numpy as np
    import onnx
    from onnx import numpy_helper

    from tidegate.ctrl.learned import DEFAULT_POLICY

    model = onnx.load(str(DEFAULT_POLICY))  # the shipped policy with NaN weights: every answer is NaN
    for init in model.graph.initializer:
        init.CopyFrom(numpy_helper.from_array(np.full_like(numpy_helper.to_array(init), np.nan), init.name))
    onnx.save(model, str(tmp_path / "nan.onnx"))
    s = Running(tiny, controller=f"learned:path={tmp_path / 'nan.onnx'}")
    try:
        for i in range(3):
            s.client.completions.create(model="tiny", prompt=f"p{i}", max_tokens=12, extra_body={"ignore_eos": True})
        health = httpx.get(s.url + "/health")
        assert health.status_code == 200
        assert health.json()["status"] == "degraded" and "fallback" in health.json()["controller"]
        metrics = httpx.get(s.url + "/metrics").text
        fallbacks = [line for line in metrics.splitlines() if line.startswith("tidegate:controller_fallbacks_total{")]
        assert fallbacks and float(fallbacks[0].rsplit(" ", 1)[1]) >= 1
        assert 'tidegate:controller_degraded{model_name="tiny"} 1.0' in metrics
        s.wait_idle()
    finally:
        s.close()


def test_the_server_keeps_idle_connections_open_longer_than_its_clients_do():
    # Otherwise a request sent on a connection the server is closing for idleness fails with a read error.
    import httpx
    from openai._constants import DEFAULT_CONNECTION_LIMITS

    from tidegate.engine.serve.launch import KEEP_ALIVE_S

    assert KEEP_ALIVE_S > max(DEFAULT_CONNECTION_LIMITS.keepalive_expiry or 0, httpx.Limits().keepalive_expiry or 0)


def test_usage_counts_cached_prompt_tokens_and_salts_keep_tenants_apart(tiny):
    s = Running(tiny, controller="greedy", enable_prompt_tokens_details=True)
    try:
        def cached(**extra) -> int:
            out = s.client.completions.create(model="tiny", prompt="a shared preamble " * 6, max_tokens=2,
                                              temperature=0, extra_body=extra)
            assert out.usage.prompt_tokens == 109
            return out.usage.prompt_tokens_details.cached_tokens

        assert cached() == 0
        assert cached() == 96  # every full block but the one holding the last prompt token
        assert cached(cache_salt="tenant-a") == 0
        assert cached(cache_salt="tenant-a") == 96
        assert cached(cache_salt="tenant-b") == 0
        for salt in ("", "s" * 1025):  # a salt is a tenant's name, not a payload to hash
            bad = httpx.post(s.url + "/v1/completions", json={"prompt": "x", "cache_salt": salt})
            assert bad.status_code == 400 and "cache_salt" in bad.text
    finally:
        s.close()


def test_usage_leaves_prompt_tokens_details_out_by_default(server):
    out = server.client.completions.create(model="tiny", prompt="hello " * 20, max_tokens=1, temperature=0)
    again = server.client.completions.create(model="tiny", prompt="hello " * 20, max_tokens=1, temperature=0)
    assert out.usage.prompt_tokens_details is None and again.usage.prompt_tokens_details is None
