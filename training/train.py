"""PPO training of the learned controller on ``tidegate/Serving-v0`` (or of the fleet gateway's admission on
``tidegate/Fleet-v0``), from a zoo-style YAML config.

    tidegate train [--env serving|fleet] [--config training/configs/ppo.yaml] [--timesteps N] [--n-envs N]
        [--seed 0] [--out runs/ppo] [--resume runs/ppo/ppo_serving_100000_steps.zip]

Reads top to bottom: config, vectorised envs (SubprocVecEnv, DummyVecEnv for one env) under
VecNormalize, PPO, callbacks (evaluation on the eval split, checkpoints, serving scalars in
TensorBoard), learn, save ``model.zip`` with ``vecnormalize.pkl`` beside it. Everything a run
writes goes to its output folder (``runs/ppo`` by default), never into the shipped ``checkpoints``.
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
from stable_baselines3.common.logger import configure
from stable_baselines3.common.vec_env import DummyVecEnv, SubprocVecEnv, VecNormalize

import tidegate.env  # noqa: F401  (registers tidegate/Serving-v0 and tidegate/Fleet-v0)
from tidegate.env import ENV_ID, FLEET_ENV_ID
from tidegate.env.fleet_env import FleetEnv
from tidegate.env.serving_env import ServingEnv
from tidegate.training.configs import DEFAULT_CONFIG, DEFAULT_OUT
from tidegate.training.errors import ConfigError
from tidegate.training.parallel import run_tasks

PPO_KEYS = ("n_steps", "batch_size", "n_epochs", "learning_rate", "gamma", "gae_lambda", "clip_range",
            "ent_coef", "vf_coef", "max_grad_norm", "target_kl", "use_sde")
CHECKPOINT_PREFIX = "ppo_serving"
#: the env each config key trains
ENV_CLASSES = {ENV_ID: ServingEnv, FLEET_ENV_ID: FleetEnv}
#: the checkpoints' name prefix, per env
CHECKPOINT_PREFIXES = {ENV_ID: CHECKPOINT_PREFIX, FLEET_ENV_ID: "ppo_fleet"}


def vecnormalize_path(model_path: str | Path) -> Path:
    """The VecNormalize statistics saved with a model by :func:`train`: ``vecnormalize.pkl`` beside
    ``model.zip``, or CheckpointCallback's ``<prefix>_vecnormalize_<n>_steps.pkl`` beside
    ``<prefix>_<n>_steps.zip``.

    :param model_path: an SB3 model ``.zip`` written by :func:`train`.
    :return: the path of its statistics (which may not exist).
    """
    model_path = Path(model_path)
    m = re.fullmatch(r"(.*)_(\d+)_steps", model_path.stem)
    if m:
        return model_path.with_name(f"{m.group(1)}_vecnormalize_{m.group(2)}_steps.pkl")
    return model_path.with_name("vecnormalize.pkl")


def load_config(config_path: str | Path | None = None, env_id: str = ENV_ID) -> dict[str, Any]:
    """The hyperparameters of ``env_id`` in a zoo-style YAML file.

    :param config_path: the YAML file (default: the shipped ``training/configs/ppo.yaml``).
    :param env_id: the top-level key to read.
    :raises ConfigError: the file is missing, unreadable, not YAML or has no mapping under ``env_id``.
    """
    path = DEFAULT_CONFIG if config_path is None else Path(config_path)
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read the config file ({type(exc).__name__})") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({type(exc).__name__})") from None
    if not isinstance(data, dict) or not isinstance(data.get(env_id), dict):
        raise ConfigError(f"{path}: expected a mapping with the key {env_id!r} holding the hyperparameters")
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


def make_envs(n_envs: int, env_kwargs: dict, seed: int, vec_env: str | None = None, env_id: str = ENV_ID):
    """``n_envs`` copies of ``env_id``'s env: SubprocVecEnv, or DummyVecEnv for one env (or on request)."""
    cls = DummyVecEnv if n_envs == 1 or vec_env == "dummy" else SubprocVecEnv
    return make_vec_env(ENV_CLASSES[env_id], n_envs=n_envs, seed=seed, env_kwargs=env_kwargs, vec_env_cls=cls)


def env_kwargs_of(cfg: dict, overrides: dict | None = None) -> tuple[dict, dict]:
    """The training and evaluation env kwargs of a config (YAML lists turned into the tuples the env
    takes); the evaluation env drops ``augment`` and applies ``eval_env_kwargs`` (default: the eval split)."""
    kwargs = {**cfg.get("env_kwargs", {}), **(overrides or {})}
    if "load_range" in kwargs:
        kwargs["load_range"] = tuple(kwargs["load_range"])
    if kwargs.get("augment"):
        kwargs["augment"] = [tuple(x) for x in kwargs["augment"]]
    eval_kwargs = {**{k: v for k, v in kwargs.items() if k != "augment"},
                   **cfg.get("eval_env_kwargs", {"split": "eval"})}
    if "load_range" in eval_kwargs:
        eval_kwargs["load_range"] = tuple(eval_kwargs["load_range"])
    return kwargs, eval_kwargs


def _check_resume(resume: str | Path | None) -> Path | None:
    if resume is None:
        return None
    resume = Path(resume)
    if not resume.is_file():
        raise ConfigError(f"{resume}: no such checkpoint to resume from")
    if not vecnormalize_path(resume).is_file():
        raise ConfigError(f"{resume}: no VecNormalize statistics beside it (expected {vecnormalize_path(resume)})")
    return resume


def _resumed_model(resume: Path, venv, **ppo_options) -> tuple[PPO, VecNormalize]:
    """The checkpoint ``resume`` and its VecNormalize statistics around ``venv``, set to keep training with
    ``ppo_options`` (the run's hyperparameters replace the saved ones: SB3 sets them before it builds the
    model's buffers and schedules)."""
    try:
        venv = VecNormalize.load(str(vecnormalize_path(resume)), venv)
        venv.training = True
        return PPO.load(str(resume), env=venv, **ppo_options), venv
    except Exception as exc:  # a corrupt or foreign file: SB3 raises whatever unpickling or unzipping does
        venv.close()
        raise ConfigError(f"{resume}: cannot resume from this checkpoint ({type(exc).__name__})") from None


def _callbacks(cfg: dict, eval_venv, out: Path, n_envs: int, prefix: str = CHECKPOINT_PREFIX) -> CallbackList:
    """Wall-time stop (``max_wall_minutes``), serving scalars, evaluation on the eval split every
    ``eval_freq`` steps and a checkpoint with its VecNormalize statistics every ``save_freq`` steps."""
    max_wall = cfg.get("max_wall_minutes")
    return CallbackList([
        *([StopOnWallTime(60.0 * float(max_wall))] if max_wall else []),
        ServingScalarsCallback(),
        EvalCallback(eval_venv, n_eval_episodes=int(cfg.get("n_eval_episodes", 4)),
                     eval_freq=max(1, int(cfg.get("eval_freq", 10_000)) // n_envs),
                     best_model_save_path=str(out / "best"), log_path=str(out / "eval"), deterministic=True),
        CheckpointCallback(save_freq=max(1, int(cfg.get("save_freq", 20_000)) // n_envs), save_path=str(out),
                           name_prefix=prefix, save_vecnormalize=True),
    ])


def train(config_path: str | Path | None = None, *, env_id: str = ENV_ID, n_timesteps: int | None = None,
          seed: int = 0, out_dir: str | Path = DEFAULT_OUT, resume: str | Path | None = None,
          n_envs: int | None = None, env_kwargs: dict | None = None, progress_bar: bool = True,
          tensorboard: bool = True, vec_env: str | None = None, overrides: dict | None = None,
          verbose: int = 0) -> Path:
    """Train PPO and save ``out_dir/model.zip`` with ``out_dir/vecnormalize.pkl``.

    :param config_path: zoo-style YAML, one key per env id (default: the shipped ``training/configs/ppo.yaml``).
    :param env_id: the env to train, and the config's key to read (``ENV_CLASSES``).
    :param n_timesteps: override the config's ``n_timesteps``.
    :param seed: seed of the envs and of PPO.
    :param out_dir: where the model, CheckpointCallback checkpoints, evaluations (``eval/``, ``best/``),
        TensorBoard logs (``tb/``) and the run record ``train_run.yaml`` go.
    :param resume: a checkpoint ``.zip`` to continue from (its VecNormalize statistics are loaded too).
    :param n_envs: override the config's ``n_envs``.
    :param env_kwargs: override entries of the config's ``env_kwargs``.
    :param progress_bar: show SB3's progress bar.
    :param tensorboard: write TensorBoard logs to ``out_dir/tb``; without them, SB3's log goes to
        ``out_dir/progress.csv``.
    :param vec_env: ``dummy`` forces DummyVecEnv.
    :param overrides: replace top-level config entries (``n_steps``, ``eval_freq``, ``save_freq``, ...).
    :param verbose: SB3's verbosity.
    :return: the path of the saved model.
    :raises ConfigError: the config or the checkpoint to resume from cannot be used.
    """
    config_path = DEFAULT_CONFIG if config_path is None else Path(config_path)
    if env_id not in ENV_CLASSES:
        raise ConfigError(f"no env {env_id!r}; choose one of {', '.join(ENV_CLASSES)}")
    cfg = {**load_config(config_path, env_id), **(overrides or {})}
    resume = _check_resume(resume)
    torch.set_num_threads(1)  # a 64x64 MLP: threads only contend with the env workers
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    n_envs = int(n_envs if n_envs is not None else cfg.get("n_envs", 1))
    kwargs, eval_kwargs = env_kwargs_of(cfg, env_kwargs)
    norm = {"norm_obs": True, "norm_reward": True, "clip_obs": 10.0, **cfg.get("normalize", {})}

    venv = make_envs(n_envs, kwargs, seed, vec_env, env_id)
    eval_venv = VecNormalize(make_envs(1, eval_kwargs, seed + 10_000, "dummy", env_id), training=False,
                             norm_obs=norm["norm_obs"], norm_reward=False, clip_obs=norm["clip_obs"])
    ppo_options = {"tensorboard_log": str(out / "tb") if tensorboard else None, "seed": seed, "verbose": verbose}
    hyper = {k: cfg[k] for k in PPO_KEYS if k in cfg}
    if resume is not None:
        model, venv = _resumed_model(resume, venv, **ppo_options, **hyper)
    else:
        venv = VecNormalize(venv, **norm)
        model = PPO(cfg.get("policy", "MlpPolicy"), venv, policy_kwargs=cfg.get("policy_kwargs"), **ppo_options,
                    **hyper)
    if not tensorboard:  # SB3 would otherwise make an empty folder in the system's temp dir at every learn()
        model.set_logger(configure(str(out), ["csv"]))

    t0 = time.perf_counter()
    model.learn(total_timesteps=int(n_timesteps if n_timesteps is not None else cfg.get("n_timesteps", 100_000)),
                callback=_callbacks(cfg, eval_venv, out, n_envs, CHECKPOINT_PREFIXES[env_id]),
                progress_bar=progress_bar,
                reset_num_timesteps=resume is None, tb_log_name="ppo")
    wall_s = time.perf_counter() - t0
    model_path = out / "model.zip"
    model.save(str(model_path))
    venv.save(str(vecnormalize_path(model_path)))
    (out / "train_run.yaml").write_text(yaml.safe_dump({
        "config": str(config_path), "env_id": env_id, "seed": seed, "n_envs": n_envs,
        "n_timesteps": int(model.num_timesteps), "wall_time_s": round(wall_s, 1), "env_kwargs": kwargs,
        "eval_env_kwargs": eval_kwargs, "resumed_from": str(resume) if resume else None,
        "max_wall_minutes": cfg.get("max_wall_minutes"),
        "hyperparameters": {k: (v if not isinstance(v, np.generic) else v.item()) for k, v in hyper.items()},
        "policy_kwargs": cfg.get("policy_kwargs"), "held_out": cfg.get("held_out"),
    }, sort_keys=False))
    venv.close()
    eval_venv.close()
    return model_path


def train_seeds(config_path: str | Path | None, seeds: list[int], out_dir: str | Path = DEFAULT_OUT, *,
                n_timesteps: int | None = None, n_envs: int | None = None, backend: str = "auto",
                address: str | None = None, workers: int | None = None, env_kwargs: dict | None = None,
                overrides: dict | None = None, env_id: str = ENV_ID) -> list[Path]:
    """One training run per seed, each in ``out_dir/seed<N>``, as parallel tasks
    (``training.parallel.run_tasks``: local processes, or Ray with ``backend``/``address``).

    :return: the saved models, in the order of ``seeds``.
    """
    if not seeds or len(set(seeds)) != len(seeds):
        raise ConfigError(f"seeds must be distinct and at least one, got {seeds}")
    # a bad config fails before any task starts
    load_config(DEFAULT_CONFIG if config_path is None else config_path, env_id)
    out = Path(out_dir)
    tasks = [{"config_path": str(config_path) if config_path else None, "seed": s, "out_dir": str(out / f"seed{s}"),
              "n_timesteps": n_timesteps, "n_envs": n_envs, "progress_bar": False, "env_kwargs": env_kwargs,
              "overrides": overrides, "tensorboard": False, "env_id": env_id} for s in seeds]
    return run_tasks(train, tasks, backend=backend, address=address, workers=workers,
                     desc=f"training {len(seeds)} seeds")
