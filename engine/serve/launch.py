"""Running the server: its settings, loading the model into an engine service, and uvicorn with a
draining shutdown."""

from __future__ import annotations

import logging
import signal
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ctrl import DEFAULT_CONTROLLER
from engine.serve.metrics import ServerMetrics
from engine.serve.service import EngineService

if TYPE_CHECKING:
    from fastapi import FastAPI

log = logging.getLogger("tidegate.server")


@dataclass
class ServeConfig:
    """Server settings (``tidegate serve --help`` describes each)."""

    model: str = "tiny"
    served_model_name: str | None = None
    controller: str = DEFAULT_CONTROLLER
    profile: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    kv_capacity_tokens: int | None = None
    block_size: int = 16
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    device: str | None = None
    dtype: str | None = None
    max_in_flight: int = 1024
    queue_timeout_s: float | None = 30.0
    stream_buffer_chunks: int = 512
    drain_timeout_s: float = 30.0
    default_max_tokens: int = 256

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model


def build_service(config: ServeConfig, model_and_tokenizer=None) -> EngineService:
    """Load the model (or use an already loaded ``(model, tokenizer)``) and start the engine thread."""
    from engine.real.llm import LLM

    llm = LLM(config.model, kv_capacity_tokens=config.kv_capacity_tokens, block_size=config.block_size,
              controller=config.controller, device=config.device, dtype=config.dtype,
              max_num_batched_tokens=config.max_num_batched_tokens, max_num_seqs=config.max_num_seqs,
              model_and_tokenizer=model_and_tokenizer, record_steps=False, profile=config.profile)
    service = EngineService(llm, ServerMetrics(config.model_name), queue_timeout_s=config.queue_timeout_s)
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
