"""The ``tidegate`` command: one click group whose subcommands are named by import path and
imported only when run, so ``tidegate --help`` starts fast and no layer of the project imports
a higher one to offer its commands (the training commands live in ``training/cli.py``)."""

from __future__ import annotations

import importlib
import os
import sys

import click

#: subcommand -> "module:attribute" of its click command, in the order ``--help`` lists them
COMMANDS = {
    "simulate": "tidegate.engine.cli.sim:simulate",
    "bench": "tidegate.engine.cli.sim:bench",
    "capacity": "tidegate.engine.cli.sim:capacity",
    "roofline": "tidegate.engine.cli.sim:roofline",
    "compile": "tidegate.engine.cli.sim:compile_command",
    "serve": "tidegate.engine.cli.serve:serve",
    "loadgen": "tidegate.engine.cli.serve:loadgen",
    "gateway": "tidegate.engine.cli.gateway:gateway",
    "generate": "tidegate.engine.cli.real:generate_command",
    "profile": "tidegate.engine.cli.real:profile_command",
    "twin-check": "tidegate.engine.cli.real:twin_check_command",
    "tiny-model": "tidegate.engine.cli.real:tiny_model_command",
    "train": "tidegate.training.cli:train_command",
    "export": "tidegate.training.cli:export_command",
    "evaluate": "tidegate.training.cli:evaluate_command",
    "tune": "tidegate.training.cli:tune_command",
    "sim-to-real": "tidegate.training.cli:sim_to_real_command",
}


class LazyGroup(click.Group):
    """A click group that imports a subcommand's module only when that subcommand runs
    (click's documented lazy-loading pattern)."""

    def __init__(self, *args, lazy_commands: dict[str, str], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.lazy_commands = lazy_commands

    def list_commands(self, ctx: click.Context) -> list[str]:
        return [*super().list_commands(ctx), *self.lazy_commands]

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.lazy_commands:
            return super().get_command(ctx, cmd_name)
        module_name, _, attr = self.lazy_commands[cmd_name].partition(":")
        command = getattr(importlib.import_module(module_name), attr)
        if not isinstance(command, click.Command):
            raise TypeError(f"{self.lazy_commands[cmd_name]} is not a click command")
        command.name = cmd_name
        return command


#: the commands ``--compiled`` applies to: simulations, fed by the project's own code. The server
#: and the real engine always run the interpreted source (engine/sim/compiled.py says why).
COMPILED_COMMANDS = ("simulate", "bench", "capacity", "train", "evaluate")


def _run_compiled(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    """``--compiled``: run the same command line again on the compiled copy (``engine/sim/compiled.py``)."""
    from tidegate.engine.sim import compiled

    try:
        if value and not ctx.resilient_parsing and not os.environ.get(compiled.ENV_VAR):
            argv = list(sys.argv[1:])
            argv.remove("--compiled")
            command = next((a for a in argv if not a.startswith("-")), None)
            if command is None and any(a in ("-h", "--help", "--version") for a in argv):
                return  # the group's own help or version: nothing to run
            if command not in COMPILED_COMMANDS:
                which = f"not to {command}" if command else "and needs one of them"
                raise compiled.CompileError(f"--compiled applies to {', '.join(COMPILED_COMMANDS)}, {which}")
            compiled.rerun(["-P", "-m", "tidegate", *argv])
        compiled.check()
    except compiled.CompileError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)


@click.group(cls=LazyGroup, lazy_commands=COMMANDS, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="tidegate", prog_name="tidegate")
@click.option("--compiled", is_flag=True, is_eager=True, expose_value=False, callback=_run_compiled,
              help="Run the command on the compiled copy of the simulator's core that `tidegate compile` "
                   "built: faster, the same results (simulate, bench, capacity, train, evaluate).")
def main() -> None:
    """tidegate: admission and batching control for streaming LLM inference."""
