"""PPO training of the learned controller on ``tidegate/Serving-v0``, from a zoo-style YAML config.

    python -m training.train --config training/configs/ppo.yaml [--timesteps N] [--seed 0]
        [--out checkpoints] [--resume checkpoints/ppo_serving_20000_steps.zip]

Reads top to bottom: config, vectorised envs (SubprocVecEnv, DummyVecEnv for one env) under
VecNormalize, PPO, callbacks (evaluation on the eval split, checkpoints, serving scalars in
TensorBoard), learn, save ``model.zip`` with ``vecnormalize.pkl`` beside it.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from stable_baselines3 import PPO
from stable_baselines3.common.callbacks import BaseCallback, CallbackList, CheckpointCallback, EvalCallback
from stable_baselines3.common.env_util import make_vec_env
from stable_baselines3.common.vec_env import DummyVecEnv, SubprocVecEnv, VecNormalize

import env  # noqa: F401  (registers tidegate/Serving-v0)
from env import ENV_ID
from env.serving_env import ServingEnv

PPO_KEYS = ("n_steps", "batch_size", "n_epochs", "learning_rate", "gamma", "gae_lambda", "clip_range",
            "ent_coef", "vf_coef", "max_grad_norm", "target_kl", "use_sde")
CHECKPOINT_PREFIX = "ppo_serving"


class ConfigError(ValueError):
    """A training config the user got wrong; the message is one sentence naming it."""


def load_config(config_path: str | Path, env_id: str = ENV_ID) -> dict[str, Any]:
    """The hyperparameters of ``env_id`` in a zoo-style YAML file."""
    path = Path(config_path)
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({type(exc).__name__})") from None
    if not isinstance(data, dict) or env_id not in data:
        raise ConfigError(f"{path}: expected a mapping with the key {env_id!r}")
    return dict(data[env_id])


class ServingScalarsCallback(BaseCallback):
    """Logs the serving figures of the training envs per rollout: ``serving/goodput`` (goodput as a
    fraction of lambda_max), ``serving/evictions`` and ``serving/rejections`` (per env step),
    ``serving/shield_intervention_rate`` and ``serving/kv_usage``."""

    KEYS = {"goodput_frac": "serving/goodput", "evictions": "serving/evictions",
            "rejections": "serving/rejections", "shield_intervention_rate": "serving/shield_intervention_rate",
            "kv_usage": "serving/kv_usage"}

    def __init__(self, verbose: int = 0) -> None:
        super().__init__(verbose)
        self._sums = dict.fromkeys(self.KEYS, 0.0)
        self._n = 0

    def _on_step(self) -> bool:
        for info in self.locals.get("infos", ()):
            for k in self.KEYS:
                self._sums[k] += float(info.get(k, 0.0))
            self._n += 1
        return True

    def _on_rollout_end(self) -> None:
        if self._n:
            for k, name in self.KEYS.items():
                self.logger.record(name, self._sums[k] / self._n)
        self._sums = dict.fromkeys(self.KEYS, 0.0)
        self._n = 0


class StopOnWallTime(BaseCallback):
    """Stops training once ``max_wall_s`` seconds have passed (checked every env step), so a run
    fits its time budget on a contended machine; the model so far is saved as usual."""

    def __init__(self, max_wall_s: float, verbose: int = 0) -> None:
        super().__init__(verbose)
        self.max_wall_s = float(max_wall_s)
        self._t0 = None

    def _on_training_start(self) -> None:
        self._t0 = time.perf_counter()

    def _on_step(self) -> bool:
        return time.perf_counter() - self._t0 < self.max_wall_s


def make_envs(n_envs: int, env_kwargs: dict, seed: int, vec_env: str | None = None):
    """``n_envs`` copies of the env: SubprocVecEnv, or DummyVecEnv for one env (or on request)."""
    cls = DummyVecEnv if n_envs == 1 or vec_env == "dummy" else SubprocVecEnv
    return make_vec_env(ServingEnv, n_envs=n_envs, seed=seed, env_kwargs=env_kwargs, vec_env_cls=cls)


def _vecnormalize_beside(checkpoint: Path) -> Path:
    """The VecNormalize statistics saved with a model: ``vecnormalize.pkl`` beside ``model.zip``, or
    CheckpointCallback's ``<prefix>_vecnormalize_<n>_steps.pkl`` beside ``<prefix>_<n>_steps.zip``."""
    m = re.fullmatch(r"(.*)_(\d+)_steps", checkpoint.stem)
    if m:
        return checkpoint.with_name(f"{m.group(1)}_vecnormalize_{m.group(2)}_steps.pkl")
    return checkpoint.with_name("vecnormalize.pkl")


def train(config_path: str | Path, *, env_id: str = ENV_ID, n_timesteps: int | None = None, seed: int = 0,
          out_dir: str | Path = "checkpoints", resume: str | Path | None = None, n_envs: int | None = None,
          env_kwargs: dict | None = None, progress_bar: bool = True, tensorboard: bool = True,
          vec_env: str | None = None, overrides: dict | None = None, verbose: int = 0) -> Path:
    """Train PPO and save ``out_dir/model.zip`` with ``out_dir/vecnormalize.pkl``.

    :param config_path: zoo-style YAML (one key per env id).
    :param env_id: the key to read (the env is always ``tidegate/Serving-v0``).
    :param n_timesteps: override the config's ``n_timesteps``.
    :param seed: seed of the envs and of PPO.
    :param out_dir: where models, checkpoints (``checkpoints/``-style), evaluations and TensorBoard logs go.
    :param resume: a checkpoint ``.zip`` to continue from (its VecNormalize statistics are loaded too).
    :param n_envs: override the config's ``n_envs``.
    :param env_kwargs: override entries of the config's ``env_kwargs``.
    :param progress_bar: show SB3's progress bar.
    :param tensorboard: write TensorBoard logs to ``out_dir/tb``.
    :param vec_env: ``dummy`` forces DummyVecEnv.
    :param overrides: replace top-level config entries (``n_steps``, ``eval_freq``, ``save_freq``, ...).
    :return: the path of the saved model.
    """
    cfg = {**load_config(config_path, env_id), **(overrides or {})}
    torch.set_num_threads(1)  # a 64x64 MLP: threads only contend with the env workers
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    n_envs = int(n_envs or cfg.get("n_envs", 1))
    total = int(n_timesteps or cfg.get("n_timesteps", 100_000))
    kwargs = {**cfg.get("env_kwargs", {}), **(env_kwargs or {})}
    if "load_range" in kwargs:
        kwargs["load_range"] = tuple(kwargs["load_range"])
    if kwargs.get("augment"):
        kwargs["augment"] = [tuple(x) for x in kwargs["augment"]]
    eval_kwargs = {**{k: v for k, v in kwargs.items() if k != "augment"}, **cfg.get("eval_env_kwargs", {"split": "eval"})}
    if "load_range" in eval_kwargs:
        eval_kwargs["load_range"] = tuple(eval_kwargs["load_range"])
    norm = {"norm_obs": True, "norm_reward": True, "clip_obs": 10.0, **cfg.get("normalize", {})}

    venv = make_envs(n_envs, kwargs, seed, vec_env)
    eval_venv = make_envs(1, eval_kwargs, seed + 10_000, "dummy")
    if resume is not None:
        resume = Path(resume)
        if not resume.exists():
            raise ConfigError(f"{resume}: no such checkpoint to resume from")
        venv = VecNormalize.load(str(_vecnormalize_beside(resume)), venv)
        venv.training = True
    else:
        venv = VecNormalize(venv, **norm)
    eval_venv = VecNormalize(eval_venv, training=False, norm_obs=norm["norm_obs"], norm_reward=False,
                             clip_obs=norm["clip_obs"])

    hyper = {k: cfg[k] for k in PPO_KEYS if k in cfg}
    tb = str(out / "tb") if tensorboard else None
    if resume is not None:
        model = PPO.load(str(resume), env=venv, tensorboard_log=tb, seed=seed, verbose=verbose)
    else:
        model = PPO(cfg.get("policy", "MlpPolicy"), venv, policy_kwargs=cfg.get("policy_kwargs"),
                    tensorboard_log=tb, seed=seed, verbose=verbose, **hyper)

    eval_freq = max(1, int(cfg.get("eval_freq", 10_000)) // n_envs)
    save_freq = max(1, int(cfg.get("save_freq", 20_000)) // n_envs)
    max_wall_s = cfg.get("max_wall_minutes")
    callbacks = CallbackList([
        *([StopOnWallTime(60.0 * float(max_wall_s))] if max_wall_s else []),
        ServingScalarsCallback(),
        EvalCallback(eval_venv, n_eval_episodes=int(cfg.get("n_eval_episodes", 4)), eval_freq=eval_freq,
                     best_model_save_path=str(out / "best"), log_path=str(out / "eval"), deterministic=True),
        CheckpointCallback(save_freq=save_freq, save_path=str(out), name_prefix=CHECKPOINT_PREFIX,
                           save_vecnormalize=True),
    ])
    t0 = time.perf_counter()
    model.learn(total_timesteps=total, callback=callbacks, progress_bar=progress_bar,
                reset_num_timesteps=resume is None, tb_log_name="ppo")
    wall_s = time.perf_counter() - t0
    model_path = out / "model.zip"
    model.save(str(model_path))
    venv.save(str(out / "vecnormalize.pkl"))
    (out / "train_run.yaml").write_text(yaml.safe_dump({
        "config": str(config_path), "env_id": env_id, "seed": seed, "n_envs": n_envs,
        "n_timesteps": int(model.num_timesteps), "wall_time_s": round(wall_s, 1), "env_kwargs": kwargs,
        "eval_env_kwargs": eval_kwargs, "resumed_from": str(resume) if resume else None,
        "max_wall_minutes": max_wall_s,
        "hyperparameters": {k: (v if not isinstance(v, np.generic) else v.item()) for k, v in hyper.items()},
        "policy_kwargs": cfg.get("policy_kwargs"),
    }, sort_keys=False))
    venv.close()
    eval_venv.close()
    return model_path


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description="Train the learned controller with PPO.")
    ap.add_argument("--config", default="training/configs/ppo.yaml")
    ap.add_argument("--timesteps", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="checkpoints")
    ap.add_argument("--resume", default=None)
    ap.add_argument("--n-envs", type=int, default=None)
    args = ap.parse_args()
    path = train(args.config, n_timesteps=args.timesteps, seed=args.seed, out_dir=args.out, resume=args.resume,
                 n_envs=args.n_envs)
    print(f"saved {path}")


if __name__ == "__main__":
    main()
