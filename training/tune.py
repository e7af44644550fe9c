"""``tidegate tune``: one deployment's own policy, from its own request log.

1. **Split** the log by time: the first part (``--split`` of its span) to train on, the later part
   held out (``OUT/train.csv``, ``OUT/heldout.csv``; a prompt's content ids are not kept).
2. **Fine-tune** the shipped policy (``checkpoints/model.zip`` and its VecNormalize statistics) with
   PPO on the env whose traffic is the first part and whose replica is the deployment's profile
   (its costs and KV spread by ``PROFILE_SPREAD``, so the policy does not lean on one exact fit);
   every episode draws a window of that traffic and a load in the config's range (``OUT/train/``).
3. **Export** the tuned actor to ONNX (``OUT/candidate.onnx``).
4. **Evaluate** the tuned policy, the shipped one, their prior (slo-flow) and every heuristic on the
   held-out part at each load (``OUT/evaluation/``), the same arrivals for every controller.
5. **Ship or keep**: the tuned policy is written to ``OUT/policy.onnx`` only if, at every load, its
   goodput beats both the shipped policy's and the prior's by more than chance: the mean of the paired
   differences over the draws (the same arrivals for each) above its standard error. Otherwise the
   command says where it lost and the shipped policy stays. ``OUT/tune.md``, ``tune.json`` and ``tune.png`` say which.

Each stage records its end in ``OUT/tune_state.json``; ``--resume`` skips the stages done, and an
interrupted fine-tuning continues from its latest checkpoint.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from tidegate.ctrl.learned import DEFAULT_POLICY
from tidegate.engine.core.figures import save_png
from tidegate.training.errors import ConfigError

#: the shipped policy's PPO checkpoint (its VecNormalize statistics beside it)
SHIPPED_MODEL = Path(DEFAULT_POLICY).with_name("model.zip")
#: the deployment's step-time coefficients and KV capacity vary by up to this share between episodes
PROFILE_SPREAD = 0.1
#: requests the train and held-out parts need at least (an episode draws a window of them)
MIN_REQUESTS = 50
#: timesteps between the fine-tuning's checkpoints (what an interrupted run loses at most)
SAVE_EVERY = 4096
_CHECKPOINT = re.compile(r"ppo_serving_(\d+)_steps\.zip$")


@dataclass
class TuneSettings:
    """What ``tidegate tune`` runs (``tidegate tune --help`` describes each)."""

    trace: Path
    out: Path
    profile: str = "a100-llama2-7b"
    split: float = 0.5
    timesteps: int = 30_000
    minutes: float = 15.0
    seed: int = 0
    loads: tuple[float, ...] = (1.2, 2.0)
    seeds: tuple[int, ...] = (0, 1, 2)
    requests: int = 1500
    resume: bool = False
    base_model: Path = SHIPPED_MODEL
    base_policy: Path = Path(DEFAULT_POLICY)
    backend: str = "auto"
    address: str | None = None
    workers: int | None = None
    #: the fine-tuning's settings over the shipped training config's (``save_freq``, ``n_epochs``, ...)
    overrides: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0.0 < self.split < 1.0:
            raise ConfigError(f"--split {self.split} is not valid: expected a share of the log between 0 and 1")
        if self.timesteps < 1 or self.minutes <= 0 or self.requests < 2:
            raise ConfigError("--timesteps and --requests must be positive, and --minutes above 0")
        if not self.loads or any(not (x > 0 and math.isfinite(x)) for x in self.loads):
            raise ConfigError("--loads must be positive numbers like 1.2,2")
        if not self.seeds:
            raise ConfigError("--seeds must name at least one draw")


def split_trace(trace: Path, split: float, out: Path) -> tuple[Path, Path, int, int]:
    """The log's first ``split`` of its time span and the rest, each written as a trace of its own
    (the rest re-based to start at 0).

    :raises ConfigError: the log cannot be read, or a part holds fewer than ``MIN_REQUESTS`` requests
    """
    from tidegate.engine.workloads.arrivals import WorkloadError
    from tidegate.engine.workloads.registry import resolve_trace
    from tidegate.engine.workloads.traces import read_trace, write_trace

    try:
        arrivals = read_trace(resolve_trace(trace))
    except (WorkloadError, OSError, ValueError) as exc:
        raise ConfigError(f"the request log {str(trace)!r} cannot be read: {exc}") from None
    if not arrivals:
        raise ConfigError(f"the request log {str(trace)!r} holds no requests")
    cut = arrivals[0].arrival_time_s + split * (arrivals[-1].arrival_time_s - arrivals[0].arrival_time_s)
    first = [a for a in arrivals if a.arrival_time_s < cut]
    rest = [a for a in arrivals if a.arrival_time_s >= cut]
    if min(len(first), len(rest)) < MIN_REQUESTS:
        raise ConfigError(f"the request log {str(trace)!r} splits into {len(first)} and {len(rest)} requests at "
                          f"--split {split}; each part needs at least {MIN_REQUESTS}")
    import dataclasses

    start = rest[0].arrival_time_s
    rest = [dataclasses.replace(a, arrival_time_s=a.arrival_time_s - start) for a in rest]
    return write_trace(first, out / "train.csv"), write_trace(rest, out / "heldout.csv"), len(first), len(rest)


def num_timesteps(model_zip: Path) -> int:
    """The timesteps a stable-baselines3 checkpoint was trained for (read from its ``data`` entry)."""
    try:
        with zipfile.ZipFile(model_zip) as z:
            return int(json.loads(z.read("data"))["num_timesteps"])
    except (OSError, KeyError, ValueError, zipfile.BadZipFile) as exc:
        raise ConfigError(f"{str(model_zip)!r} is not a PPO checkpoint ({type(exc).__name__})") from None


def latest_checkpoint(folder: Path, low: int = 0, high: int | None = None) -> Path | None:
    """The fine-tuning's newest periodic checkpoint in ``folder`` that can be resumed (its zip reads and its
    VecNormalize statistics were saved beside it), of ``low`` to ``high`` timesteps; None if there is none."""
    found = sorted(((int(m.group(1)), p) for p in folder.glob("ppo_serving_*_steps.zip")
                    if (m := _CHECKPOINT.search(p.name))), reverse=True)
    for steps, path in found:
        if steps < low or (high is not None and steps > high):
            continue
        if not path.with_name(f"ppo_serving_vecnormalize_{steps}_steps.pkl").exists():
            continue  # interrupted between the model and its statistics
        try:
            num_timesteps(path)
        except ConfigError:
            continue  # interrupted while writing the model
        return path
    return None


class _State:
    """``OUT/tune_state.json``: the settings, the stages done and what they found."""

    def __init__(self, path: Path, fresh: bool) -> None:
        self.path = path
        self.data: dict = {}
        if not fresh and path.exists():
            try:
                self.data = json.loads(path.read_text())
            except (OSError, ValueError):
                raise ConfigError(f"--resume: {str(path)!r} cannot be read; start again without --resume") from None

    def done(self, stage: str) -> bool:
        return stage in self.data

    def record(self, stage: str, value) -> None:
        self.data[stage] = value
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=2))
        os.replace(tmp, self.path)  # an interruption leaves the old file or the new one, never half of one


def tune(s: TuneSettings, say=print) -> dict:
    """Run the five stages (the module's docstring); ``say`` reports progress, one line a stage.

    :return: the verdict: ``shipped`` (whether ``OUT/policy.onnx`` was written), the per-load figures
        and the paths written
    :raises ConfigError: a bad log, profile or base model, in one sentence
    """
    from tidegate.engine.core.profile import load_profile

    try:
        load_profile(s.profile)
    except (ValueError, OSError) as exc:
        raise ConfigError(f"--profile {s.profile!r}: {exc}") from None
    if not s.base_model.exists():
        raise ConfigError(f"the base model {str(s.base_model)!r} does not exist")
    try:
        s.out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--out {str(s.out)!r} cannot be written ({exc.strerror or exc})") from None
    state = _State(s.out / "tune_state.json", fresh=not s.resume)
    settings = {"trace": str(s.trace), "profile": s.profile, "split": s.split, "seed": s.seed,
                "timesteps": s.timesteps, "loads": list(s.loads), "seeds": list(s.seeds), "requests": s.requests,
                "base_model": str(s.base_model), "base_policy": str(s.base_policy)}
    before = state.data.get("settings")
    if before is not None and before != settings:
        changed = ", ".join(k for k in settings if before.get(k) != settings[k])
        raise ConfigError(f"--resume: {str(s.out)!r} holds a tune with other settings ({changed}); resume with "
                          f"the same ones or give a new --out")
    if not s.resume:  # a fresh run resumes nothing an earlier run left there
        shutil.rmtree(s.out / "train", ignore_errors=True)
        (s.out / "policy.onnx").unlink(missing_ok=True)
    state.record("settings", settings)

    if not state.done("split"):
        train_csv, held_csv, n_train, n_held = split_trace(s.trace, s.split, s.out)
        state.record("split", {"train": str(train_csv), "heldout": str(held_csv), "train_requests": n_train,
                               "heldout_requests": n_held})
    split = state.data["split"]
    say(f"1/4 split: {split['train_requests']} requests to train on ({split['train']}), "
        f"{split['heldout_requests']} held out ({split['heldout']})")

    model = s.out / "train" / "model.zip"
    if not state.done("trained"):
        _fine_tune(s, Path(split["train"]), say)
        state.record("trained", {"model": str(model), "timesteps": num_timesteps(model)})
    say(f"2/4 fine-tuned: {model} ({state.data['trained']['timesteps']} timesteps in all)")

    candidate = s.out / "candidate.onnx"
    if not state.done("exported"):
        from tidegate.training.export import export

        export(model, candidate)
        state.record("exported", str(candidate))
    say(f"3/4 exported: {candidate}")

    if not state.done("evaluated"):
        state.record("evaluated", _evaluate(s, candidate, Path(split["heldout"])))
    verdict = _verdict(s, state.data["evaluated"])
    say(f"4/4 evaluated on the held-out part at loads {', '.join(f'{x:g}' for x in s.loads)}")
    _write_report(s, verdict)
    return verdict


def _fine_tune(s: TuneSettings, train_csv: Path, say) -> None:
    from tidegate.training.train import train

    folder = s.out / "train"
    base_steps = num_timesteps(s.base_model)
    resume_from, remaining = s.base_model, s.timesteps
    latest = latest_checkpoint(folder, base_steps + 1, base_steps + s.timesteps + SAVE_EVERY) if s.resume else None
    if latest is not None:
        done = num_timesteps(latest) - base_steps
        if done >= s.timesteps:  # it ended between its last checkpoint and recording the stage
            shutil.copyfile(latest, folder / "model.zip")
            shutil.copyfile(latest.with_name(f"ppo_serving_vecnormalize_{num_timesteps(latest)}_steps.pkl"),
                            folder / "vecnormalize.pkl")
            say(f"2/4 fine-tuning had ended: {latest}")
            return
        resume_from, remaining = latest, s.timesteps - done
        say(f"2/4 fine-tuning resumes from {latest} ({done} of {s.timesteps} timesteps done)")
    else:
        say(f"2/4 fine-tuning the shipped policy for {s.timesteps} timesteps (at most {s.minutes:g} min)")
    env_kwargs = {"families": [{"name": "tune-train", "trace": str(train_csv.resolve())}], "profile": s.profile,
                  "profile_spread": PROFILE_SPREAD}
    overrides = {"max_wall_minutes": s.minutes, "eval_freq": 10**12, "save_freq": SAVE_EVERY, **s.overrides}
    try:
        train(None, n_timesteps=remaining, seed=s.seed, out_dir=folder, resume=resume_from, n_envs=1,
              env_kwargs=env_kwargs, overrides=overrides, tensorboard=False, progress_bar=True)
    except FileNotFoundError as exc:
        raise ConfigError(f"the fine-tuning cannot start: {exc}") from None


def _evaluate(s: TuneSettings, candidate: Path, held_csv: Path) -> dict:
    from tidegate.training.evaluate import evaluate, summarize, write_report

    named = {"tuned": str(candidate), "shipped": str(s.base_policy)}
    rows = evaluate(named, families=[str(held_csv.resolve())], loads=list(s.loads), seeds=list(s.seeds),
                    requests=s.requests, profile=s.profile, backend=s.backend, address=s.address,
                    workers=s.workers)
    write_report(rows, list(named), s.out / "evaluation")
    draws: dict[str, dict[str, list[float]]] = {}
    for r in sorted(rows, key=lambda r: r["seed"]):
        draws.setdefault(f"{r['load']:g}", {}).setdefault(r["controller"], []).append(r["goodput_frac"])
    return {"summary": summarize(rows, list(named)), "draws": draws}


def _verdict(s: TuneSettings, evaluated: dict) -> dict:
    from tidegate.training.evaluate import PRIOR

    cells = []
    for row in evaluated["summary"]:
        best = row.get("best_heuristic")
        draws = evaluated["draws"][f"{row['load']:g}"]
        cells.append({"load": row["load"], "tuned": row["tuned"], "shipped": row["shipped"], "prior": row[PRIOR],
                      "best_heuristic": best, "best_heuristic_goodput": row.get(best) if best else None,
                      "prior_rel_se": row.get("prior_rel_se"),
                      "margin_shipped": paired_margin(draws["tuned"], draws["shipped"]),
                      "margin_prior": paired_margin(draws["tuned"], draws[PRIOR])})
    losses = [f"at load {c['load']:g} ({c['tuned']:.3f} against the shipped {c['shipped']:.3f} and the prior "
              f"{c['prior']:.3f})" for c in cells if not (beats(c["margin_shipped"]) and beats(c["margin_prior"]))]
    policy = s.out / "policy.onnx"
    if losses:
        policy.unlink(missing_ok=True)
    else:
        shutil.copyfile(s.out / "candidate.onnx", policy)
    return {"shipped": not losses, "policy": str(policy) if not losses else None, "losses": losses, "cells": cells,
            "trace": str(s.trace), "profile": s.profile}


def paired_margin(a: list[float], b: list[float]) -> dict:
    """``a`` against ``b`` over the same draws (every controller of a draw serves the same arrivals): the
    mean difference and its standard error (None with one draw)."""
    import numpy as np

    d = np.asarray(a, dtype=float) - np.asarray(b, dtype=float)
    se = float(np.std(d, ddof=1) / math.sqrt(len(d))) if len(d) > 1 else None
    return {"mean": float(d.mean()), "se": se}


def beats(margin: dict) -> bool:
    """Better by more than chance: the mean difference above its standard error (one draw: above 0)."""
    return margin["mean"] > max(0.0, margin["se"] or 0.0)


def _write_report(s: TuneSettings, verdict: dict) -> None:
    cells = verdict["cells"]
    lines = [f"# tidegate tune: {s.trace}", "", f"Profile {s.profile}; trained on the first {s.split:.0%} of the "
             f"log's span, evaluated on the rest ({len(s.seeds)} draws of {s.requests} requests a load). Goodput "
             "per lambda_max:", "",
             "| load | tuned | shipped | prior (slo-flow) | best heuristic | tuned - shipped | tuned - prior |",
             "|---:|---:|---:|---:|---|---:|---:|"]

    def margin(m: dict) -> str:
        return f"{m['mean']:+.4f}" + ("" if m["se"] is None else f" ± {m['se']:.4f}") + (" ✓" if beats(m) else "")

    for c in cells:
        lines.append(f"| {c['load']:g} | {c['tuned']:.3f} | {c['shipped']:.3f} | {c['prior']:.3f} | "
                     f"{c['best_heuristic']} {c['best_heuristic_goodput'] or 0:.3f} | "
                     f"{margin(c['margin_shipped'])} | {margin(c['margin_prior'])} |")
    lines += ["", "A margin is the mean over the draws of the paired difference in goodput / lambda_max (every "
              "controller of a draw serves the same arrivals) ± its standard error; ✓: above its standard error, "
              "what shipping needs at every load."]
    lines.append("")
    if verdict["shipped"]:
        lines.append(f"**Shipped**: `tidegate serve --controller learned:path={verdict['policy']}` deploys it.")
    else:
        lines.append("**Not shipped**: the tuned policy did not beat both the shipped policy and the prior "
                     + "; ".join(verdict["losses"]) + ". The shipped policy stays.")
    (s.out / "tune.md").write_text("\n".join(lines) + "\n")
    (s.out / "tune.json").write_text(json.dumps(verdict, indent=2))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    names = ("tuned", "shipped", "prior", "best_heuristic_goodput")
    labels = ("tuned", "shipped", "slo-flow (prior)", "best heuristic")
    x = np.arange(len(cells))
    fig, ax = plt.subplots(figsize=(6, 3.2))
    for i, (name, label) in enumerate(zip(names, labels)):
        ax.bar(x + (i - 1.5) * 0.2, [c[name] or 0.0 for c in cells], 0.2, label=label)
    ax.set_xticks(x, [f"{c['load']:g} x" for c in cells])
    ax.set_ylabel("goodput / lambda_max")
    ax.set_title("The held-out part of the log")
    ax.legend(fontsize=7)
    fig.tight_layout()
    save_png(fig, s.out / "tune.png", dpi=120)
    plt.close(fig)
