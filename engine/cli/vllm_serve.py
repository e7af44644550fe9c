"""``tidegate serve --engine vllm``: vLLM's own OpenAI server with tidegate's plugin and its 429.

The settings are checked here first, in tidegate's own environment (``engine.vllm.config`` does not
import vLLM), so a bad controller, option or profile is one sentence and exit code 2 before vLLM
spends a minute starting. Then this process becomes vLLM's server (``exec``: signals and the exit
code are vLLM's own), run by vLLM's python (``.venv-vllm``, ``make vllm-setup``)::

    python -m vllm.entrypoints.openai.api_server --model DIR --host H --port P \\
        --scheduler-cls tidegate.engine.vllm.scheduler.TidegateScheduler \\
        --middleware tidegate.engine.vllm.middleware.AdmissionMiddleware \\
        --additional-config '{"tidegate": {...}}' [--vllm-arg ...]
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path

import click

SCHEDULER = "tidegate.engine.vllm.scheduler.TidegateScheduler"
ASYNC_SCHEDULER = "tidegate.engine.vllm.scheduler.TidegateAsyncScheduler"
MIDDLEWARE = "tidegate.engine.vllm.middleware.AdmissionMiddleware"
#: ``serve``'s options that mean the same to vLLM, and vLLM's flag for each
SHARED_OPTIONS = {"host": "--host", "port": "--port", "served_model_name": "--served-model-name",
                  "max_model_len": "--max-model-len", "dtype": "--dtype", "api_key": "--api-key",
                  "chat_template_path": "--chat-template",
                  "trust_request_chat_template": "--trust-request-chat-template"}


class VllmServeError(Exception):
    """A setting ``serve --engine vllm`` cannot use; one sentence (exit code 2 at the command)."""


def check_settings(controller_spec: str, profile: str | None, step_log: str | None = None) -> dict:
    """The plugin's settings, checked as vLLM's engine will check them; raises :class:`VllmServeError`."""
    from tidegate.engine.core.profile import ProfileError, load_profile
    from tidegate.engine.vllm.config import (
        PluginConfigError, ReplicaLimits, build_plugin_controller, read_plugin_config, replica_profile,
    )

    settings = {"controller": controller_spec, **({"profile": profile} if profile else {}),
                **({"step_log": step_log} if step_log else {})}
    try:
        config = read_plugin_config({"tidegate": settings})
        base = load_profile(config.profile)
        limits = ReplicaLimits(base.kv_capacity_tokens, base.block_size, base.max_num_seqs,
                               base.max_num_batched_tokens)  # vLLM's replace them at start-up
        build_plugin_controller(config, replica_profile(config, limits))
    except (PluginConfigError, ProfileError) as exc:
        raise VllmServeError(str(exc)) from None
    return settings


def find_vllm_python(given: Path | None) -> Path:
    """vLLM's python: ``given``, else ``.venv-vllm/bin/python`` beside the project or in the current folder."""
    if given is not None:
        if not (given.is_file() and os.access(given, os.X_OK)):
            raise VllmServeError(f"--vllm-python {str(given)!r} is not an executable file.")
        return given
    import tidegate

    project = Path(tidegate.__file__).resolve().parent.parent
    for folder in (project, Path.cwd()):
        candidate = folder / ".venv-vllm" / "bin" / "python"
        if candidate.is_file():
            return candidate
    raise VllmServeError(f"vLLM's environment is missing (no .venv-vllm in {project}): run `make vllm-setup` "
                         "there, or pass --vllm-python PATH.")


def vllm_command(python: Path, model: str, settings: dict, shared: dict, vllm_args: tuple[str, ...]) -> list[str]:
    """The command line of vLLM's server with the plugin."""
    extra = [word for arg in vllm_args for word in shlex.split(arg)]
    scheduler = ASYNC_SCHEDULER if "--async-scheduling" in extra else SCHEDULER
    command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", model]
    for name, flag in SHARED_OPTIONS.items():
        value = shared.get(name)
        if value is True:  # an on/off flag
            command.append(flag)
        elif value is not None and value is not False:
            command += [flag, str(value)]
    return command + ["--scheduler-cls", scheduler, "--middleware", MIDDLEWARE,
                      "--additional-config", json.dumps({"tidegate": settings}), *extra]


def serve_vllm(ctx: click.Context, model: str, controller_spec: str, profile: str | None, vllm_args: tuple[str, ...],
               vllm_python: Path | None, step_log: str | None, own_options: tuple[str, ...]) -> None:
    """Check, then become vLLM's server (never returns)."""
    from click.core import ParameterSource

    for name in own_options:
        if ctx.get_parameter_source(name) not in (ParameterSource.DEFAULT, None):
            flag = "--" + name.replace("_", "-")
            raise VllmServeError(f"{flag} applies to tidegate's own engine; give vLLM its flags with --vllm-arg, "
                                 "e.g. --vllm-arg '--max-num-seqs 64'.")
    if model == "tiny":
        raise VllmServeError("--engine vllm needs --model DIR, a Hugging Face model folder (`tidegate tiny-model "
                             "DIR` saves the tiny model as one).")
    settings = check_settings(controller_spec, profile, step_log)
    python = find_vllm_python(vllm_python)
    shared = {name: ctx.params.get(name) for name in SHARED_OPTIONS}
    if shared["port"] is None:
        shared["port"] = 8000
    command = vllm_command(python, model, settings, shared, vllm_args)
    click.echo(f"tidegate: vLLM's server with controller {controller_spec!r}: {shlex.join(command)}", err=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(command[0], command)
