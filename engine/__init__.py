"""tidegate's engine: one continuous-batching loop, two executors.

The map (dependencies point down this list, never up; ``ctrl`` is below all of it)::

    engine/cli/        the ``tidegate`` command
    engine/bench/      controllers x loads on traces; a load generator for any OpenAI server
    engine/serve/      the OpenAI-compatible streaming server
    engine/twin/       the real engine replayed against the simulator; profiles from serving steps
    engine/real/       transformers model, paged KV cache, TorchExecutor, LLM (torch)
    engine/sim/        SimExecutor, simulate, roofline presets, step-time fitting (no torch)
    engine/workloads/  trace readers, synthetic workloads, shipped traces, train/eval splits
    engine/core/       requests, block pool, EngineCore, clock, profile, metrics and SLOs (no torch)

The public API is importable from here; names that need torch load it on first use::

    from tidegate.engine import EngineCore, Request, simulate, LLM, SamplingParams
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "EngineCore": "tidegate.engine.core.engine_core",
    "Request": "tidegate.engine.core.request",
    "RequestState": "tidegate.engine.core.request",
    "Profile": "tidegate.engine.core.profile",
    "load_profile": "tidegate.engine.core.profile",
    "simulate": "tidegate.engine.sim.simulate",
    "LLM": "tidegate.engine.real.llm",
    "SamplingParams": "tidegate.engine.real.sampling",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tidegate.engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
