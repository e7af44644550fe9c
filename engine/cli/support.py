"""What every ``tidegate`` command shares: user errors as one line and exit code 2, and the
options that pick a workload."""

from __future__ import annotations

import functools
import math
import sys
from typing import NoReturn

import click


def _project_errors() -> tuple[type[Exception], ...]:
    from tidegate.ctrl import ControllerSpecError
    from tidegate.engine.core.driver import ReplayStalled
    from tidegate.engine.core.profile import ProfileError
    from tidegate.engine.real.model import ModelLoadError
    from tidegate.engine.workloads import WorkloadError
    return (ControllerSpecError, ProfileError, WorkloadError, ModelLoadError, ReplayStalled)


def fail(message: str) -> NoReturn:
    """End on a user error: ``error: message`` on stderr and exit code 2 (for scripts outside click as well)."""
    click.echo(f"error: {message}", err=True)
    sys.exit(2)


def friendly(*extra: type[Exception]):
    """Decorator: the project's user-input errors (and ``extra`` ones) become one
    ``error: ...`` line on stderr and exit code 2, never a traceback."""
    def decorate(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except (*_project_errors(), *extra) as exc:
                fail(str(exc))
            except OSError as exc:  # a file or folder the command cannot read or write
                fail(f"{exc.strerror or exc}: {exc.filename}" if exc.filename else str(exc))
        return wrapper
    return decorate


def parse_floats(text: str, what: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"{what} must be comma-separated numbers, got {text!r}") from None
    if not values or not all(0 < v < math.inf for v in values):
        raise click.BadParameter(f"{what} must be positive finite numbers, got {text!r}")
    return values


class _PositiveFloat(click.ParamType):
    """A finite number above 0 (click's FloatRange lets NaN and infinity through)."""

    name = "number"

    def convert(self, value, param, ctx):
        try:
            number = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number", param, ctx)
        if not 0 < number < math.inf:
            self.fail(f"{value!r} is not a positive finite number", param, ctx)
        return number


POSITIVE = _PositiveFloat()


def workload_options(fn):
    """The options that pick and shape a workload."""
    opts = [
        click.option("--trace", help="Trace file (Splitwise/Vidur, Azure 2023, BurstGPT CSV, Mooncake "
                     "JSONL) or a shipped name: splitwise_conv, splitwise_code."),
        click.option("--workload", help="Synthetic workload YAML (or the shipped paper_sec41)."),
        click.option("--rate-scale", type=POSITIVE, default=None, help="Replay at this many times the trace's speed."),
        click.option("--load", type=POSITIVE, default=None,
                     help="Replay at this multiple of the fluid bound lambda_max (instead of --rate-scale)."),
        click.option("--first", "first_n", type=click.IntRange(min=1), default=None, help="Keep the first N requests."),
        click.option("--start-s", type=float, default=None, help="Keep requests from this trace time on."),
        click.option("--end-s", type=float, default=None, help="Keep requests before this trace time."),
        click.option("--length-scale", type=POSITIVE, default=1.0, show_default=True,
                     help="Multiply prompt and output lengths (for small models)."),
        click.option("--max-tokens", type=click.IntRange(min=1), default=None,
                     help="max_tokens of every request (outputs are capped to it; default 2048)."),
        click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True,
                     help="Seed of synthetic draws and controllers."),
    ]
    for opt in reversed(opts):
        fn = opt(fn)
    return fn


def load_arrivals(trace, workload, first_n, start_s, end_s, length_scale, max_tokens, seed, rate_scale=None):
    from tidegate.engine.workloads import load_synthetic, read_trace, resolve_trace
    if bool(trace) == bool(workload):
        raise click.UsageError("give exactly one of --trace FILE or --workload FILE.yaml")
    if workload:
        if first_n or start_s is not None or end_s is not None:
            raise click.UsageError("--first, --start-s and --end-s apply to traces, not to --workload")
        return load_synthetic(resolve_trace(workload), seed=seed, rate_scale=rate_scale or 1.0,
                              length_scale=length_scale, max_tokens_cap=max_tokens)
    return read_trace(resolve_trace(trace), rate_scale=rate_scale or 1.0, first_n=first_n, start_s=start_s,
                      end_s=end_s, length_scale=length_scale, max_tokens_cap=max_tokens)
