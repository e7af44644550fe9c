"""The fleet env (``tidegate/Fleet-v0``): the fleet twin stepped one control interval at a time, the gateway's
admission budget as the action, the features the HTTP gateway would compute, and PPO training on it."""

from __future__ import annotations

import math

import gymnasium
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env
from hypothesis import given, settings
from hypothesis import strategies as st

from tidegate.ctrl import build_controller
from tidegate.engine.core.profile import load_profile
from tidegate.engine.gateway.features import BUDGET_BASE, FLEET_FEATURES, FLEET_OBS_DIM, FleetFeatures, budget_scale
from tidegate.engine.gateway.gate import Gate
from tidegate.engine.gateway.replicas import ReplicaView
from tidegate.engine.gateway.twin import FleetSettings, FleetTwin, simulate_fleet
from tidegate.engine.workloads import Arrival
from tidegate.env import FLEET_ENV_ID
from tidegate.env.fleet_env import FleetEnv

SMALL = {"replicas": 2, "episode_steps": 16, "families": ["chat"], "episode_requests": 400}


def _episode(env: FleetEnv, action: float, seed: int, load: float) -> tuple[list, list, dict]:
    obs, info = env.reset(seed=seed, options={"load": load})
    observations, rewards = [obs], []
    while True:
        obs, reward, terminated, truncated, step_info = env.step(np.array([action], dtype=np.float32))
        observations.append(obs)
        rewards.append(reward)
        assert step_info["budget_scale"] == pytest.approx(BUDGET_BASE ** action)
        if terminated or truncated:
            return observations, rewards, {**info, **env.totals, "terminated": terminated}


def test_passes_gymnasiums_checker_and_is_registered():
    env = gymnasium.make(FLEET_ENV_ID, **SMALL).unwrapped
    assert isinstance(env, FleetEnv)
    check_env(env, skip_render_check=True)
    assert env.observation_space.shape == (FLEET_OBS_DIM,) == (len(FLEET_FEATURES),)
    assert env.action_space.shape == (1,)


def test_every_arrival_ends_once_and_an_episode_is_a_pure_function_of_its_seed():
    a, b = FleetEnv(**SMALL), FleetEnv(**SMALL)
    obs_a, rew_a, end_a = _episode(a, -0.5, seed=3, load=2.0)
    obs_b, rew_b, end_b = _episode(b, -0.5, seed=3, load=2.0)
    assert end_a["terminated"]  # the drain ends it
    # every arrival of the episode ended in exactly one of the three outcomes, the drain included
    assert end_a["good"] + end_a["missed"] + end_a["rejected"] == end_a["requests"] > 0
    assert all(np.array_equal(x, y) for x, y in zip(obs_a, obs_b)) and rew_a == rew_b
    assert end_a == end_b
    assert all(a.observation_space.contains(o) for o in obs_a)


def test_the_action_is_the_admission_budget_a_looser_one_lets_in_requests_that_miss():
    # long enough for the drain rate to be measured: before it, admission holds the queue to one per replica
    env = FleetEnv(**{**SMALL, "episode_steps": 96})
    _, _, tight = _episode(env, -1.0, seed=2, load=3.0)
    _, _, rule = _episode(env, 0.0, seed=2, load=3.0)
    _, _, loose = _episode(env, 1.0, seed=2, load=3.0)
    assert tight["requests"] == rule["requests"] == loose["requests"]
    # admitted past what the SLO leaves, requests wait past it: more of the served miss, and fewer are refused
    # (not in proportion: a fleet that serves late also serves less)
    assert tight["missed"] <= rule["missed"] < loose["missed"]
    assert loose["rejected"] < rule["rejected"]
    assert tight["good"] > loose["good"]
    assert budget_scale(-1.0) == 0.5 and budget_scale(0.0) == 1.0 and budget_scale(1.0) == 2.0
    assert budget_scale(5.0) == 2.0 and budget_scale(math.nan) == 1.0


def test_paid_against_the_gateways_own_rule_action_0_earns_nothing():
    env = FleetEnv(**SMALL, baseline="prior")
    _, rewards, _ = _episode(env, 0.0, seed=2, load=1.5)
    assert rewards and all(r == 0.0 for r in rewards)
    _, rewards, _ = _episode(env, -1.0, seed=2, load=3.0)
    assert any(r != 0.0 for r in rewards)


@pytest.mark.parametrize("kwargs, message", [
    ({"replicas": 0}, "replicas must be a whole number >= 1"),
    ({"router": "nope"}, "router must be one of"),
    ({"load_range": (2.0, 1.0)}, "load_range must be"),
    ({"interval_s": 0}, "interval_s must be a positive number"),
    ({"reward_weights": {"speed": 1}}, "unknown reward weights"),
    ({"baseline": "best"}, "baseline must be 'none' or 'prior'"),
    ({"settings": FleetSettings(admission=False)}, "settings.admission must be on"),
    ({"replica_controller": "bogus"}, "unknown controller 'bogus'"),
])
def test_bad_options_fail_in_one_sentence(kwargs, message):
    with pytest.raises(ValueError, match=message):
        FleetEnv(**{**SMALL, **kwargs})


def _arrivals(n: int, rate: float, seed: int) -> list[Arrival]:
    rng = np.random.default_rng(seed)
    times = np.cumsum(rng.exponential(1.0 / rate, n))
    return [Arrival(float(t), int(rng.integers(16, 1500)), int(o), 512)
            for t, o in zip(times, rng.integers(1, 400, n))]


@settings(max_examples=12, deadline=None)
@given(cuts=st.lists(st.floats(0.0, 60.0), max_size=6), seed=st.integers(0, 3))
def test_the_fleet_twin_advanced_in_pieces_is_the_fleet_twin_run_whole(cuts, seed):
    profile = load_profile("a100-llama2-7b")
    arrivals = _arrivals(600, 30.0, seed)
    whole = simulate_fleet(arrivals, profile, [build_controller("greedy", profile) for _ in range(3)])
    fleet = FleetTwin(arrivals, profile, [build_controller("greedy", profile) for _ in range(3)], FleetSettings(),
                      True, 0)
    fleet.start()
    for t in sorted(cuts):
        fleet.advance(t)
        assert fleet.now >= t
    assert not fleet.advance(math.inf)
    fleet.finish()
    pieces = fleet.summary()
    for summary in (whole, pieces):
        summary.pop("wall_time_s", None)
    assert pieces == whole


def test_the_features_count_an_interval_and_start_anew():
    gate = Gate([ReplicaView("a"), ReplicaView("b")], "round-robin", True, 2.0, 0.1)
    features = FleetFeatures(2.0)
    features.reset(0.0)
    for refused in (False, False, True, False):
        features.on_arrival(refused)
    features.on_end(True)
    features.on_end(False)
    x = dict(zip(FLEET_FEATURES, features.read(gate, 1.0, -0.25)))
    assert x["refused_share"] == 0.25 and x["good_share"] == 0.5 and x["last_action"] == -0.25
    assert x["room_share"] == 1.0 and x["drain_trusted"] == 0.0 and x["arrival_over_drain"] == 0.0
    y = dict(zip(FLEET_FEATURES, features.read(gate, 2.0, 0.0)))
    assert y["refused_share"] == 0.0 and y["good_share"] == 1.0  # nothing ended: no evidence of a miss


def test_ppo_trains_on_it_and_the_exported_policy_runs_against_fixed_budgets(tmp_path):
    from tidegate.env import FLEET_ENV_ID as env_id
    from tidegate.training.export import export
    from tidegate.training.fleet_eval import evaluate_fleet
    from tidegate.training.train import train

    model = train(None, env_id=env_id, n_timesteps=256, out_dir=tmp_path, n_envs=1, progress_bar=False,
                  tensorboard=False, env_kwargs={**SMALL, "episode_requests": 300},
                  overrides={"n_steps": 128, "batch_size": 64, "n_epochs": 2, "eval_freq": 128, "save_freq": 128,
                             "n_eval_episodes": 1})
    assert model.exists() and (tmp_path / "vecnormalize.pkl").exists()
    policy = export(model, tmp_path / "fleet.onnx")
    rows = evaluate_fleet(str(policy), ["chat"], [2.0], [0], fixed=(0.0,),
                          env_kwargs={"replicas": 2, "episode_steps": 16, "episode_requests": 300})
    assert {r["arm"] for r in rows} == {"fixed:0", "learned"}
    for r in rows:
        assert r["good"] + r["missed"] + r["rejected"] == r["requests"] > 0
        assert -1.0 <= r["mean_action"] <= 1.0
    assert len({r["requests"] for r in rows}) == 1  # both arms served the same arrivals
