"""Training smoke test and the ONNX export's parity with SB3's deterministic predict."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from ctrl.learned import OBS_DIM, NumpyPolicy, OnnxPolicy, make_learned_controller
from ctrl.shield import ShieldedController
from engine.core.profile import load_profile


SMALL_RUN = {"n_steps": 512, "batch_size": 128, "n_epochs": 4, "eval_freq": 1024, "save_freq": 1024,
             "n_eval_episodes": 1}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from training.train import train

    out = tmp_path_factory.mktemp("ppo")
    model = train("training/configs/ppo.yaml", n_timesteps=3072, out_dir=out, n_envs=1, progress_bar=False,
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


def test_resume_from_checkpoint(trained, tmp_path):
    from training.train import train

    out, _ = trained
    ckpts = sorted(out.glob("ppo_serving_*_steps.zip"))
    assert ckpts, "CheckpointCallback wrote nothing"
    model = train("training/configs/ppo.yaml", n_timesteps=512, out_dir=tmp_path, n_envs=1, progress_bar=False,
                  tensorboard=False, resume=ckpts[0], env_kwargs={"episode_steps": 64, "control_interval": 5},
                  overrides=SMALL_RUN)
    assert model.exists()


def test_export_matches_predict(trained, tmp_path):
    from stable_baselines3 import PPO

    from training.export import export

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
    from engine.core.profile import load_profile
    from engine.sim.simulate import simulate
    from engine.workloads.workload import read_trace, resolve_trace

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


def test_admission_knob_rejects_on_predicted_delay_and_shield_still_rejects():
    from ctrl.base import Observation
    from ctrl.learned import ACTION_DIM, LearnedController, action_to_knobs, predicted_delay_s

    obs = Observation(kv_capacity_tokens=100_000)
    obs.num_waiting, obs.num_running, obs.completion_rate_rps = 40, 10, 4.0  # 10 s of queue
    obs.mean_step_time_s, obs.waiting_prompt_tokens = 0.05, 40_000
    assert predicted_delay_s(obs, 1000, 1000) >= 10.0
    _, _, d_low = action_to_knobs(0, 0, 1.0, -1.0, ttft_slo_s=2.0)
    _, _, d_high = action_to_knobs(0, 0, 1.0, 1.0, ttft_slo_s=2.0)
    assert d_low < 2.0 < d_high

    class Const:
        def __init__(self, a):
            self.a = np.array(a, dtype=np.float32)

        def __call__(self, x):
            return self.a

    ctrl = make_learned_controller("/nonexistent/policy.onnx", profile=load_profile("a100-llama2-7b"), lambda_max_rps=4.0,
                                   max_waiting=50)
    ctrl.inner.policy = Const([0.0, 0.0, -1.0])
    ctrl.reset()
    ctrl.decide(obs)  # the policy sets the knobs
    assert ctrl.inner.knobs.reject_delay_s < 10.0
    assert ctrl.admit(obs, 1000, 100) is not None  # refused by the learned threshold
    obs.num_waiting = 0
    assert ctrl.admit(obs, 1000, 100) is None  # empty queue: always admitted
    obs.num_waiting, obs.completion_rate_rps = 60, 1e9
    ctrl.inner.policy = Const([0.0, 0.0, 1.0])
    ctrl.inner._steps = 0
    ctrl.decide(obs)
    assert "queue is full" in ctrl.admit(obs, 1, 1).reason  # the shield's max_waiting is always on
    assert ACTION_DIM == 3


def test_learned_controller_needs_a_profile_and_ctrl_never_loads_one():
    from ctrl import ControllerSpecError, build_controller

    with pytest.raises(ControllerSpecError, match="needs the replica's profile"):
        build_controller("learned")
    shielded = build_controller("learned", load_profile("tiny-cpu"))
    assert isinstance(shielded, ShieldedController) and shielded.inner.features.ttft_slo_s == 1.0
    assert shielded.inner.policy is not None  # the shipped policy, found as package data


def test_prior_workload_is_the_training_trace():
    from ctrl.learned import PRIOR_LIFETIME_KV_WORKLOAD, PRIOR_MEAN_TOKENS_PER_REQUEST, prior_lambda_max
    from ctrl.theory import capacity
    from engine.workloads.workload import read_trace, resolve_trace

    arrivals = read_trace(resolve_trace("splitwise_conv"))
    profile = load_profile("tiny-cpu")
    cap = capacity([a.prompt_tokens for a in arrivals], [a.output_tokens for a in arrivals], profile)
    assert PRIOR_MEAN_TOKENS_PER_REQUEST == pytest.approx(cap.mean_tokens_per_request, rel=1e-12)
    assert PRIOR_LIFETIME_KV_WORKLOAD == pytest.approx(cap.lifetime_kv_workload, rel=1e-12)
    assert prior_lambda_max(profile) == pytest.approx(cap.lambda_max_rps, rel=1e-12)
