"""The arms of the comparison: a name and the vLLM server arguments that make it.

Every arm runs the same ``python -m vllm.entrypoints.openai.api_server`` with the same model and common
arguments; an arm adds its own. ``--arm NAME='ARGS'`` on the command line replaces a default arm of
that name or adds one, and ``--arm NAME+='ARGS'`` adds arguments to one, so the plugin's final flags
(``--middleware ...`` once 429s are answered in vLLM's API process) go in without an edit here.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass

from tidegate.ctrl import DEFAULT_CONTROLLER

#: the plugin's scheduler class
SCHEDULER_CLS = "tidegate.engine.vllm.scheduler.TidegateScheduler"
#: the plugin's admission in vLLM's API process (the 429)
MIDDLEWARE = "tidegate.engine.vllm.middleware.AdmissionMiddleware"
_QUEUED = re.compile(r"vllm-queued-(\d+)")


class ArmError(ValueError):
    """An ``--arm`` that cannot be used; the message is one sentence naming it."""


@dataclass(frozen=True)
class Arm:
    """One server configuration.

    :param name: how tables and figures call it.
    :param server_args: vLLM server arguments added to the common ones.
    :param loads: the loads (multiples of capacity) this arm runs at; None: every load.
    :param extends: given as ``NAME+=ARGS``: its arguments go after those of the arm of that name.
    """

    name: str
    server_args: tuple[str, ...]
    loads: tuple[float, ...] | None = None
    extends: bool = False

    @property
    def is_vanilla(self) -> bool:
        return self.name == "vllm"

    @property
    def queued_reqs(self) -> int | None:
        """N of a ``vllm-queued-N`` arm (vanilla vLLM with ``--max-num-queued-reqs N``), else None."""
        m = _QUEUED.fullmatch(self.name)
        return int(m.group(1)) if m else None

    def runs_at(self, load: float) -> bool:
        return self.loads is None or any(abs(load - x) < 1e-9 for x in self.loads)


def plugin_args(controller: str, step_log: str | None = None, ttft_slo_s: float | None = None,
                tpot_slo_s: float | None = None) -> tuple[str, ...]:
    """The server arguments that load the plugin with ``controller`` (and its step log and the SLOs it
    serves to; None: the profile's): the scheduler and the admission middleware that answers its
    refusals with 429."""
    config: dict[str, str | float] = {"controller": controller}
    if step_log:
        config["step_log"] = step_log
    if ttft_slo_s is not None:
        config["ttft_slo_s"] = ttft_slo_s
    if tpot_slo_s is not None:
        config["tpot_slo_s"] = tpot_slo_s
    return ("--scheduler-cls", SCHEDULER_CLS, "--middleware", MIDDLEWARE,
            "--additional-config", json.dumps({"tidegate": config}))


def queued_arms(values: list[int], loads: tuple[float, ...] | None) -> list[Arm]:
    """``vllm-queued-N``: vanilla vLLM with ``--max-num-queued-reqs N`` (503 past N unfinished requests)."""
    return [Arm(f"vllm-queued-{n}", ("--max-num-queued-reqs", str(n)), loads) for n in values]


def default_arms(controller: str = DEFAULT_CONTROLLER, ttft_slo_s: float | None = None,
                 tpot_slo_s: float | None = None) -> list[Arm]:
    """``vllm`` (vanilla) and ``tidegate`` (the plugin with ``controller``, tidegate's default, told the
    SLOs the benchmark measures; ``{step_log}`` in an arm's arguments is replaced by the path of that
    arm's step log)."""
    return [Arm("vllm", ()), Arm("tidegate", plugin_args(controller, "{step_log}", ttft_slo_s, tpot_slo_s))]


def parse_arm(text: str) -> Arm:
    """``NAME=ARGS`` (shell-quoted vLLM arguments; empty for vanilla) or ``NAME+=ARGS`` (added to the
    arguments of the arm ``NAME``) as an :class:`Arm`.

    :raises ArmError: no ``=`` or a bad name.
    """
    name, eq, args = text.partition("=")
    extends = name.endswith("+")
    name = name.removesuffix("+").strip()
    if not eq or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name):
        raise ArmError(f"--arm {text!r}: expected NAME='vLLM server args' or NAME+='more args', e.g. "
                       "tidegate+='--middleware pkg.module.obj'.")
    try:
        return Arm(name, tuple(shlex.split(args)), extends=extends)
    except ValueError as exc:
        raise ArmError(f"--arm {text!r}: its arguments do not parse as a shell line ({exc}).") from None


def merge_arms(defaults: list[Arm], given: list[Arm], only: list[str] | None,
               queued_loads: tuple[float, ...] | None, need_vanilla: bool = True) -> list[Arm]:
    """``defaults`` with each arm of ``given`` replacing the one of its name (keeping its loads), extending
    it (``NAME+=``), or added (a ``vllm-queued-N`` at ``queued_loads``); then, if ``only`` is given, those
    arms alone, in that order.

    :param need_vanilla: the vanilla ``vllm`` arm must run (False where an earlier run's rows stand for it).
    :raises ArmError: ``NAME+=`` of no arm, ``only`` names an arm that does not exist, or there is no
        vanilla ``vllm`` arm where one is needed.
    """
    arms = {a.name: a for a in defaults}
    for a in given:
        old = arms.get(a.name)
        if a.extends and old is None:
            raise ArmError(f"--arm {a.name}+=...: there is no arm {a.name!r} to add arguments to.")
        loads = old.loads if old else (queued_loads if a.queued_reqs is not None else None)
        args = (*old.server_args, *a.server_args) if a.extends and old else a.server_args
        arms[a.name] = Arm(a.name, args, loads)
    if only is not None:
        missing = [n for n in only if n not in arms]
        if missing:
            raise ArmError(f"--arms names {missing[0]!r}, which is not an arm; the arms are "
                           f"{', '.join([*arms, 'vllm-queued'])}.")
        arms = {n: arms[n] for n in only}
    if "vllm" not in arms:
        if need_vanilla:
            raise ArmError("the arms must include vllm (vanilla vLLM): capacity and every ratio are measured "
                           "against it (or --reuse an earlier run that measured it).")
        return list(arms.values())
    return [arms["vllm"], *(a for n, a in arms.items() if n != "vllm")]
