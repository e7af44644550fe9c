"""The ``tidegate`` commands of the learned controller: ``train``, ``export``, ``evaluate`` and
``sim-to-real``, loaded lazily by ``engine.cli`` (``training.cli:train_command`` and so on).

Torch and stable-baselines3 are imported inside the commands, so ``tidegate --help`` stays fast.
A user error (a missing or corrupt file, a bad value) is one ``error: ...`` line and exit code 2.
"""

from __future__ import annotations

from pathlib import Path

import click

from tidegate.ctrl.learned import DEFAULT_POLICY
from tidegate.engine.cli.support import POSITIVE, friendly
from tidegate.training.configs import DEFAULT_CONFIG, DEFAULT_OUT
from tidegate.training.errors import ConfigError, EvaluationError, ExportError
from tidegate.training.parallel import TaskError, add_backend_options


class OptionError(ValueError):
    """A command-line value the user got wrong; the message is one sentence naming the option."""


def parse_list(text: str, option: str, kind: type, expected: str) -> list:
    """The comma-separated values of ``option`` as ``kind``; an empty item is an error, not skipped.

    :param expected: what the values should be, for the error message (e.g. ``integers like 0,1,2``).
    :raises OptionError: an item is empty or not a ``kind``.
    """
    try:
        values = [kind(x) for x in text.split(",")]
    except ValueError:
        raise OptionError(f"{option} {text!r} is not valid: expected {expected}") from None
    if kind is int and "non-negative" in expected and any(v < 0 for v in values):
        raise OptionError(f"{option} {text!r} is not valid: expected {expected}")
    return values


def _path() -> click.Path:
    # no exists/dir checks here: the commands name a bad path in one line, click would print its usage too
    return click.Path(path_type=Path)


@click.command("train")
@click.option("--config", "config_path", type=_path(), default=DEFAULT_CONFIG,
              show_default="shipped training/configs/ppo.yaml", help="Zoo-style YAML, one key per env id.")
@click.option("--env", "env_name", type=click.Choice(["serving", "fleet"]), default="serving", show_default=True,
              help="serving: one replica's controller (tidegate/Serving-v0); fleet: the gateway's admission in "
                   "front of a fleet (tidegate/Fleet-v0).")
@click.option("--timesteps", type=click.IntRange(min=1), default=None, help="Override the config's n_timesteps.")
@click.option("--n-envs", type=click.IntRange(min=1), default=None, help="Override the config's n_envs.")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True, help="Seed of the envs and of PPO.")
@click.option("--seeds", default=None,
              help="Several training seeds, e.g. 0,1,2: one run each, in OUT/seed<N>, run as parallel tasks.")
@click.option("--out", "out_dir", type=_path(), default=DEFAULT_OUT, show_default=True,
              help="Model, vecnormalize.pkl, checkpoints, evaluations and TensorBoard logs (tb/).")
@click.option("--resume", type=_path(), default=None,
              help="A checkpoint .zip to continue from (its VecNormalize statistics beside it).")
@add_backend_options
@friendly(ConfigError, OptionError, TaskError, ImportError)
def train_command(config_path, env_name, timesteps, n_envs, seed, seeds, out_dir, resume, backend, address, workers):
    """Train the learned controller (or, with --env fleet, the gateway's admission) with PPO."""
    from tidegate.env import ENV_ID, FLEET_ENV_ID
    from tidegate.training.train import train, train_seeds

    env_id = FLEET_ENV_ID if env_name == "fleet" else ENV_ID
    if seeds is None:
        path = train(config_path, env_id=env_id, n_timesteps=timesteps, n_envs=n_envs, seed=seed, out_dir=out_dir,
                     resume=resume)
        click.echo(f"saved {path}")
        return
    if resume is not None:
        raise OptionError("--resume continues one run: give --seed, not --seeds")
    seed_list = parse_list(seeds, "--seeds", int, "non-negative integers like 0,1,2")
    for path in train_seeds(config_path, seed_list, out_dir, n_timesteps=timesteps, n_envs=n_envs,
                            backend=backend, address=address, workers=workers, env_id=env_id):
        click.echo(f"saved {path}")


@click.command("export")
@click.argument("checkpoint", type=_path())
@click.argument("out", type=_path(), required=False)
@click.option("--vecnormalize", type=_path(), default=None,
              help="VecNormalize statistics (default: the file saved beside the checkpoint).")
@click.option("--residual-scale", type=float, default=None,
              help="Share of the policy's action the learned controller applies, 0-1 (0: the slo-flow prior "
                   "alone), recorded in the file [default: none recorded, read as 1].")
@friendly(ExportError)
def export_command(checkpoint, out, vecnormalize, residual_scale):
    """Export a PPO checkpoint's deterministic actor to ONNX (normalisation folded in).

    OUT defaults to policy.onnx in the checkpoint's folder.
    """
    from tidegate.training.export import export

    click.echo(f"wrote {export(checkpoint, out, vecnormalize, residual_scale)}")


@click.command("evaluate")
@click.option("--policy", "policies", type=_path(), multiple=True, default=(DEFAULT_POLICY,),
              show_default="shipped checkpoints/policy.onnx",
              help="An ONNX policy written by `tidegate export`; repeat for several (e.g. one per training seed).")
@click.option("--family", "families", multiple=True,
              help="A shipped workload family, a family YAML or a trace file; repeat (default: every shipped family).")
@click.option("--profile", "profiles", multiple=True, default=("a100-llama2-7b",), show_default=True,
              help="Profile name or file; repeat for a profile axis (each family runs on each profile).")
@click.option("--loads", default="0.5,0.8,1.2,2.0,3.0", show_default=True, help="Multiples of lambda_max.")
@click.option("--requests", type=int, default=1500, show_default=True, help="Requests per cell.")
@click.option("--seeds", default="0,1,2", show_default=True, help="Draws per (family, load).")
@click.option("--out", type=_path(), default=None,
              help="Write matrix.md, matrix.json and the heatmaps (PNG) into this folder.")
@add_backend_options
@friendly(OptionError, EvaluationError, TaskError, ImportError)
def evaluate_command(policies, families, profiles, loads, requests, seeds, out, backend, address, workers):
    """The evaluation matrix: families x loads x seeds, the learned controller against the heuristics."""
    load_list = parse_list(loads, "--loads", float, "positive numbers like 0.8,1.5")
    seed_list = parse_list(seeds, "--seeds", int, "non-negative integers like 0,1,2")
    from tidegate.training.evaluate import evaluate, markdown, summarize, targets, write_report

    paths = list(policies)
    named = {("learned" if len(paths) == 1 else f"learned[{i}]"): p for i, p in enumerate(paths)}
    rows = evaluate(named, families=list(families) or None, loads=load_list, seeds=seed_list, requests=requests,
                    profile=list(profiles), backend=backend, address=address, workers=workers)
    if out is not None:
        write_report(rows, list(named), out)
    summary = summarize(rows, list(named))
    click.echo(markdown(summary, list(named)))
    for key, value in targets(summary).items():
        click.echo(f"{key}: {value:.3f}")


@click.command("tune")
@click.argument("trace", type=_path())
@click.option("--profile", default="a100-llama2-7b", show_default=True,
              help="The deployment's step-time profile: a name or file (`tidegate profile` fits one).")
@click.option("--split", type=float, default=0.5, show_default=True,
              help="The share of the log's time span to train on; the rest is held out for the verdict.")
@click.option("--timesteps", type=click.IntRange(min=1), default=30_000, show_default=True,
              help="PPO timesteps of fine-tuning.")
@click.option("--minutes", type=POSITIVE, default=15.0, show_default=True,
              help="Stop the fine-tuning after this long (what it learned so far is kept).")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True, help="Seed of the fine-tuning.")
@click.option("--loads", default="1.2,2.0", show_default=True, help="Loads of the verdict, multiples of lambda_max.")
@click.option("--seeds", default="0,1,2", show_default=True, help="Draws of the held-out part at each load.")
@click.option("--requests", type=int, default=1500, show_default=True, help="Requests per draw.")
@click.option("--out", type=_path(), default=Path("runs/tune"), show_default=True,
              help="The split log, the fine-tuning, the evaluation, the verdict (tune.md) and policy.onnx if it "
                   "ships.")
@click.option("--resume", is_flag=True, help="Skip the stages OUT records as done; continue an interrupted "
                                             "fine-tuning from its latest checkpoint.")
@add_backend_options
@friendly(OptionError, ConfigError, EvaluationError, ExportError, TaskError, ImportError)
def tune_command(trace, profile, split, timesteps, minutes, seed, loads, seeds, requests, out, resume, backend,
                 address, workers):
    """One deployment's own policy from its request log TRACE (any supported trace format): fine-tune the
    shipped policy on the log's first part, evaluate it on the rest against the shipped policy, its prior
    and every heuristic, and ship OUT/policy.onnx only if it beats both."""
    from tidegate.training.tune import TuneSettings, tune

    settings = TuneSettings(trace=trace, out=out, profile=profile, split=split, timesteps=timesteps,
                            minutes=minutes, seed=seed,
                            loads=tuple(parse_list(loads, "--loads", float, "positive numbers like 1.2,2")),
                            seeds=tuple(parse_list(seeds, "--seeds", int, "non-negative integers like 0,1,2")),
                            requests=requests, resume=resume, backend=backend, address=address, workers=workers)
    verdict = tune(settings, say=lambda line: click.echo(line, err=True))
    click.echo((out / "tune.md").read_text())
    if verdict["shipped"]:
        click.echo(f"shipped {verdict['policy']}")
    else:
        click.echo("not shipped: the shipped policy stays")


@click.command("sim-to-real")
@click.option("--policy", type=_path(), default=DEFAULT_POLICY,
              show_default="shipped checkpoints/policy.onnx", help="An ONNX policy written by `tidegate export`.")
@click.option("--requests", type=int, default=200, show_default=True, help="The first N requests of splitwise_conv.")
@click.option("--load", type=float, default=1.5, show_default=True, help="Offered load, a multiple of lambda_max.")
@click.option("--length-scale", type=float, default=0.1, show_default=True,
              help="Multiply prompt and output lengths (to fit the tiny model).")
@click.option("--max-tokens", type=int, default=256, show_default=True, help="Cap on every request's output.")
@click.option("--profile", default="tiny-cpu", show_default=True,
              help="Profile of the tiny model on this machine (name or file).")
@click.option("--out", type=_path(), default=None, help="Write the Markdown table here.")
@friendly(EvaluationError)
def sim_to_real_command(policy, requests, load, length_scale, max_tokens, profile, out):
    """The learned controller and two heuristics on the simulator twin and on the real tiny model
    (CPU, wall clock): the same arrivals, goodput side by side. Progress goes to stderr."""
    from tidegate.training.sim_to_real import sim_to_real, sim_to_real_table

    rows = sim_to_real(policy, requests, load, length_scale, max_tokens=max_tokens, profile=profile,
                       log=lambda line: click.echo(line, err=True))
    table = sim_to_real_table(rows, load, requests, length_scale, profile)
    click.echo(table)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(table + "\n")
