"""What the operator sets around the routes: the API key, the request size limit, and OpenAI's
error body for every error Starlette and FastAPI answer on their own (an unknown path, a wrong
method, a body that is empty, not UTF-8, not JSON or not sent as JSON).

Both checks are plain ASGI middleware, not ``BaseHTTPMiddleware``, so streamed responses and the
routes' disconnect checks pass through untouched.
"""

from __future__ import annotations

import asyncio
import hmac
import uuid
from http import HTTPStatus
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tidegate.engine.serve.protocol import error_response

if TYPE_CHECKING:
    from tidegate.engine.serve.config import ServeConfig

#: paths answered without the API key: the probes, as vLLM leaves them open
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics", "/version"})

_Handler = Callable[[HttpRequest, Any], Awaitable[Response]]


def install_operator(app: FastAPI, config: ServeConfig) -> None:
    """Register the error handlers, the request size limit and, when ``config.api_key`` is set, the
    API key check (outermost, so a request without the key is refused before its body is read).

    :param app: the application, with its own handlers already registered
    :param config: the server settings
    """
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(RequestValidationError, body_errors(app.exception_handlers.get(RequestValidationError)))
    app.add_middleware(BodyLimits, max_bytes=config.max_request_bytes)
    if config.api_key:
        app.add_middleware(ApiKeyAuth, api_key=config.api_key)
    app.add_middleware(RequestId)  # outermost: every answer, refusals by the others included, carries it


# ---------------------------------------------------------------------------------- middleware
def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return value
    return None


class RequestId:
    """Every response carries ``X-Request-Id``: the client's, or a new one when it sent none (or one
    that is not a short printable token)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        raw = _header(scope, b"x-request-id")
        rid = raw.decode("latin-1") if raw else ""
        if not rid or len(rid) > 256 or not rid.isprintable():
            rid = uuid.uuid4().hex
        value = rid.encode("latin-1")

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", value)]}
            await send(message)

        await self.app(scope, receive, send_with_id)


class ApiKeyAuth:
    """401 for a request without ``Authorization: Bearer <api_key>``, except on :data:`OPEN_PATHS`."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.api_key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        given = _header(scope, b"authorization")
        scheme, _, token = (given or b"").partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.api_key):
            await self.app(scope, receive, send)
            return
        message = ("the API key is not valid" if given else
                   "this server needs an API key: send it as 'Authorization: Bearer <key>'")
        response = error_response(401, message, "authentication_error")
        response.headers["WWW-Authenticate"] = "Bearer"
        await response(scope, receive, send)


class _TooLarge(Exception):
    """The body grew past the limit while it was read."""


class _TooSlow(Exception):
    """The body did not arrive whole in time."""


#: seconds a request's whole body may take to arrive (32 MiB at half a megabyte a second)
BODY_TIMEOUT_S = 60.0


class BodyLimits:
    """413 for a request body over ``max_bytes``: at once when its ``Content-Length`` says so, else as
    soon as the bytes read pass the limit (a chunked body); 408 for one that is not whole ``timeout_s``
    after the route began to read it (a client that trickles its body holds a connection and a task no
    longer); whatever the route then tries to answer."""

    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float = BODY_TIMEOUT_S) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

    def _refusal(self, slow: bool = False) -> Response:
        if slow:
            response = error_response(408, f"the request body did not arrive whole within {self.timeout_s:g} s")
        else:
            response = error_response(413, f"the request body is larger than this server's limit of "
                                           f"{self.max_bytes} bytes")
        response.headers["Connection"] = "close"  # the rest of the body is never read
        return response

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refusal()(scope, receive, send)
            return
        received = 0
        too_large = too_slow = False
        started = False
        replaced = False  # the route's answer, swallowed for the 413 or 408
        whole = False
        deadline: float | None = None

        async def counted_receive() -> Message:
            nonlocal received, too_large, too_slow, whole, deadline
            if whole:  # after the body: the route waits for the client's disconnect, as long as it likes
                return await receive()
            loop = asyncio.get_running_loop()
            if deadline is None:
                deadline = loop.time() + self.timeout_s
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                too_slow = True
                raise _TooSlow from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    too_large = True
                    raise _TooLarge
                whole = not message.get("more_body", False)
            else:
                whole = True
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started, replaced
            if replaced:
                return
            if (too_large or too_slow) and not started:  # the route answered a body cut short (FastAPI: a 400)
                replaced = started = True
                await self._refusal(slow=too_slow)(scope, receive, send)
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, guarded_send)
        except (_TooLarge, _TooSlow):
            if replaced:
                return
            if started:
                raise
            await self._refusal(slow=too_slow)(scope, receive, send)


# ---------------------------------------------------------------------------------- error bodies
async def http_error(request: HttpRequest, exc: StarletteHTTPException) -> Response:
    """Any HTTPException (the router's 404 and 405, FastAPI's unreadable body) in OpenAI's error body."""
    status = exc.status_code
    default = exc.detail == _phrase(status)  # raised by the router or FastAPI, not by a route with its own words
    if status == 404 and default:
        message = f"there is no route {request.method} {request.url.path}"
    elif status == 405 and default:
        allowed = (exc.headers or {}).get("Allow")
        message = f"{request.url.path} does not take {request.method}" + (f"; it takes {allowed}" if allowed else "")
    elif isinstance(exc.__cause__, UnicodeDecodeError):
        message = "the request body is not valid UTF-8"
    elif status == 400 and exc.__cause__ is not None:
        message = "the request body cannot be read as JSON"
    else:
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
    kind = "invalid_request_error" if status < 500 else "internal_error"
    response = error_response(status, message, kind)
    for key, value in (exc.headers or {}).items():
        response.headers[key] = value
    return response


def _phrase(status: int) -> str | None:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return None


def body_errors(fallback: _Handler | None) -> _Handler:
    """A handler of RequestValidationError that words a missing or non-JSON body itself (FastAPI's
    error names no field there) and passes every other error to ``fallback``."""

    async def handler(request: HttpRequest, exc: RequestValidationError) -> Response:
        problem = _body_problem(request, exc.errors())
        if problem is not None:
            return error_response(*problem)
        if fallback is not None:
            return await fallback(request, exc)
        return error_response(400, "the request body is not valid")

    return handler


def _is_json(content_type: str | None) -> bool:
    media = (content_type or "").split(";")[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def _body_problem(request: HttpRequest, errors) -> tuple[int, str] | None:
    """(status, message) when the body as a whole is missing or not a JSON object; None otherwise."""
    if not errors or tuple(errors[0].get("loc", ())) != ("body",):
        return None
    if errors[0].get("type") == "missing":
        return 400, "the request body is empty; send a JSON object"
    content_type = request.headers.get("content-type")
    if not _is_json(content_type):
        return 415, (f"the request body must be JSON, sent with 'Content-Type: application/json' "
                     f"(got {content_type!r})" if content_type else
                     "the request body must be JSON, sent with 'Content-Type: application/json' (got none)")
    return 400, "the request body must be a JSON object"
