"""The server's settings, shared by its HTTP side and its engine process."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ctrl import DEFAULT_CONTROLLER


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
    #: run the engine in a process of its own (False: a thread of the server's process)
    engine_process: bool = True
    #: an engine that sends nothing for this long is stopped and replaced
    engine_timeout_s: float = 30.0
    #: how long the engine may take to load the model
    engine_start_timeout_s: float = 600.0
    #: the runtime twin guard of a learned controller
    guard: bool = True
    #: torch threads of the engine (None: in an engine process, every core but one, which the HTTP side
    #: needs; in an engine thread, torch's default)
    threads: int | None = None

    def __post_init__(self) -> None:
        if self.threads is not None and not (isinstance(self.threads, int) and self.threads >= 1):
            raise ValueError(f"threads must be a whole number >= 1, got {self.threads!r}")
        for name in ("queue_timeout_s", "engine_timeout_s", "engine_start_timeout_s", "drain_timeout_s"):
            value = getattr(self, name)
            if value is None and name == "queue_timeout_s":
                continue
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0
                    and (value > 0 or name == "drain_timeout_s")):
                raise ValueError(f"{name} must be a finite number of seconds above 0, got {value!r}")

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model
