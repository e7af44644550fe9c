"""Training smoke test, the ONNX export's parity with SB3's deterministic predict, the
``tidegate train/export/evaluate/sim-to-real`` commands and their default paths."""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import yaml
import pytest
from click.testing import CliRunner

from tidegate.ctrl.learned import DEFAULT_POLICY, OBS_DIM, make_learned_controller
from tidegate.ctrl.policy import NumpyPolicy, OnnxPolicy
from tidegate.ctrl.shield import ShieldedController
from tidegate.engine.cli import main
from tidegate.engine.core.profile import load_profile

REPO = Path(__file__).resolve().parents[1]


SMALL_RUN = {"n_steps": 512, "batch_size": 128, "n_epochs": 4, "eval_freq": 1024, "save_freq": 1024,
             "n_eval_episodes": 1}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from tidegate.training.train import train

    out = tmp_path_factory.mktemp("ppo")
    model = train(None, n_timesteps=3072, out_dir=out, n_envs=1, progress_bar=False,
                  tensorboard=True, env_kwargs={"episode_steps": 64, "control_interval": 5},
                  overrides=SMALL_RUN)
    return out, model


def test_smoke_training_saves_model_and_vecnormalize(trained):
    out, model = trained
    assert model.exists() and (out / "vecnormalize.pkl").exists()
    assert list((out / "tb").rglob("events.out.tfevents*"))
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ev = EventAccumulator(str(next((out / "tb").iterdir())))
    ev.Reload()
    tags = set(ev.Tags()["scalars"])
    assert {"serving/goodput", "serving/evictions", "serving/rejections", "serving/shield_intervention_rate",
            "serving/kv_usage"} <= tags


def test_resume_from_checkpoint(trained, tmp_path, monkeypatch):
    import tempfile

    from tidegate.training.train import train

    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    out, _ = trained
    ckpts = sorted(out.glob("ppo_serving_*_steps.zip"))
    assert ckpts, "CheckpointCallback wrote nothing"
    model = train(None, n_timesteps=512, out_dir=tmp_path, n_envs=1, progress_bar=False,
                  tensorboard=False, resume=ckpts[0], env_kwargs={"episode_steps": 64, "control_interval": 5},
                  overrides={**SMALL_RUN, "batch_size": 64, "n_epochs": 2})
    assert model.exists()
    # the run's hyperparameters, not the checkpoint's (batch 128, 4 epochs), drive the resumed training
    from stable_baselines3 import PPO

    resumed = PPO.load(str(model))
    assert (resumed.n_steps, resumed.batch_size, resumed.n_epochs) == (512, 64, 2)
    # without TensorBoard, SB3's log lands in the run folder, not in an empty folder of the temp dir
    assert "time/total_timesteps" in (tmp_path / "progress.csv").read_text().splitlines()[0]
    assert not list(temp.iterdir())


def test_training_seeds_run_as_parallel_tasks_each_in_its_folder(tmp_path):
    from tidegate.training.train import train_seeds

    paths = train_seeds(None, [3, 4], tmp_path, n_timesteps=512, n_envs=1, backend="process", workers=2,
                        env_kwargs={"episode_steps": 32, "control_interval": 5, "episode_requests": 400},
                        overrides={**SMALL_RUN, "eval_freq": 512, "save_freq": 512})
    assert paths == [tmp_path / "seed3" / "model.zip", tmp_path / "seed4" / "model.zip"]
    assert all(p.is_file() and (p.parent / "vecnormalize.pkl").is_file() for p in paths)
    runs = [yaml.safe_load((p.parent / "train_run.yaml").read_text()) for p in paths]
    assert [r["seed"] for r in runs] == [3, 4] and runs[0]["held_out"]


def test_export_matches_predict(trained, tmp_path):
    from stable_baselines3 import PPO

    from tidegate.training.export import export

    out, model_path = trained
    onnx_path = export(model_path, tmp_path / "policy.onnx")
    model = PPO.load(str(model_path), device="cpu")
    with open(out / "vecnormalize.pkl", "rb") as f:
        vn = pickle.load(f)
    obs = np.random.default_rng(0).uniform(-10, 10, size=(1000, OBS_DIM)).astype(np.float32)
    expected, _ = model.predict(vn.normalize_obs(obs), deterministic=True)
    ort_policy, np_policy = OnnxPolicy(onnx_path), NumpyPolicy(onnx_path)
    got_ort = np.stack([ort_policy(o) for o in obs])
    got_np = np.stack([np_policy(o) for o in obs])
    np.testing.assert_allclose(got_ort, expected, atol=1e-5)
    np.testing.assert_allclose(got_np, expected, atol=1e-5)

    shielded = make_learned_controller(onnx_path, profile=load_profile("tiny-cpu"))
    assert isinstance(shielded, ShieldedController) and shielded.inner.policy is not None


def test_learned_controller_falls_back(tmp_path, caplog):
    from tidegate.engine.core.profile import load_profile
    from tidegate.engine.sim.simulate import simulate
    from tidegate.engine.workloads import read_trace, resolve_trace

    bad = tmp_path / "policy.onnx"
    bad.write_bytes(b"not an onnx file")
    ctrl = make_learned_controller(bad, profile=load_profile("a100-llama2-7b"))
    assert ctrl.inner.policy is None
    arrivals = read_trace(resolve_trace("splitwise_conv"), first_n=100)
    res = simulate(arrivals, load_profile("a100-llama2-7b"), ctrl, record_steps=False)
    assert res.summary["completed"] + res.summary["rejected"] + res.summary["expired"] == 100
    assert ctrl.inner.fallback_total > 0 and len(ctrl.inner.fallbacks) == 1

    class Raising:
        calls = 0

        def __call__(self, obs):
            Raising.calls += 1
            return [float("nan"), 0.0, 0.0] if Raising.calls % 2 else 1 / 0

    ctrl = make_learned_controller(bad, profile=load_profile("a100-llama2-7b"))
    ctrl.inner.policy = Raising()
    ctrl.reset()
    res = simulate(arrivals, load_profile("a100-llama2-7b"), ctrl, record_steps=False)
    assert set(ctrl.inner.fallbacks) == {"policy returned NaN or inf", "policy raised ZeroDivisionError"}


def test_learned_controller_needs_a_profile_and_ctrl_never_loads_one():
    from tidegate.ctrl import ControllerSpecError, build_controller

    with pytest.raises(ControllerSpecError, match="needs the replica's profile"):
        build_controller("learned")
    shielded = build_controller("learned", load_profile("tiny-cpu"))
    assert isinstance(shielded, ShieldedController) and shielded.inner.features.ttft_slo_s == 1.0
    assert shielded.inner.policy is not None  # the shipped policy, found as package data


# --- paths -------------------------------------------------------------------------------------


def test_vecnormalize_path_names_the_statistics_saved_with_a_model():
    from tidegate.training.train import vecnormalize_path

    assert vecnormalize_path("runs/ppo/model.zip") == Path("runs/ppo/vecnormalize.pkl")
    assert vecnormalize_path(Path("r/ppo_serving_100_steps.zip")) == Path("r/ppo_serving_vecnormalize_100_steps.pkl")
    assert vecnormalize_path(REPO / "checkpoints/model.zip").is_file()  # the source of the shipped export


def test_default_paths_are_package_data_and_runs_go_to_runs():
    from tidegate.training import cli
    from tidegate.training.configs import DEFAULT_CONFIG, DEFAULT_OUT
    from tidegate.training.export import default_export_path

    assert DEFAULT_CONFIG.is_file() and DEFAULT_CONFIG.name == "ppo.yaml"
    assert DEFAULT_POLICY.is_file() and DEFAULT_POLICY.parent.name == "checkpoints"
    assert DEFAULT_OUT == Path("runs/ppo")
    defaults = {(c.name, p.name): p.default for c in (cli.train_command, cli.evaluate_command,
                                                      cli.sim_to_real_command) for p in c.params}
    assert defaults["train", "config_path"] == DEFAULT_CONFIG and defaults["train", "out_dir"] == DEFAULT_OUT
    assert defaults["evaluate", "policies"] == (DEFAULT_POLICY,) and defaults["sim-to-real", "policy"] == DEFAULT_POLICY
    assert default_export_path("runs/ppo/model.zip") == Path("runs/ppo/policy.onnx")
    assert default_export_path(REPO / "checkpoints/model.zip").resolve() == DEFAULT_POLICY.resolve()
    shipped = subprocess.run(["git", "ls-files", "checkpoints"], cwd=REPO, capture_output=True, text=True).stdout
    if shipped:  # a git checkout: only the shipped policy, its card and the source of its export
        assert set(shipped.split()) == {f"checkpoints/{n}" for n in ("__init__.py", "MODEL_CARD.md", "model.zip",
                                                                     "policy.onnx", "train_run.yaml",
                                                                     "vecnormalize.pkl")}


# --- the commands ------------------------------------------------------------------------------


def invoke(*args: str):
    return CliRunner().invoke(main, [str(a) for a in args])


def assert_one_line_error(res, *needles: str) -> None:
    """Exit code 2 and a single ``error: ...`` line naming the input, no traceback."""
    assert res.exit_code == 2, res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    assert all(n in lines[0] for n in needles), lines[0]
    assert res.exception is None or isinstance(res.exception, SystemExit)


def test_export_command_writes_policy_beside_the_checkpoint_by_default(trained, tmp_path):
    out, model_path = trained
    for name in ("model.zip", "vecnormalize.pkl"):
        shutil.copy(out / name, tmp_path / name)
    res = invoke("export", tmp_path / "model.zip")
    assert res.exit_code == 0, res.output
    assert (tmp_path / "policy.onnx").is_file() and NumpyPolicy(tmp_path / "policy.onnx") is not None
    res = invoke("export", tmp_path / "model.zip", tmp_path / "sub" / "other.onnx", "--vecnormalize",
                 tmp_path / "vecnormalize.pkl")
    assert res.exit_code == 0 and (tmp_path / "sub" / "other.onnx").is_file(), res.output


def test_evaluate_matrix_on_tiny_inputs(tmp_path):
    from tidegate.training.evaluate import HEURISTICS, PRIOR, evaluate, write_report

    rows = evaluate({"learned": DEFAULT_POLICY}, families=["chat", "splitwise_code"], loads=[0.8, 2.0], seeds=[0],
                    requests=120, workers=1, progress=False)
    assert {r["controller"] for r in rows} == {"learned", PRIOR, *HEURISTICS}
    assert {r["family"] for r in rows} == {"chat", "splitwise_code"}
    assert all(r["requests"] == 120 for r in rows)
    again = evaluate({"learned": DEFAULT_POLICY}, families=["chat", "splitwise_code"], loads=[0.8, 2.0], seeds=[0],
                     requests=120, workers=2, progress=False)
    assert again == rows  # a cell is a pure function of its inputs, in any process
    report = write_report(rows, ["learned"], tmp_path, held_out=["splitwise_code"])
    assert {"worst_cell_vs_best", "geomean_vs_best_load_ge_1.2"} <= set(report["targets"])
    assert {p.name for p in tmp_path.iterdir()} >= {"matrix.md", "matrix.json", "learned_vs_best.png"}
    assert "(held out)" in (tmp_path / "matrix.md").read_text()

    res = invoke("evaluate", "--family", "short", "--loads", "1.0", "--requests", "60", "--seeds", "0",
                 "--workers", "1")
    assert res.exit_code == 0, res.output
    assert "vs_best" in res.stdout and "worst_cell_vs_best" in res.stdout


def test_the_matrix_has_a_profile_axis(tmp_path):
    from tidegate.training.evaluate import evaluate, summarize

    rows = evaluate({"learned": DEFAULT_POLICY}, families=["short", "splitwise_code"], loads=[1.2], seeds=[0],
                    requests=80, profile=["a100-llama2-7b", "slot"], workers=1, progress=False)
    assert {(r["family"], r["profile"]) for r in rows} == {(f, p) for f in ("short", "splitwise_code")
                                                           for p in ("a100-llama2-7b", "slot")}
    summary = summarize(rows, ["learned"], held_out=["splitwise_code"])
    assert {r["family"] for r in summary} == {"short @ a100-llama2-7b", "short @ slot",
                                              "splitwise_code @ a100-llama2-7b", "splitwise_code @ slot"}
    assert all(r["held_out"] == r["family"].startswith("splitwise_code") for r in summary)
    res = invoke("evaluate", "--family", "short", "--loads", "1.2", "--requests", "60", "--seeds", "0",
                 "--workers", "1", "--profile", "slot", "--profile", "tiny-cpu")
    assert res.exit_code == 0 and "short @ slot" in res.stdout and "short @ tiny-cpu" in res.stdout, res.output
    res = invoke("evaluate", "--family", "short", "--profile", "no-such-profile")
    assert res.exit_code == 2 and "no-such-profile" in res.output


@pytest.mark.parametrize("args, needles", [
    (["--seeds", "a"], ["--seeds", "'a'"]),
    (["--seeds", ""], ["--seeds"]),
    (["--seeds", "0,,1"], ["--seeds"]),
    (["--seeds", "-1"], ["seeds", "-1"]),
    (["--loads", "fast"], ["--loads", "'fast'"]),
    (["--loads", "0"], ["loads", "0.0"]),
    (["--requests", "0"], ["requests"]),
    (["--profile", "no-such-profile"], ["no-such-profile"]),
    (["--policy", "/nonexistent/policy.onnx"], ["/nonexistent/policy.onnx", "no such policy"]),
    (["--family", "no-such-family.yaml"], ["no-such-family.yaml"]),
    (["--family", "/nonexistent/trace.csv"], ["/nonexistent/trace.csv"]),
])
def test_evaluate_bad_input_is_one_line_and_exit_2(args, needles):
    assert_one_line_error(invoke("evaluate", "--requests", "10", *args), *needles)


def test_evaluate_refuses_a_corrupt_policy_instead_of_evaluating_the_fallback(tmp_path):
    bad = tmp_path / "policy.onnx"
    bad.write_bytes(b"not an onnx file")
    assert_one_line_error(invoke("evaluate", "--requests", "10", "--policy", bad), str(bad), "tidegate export")


def test_export_and_train_bad_input_is_one_line_and_exit_2(tmp_path):
    corrupt = tmp_path / "model.zip"
    corrupt.write_bytes(b"not a zip")
    assert_one_line_error(invoke("export", tmp_path / "missing.zip"), "missing.zip", "no such checkpoint")
    assert_one_line_error(invoke("export", corrupt), "model.zip", "not a stable-baselines3 PPO checkpoint")
    assert_one_line_error(invoke("train", "--config", tmp_path / "missing.yaml"), "missing.yaml")
    (tmp_path / "bad.yaml").write_text("tidegate/Serving-v0: [unclosed")
    assert_one_line_error(invoke("train", "--config", tmp_path / "bad.yaml"), "bad.yaml", "not valid YAML")
    (tmp_path / "other.yaml").write_text("CartPole-v1: {n_envs: 1}")
    assert_one_line_error(invoke("train", "--config", tmp_path / "other.yaml"), "tidegate/Serving-v0")
    assert_one_line_error(invoke("train", "--resume", tmp_path / "missing.zip", "--out", tmp_path / "run"),
                          "missing.zip")
    assert_one_line_error(invoke("train", "--resume", corrupt, "--out", tmp_path / "run"), "VecNormalize")
    (tmp_path / "vecnormalize.pkl").write_bytes(b"junk")
    assert_one_line_error(invoke("train", "--resume", corrupt, "--out", tmp_path / "run", "--n-envs", "1"),
                          "cannot resume")


def test_sim_to_real_bad_input_is_one_line_and_exit_2(tmp_path):
    assert_one_line_error(invoke("sim-to-real", "--policy", tmp_path / "missing.onnx"), "missing.onnx")
    assert_one_line_error(invoke("sim-to-real", "--requests", "1"), "requests")
    assert_one_line_error(invoke("sim-to-real", "--profile", "no-such-profile"), "no-such-profile")


def test_sim_to_real_runs_on_tiny_inputs(tmp_path):
    from tidegate.training.sim_to_real import sim_to_real

    rows = sim_to_real(requests=6, load=1.0, length_scale=0.05, max_tokens=16, heuristics=("greedy",))
    assert [(r["engine"], r["controller"]) for r in rows] == [("sim", "learned+shield"), ("real", "learned+shield"),
                                                               ("sim", "greedy"), ("real", "greedy")]
    assert all(r["completed"] + r["rejected"] + r["expired"] == 6 for r in rows)
    # A busy machine may make the policy late on the real engine's wall clock (counted apart); it never fails.
    assert rows[1]["fallbacks"] == 0 and rows[1]["late"] >= 0 and rows[0]["lambda_max_rps"] > 0

    out = tmp_path / "twin.md"
    res = invoke("sim-to-real", "--requests", "4", "--load", "1.0", "--length-scale", "0.05", "--max-tokens", "8",
                 "--out", out)
    assert res.exit_code == 0, res.output
    assert "| real | learned+shield |" in res.stdout and out.read_text().startswith("lambda_max (tiny-cpu")


# --- a non-editable install --------------------------------------------------------------------


@pytest.mark.slow
def test_the_wheel_installs_one_package_that_finds_policy_and_config_from_any_directory(tmp_path):
    """The wheel, installed into a fresh venv, puts one top-level import name into site-packages,
    `tidegate`, and the installed copy finds its shipped policy and config from any directory."""
    # Build from a copy of the source tree: an in-tree build writes build/ and *.egg-info into the checkout.
    src, dist, venv = tmp_path / "src", tmp_path / "dist", tmp_path / "venv"
    shutil.copytree(REPO, src, symlinks=True,
                    ignore=shutil.ignore_patterns(".venv*", ".git", "runs", "build", "dist", "*.egg-info",
                                                  "__pycache__", ".*_cache", ".hypothesis", "bench-out"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "--wheel-dir", str(dist), str(src)], check=True, capture_output=True, timeout=240)
    wheel = next(dist.glob("tidegate-*.whl"))
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-deps",
                    "--no-index", str(wheel)], check=True, capture_output=True, timeout=240)
    tools = ("__pycache__", "_distutils_hack")  # what a venv's own setuptools may leave beside
    installed = sorted(p.name for p in site.iterdir()
                       if not p.name.endswith((".dist-info", ".pth")) and p.name not in tools)
    assert installed == ["tidegate"]
    target = site / "tidegate"
    assert not (target / "checkpoints" / "model.zip").exists()  # only the shipped files are package data
    # The dependencies come from this venv's site-packages, put on the path as a plain folder, so its
    # editable install of the source tree (a .pth hook) stays out: every tidegate module is the wheel's.
    deps = sysconfig.get_paths()["purelib"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": deps}
    snippet = (
        "import gymnasium, tidegate, tidegate.ctrl as ctrl, tidegate.ctrl.learned, tidegate.training.cli\n"
        "import tidegate.training.configs, tidegate.env\n"
        "from tidegate.engine.core.profile import load_profile\n"
        "c = ctrl.build_controller('learned', load_profile('tiny-cpu'))\n"
        "assert c.inner.policy is not None, c.inner.load_error\n"
        "gymnasium.make('tidegate/Serving-v0').close()\n"
        "print(tidegate.ctrl.learned.DEFAULT_POLICY)\n"
        "print(tidegate.training.configs.DEFAULT_CONFIG)\n"
        "print({p.name: p.default for p in tidegate.training.cli.train_command.params}['config_path'])\n"
        "print(ctrl.__file__)\n"
    )
    res = subprocess.run([python, "-c", snippet], cwd="/", env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    policy, config, cli_config, ctrl_file = (Path(line) for line in res.stdout.split())
    for path in (policy, config, cli_config, ctrl_file):
        assert path.is_relative_to(target), path
    assert policy.is_file() and config.is_file() and cli_config == config

    # The server itself, started from / by the installed command, serves the learned policy, not the fallback.
    serve = [venv / "bin" / "tidegate", "serve", "--port", "0", "--kv-capacity-tokens", "4096",
             "--controller", "learned"]
    proc = subprocess.Popen(serve, cwd="/", env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        for line in proc.stderr:
            lines.append(line)
            if "learned policy" in line or len(lines) > 200:
                break
    finally:
        proc.terminate()
        proc.wait(30)
    banner = next((line for line in lines if "learned policy" in line), "".join(lines))
    assert "loaded" in banner and "unavailable" not in banner, banner
    assert str(target / "checkpoints" / "policy.onnx") in banner


def test_export_records_a_residual_scale_that_the_controller_applies(trained, tmp_path):
    from tidegate.ctrl.learned import make_learned_controller
    from tidegate.ctrl.policy import OnnxPolicy
    from tidegate.engine.core.profile import load_profile

    _, model_path = trained
    res = invoke("export", model_path, tmp_path / "p.onnx", "--residual-scale", "0.25")
    assert res.exit_code == 0, res.output
    assert NumpyPolicy(tmp_path / "p.onnx").residual_scale == 0.25 == OnnxPolicy(tmp_path / "p.onnx").residual_scale
    c = make_learned_controller(tmp_path / "p.onnx", profile=load_profile("a100-llama2-7b"))
    assert c.inner.policy is not None and c.inner.residual_scale == 0.25
    assert_one_line_error(invoke("export", model_path, tmp_path / "q.onnx", "--residual-scale", "2"),
                          "residual_scale", "[0, 1]")
    assert not (tmp_path / "q.onnx").exists()


def test_the_shipped_residual_scale_never_loses_more_than_the_floor_on_validation():
    from tidegate.training.evaluate import choose_residual_scale

    losing = {0.25: {"min": 0.95, "mean": 1.04}, 0.5: {"min": 0.9, "mean": 1.08}, 1.0: {"min": 0.7, "mean": 1.1}}
    assert choose_residual_scale(losing, 0.98) == 0.0  # every scale loses somewhere: the prior ships
    assert choose_residual_scale(losing, 0.9) == 0.5
    safe = {0.25: {"min": 0.99, "mean": 1.02}, 0.5: {"min": 0.985, "mean": 1.05}, 1.0: {"min": 0.97, "mean": 1.2}}
    assert choose_residual_scale(safe, 0.98) == 0.5
    flat = {0.25: {"min": 1.0, "mean": 1.0}, 0.5: {"min": float("nan"), "mean": float("nan")}}
    assert choose_residual_scale(flat, 0.98) == 0.0  # no gain: the smaller scale; NaN never qualifies


def test_summary_reports_how_far_a_cell_moves_by_chance():
    from tidegate.training.evaluate import HEURISTICS, PRIOR, summarize, targets

    rows = [{"family": "f", "load": 1.2, "seed": s, "controller": c, "goodput_frac": g, "rejected": 0}
            for s, g in enumerate([0.8, 1.0, 0.9]) for c in (PRIOR, "learned", *HEURISTICS)]
    (row,) = summarize(rows, ["learned"])
    assert row["prior_rel_se"] == pytest.approx(0.1 / 3 ** 0.5 / 0.9)  # std 0.1 over 3 draws, mean 0.9
    assert targets([row])["prior_rel_se_max"] == row["prior_rel_se"]
