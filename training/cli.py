"""Click commands ``train``, ``export`` and ``evaluate`` for the ``tidegate`` group
(``group.add_command(train_command)`` etc.)."""

from __future__ import annotations

import click


@click.command("train")
@click.option("--config", "config_path", default="training/configs/ppo.yaml", show_default=True,
              help="Zoo-style YAML, one key per env id.")
@click.option("--timesteps", type=int, default=None, help="Override the config's n_timesteps.")
@click.option("--n-envs", type=int, default=None, help="Override the config's n_envs.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--out", "out_dir", default="checkpoints", show_default=True, help="Models, checkpoints, logs.")
@click.option("--resume", default=None, help="A checkpoint .zip to continue from.")
def train_command(config_path, timesteps, n_envs, seed, out_dir, resume):
    """Train the learned controller with PPO on tidegate/Serving-v0."""
    from training.train import ConfigError, train

    try:
        path = train(config_path, n_timesteps=timesteps, n_envs=n_envs, seed=seed, out_dir=out_dir, resume=resume)
    except (ConfigError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"saved {path}")


@click.command("export")
@click.argument("checkpoint")
@click.argument("out", default="checkpoints/policy.onnx")
@click.option("--vecnormalize", default=None, help="VecNormalize statistics (default: beside the checkpoint).")
def export_command(checkpoint, out, vecnormalize):
    """Export a PPO checkpoint's deterministic actor to ONNX (normalisation folded in)."""
    from training.export import ExportError, export

    try:
        click.echo(f"wrote {export(checkpoint, out, vecnormalize)}")
    except ExportError as exc:
        raise click.ClickException(str(exc)) from None


@click.command("evaluate")
@click.option("--policy", default="checkpoints/policy.onnx", show_default=True)
@click.option("--profile", default="a100-llama2-7b", show_default=True)
@click.option("--loads", default="0.8,1.0,1.2,1.5,2.0", show_default=True, help="Multiples of lambda_max.")
@click.option("--requests", type=int, default=2000, show_default=True, help="Requests per run.")
@click.option("--seeds", default="0", show_default=True, help="Window seeds (0: the first requests).")
@click.option("--out", default=None, help="Write the Markdown tables here.")
@click.option("--plots", default=None, help="Write learned_goodput.png into this folder.")
def evaluate_command(policy, profile, loads, requests, seeds, out, plots):
    """Compare the learned controller with the heuristics on the evaluation traces."""
    from engine.bench.bench import markdown_table
    from training.evaluate import DEFAULT_HEURISTICS, evaluate, summarize, summary_columns

    try:
        load_list = [float(x) for x in loads.split(",") if x]
    except ValueError:
        raise click.ClickException(f"--loads {loads!r} is not valid: expected numbers like 0.8,1.5") from None
    try:
        seed_list = [int(x) for x in seeds.split(",") if x]
    except ValueError:
        raise click.ClickException(f"--seeds {seeds!r} is not valid: expected integers like 0,1,2") from None
    try:
        rows = evaluate(policy, profile=profile, loads=load_list, requests=requests, seeds=seed_list, out=out,
                        plots=plots)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(markdown_table(summarize(rows), summary_columns(DEFAULT_HEURISTICS, bool(policy))))
