"""The plugin's settings and its controller, built exactly as ``tidegate serve --controller`` builds one.

The settings come from vLLM's ``--additional-config`` JSON, under the key ``tidegate``::

    --additional-config '{"tidegate": {"controller": "flow:budget=2", "step_log": "steps.csv"}}'

and, when that holds no ``tidegate`` key, from the environment of the vLLM server
(``TIDEGATE_CONTROLLER``, ``TIDEGATE_PROFILE``, ``TIDEGATE_PROFILE_FIT``, ``TIDEGATE_STEP_LOG``,
``TIDEGATE_DECIDE_TIMEOUT_S``, ``TIDEGATE_CHANNEL``, ``TIDEGATE_ACTION_CHANNEL``). vLLM hands the
additional config to the scheduler as ``vllm_config.additional_config``, and the API process
(``middleware``) reads the same settings from its own copy of the config, so both build the same
controller.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

from tidegate.ctrl import DEFAULT_CONTROLLER, Controller, ControllerSpecError, build_controller, parse_spec
from tidegate.engine.core.profile import Profile, ProfileError, load_profile
from tidegate.engine.sim.online import OnlineProfile

#: the controller name that leaves vLLM's own scheduling untouched (the baseline)
PASS_THROUGH = "vllm"
#: the values of the ``profile_fit`` setting
PROFILE_FITS = ("online", "off")
#: the additional config's key for the plugin's settings
CONFIG_KEY = "tidegate"
_ENV = {"controller": "TIDEGATE_CONTROLLER", "profile": "TIDEGATE_PROFILE", "profile_fit": "TIDEGATE_PROFILE_FIT",
        "step_log": "TIDEGATE_STEP_LOG", "decide_timeout_s": "TIDEGATE_DECIDE_TIMEOUT_S", "channel": "TIDEGATE_CHANNEL",
        "action_channel": "TIDEGATE_ACTION_CHANNEL", "ttft_slo_s": "TIDEGATE_TTFT_SLO_S",
        "tpot_slo_s": "TIDEGATE_TPOT_SLO_S"}


class PluginConfigError(ValueError):
    """A setting of the plugin that cannot be used; the message is one sentence naming it."""


@dataclass(frozen=True)
class PluginConfig:
    """What the plugin runs.

    :param controller: ``NAME[:key=value,...]`` as ``tidegate serve --controller`` takes it, or
        ``vllm``: vLLM's own scheduling, untouched (the step log is still written).
    :param profile: the step-time profile the controllers estimate with (a shipped name or a file);
        its KV size, block size and batch limits are replaced by the vLLM replica's.
    :param profile_fit: ``online``: the profile is the prior of a step-time model refitted from the
        replica's own steps while it serves (``engine.sim.online``), so the controllers' estimates
        describe this replica whatever the profile was fitted on; ``off``: the profile as given.
    :param step_log: the CSV file of one row per step (None: no log).
    :param decide_timeout_s: the longest a step waits for the controller's decision; a later one is
        replaced by the conservative decision.
    :param channel: the path prefix of the records the engine and API processes share (``channel``);
        None: one named after the API process's pid in ``/dev/shm``.
    :param action_channel: the path prefix of the actions file a Gymnasium env answers the learned
        controller's policy calls through (``actions``; ``ServingEnv(backend="vllm")`` sets it); only
        with ``learned``, whose policy it replaces.
    :param ttft_slo_s: the deployment's TTFT SLO in seconds (None: the profile's), which the
        controllers admit against.
    :param tpot_slo_s: the deployment's TPOT SLO in seconds (None: the profile's), which the
        controllers size the token budget and the running requests by.
    """

    controller: str = DEFAULT_CONTROLLER
    profile: str = "tiny-cpu"
    profile_fit: str = "online"
    step_log: str | None = None
    decide_timeout_s: float = 0.05
    channel: str | None = None
    action_channel: str | None = None
    ttft_slo_s: float | None = None
    tpot_slo_s: float | None = None

    @property
    def passes_through(self) -> bool:
        return self.controller.strip() == PASS_THROUGH


def read_plugin_config(additional_config: object, environ: Mapping[str, str] = os.environ) -> PluginConfig:
    """The settings under ``tidegate`` in vLLM's additional config, else those of the environment.

    :raises PluginConfigError: an unknown key, or a value of the wrong kind.
    """
    section = additional_config.get(CONFIG_KEY) if isinstance(additional_config, Mapping) else None
    where = f"--additional-config's {CONFIG_KEY!r}"
    if section is None:
        section = {key: environ[var] for key, var in _ENV.items() if environ.get(var)}
        where = "the TIDEGATE_* environment"
    if not isinstance(section, Mapping):
        raise PluginConfigError(f"{where} must be a JSON object such as {{\"controller\": \"slo-flow\"}}, "
                                f"got {type(section).__name__}.")
    unknown = sorted(set(section) - set(_ENV))
    if unknown:
        raise PluginConfigError(f"{where} has no setting {unknown[0]!r}; it accepts {', '.join(_ENV)}.")
    values: dict[str, object] = {}
    for key in ("controller", "profile", "step_log", "channel", "action_channel"):
        if key in section:
            value = section[key]
            if not isinstance(value, str) or not value.strip():
                raise PluginConfigError(f"{where}: {key} must be a non-empty string, got {value!r}.")
            values[key] = value
    for key in ("decide_timeout_s", "ttft_slo_s", "tpot_slo_s"):
        if key in section:
            values[key] = _positive_seconds(section[key], where, key)
    if "profile_fit" in section:
        fit = section["profile_fit"]
        if fit not in PROFILE_FITS:
            raise PluginConfigError(f"{where}: profile_fit must be {' or '.join(PROFILE_FITS)}, got {fit!r}.")
        values["profile_fit"] = fit
    return PluginConfig(**values)  # type: ignore[arg-type]


def _positive_seconds(value: object, where: str, key: str) -> float:
    try:
        seconds = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        seconds = math.nan
    if not 0 < seconds < math.inf or isinstance(value, bool):
        raise PluginConfigError(f"{where}: {key} must be a positive number of seconds, got {value!r}.")
    return seconds


@dataclass(frozen=True)
class ReplicaLimits:
    """What vLLM's configuration says about this replica: the numbers a profile takes from it."""

    kv_capacity_tokens: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int


def replica_profile(config: PluginConfig, limits: ReplicaLimits) -> Profile:
    """The configured profile with the replica's KV size, block size, batch limits and the configured
    SLOs; with
    ``profile_fit`` online, an ``OnlineProfile`` that starts from it (it reads as a ``Profile``)."""
    try:
        profile = with_limits(load_profile(config.profile), limits)
    except ProfileError as exc:
        raise PluginConfigError(str(exc)) from None
    slos = {key: value for key, value in (("ttft_slo_s", config.ttft_slo_s), ("tpot_slo_s", config.tpot_slo_s))
            if value is not None}
    if slos:
        profile = dataclasses.replace(profile, **slos)
    if config.profile_fit == "online":
        return cast(Profile, OnlineProfile(profile))
    return profile


def with_limits(profile: Profile, limits: ReplicaLimits) -> Profile:
    """``profile`` with the vLLM replica's KV size, block size and batch limits."""
    return dataclasses.replace(profile, kv_capacity_tokens=limits.kv_capacity_tokens, block_size=limits.block_size,
                               max_num_seqs=limits.max_num_seqs, max_num_batched_tokens=limits.max_num_batched_tokens)


def build_plugin_controller(config: PluginConfig, profile: Profile) -> Controller | None:
    """The controller of ``config`` on ``profile`` (None for ``vllm``, the pass-through), on a wall
    clock; ``learned`` comes inside its shield with its fallback, as ``tidegate serve`` builds it.

    :raises PluginConfigError: an unknown controller or option, or a bad value.
    """
    try:
        name, options = parse_spec(config.controller)
        if name == PASS_THROUGH:
            if options:
                raise PluginConfigError(f"controller {PASS_THROUGH!r} (vLLM's own scheduling) takes no options, "
                                        f"got {', '.join(options)}.")
            return None
        if config.action_channel and name != "learned":
            raise PluginConfigError(f"action_channel answers the learned controller's policy calls; it needs "
                                    f"controller 'learned', got {name!r}.")
        controller = build_controller(config.controller, profile)
    except ControllerSpecError as exc:
        message = str(exc).rstrip(".")
        if message.startswith("unknown controller"):
            message += f", or {PASS_THROUGH} (vLLM's own scheduling, untouched)"
        raise PluginConfigError(f"{message}.") from None
    controller.use_wall_clock()
    if config.action_channel:
        _answer_from_channel(controller, config.action_channel)
    return controller


def _answer_from_channel(controller: Controller, channel: str) -> None:
    """The learned controller (inside its shield) asks the env at ``channel`` instead of its policy
    file, with the residuals as the env's actions (scale 1) and the env's answers waited for up to
    1.5 x the controller's time budget (a later one is the controller's to miss)."""
    from tidegate.engine.vllm.actions import ChannelPolicy

    learned: Any = getattr(controller, "inner", controller)
    budget = learned.time_budget_s
    learned.policy = ChannelPolicy(channel, 1.5 * budget)
    learned.policy_source = f"the env's answers through {channel}.actions"
    learned.load_error = None
    learned.residual_scale = 1.0


def share_vllm_log_handlers() -> None:
    """tidegate's log lines go out through vLLM's own handlers, formatted as vLLM's."""
    ours, theirs = logging.getLogger("tidegate"), logging.getLogger("vllm")
    if not ours.handlers and theirs.handlers:
        for handler in theirs.handlers:
            ours.addHandler(handler)
        ours.setLevel(logging.INFO)
        ours.propagate = False
