"""The gateway's HTTP front: OpenAI's routes, proxied to the fleet, and the gateway's own probes.

A completion's body goes to the replica unchanged, so every field a replica serves works through
the gateway; the gateway reads only what it routes and admits by (``stream``, ``priority``, the
prompt and ``max_tokens``). The faults:

- an arrival when no replica is up: 503 (down), told apart from 429 (busy, with Retry-After);
- a replica that refuses (429/503) or cannot be reached before the stream starts: the request goes
  back to the head of its turn in the queue and to another replica; the replica that could not be
  reached is marked down and health-checked back in; a request every replica up has refused gets the
  last refusal (its reason and Retry-After);
- a replica that fails after the stream started: the stream ends with an error event and
  ``[DONE]``; it is never sent again, because the client has seen tokens;
- a client that goes away: its upstream request is closed, and the replica cancels it; one that goes
  away while its request waits in the queue or for a whole (non-streamed) answer is noticed there too,
  so no replica generates for nobody.

A body over ``GatewayConfig.max_request_bytes`` (32 MiB) gets 413 as soon as its length says so (or its
bytes pass it), on every route.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import Response, StreamingResponse
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from tidegate.engine.gateway.fleet import TRANSPORT_ERRORS, Fleet, GatewayConfig
from tidegate.engine.gateway.queue import Queued, clamp_priority, header_priority
from tidegate.engine.gateway.replicas import ReplicaView
from tidegate.engine.serve.operator import BodyLimits, http_error
from tidegate.engine.serve.protocol import error_response

log = logging.getLogger("tidegate.gateway")

#: request headers passed on to the replica
_FORWARDED = ("authorization", "content-type", "accept", "x-request-id", "openai-organization", "openai-project")
#: the output tokens a request is charged for when it names no max_tokens
_DEFAULT_OUTPUT_TOKENS = 256
#: characters to a token, for a prompt's size before any replica has tokenized it (English text; a size class
#: of the first byte's time spans a factor of two)
_CHARS_PER_TOKEN = 4
#: what a request's max_tokens and n count for at most in its tenant's charge (the replica judges the values)
_MAX_CHARGED = 1 << 20


def create_gateway_app(config: GatewayConfig) -> FastAPI:
    """The gateway's FastAPI application; its lifespan starts and stops the fleet's tasks."""
    fleet = Fleet(config)

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        await fleet.start()
        try:
            yield
        finally:
            await fleet.stop()

    app = FastAPI(title="tidegate gateway", lifespan=lifespan)
    app.add_middleware(BodyLimits, max_bytes=config.max_request_bytes)
    app.add_exception_handler(StarletteHTTPException, http_error)  # 404, 405: OpenAI's error body, as the replicas'
    app.add_exception_handler(ClientDisconnect, _client_left)
    app.state.fleet = fleet

    @app.get("/health")
    @app.head("/health", include_in_schema=False)  # uptime monitors
    async def health():
        return {"status": "ok" if fleet.any_up() else "no replica is up", **fleet.status()}

    @app.get("/ready")
    @app.head("/ready", include_in_schema=False)
    async def ready():
        if not fleet.any_up():
            return error_response(503, "no replica is up", "unavailable", retry_after_s=config.health_interval_s)
        return {"status": "ready"}

    @app.get("/metrics")
    @app.head("/metrics", include_in_schema=False)
    async def metrics():
        fleet.refresh_metrics()
        return Response(generate_latest(fleet.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(http: HttpRequest):
        return await _pass_through(fleet, "GET", "/v1/models", b"", http)

    for path in ("/tokenize", "/detokenize"):
        app.add_api_route(path, _make_pass_through(fleet, path), methods=["POST"])

    @app.post("/v1/completions")
    async def completions(http: HttpRequest):
        return await _complete(fleet, "/v1/completions", http)

    @app.post("/v1/chat/completions")
    async def chat(http: HttpRequest):
        return await _complete(fleet, "/v1/chat/completions", http)

    return app


def _make_pass_through(fleet: Fleet, path: str):
    async def route(http: HttpRequest):
        return await _pass_through(fleet, "POST", path, await http.body(), http)
    return route


def _headers(http: HttpRequest) -> dict[str, str]:
    """The client's headers the replica needs; bytes come back as sent (they are relayed as they are)."""
    return {**{k: v for k, v in http.headers.items() if k.lower() in _FORWARDED}, "accept-encoding": "identity"}


#: headers the client library would add that the client did not send (a body without a content type stays one)
_NOT_ADDED = ("Content-Type",)


async def _pass_through(fleet: Fleet, method: str, path: str, body: bytes, http: HttpRequest) -> Response:
    """A request outside admission (models, tokenize), to the least loaded replica that is up."""
    now = time.monotonic()
    for view in sorted((v for v in fleet.views if v.up), key=lambda v: v.load(now)):
        try:
            assert fleet.client is not None
            async with fleet.client.request(method, view.url + path, data=body, headers=_headers(http),
                                            skip_auto_headers=_NOT_ADDED) as r:
                content = await r.read()
        except TRANSPORT_ERRORS as exc:
            fleet.replica_failed(view, f"{path} failed ({type(exc).__name__})")
            continue
        return Response(content, status_code=r.status, media_type=r.headers.get("content-type"))
    return error_response(503, "no replica is up", "unavailable", retry_after_s=fleet.config.health_interval_s)


# ------------------------------------------------------------------------------- completions
#: a chat body's fields that its template renders into the prompt besides the messages (their size counts)
_RENDERED = ("tools", "documents", "chat_template_kwargs")


def _read(body: dict, chat: bool) -> tuple[str, int, bool, int | None]:
    """(prompt text, output tokens charged, stream, priority) of a completion body."""
    if chat:
        parts = []
        messages = body.get("messages")
        for m in messages if isinstance(messages, list) else ():
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, str):
                parts.append(content)
            elif isinstance(content, list):
                parts.extend(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"),
                                                                                                    str))
            if isinstance(m, dict) and m.get("tool_calls"):
                parts.append(json.dumps(m["tool_calls"]))
        # what else the chat template renders into the prompt, after the messages (their prefix routes)
        parts.extend(json.dumps(body[k]) for k in _RENDERED if body.get(k))
        prompt = "\n".join(parts)
    else:
        p = body.get("prompt")
        prompt = p if isinstance(p, str) else json.dumps(p)
    out = body.get("max_completion_tokens") if chat else None
    out = out if isinstance(out, int) else body.get("max_tokens")
    n = min(body["n"], _MAX_CHARGED) if isinstance(body.get("n"), int) and body["n"] > 0 else 1
    charged = min(out, _MAX_CHARGED) if isinstance(out, int) and out > 0 else _DEFAULT_OUTPUT_TOKENS
    charged *= n
    priority = body.get("priority")
    priority = clamp_priority(priority) if isinstance(priority, int) else None
    return prompt, charged, bool(body.get("stream")), priority


async def _complete(fleet: Fleet, path: str, http: HttpRequest) -> Response:
    c = fleet.config
    m = fleet.metrics
    arrived = time.monotonic()
    raw = await http.body()  # at most max_request_bytes (BodyLimits)
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        return error_response(400, "the body is not valid JSON (or nests too deeply)")
    if not isinstance(body, dict):
        return error_response(400, "the body must be a JSON object")
    prompt, charged, stream, priority = _read(body, chat=path.endswith("chat/completions"))
    if c.priority_from != "body":
        priority = None  # the body's field is the client's word: ignored unless the operator trusts it
    header = http.headers.get(c.priority_header) if c.priority_from != "none" else None
    if priority is None and header is not None:
        try:
            priority = header_priority(header)
        except ValueError:
            return error_response(400, f"the {c.priority_header} header must be an integer", param=c.priority_header)
    priority = priority or 0
    if body.get("priority") != (priority or None):
        # the replica reads the body's priority too (vLLM's priority scheduling, a tidegate replica's classes): it
        # gets the priority the gateway took (the header's, or none), not the client's own word
        body.pop("priority", None)
        if priority:
            body["priority"] = priority
        raw = json.dumps(body).encode()
    if not fleet.any_up():
        m.requests.labels("unavailable").inc()
        return error_response(503, "no replica is up", "unavailable", retry_after_s=c.health_interval_s)
    prompt_tokens = len(prompt) / _CHARS_PER_TOKEN
    retry_after = fleet.admit(priority, arrived, prompt_tokens)
    fleet.features.on_arrival(refused=retry_after is not None)
    if retry_after is not None:
        m.requests.labels("rejected").inc()
        return error_response(429, "the fleet is busy: the queue ahead would not start this request within the "
                                   f"TTFT SLO of {c.ttft_slo_s:g} s", "rate_limit_exceeded",
                              retry_after_s=retry_after)
    item = Queued(priority, http.headers.get(c.tenant_header, ""), prompt_tokens + charged, arrived,
                  arrived + c.queue_ttl_s, prompt, prompt_tokens=prompt_tokens,
                  predicted_wait_s=fleet.gate.predicted_wait_s(priority, arrived))
    gone = asyncio.ensure_future(_client_gone(http))
    try:
        return await _queued(fleet, path, http, raw, item, stream, gone)
    finally:
        gone.cancel()


async def _queued(fleet: Fleet, path: str, http: HttpRequest, raw: bytes, item: Queued, stream: bool,
                  gone: asyncio.Future) -> Response:
    """An admitted request: its wait in the queue for a replica with room, and the replica's answer."""
    c = fleet.config
    m = fleet.metrics
    while True:
        item.ticket = asyncio.get_running_loop().create_future()
        fleet.enqueue(item, front=item.retries > 0)
        try:
            await asyncio.wait((item.ticket, gone), return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            _abandon(fleet, item)
            raise
        if gone.done():
            _abandon(fleet, item)
            return _nobody()
        view = item.ticket.result()
        if view is None:
            m.requests.labels("expired").inc()
            fleet.features.on_end(good=False)
            return error_response(503, f"waited {c.queue_ttl_s:g} s (the gateway queue's TTL) for a replica with room",
                                  "unavailable", retry_after_s=c.health_interval_s)
        answer = await _send(fleet, view, path, raw, http, item, stream, gone)
        if answer is not None:
            return answer
        if not fleet.any_up():  # the last replica went down under it: nothing to wait for
            m.requests.labels("unavailable").inc()
            return error_response(503, "no replica is up", "unavailable", retry_after_s=c.health_interval_s)
        item.retries += 1


def _abandon(fleet: Fleet, item: Queued) -> None:
    """Its client left while the request waited: it leaves the queue, or ends where it was dispatched as it went."""
    ticket = item.ticket
    if ticket.done() and not ticket.cancelled() and ticket.result() is not None:
        ticket.result().ended(time.monotonic(), completed=False)
        fleet.wake()
    ticket.cancel()
    fleet.metrics.requests.labels("client_gone").inc()


async def _client_gone(http: HttpRequest) -> None:
    """Returns when the client has gone away (its body is read: what it sends next is its disconnect)."""
    while (await http.receive())["type"] != "http.disconnect":
        pass


async def _client_left(http: HttpRequest, exc: ClientDisconnect) -> Response:
    """A client that went away while its body was read: nobody to answer, nothing to log."""
    return _nobody()


def _nobody() -> Response:
    """The answer to a client that left (nobody reads it; 499 as nginx logs such a request)."""
    return Response(status_code=499)


async def _send(fleet: Fleet, view: ReplicaView, path: str, raw: bytes, http: HttpRequest, item: Queued,
                stream: bool, gone: asyncio.Future) -> Response | None:
    """The replica's answer, streamed through; None when the request must go to another replica."""
    assert fleet.client is not None
    m = fleet.metrics
    dispatched = time.monotonic()
    # the replica's headers may come with its whole answer: a client that leaves meanwhile closes the request
    requesting = asyncio.ensure_future(fleet.client.request("POST", view.url + path, data=raw, headers=_headers(http),
                                                            skip_auto_headers=_NOT_ADDED))
    try:
        await asyncio.wait((requesting, gone), return_when=asyncio.FIRST_COMPLETED)
        if not requesting.done():
            requesting.cancel()
            view.ended(time.monotonic(), completed=False)
            fleet.wake()
            m.requests.labels("client_gone").inc()
            return _nobody()
        upstream = requesting.result()
    except TRANSPORT_ERRORS as exc:
        view.ended(time.monotonic(), completed=False)
        fleet.replica_failed(view, f"a request to it failed ({type(exc).__name__})")
        m.retries.labels("unreachable").inc()
        return None
    except BaseException:
        requesting.cancel()
        view.ended(time.monotonic(), completed=False)
        raise
    fleet.answered(view, upstream.status)
    if upstream.status in (429, 503) and fleet.config.admission:
        now = time.monotonic()
        view.ended(now, completed=False)
        view.refused(now)
        fleet.wake()
        item.refused_by.add(view.url)
        if item.refused_by.issuperset(v.url for v in fleet.gate.views if v.up):
            # every replica up refused it: their answer is the fleet's. Sent round again it would be refused
            # again (a request too large for any replica's admission now), each try prefilled and aborted,
            # until its TTL, while the arrivals behind it waited
            return await _refusal(fleet, upstream)
        upstream.close()
        m.retries.labels(str(upstream.status)).inc()
        return None
    if upstream.status != 200 or not stream:
        return await _whole(fleet, view, upstream, item, dispatched, gone)
    return _RelayedResponse(_Relay(fleet, view, upstream, item, dispatched),
                            upstream.headers.get("content-type", "text/event-stream"))


async def _refusal(fleet: Fleet, upstream: aiohttp.ClientResponse) -> Response:
    """A replica's refusal (429 or 503) passed to the client, with its reason and Retry-After."""
    status = upstream.status
    try:
        content = await asyncio.wait_for(upstream.read(), fleet.config.connect_timeout_s)
        media_type = upstream.headers.get("content-type")
    except (asyncio.TimeoutError, *TRANSPORT_ERRORS):
        upstream.close()
        return error_response(status, "every replica refused the request", "rate_limited" if status == 429
                              else "unavailable", retry_after_s=fleet.config.health_interval_s)
    finally:
        upstream.release()
    fleet.metrics.requests.labels(f"replica_{status}").inc()
    fleet.features.on_end(good=False)
    retry_after = upstream.headers.get("retry-after")
    return Response(content, status_code=status, media_type=media_type,
                    headers={"Retry-After": retry_after} if retry_after else None)


async def _whole(fleet: Fleet, view: ReplicaView, upstream: aiohttp.ClientResponse, item: Queued,
                 dispatched: float, gone: asyncio.Future) -> Response:
    """A non-streamed answer (or an error the replica gave), read whole and passed on; a client that leaves
    first has the replica's answer closed, so the replica cancels it."""
    m = fleet.metrics
    ok = left = False
    reading = asyncio.ensure_future(upstream.read())
    try:
        await asyncio.wait((reading, gone), return_when=asyncio.FIRST_COMPLETED)
        if not reading.done():
            left = True
            reading.cancel()
            upstream.close()
            m.requests.labels("client_gone").inc()
            return _nobody()
        content = reading.result()
        ok = upstream.status == 200
    except TRANSPORT_ERRORS as exc:
        fleet.replica_failed(view, f"an answer from it broke off ({type(exc).__name__})")
        m.requests.labels("failed").inc()
        return error_response(502, f"the replica failed while it answered ({type(exc).__name__})", "replica_failed")
    finally:
        if not reading.done():
            reading.cancel()
            upstream.close()
        now = time.monotonic()
        view.ended(now, completed=ok, lifetime_s=now - dispatched)
        fleet.wake()
        if not left:
            upstream.release()
    if ok:
        fleet.admission.completed(now)
        m.ttfb.observe(now - item.arrived_at)
    fleet.features.on_end(good=ok)  # whole: no token timing to judge by
    m.requests.labels("completed" if ok else f"replica_{upstream.status}").inc()
    return Response(content, status_code=upstream.status, media_type=upstream.headers.get("content-type"))


class _Relay:
    """One replica's stream relayed to its client; ``finish`` ends its accounting exactly once, from the
    stream's own end or from the response's, whichever comes first (a stream the server never starts,
    for a client that left before its first byte, still ends)."""

    def __init__(self, fleet: Fleet, view: ReplicaView, upstream: aiohttp.ClientResponse, item: Queued,
                 dispatched: float) -> None:
        self.fleet, self.view, self.upstream, self.item, self.dispatched = fleet, view, upstream, item, dispatched
        self.outcome = "client_gone"
        self._finished = False
        self.first_s: float | None = None
        self.last_s = 0.0
        self.events = 0

    async def chunks(self) -> AsyncIterator[bytes]:
        """The replica's stream, chunk by chunk; an error event and ``[DONE]`` if the replica fails in it."""
        fleet, view, m = self.fleet, self.view, self.fleet.metrics
        last: float | None = None
        try:
            async for chunk in self.upstream.content.iter_any():
                if not chunk:
                    continue
                now = time.monotonic()
                self.events += chunk.count(b"data: {")
                self.last_s = now
                if last is None:
                    self.first_s = now
                    view.first_byte(self.dispatched, now)
                    fleet.admission.first_byte(now - self.dispatched, now, self.item.prompt_tokens)
                    m.ttfb.observe(now - self.item.arrived_at)
                else:
                    view.tokens_streamed(now, now - last, chunk.count(b"data: {"))
                last = now
                if b"data: [DONE]" in chunk:
                    # the answer is whole: a client that closes now (the openai client does) leaves nothing undone
                    self.outcome = "completed"
                yield chunk
            self.outcome = "completed"
        except TRANSPORT_ERRORS as exc:
            if self.outcome == "completed":  # after [DONE]: the answer was whole
                return
            self.outcome = "failed"
            fleet.replica_failed(view, f"a stream from it broke off ({type(exc).__name__})")
            error = {"error": {"message": f"the replica failed mid-stream ({type(exc).__name__}); the tokens sent "
                                          "are all there will be", "type": "replica_failed", "code": 502}}
            yield f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()
        finally:
            await self.finish()

    async def finish(self) -> None:
        if self._finished:
            return
        self._finished = True
        now = time.monotonic()
        completed = self.outcome == "completed"
        self.view.ended(now, completed=completed, lifetime_s=now - self.dispatched)
        if completed:
            self.fleet.admission.completed(now)
        if self.outcome != "client_gone":  # a client that left says nothing of the fleet
            self.fleet.features.on_end(good=completed and self.met_slo())
        self.fleet.metrics.requests.labels(self.outcome).inc()
        self.fleet.wake()
        if completed:
            self.upstream.release()  # read to its end: the connection goes back to the pool
        else:
            self.upstream.close()  # a client that left, or a broken stream: closed, so the replica cancels


    def met_slo(self) -> bool:
        """The stream's first byte within the TTFT SLO of the request's arrival, and its events, after the
        first, at most the TPOT SLO apart on average (an event is a token, or ``stream_interval`` of them)."""
        c = self.fleet.config
        if self.first_s is None or self.first_s - self.item.arrived_at > c.ttft_slo_s:
            return False
        return self.events < 2 or (self.last_s - self.first_s) / (self.events - 1) <= c.tpot_slo_s


class _RelayedResponse(StreamingResponse):
    """A StreamingResponse that ends its relay however the response ends."""

    def __init__(self, relay: _Relay, media_type: str) -> None:
        super().__init__(relay.chunks(), status_code=200, media_type=media_type)
        self.relay = relay

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.relay.finish()
