"""The OpenAI-compatible streaming server, split as vLLM's ``entrypoints/openai``.

- :mod:`engine.serve.protocol`: the OpenAI wire format (request and response bodies, events, errors).
- :mod:`engine.serve.service`: the engine loop in its own thread, and the per-request stream buffer.
- :mod:`engine.serve.app`: the FastAPI application and its routes.
- :mod:`engine.serve.launch`: the settings, loading the model, uvicorn with a draining shutdown.
- :mod:`engine.serve.metrics`: the Prometheus metrics.
"""

from engine.serve.app import create_app
from engine.serve.launch import GracefulServer, ServeConfig, build_service

__all__ = ["GracefulServer", "ServeConfig", "build_service", "create_app"]
