"""tidegate on Ray Serve: the gateway's ranking alone, then ``tidegate serve --ray-replicas 2`` on a local
Ray, driven over HTTP with the openai client and httpx."""

from __future__ import annotations

import math
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


# ------------------------------------------------------------ the router's queue (no Ray running)
def _router(ttl_s: float = 30.0):
    """A TidegateRouter's state as Ray's router would set it up, without Ray's routing machinery."""
    from collections import deque

    from tidegate.engine.gateway.ray_serve import TidegateRouter

    router = object.__new__(TidegateRouter)
    router.initialize_state(max_queued=16, queue_ttl_s=ttl_s, router="least-loaded")
    router._pending_requests_to_fulfill = deque()
    router._remove_pending_request_from_indices = lambda pending: None
    return router


def _pending(loop, rid: str, created_at: float, headers=()):
    """A request as Ray's HTTP proxy hands it on: its ASGI scope pickled in a StreamingHTTPRequest."""
    import pickle

    from ray.serve._private.common import RequestMetadata, StreamingHTTPRequest
    from ray.serve.request_router import PendingRequest

    scope = {"type": "http", "method": "POST", "path": "/v1/completions",
             "headers": [(k.encode(), v.encode()) for k, v in headers]}
    return PendingRequest(args=[pickle.dumps(StreamingHTTPRequest(scope, proxy_actor_name="proxy"))], kwargs={},
                          metadata=RequestMetadata(request_id=rid, internal_request_id=rid), created_at=created_at,
                          future=loop.create_future())


def test_the_router_reads_a_request_class_from_its_headers():
    import asyncio

    from tidegate.engine.gateway.ray_serve import request_class

    loop = asyncio.new_event_loop()
    try:
        names = (b"x-gateway-inference-priority", b"x-gateway-inference-fairness-id")
        urgent = _pending(loop, "a", 0.0, [("X-Gateway-Inference-Priority", " -3 "),
                                           ("x-gateway-inference-fairness-id", "team-a")])
        assert request_class(urgent, *names) == (-3, "team-a")
        assert request_class(_pending(loop, "b", 0.0), *names) == (0, "")
        # the replica answers it 400 (Ray's proxy answers a router's refusal with 408, 429 or 503 only)
        assert request_class(_pending(loop, "c", 0.0, [("x-gateway-inference-priority", "high")]), *names) == (0, "")
    finally:
        loop.close()


def test_a_freed_replica_goes_to_the_most_urgent_waiting_request_then_the_least_served_tenant():
    """Ray's FIFO mixin asks the router which pending request a replica goes to: priority levels first (lower
    first), then tenants in turn within a level, first come first served within a tenant."""
    import asyncio

    loop = asyncio.new_event_loop()
    try:
        router = _router()
        now = time.time()
        arrivals = [("a1", "a", "5"), ("a2", "a", "5"), ("a3", "a", "5"), ("b1", "b", "5"), ("u1", "a", "-1")]
        for i, (rid, tenant, priority) in enumerate(arrivals):
            router._pending_requests_to_fulfill.append(_pending(loop, rid, now + i * 0.01, [
                ("x-gateway-inference-fairness-id", tenant), ("x-gateway-inference-priority", priority)]))
        order = []
        while (pending := router._get_pending_request_matching_metadata()) is not None:
            pending.future.set_result("replica")
            order.append(pending.metadata.internal_request_id)
        assert order == ["u1", "a1", "b1", "a2", "a3"]
        assert not router._queued and not len(router.queue)
    finally:
        loop.close()


def test_requests_that_ended_neither_count_as_ahead_nor_charge_their_tenant_and_a_retry_keeps_its_turn():
    """Entries of requests refused or cancelled (their clients left) leave the mirror at once: left behind, they
    counted as ahead of every later arrival (which was then refused though nothing live waited) and charged their
    tenant. A request that a replica turned away, which Ray tries again, goes back to its turn's head."""
    import asyncio

    loop = asyncio.new_event_loop()
    try:
        router = _router()
        now = time.time()
        fifo = router._pending_requests_to_fulfill
        gone = [_pending(loop, f"a{i}", now + i * 0.01, [("x-gateway-inference-fairness-id", "a")]) for i in range(3)]
        live = _pending(loop, "a3", now + 0.03, [("x-gateway-inference-fairness-id", "a")])
        others = [_pending(loop, f"b{i}", now + 0.04 + i * 0.01, [("x-gateway-inference-fairness-id", "b")])
                  for i in range(2)]
        fifo.extend([*gone, live, *others])
        router._sync(now)
        for pending in gone:
            pending.future.cancel()
        newcomer = _pending(loop, "c", now + 0.1)
        fifo.append(newcomer)
        router._sync(now)
        assert router.queue.before(router._queued["c"]) == 3  # a3, b0, b1: not the three that left
        first = router._get_pending_request_matching_metadata()
        assert first is live  # tenant a was not charged for the requests its clients took back
        # the replica turned a3 away: Ray resets its future and tries it again, first in its FIFO
        live.future = loop.create_future()
        fifo.appendleft(live)
        order = []
        while (pending := router._get_pending_request_matching_metadata()) is not None:
            pending.future.set_result("replica")
            order.append(pending.metadata.internal_request_id)
        assert order[0] == "a3" and sorted(order) == ["a3", "b0", "b1", "c"]
    finally:
        loop.close()


def test_a_request_past_the_queue_ttl_ends_with_503():
    import asyncio

    loop = asyncio.new_event_loop()
    try:
        router = _router(ttl_s=5.0)
        now = time.time()
        old, fresh = _pending(loop, "old", now - 6.0), _pending(loop, "fresh", now - 1.0)
        router._pending_requests_to_fulfill.extend([old, fresh])
        router._sync(now)
        assert old.future.done() and old.future.exception().status_code == 503
        assert "TTL" in str(old.future.exception()) and float(old.future.exception().retry_after_s) > 0
        assert not fresh.future.done()
        assert router._get_pending_request_matching_metadata() is fresh
    finally:
        loop.close()


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


def _first_byte_at(url: str, max_tokens: int, headers: dict | None = None, started=None) -> tuple[int, float, float]:
    """(status, when its first streamed byte came, when it ended); ``started`` is released at the first byte."""
    body = {"model": "tiny", "prompt": "a b c d e f g", "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True}
    with httpx.Client(timeout=120) as client:
        with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers or {}) as resp:
            first = math.inf
            for _ in resp.iter_bytes():
                if first == math.inf:
                    first = time.monotonic()
                    if started is not None:
                        started.release()
            return resp.status_code, first, time.monotonic()


def test_a_freed_slot_goes_to_the_more_urgent_request_through_ray(fleet):
    """Both replicas full (4 each), three requests waiting at Ray's router at priority 5, then one at -1 (the
    header, read from the request Ray's proxy forwards): the urgent one starts first. A round in which a full
    replica freed a slot before the four were waiting is run again (the slot went to what waited then)."""
    for _ in range(3):
        started = threading.Semaphore(0)
        with ThreadPoolExecutor(12) as pool:
            busy = [pool.submit(_first_byte_at, fleet.url, 400, None, started) for _ in range(8)]
            for _ in range(8):
                assert started.acquire(timeout=60)
            low = []
            for _ in range(3):
                low.append(pool.submit(_first_byte_at, fleet.url, 4, {"x-gateway-inference-priority": "5"}))
                time.sleep(0.05)
            urgent = pool.submit(_first_byte_at, fleet.url, 4, {"x-gateway-inference-priority": "-1"})
            queued_at = time.monotonic()
            results = [f.result() for f in busy + low + [urgent]]
        assert all(status == 200 for status, _, _ in results), results
        if min(end for _, _, end in (f.result() for f in busy)) > queued_at + 0.2:
            break
    else:
        pytest.fail("in three rounds a replica freed a slot before the requests were waiting")
    assert urgent.result()[1] < min(first for _, first, _ in (f.result() for f in low))
    bad = httpx.post(f"{fleet.url}/v1/completions", json={"model": "tiny", "prompt": "a", "max_tokens": 1},
                     headers={"x-gateway-inference-priority": "soon"}, timeout=60)
    assert bad.status_code == 400 and "must be an integer" in bad.text


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
