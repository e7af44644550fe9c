"""Build an EngineCore for one replica described by a profile: the one place that turns a
profile's KV size, block size and step time into engine settings, for the simulator, the real
engine, the twin and the env alike."""

from __future__ import annotations

from typing import Callable

from tidegate.ctrl.base import Controller
from tidegate.engine.core.clock import Clock, VirtualClock
from tidegate.engine.core.engine_core import EngineCore
from tidegate.engine.core.executor import Executor
from tidegate.engine.core.profile import Profile
from tidegate.engine.core.request import Request


def rate_window_s(profile: Profile) -> float:
    """Time constant of the engine's arrival and completion rate estimates: 200 idle ticks,
    at least 10 s, so the estimates are smooth on fast and slow replicas alike."""
    idle = profile.idle_s if profile.idle_s is not None else profile.base_s
    return max(10.0, 200 * idle)


def build_engine(profile: Profile, controller: Controller, executor: Executor, clock: Clock, *,
                 record_steps: bool = True, on_token: Callable[[Request, int | None], None] | None = None,
                 on_finish: Callable[[Request], None] | None = None, eviction: str = "recompute",
                 prefix_caching: bool = True) -> EngineCore:
    """An EngineCore with the profile's KV capacity and block size.

    :param profile: the replica (``kv_capacity_tokens``, ``block_size``, step time).
    :param controller: decides activations, batch size and admission.
    :param executor: ``SimExecutor`` or ``TorchExecutor``.
    :param clock: ``VirtualClock`` or ``WallClock``.
    :param record_steps: keep per-step traces in the metrics.
    :param on_token: called for every committed output token (see ``EngineCore``).
    :param on_finish: called once with every request that ends.
    :param eviction: ``recompute`` (an evicted request keeps its tokens) or ``reset`` (the paper's
        model: its progress is discarded); see ``EngineCore``.
    :param prefix_caching: reuse the KV blocks of cached prompt prefixes (see ``EngineCore``).
    """
    if not isinstance(clock, VirtualClock):
        controller.use_wall_clock()
    return EngineCore(controller, executor, clock, kv_capacity_tokens=profile.kv_capacity_tokens,
                      block_size=profile.block_size, rate_window_s=rate_window_s(profile),
                      on_token=on_token, on_finish=on_finish, record_steps=record_steps, eviction=eviction,
                      prefix_caching=prefix_caching, ttft_profile=profile)
