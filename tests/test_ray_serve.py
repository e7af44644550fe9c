"""tidegate on Ray Serve: the gateway's ranking alone, then ``tidegate serve --ray-replicas 2`` on a local
Ray, driven over HTTP with the openai client and httpx."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from click.testing import CliRunner

from tidegate.engine.cli import main
from tidegate.engine.gateway.ranking import GatewayRanking, Refused
from tidegate.engine.gateway.ray_serve import RayFleetConfig
from tests.test_server import free_port

pytestmark = pytest.mark.timeout(240)


# --------------------------------------------------------------------------- the ranking
def _report(ranking, key, now, waiting=0.0, running=0.0, finished=None, age=0.0):
    stats = {"waiting": waiting, "running": running, "kv_usage": 0.1, "at": 1000.0 + now - age}
    if finished is not None:
        stats["finished"] = finished
    ranking.report(key, stats, now, 1000.0 + now)


def test_the_ranking_prefers_the_replica_its_reports_say_is_less_loaded():
    r = GatewayRanking("least-loaded", report_period_s=0.25)
    r.view("a", 8)
    r.view("b", 8)
    _report(r, "a", 10.0, waiting=0.0, running=6.0)
    _report(r, "b", 10.0, waiting=0.0, running=1.0)
    assert r.rank([("a", 8), ("b", 8)], "", "q1", 0.0, 10.0) == ["b", "a"]
    # a report no newer than the last is ignored; a newer one counts
    _report(r, "b", 10.0, running=7.0, age=0.5)
    assert r.rank([("a", 8), ("b", 8)], "", "q2", 0.0, 10.0)[0] == "b"
    _report(r, "b", 10.1, running=7.0)
    assert r.rank([("a", 8), ("b", 8)], "", "q3", 0.0, 10.1)[0] == "a"


def test_predicted_delay_sends_more_to_the_replica_that_finishes_more():
    r = GatewayRanking("predicted-delay", report_period_s=0.25)
    for key in ("fast", "slow"):
        r.view(key, 64)
    for i in range(40):  # ten seconds of reports: fast finishes 4 a report, slow 1
        now = 10.0 + 0.25 * i
        _report(r, "fast", now, running=4.0, finished=4.0 * i)
        _report(r, "slow", now, running=2.0, finished=1.0 * i)
    # fast holds twice the requests but finishes four times as many: the sooner end is there
    assert r.rank([("fast", 64), ("slow", 64)], "", "q", 0.0, 20.0)[0] == "fast"
    # a replica that restarted reports fewer finished: no negative rate, no crash
    _report(r, "slow", 20.25, running=0.0, finished=0.0)
    assert r.views["slow"].completion_rate(20.25) >= 0.0


def test_a_request_waits_for_room_and_before_the_rate_is_measured_goes_on_after_the_slo():
    r = GatewayRanking("least-loaded", ttft_slo_s=1.0, report_period_s=0.25)
    for key in ("a", "b"):
        r.view(key, 1)
        _report(r, key, 5.0)
    r.routed("q1", "a", 5.0)
    r.routed("q2", "b", 5.0)
    # every replica holds its limit: the third request waits at the router
    assert r.rank([("a", 1), ("b", 1)], "", "q3", 0.2, 5.2) == []
    assert r.rank([("a", 1), ("b", 1)], "", "q3", 0.6, 5.6) == []
    assert r.held_total == 1 and r.holding == 1 and r.released_total == 0
    # no drain rate measured yet: once its SLO is spent it goes on, and the best replica's controller decides
    assert len(r.rank([("a", 1), ("b", 1)], "", "q3", 1.1, 6.1)) == 2
    assert r.released_total == 1 and r.holding == 0
    # a request that ends frees its replica's room
    r.ended("q1", "a", 6.2)
    assert r.rank([("a", 1), ("b", 1)], "", "q4", 0.0, 6.2) == ["a"]
    assert r.views["a"].in_flight == 0 and r.views["b"].in_flight == 1


def test_with_the_drain_rate_measured_a_request_that_would_start_late_is_refused():
    r = GatewayRanking("least-loaded", ttft_slo_s=2.0, report_period_s=0.25)
    for key in ("a", "b"):
        r.view(key, 2)
    for i in range(41):  # ten seconds of reports: each replica finishes one a report, 8 a second in all
        for key in ("a", "b"):
            _report(r, key, 0.25 * i, running=2.0, finished=float(i))
    now = 10.0
    for i, key in enumerate(("a", "a", "b", "b")):
        r.routed(f"run{i}", key, now)
    assert r.admission.predicted_wait_s(now, 0) == pytest.approx(0.125, rel=0.3)
    # nothing ahead: held; two more behind it are held while they would start within 2 s
    assert r.rank([("a", 2), ("b", 2)], "", "w1", 0.0, now) == []
    assert r.rank([("a", 2), ("b", 2)], "", "w2", 0.0, now) == []
    assert r.holding == 2
    # one that has already waited 1.95 s in Ray's queue would not start within 2 s: refused
    with pytest.raises(Refused) as refusal:
        r.rank([("a", 2), ("b", 2)], "", "late", 1.95, now)
    assert refusal.value.retry_after_s >= 1.0 and r.refused_total == 1 and r.holding == 2
    # w1 is handed a replica that freed: its wait is measured against what was predicted
    r.ended("run0", "a", now + 0.4)
    assert r.rank([("a", 2), ("b", 2)], "", "w1", 0.4, now + 0.4) == ["a"]
    r.routed("w1", "a", now + 0.4)
    assert r.holding == 1
    # a waiting request never seen again (its client left) is forgotten
    assert r.rank([("a", 2), ("b", 2)], "", "w3", 0.0, now + 20.0) == [] and r.holding == 1


def test_an_end_heard_before_its_routing_or_from_an_earlier_try_leaves_no_request_counted():
    r = GatewayRanking("least-loaded", report_period_s=0.25)
    for key in ("a", "b"):
        r.view(key, 1)
    r.ended("quick", "a", 1.0)  # the replica's answer came before the routing's bookkeeping
    r.routed("quick", "a", 1.0)
    assert r.views["a"].in_flight == 0
    r.routed("retried", "b", 2.0)  # a first try on a was refused; its late end must not end the try on b
    r.ended("retried", "a", 2.1)
    assert r.views["b"].in_flight == 1
    r.ended("retried", "b", 2.2)
    assert r.views["b"].in_flight == 0
    # held requests Ray no longer holds (their clients left) are forgotten
    r.routed("x", "a", 3.0)
    r.routed("y", "b", 3.0)
    assert r.rank([("a", 1), ("b", 1)], "", "gone", 0.0, 3.0) == [] and r.holding == 1
    r.prune(set())
    assert r.holding == 0


def test_the_ranking_forgets_stopped_replicas_and_ignores_bad_reports():
    r = GatewayRanking(report_period_s=0.25)
    r.view("a", 4)
    r.view("b", 4)
    r.report("a", {"waiting": "many", "at": float("nan")}, 1.0, 1000.0)
    r.report("a", {"waiting": float("inf"), "running": 2, "at": 1000.0}, 1.0, 1000.0)
    assert r.views["a"].waiting is None and r.views["a"].running == 2.0
    r.report("ghost", {"waiting": 1, "at": 1000.0}, 1.0, 1000.0)  # an unknown replica: nothing
    r.keep(["b"])
    assert list(r.views) == ["b"]
    assert r.rank([], "", "q", 5.0, 2.0) == []


def test_the_fleet_settings_refuse_what_cannot_run():
    with pytest.raises(ValueError, match="prompt"):
        RayFleetConfig(router="prefix-affinity")
    with pytest.raises(ValueError, match="at least 1"):
        RayFleetConfig(replicas=0)
    with pytest.raises(ValueError):
        GatewayRanking(ttft_slo_s=0.0)


def test_ray_options_without_ray_replicas_get_one_sentence():
    runner = CliRunner()
    out = runner.invoke(main, ["serve", "--router", "least-loaded"])
    assert out.exit_code == 2 and "--router applies to --ray-replicas" in out.output
    out = runner.invoke(main, ["serve", "--ray-replicas", "2", "--engine", "vllm"])
    assert out.exit_code == 2 and "does not apply" in out.output
    out = runner.invoke(main, ["serve", "--ray-replicas", "2", "--profile", "fit"])
    assert out.exit_code == 2 and "--profile fit" in out.output


# --------------------------------------------------------------------- on a local Ray
class RayFleet:
    def __init__(self, port: int) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "tidegate.engine.cli", "serve", "--ray-replicas", "2", "--port", str(port),
               "--engine-thread", "--threads", "1", "--kv-capacity-tokens", "2048", "--max-in-flight", "4",
               "--ray-max-queued", "6", "--ray-replica-cpus", "0.5", "--router", "predicted-delay",
               "--log-level", "warning"]
        env = {**os.environ, "RAY_DEDUP_LOGS": "0", "RAY_USAGE_STATS_ENABLED": "0"}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True, text=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)[-4000:]

    def wait_ready(self, timeout_s: float) -> None:
        """Until the command says it serves (every replica runs), and Ray's proxy has heard of both."""
        deadline = time.monotonic() + timeout_s
        while not any("tidegate: serving" in line for line in self.lines):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"the server did not start: {self.output}")
            time.sleep(0.2)
        assert httpx.get(f"{self.url}/v1/models", timeout=10).status_code == 200
        time.sleep(2.0)  # the proxy learns of new replicas by long poll

    def stop(self) -> int:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                return self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
                return -9
        return self.proc.returncode


@pytest.fixture(scope="module")
def fleet():
    f = RayFleet(free_port())
    try:
        f.wait_ready(180)
        yield f
    finally:
        f.rc = f.stop()


def _completion(url: str, max_tokens: int) -> httpx.Response:
    body = {"model": "tiny", "prompt": "a b c d e f g", "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True}
    with httpx.Client(timeout=120) as client:
        with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
            resp.read()
            return resp


def test_the_openai_client_streams_through_ray_serve(fleet):
    client = openai.OpenAI(base_url=f"{fleet.url}/v1", api_key="none", max_retries=0)
    chunks = list(client.completions.create(model="tiny", prompt="hello", max_tokens=6, stream=True,
                                            extra_body={"ignore_eos": True}))
    assert sum(len(c.choices[0].text) > 0 for c in chunks if c.choices) >= 1
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert chat.choices[0].finish_reason in ("length", "stop") and chat.usage.completion_tokens >= 1


def test_a_burst_spreads_over_both_replicas_and_overload_gets_429_with_retry_after(fleet):
    # 6 requests: within what the replicas hold (4 each), so every one is served, by both replicas
    with ThreadPoolExecutor(6) as pool:
        small = list(pool.map(lambda _: _completion(fleet.url, 24), range(6)))
    assert [r.status_code for r in small] == [200] * 6
    assert len({r.headers["x-tidegate-replica"] for r in small}) == 2
    # 40 at once: 8 held by the replicas, 6 waiting at the router, the rest refused at once
    with ThreadPoolExecutor(40) as pool:
        burst = list(pool.map(lambda _: _completion(fleet.url, 192), range(40)))
    codes = [r.status_code for r in burst]
    assert set(codes) <= {200, 429}, codes
    assert codes.count(200) >= 8 and codes.count(429) >= 1
    assert all(float(r.headers["retry-after"]) > 0 for r in burst if r.status_code == 429)
    # served after the burst: nothing was left stuck
    assert _completion(fleet.url, 4).status_code == 200


def test_the_server_stops_on_sigint_and_takes_ray_down(fleet):
    rc = fleet.stop()
    assert rc == 0, fleet.output
    assert "stopping the Ray Serve application" in fleet.output
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{fleet.url}/v1/models", timeout=2)
