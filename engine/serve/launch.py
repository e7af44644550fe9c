"""Running the server: its settings, loading the model into an engine service, and uvicorn with a
draining shutdown."""

from __future__ import annotations

import logging
import signal
import threading
import time
from typing import TYPE_CHECKING

from engine.serve.config import ServeConfig
from engine.serve.metrics import ServerMetrics
from engine.serve.service import EngineService

if TYPE_CHECKING:
    from fastapi import FastAPI

log = logging.getLogger("tidegate.server")


def build_service(config: ServeConfig, model_and_tokenizer=None) -> EngineService:
    """Start the engine (in a process of its own, or, given an already loaded ``(model, tokenizer)``
    or ``engine_process=False``, in a thread here) and wait until it serves.

    :raises ValueError: one sentence, when the engine cannot start (bad model, device, sizes).
    """
    service = EngineService(config, ServerMetrics(config.model_name), model_and_tokenizer)
    service.start()
    return service


class GracefulServer:
    """uvicorn with a draining shutdown: on SIGTERM stop admitting (503), let in-flight requests
    finish within ``drain_timeout_s``, then exit. A second signal exits at once."""

    def __init__(self, app: FastAPI, service: EngineService, config: ServeConfig) -> None:
        import uvicorn

        class _Server(uvicorn.Server):
            def handle_exit(inner, sig: int, frame) -> None:  # noqa: N805
                if service.draining or sig != signal.SIGTERM:
                    return uvicorn.Server.handle_exit(inner, sig, frame)
                service.draining = True
                log.warning("SIGTERM: draining %d in-flight requests (up to %.0f s)", service.in_flight,
                            config.drain_timeout_s)
                threading.Thread(target=self._drain_then_exit, daemon=True).start()

        self.service = service
        self.config = config
        self.server = _Server(uvicorn.Config(app, host=config.host, port=config.port, log_level="warning",
                                             timeout_graceful_shutdown=5))

    def _drain_then_exit(self) -> None:
        deadline = time.monotonic() + self.config.drain_timeout_s
        while self.service.in_flight > 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        self.server.should_exit = True

    def run(self) -> None:
        try:
            self.server.run()
        finally:
            self.service.stop()
