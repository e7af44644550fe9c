"""The OpenAI-compatible streaming server, split as vLLM's ``entrypoints/openai``.

- :mod:`engine.serve.protocol`: the OpenAI wire format (request and response bodies, events, errors).
- :mod:`engine.serve.engine_proc`: the engine loop, in a process of its own, fed by a pipe.
- :mod:`engine.serve.service`: the HTTP side's handle on it: admission on the engine's latest
  snapshot, the per-request stream buffers, and a new engine when one dies or hangs.
- :mod:`engine.serve.app`: the FastAPI application: its routes and error handlers.
- :mod:`engine.serve.serving`: a completion's arrival: the prompt tokenized and checked, admission,
  and one engine request per choice.
- :mod:`engine.serve.arrival`: what an arrival asks for: the engine's sampling parameters of a body,
  and the refusal of one that is not served.
- :mod:`engine.serve.answer`: the answer, whole or streamed: its choices merged, its logprobs shaped.
- :mod:`engine.serve.extra_routes`: ``/version``, ``/tokenize`` and ``/detokenize``.
- :mod:`engine.serve.operator`: what an operator sets around the routes: the API key, the request
  size limit, OpenAI-shaped error bodies for every error.
- :mod:`engine.serve.config`: the settings.
- :mod:`engine.serve.launch`: starting the engine, uvicorn with a draining shutdown.
- :mod:`engine.serve.metrics`: the Prometheus metrics.
"""

from tidegate.engine.serve.app import create_app
from tidegate.engine.serve.launch import GracefulServer, ServeConfig, build_service

__all__ = ["GracefulServer", "ServeConfig", "build_service", "create_app"]
