"""The FastAPI application: its routes and the handlers of the errors no route answers.

The completion routes hand their bodies to :class:`engine.serve.serving.OpenAIServing`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from tidegate.engine.serve.protocol import ChatBody, CompletionBody, error_response, model_list, validation_message
from tidegate.engine.serve.serving import OpenAIServing

if TYPE_CHECKING:
    from tidegate.engine.serve.launch import ServeConfig
    from tidegate.engine.serve.service import EngineService

log = logging.getLogger("tidegate.server")


def create_app(service: EngineService, config: ServeConfig) -> FastAPI:
    """The FastAPI application around a running EngineService.

    :param service: the running engine service
    :param config: the server settings
    """
    from tidegate.engine.serve.extra_routes import add_extra_routes, package_version
    from tidegate.engine.serve.operator import install_operator

    app = FastAPI(title="tidegate", version=package_version())
    app.add_exception_handler(RequestValidationError, _invalid_request)
    app.add_exception_handler(Exception, _unexpected)
    _add_probe_routes(app, service)
    serving = OpenAIServing(service, config)
    _add_openai_routes(app, serving)
    add_extra_routes(app, serving, config)
    install_operator(app, config)  # after the handlers above: it wraps the validation one
    return app


# ---------------------------------------------------------------------------------- routes
def _add_probe_routes(app: FastAPI, service: EngineService) -> None:
    """Liveness, readiness and Prometheus metrics."""

    @app.get("/health")
    @app.head("/health", include_in_schema=False)  # uptime monitors
    async def health():
        if not service.alive:
            return error_response(503, "the engine is not running; a new one is starting", "unavailable",
                                  retry_after_s=5)
        # degraded: serving, but on the learned policy's fallback (the policy failed, was late or is
        # backing off); guarded (in "controller"): the runtime guard found the policy losing
        return {"status": "degraded" if service.degraded else "ok", **service.status()}

    @app.get("/ready")
    @app.head("/ready", include_in_schema=False)  # uptime monitors
    async def ready():
        if service.draining:
            return error_response(503, "the server is shutting down", "unavailable", retry_after_s=5)
        if not service.alive:
            return error_response(503, "the engine is restarting", "unavailable", retry_after_s=5)
        return {"status": "ready"}

    @app.get("/metrics")
    @app.head("/metrics", include_in_schema=False)  # uptime monitors
    async def prometheus_metrics(http: HttpRequest):
        # ?name[]=...: only those series, as prometheus_client's own exposition app answers; a gateway that reads
        # a few gauges ten times a second costs the server a ninth of rendering them all
        names = http.query_params.getlist("name[]")
        registry = service.metrics.registry
        return Response(generate_latest(registry.restricted_registry(names) if names else registry),
                        media_type=CONTENT_TYPE_LATEST)


def _add_openai_routes(app: FastAPI, serving: OpenAIServing) -> None:
    """``/v1/models``, ``/v1/completions`` and ``/v1/chat/completions``."""

    @app.get("/v1/models")
    async def models():
        return model_list(serving.model_name, serving.created, serving.service.max_model_len)

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, http: HttpRequest):
        return await serving.create_completion(body, http)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody, http: HttpRequest):
        return await serving.create_chat_completion(body, http)


async def _invalid_request(request: HttpRequest, exc: RequestValidationError):
    """A body that fails its schema: 400 with the first error, in OpenAI's error body."""
    message, param = validation_message(exc.errors())
    return error_response(400, message, param=param)


async def _unexpected(request: HttpRequest, exc: Exception):
    log.exception("unexpected error")
    return error_response(500, f"internal error: {type(exc).__name__}", "internal_error")
