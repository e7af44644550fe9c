"""The server's settings, shared by its HTTP side and its engine process."""

from __future__ import annotations

import math
from dataclasses import dataclass

from tidegate.ctrl import DEFAULT_CONTROLLER
from tidegate.engine.serve.tools import TOOL_PARSERS

LOG_LEVELS = ("debug", "info", "warning", "error")

#: the engine process's default niceness above the HTTP side's. The HTTP side needs little CPU and
#: needs it at once: under CFS, nice 5 gives the engine a third of the HTTP side's weight when both
#: want one core, so a liveness probe or a 429 waits for no model step, while an engine with a core
#: of its own runs exactly as fast as before.
ENGINE_NICE = 5


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
    #: the step's token budget and the most running requests (None: vLLM's defaults for the device)
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    #: a prompt whose leading blocks are cached starts after them (vLLM's automatic prefix caching)
    prefix_caching: bool = True
    #: usage says how many prompt tokens the prefix cache held (``prompt_tokens_details``), as vLLM's flag
    enable_prompt_tokens_details: bool = False
    device: str | None = None
    dtype: str | None = None
    max_in_flight: int = 1024
    queue_timeout_s: float | None = 30.0
    stream_buffer_chunks: int = 512
    drain_timeout_s: float = 30.0
    default_max_tokens: int = 256
    #: "auto": a request that leaves out a sampling parameter gets the model's generation_config.json value, as
    #: vLLM's flag of that name; "vllm": OpenAI's neutral defaults
    generation_config: str = "auto"
    #: tool_choice "auto" (the default with tools) is served, its calls read by ``tool_call_parser``, as vLLM's flags
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    #: run the engine in a process of its own (False: a thread of the server's process)
    engine_process: bool = True
    #: an engine that sends nothing for this long is stopped and replaced
    engine_timeout_s: float = 30.0
    #: how long the engine may take to load the model
    engine_start_timeout_s: float = 600.0
    #: the runtime twin guard of a learned controller
    guard: bool = True
    #: torch threads of the engine (None: in an engine process, the cores free at its start, all but one
    #: from four on, ``engine.serve.cores``; in an engine thread, torch's default)
    threads: int | None = None
    #: niceness added to the engine process: on a machine with fewer free cores than busy processes,
    #: the HTTP side's short answers (/health, 429, /metrics) then go before model steps (0: none)
    engine_nice: int = ENGINE_NICE
    #: clients must send ``Authorization: Bearer <api_key>`` (None: no key needed); the probes
    #: (/health, /ready, /metrics, /version) stay open
    api_key: str | None = None
    #: a Jinja chat template's text, used instead of the tokenizer's (None: the tokenizer's)
    chat_template: str | None = None
    #: take a request's own ``chat_template`` (rendered in the sandbox, as the server's), as vLLM's flag
    trust_request_chat_template: bool = False
    #: the longest prompt + output served, in tokens (None: the model's context)
    max_model_len: int | None = None
    #: a request body larger than this gets 413 before it is read whole
    max_request_bytes: int = 16 * 1024 * 1024
    log_level: str = "info"
    #: uvicorn's access log, one line per request
    access_log: bool = False

    def __post_init__(self) -> None:
        for name in ("threads", "max_model_len", "max_num_batched_tokens", "max_num_seqs"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int) and value >= 1):
                raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs tool_call_parser (the model's syntax of a call: hermes)")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_PARSERS)}, "
                             f"got {self.tool_call_parser!r}")
        if self.generation_config not in ("auto", "vllm"):
            raise ValueError(f"generation_config must be 'auto' or 'vllm', got {self.generation_config!r}")
        if not (isinstance(self.engine_nice, int) and 0 <= self.engine_nice <= 19):
            raise ValueError(f"engine_nice must be a whole number from 0 to 19, got {self.engine_nice!r}")
        if not (isinstance(self.max_request_bytes, int) and self.max_request_bytes >= 1):
            raise ValueError(f"max_request_bytes must be a whole number >= 1, got {self.max_request_bytes!r}")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key must not be empty")
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
