"""The Gymnasium environment: both env checkers, determinism, splits and the shield's report."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest

import tidegate.env  # noqa: F401  (registers tidegate/Serving-v0)
from tidegate.engine.workloads import split_segments
from tidegate.env.serving_env import ServingEnv
from tidegate.engine.core.profile import load_profile

SMALL = dict(episode_steps=16, control_interval=5)


def test_sb3_check_env():
    from stable_baselines3.common.env_checker import check_env

    check_env(ServingEnv(**SMALL), warn=True)


def test_gymnasium_check_env():
    from gymnasium.utils.env_checker import check_env

    check_env(gym.make("tidegate/Serving-v0", **SMALL).unwrapped)


@pytest.mark.parametrize("drain", [True, False])
def test_registered_and_episode_ends_drained_or_truncated(drain):
    e = gym.make("tidegate/Serving-v0", **SMALL, drain=drain)
    obs, info = e.reset(seed=3)
    assert e.observation_space.contains(obs) and 0.5 <= info["load"] <= 2.0
    for i in range(SMALL["episode_steps"]):
        obs, reward, terminated, truncated, info = e.step(e.action_space.sample())
        assert e.observation_space.contains(obs) and np.isfinite(reward)
        assert 0.0 <= info["shield_intervention_rate"] <= 1.0
        assert 0.0 <= info["kv_usage"] <= 1.0
        last = i == SMALL["episode_steps"] - 1
        assert (terminated, truncated) == ((last, False) if drain else (False, last))
    core = e.unwrapped.core
    assert ("drain_reward" in info) == drain
    assert not (core.waiting or core.running) if drain else True  # drained: every request ended


def test_the_drain_charges_a_backlog_the_policy_leaves_behind():
    """The prior against itself earns nothing, drain included; a policy that halves the activations, the batch
    and the admission threshold leaves a backlog whose drain differs from the prior's on some of six draws (on
    a given draw the two backlogs can drain alike, so no single seed is asked for)."""
    drains = []
    for seed in range(6):
        e = ServingEnv(families=["chat"], load_range=(2.5, 2.5), episode_steps=30, baseline="prior", seed=seed)
        if seed < 2:
            e.reset(seed=seed)
            rewards = [e.step(np.zeros(3))[1] for _ in range(30)]
            assert rewards == [0.0] * 30  # the prior against itself, drain included
        e.reset(seed=seed)
        info = {}
        for _ in range(30):
            *_, info = e.step(np.array([-1.0, -1.0, -1.0]))
        drains.append(info["drain_reward"])
        arrived = e.totals["good"] + e.totals["missed"] + e.totals["rejected"]
        assert arrived == e.core.metrics.arrived  # every request that came is counted once, the drain's too
    assert sum(d != 0.0 for d in drains) >= 2, drains


def test_same_seed_same_episode():
    def run(seed):
        e = ServingEnv(**SMALL)
        e.action_space.seed(seed)
        out = [e.reset(seed=seed)[0]]
        for _ in range(10):
            out.append(e.step(e.action_space.sample())[0])
        return np.array(out)

    assert np.array_equal(run(7), run(7))


def test_strict_shield_never_evicts_at_overload():
    e = ServingEnv(shield_mode="strict", load_range=(3.0, 3.0), episode_steps=60, control_interval=10)
    e.reset(seed=0)
    for _ in range(60):
        _, _, _, _, info = e.step(np.array([1.0, 1.0, 1.0], dtype=np.float32))
        assert info["evictions"] == 0


def test_adversarial_actions_are_safe():
    e = ServingEnv(**SMALL)
    e.reset(seed=1)
    for a in ([np.nan, np.inf, 0.0], [-np.inf, 5.0, np.nan], [1e9, -1e9, 1e9], [0.0, 0.0]):
        obs, reward, *_ = e.step(np.array(a, dtype=np.float32))
        assert np.all(np.isfinite(obs)) and np.isfinite(reward)


def test_splits_do_not_overlap():
    p = load_profile("a100-llama2-7b")
    train = split_segments(None, "train", p)
    evals = split_segments(None, "eval", p)
    assert [s.name for s in train] == ["splitwise_conv[train]"]
    assert [s.name for s in evals] == ["splitwise_conv[eval]", "splitwise_code[eval]"]
    assert len(train[0].times_s) + len(evals[0].times_s) == 19366


def test_action_has_an_admission_knob_and_augment_adds_segments():
    e = ServingEnv(augment=[(1.0, 1.0), (2.0, 0.15)], **SMALL)
    assert e.action_space.shape == (3,)
    assert [s.name for s in e.segments] == ["splitwise_conv[train]", "splitwise_conv[train]x2/0.15"]
    # a tight threshold (action[2] = -1) refuses sooner than a loose one: up to the first step at which it refuses,
    # the loose one refuses fewer (the two episodes are the same until a decision differs; after that, the tight
    # one holds the shorter queue and may refuse less)
    refused = {}
    for threshold in (-1.0, 1.0):
        e.reset(seed=0, options={"load": 2.5, "segment": 0})
        action = np.array([0.0, 0.0, threshold], dtype=np.float32)
        refused[threshold] = np.cumsum([e.step(action)[4]["rejections"] for _ in range(16)])
    first = int(np.argmax(refused[-1.0] > 0))
    assert refused[-1.0][first] > 0 and refused[-1.0][first] > refused[1.0][first], refused


@pytest.mark.timeout(120)
def test_engine_backend_runs_a_few_steps():
    """The real engine (tiny model, CPU, wall clock): a handful of env steps on a short workload."""
    from tidegate.engine.workloads import Arrival

    workload = [Arrival(0.02 * i, 16 + (7 * i) % 32, 2 + i % 6, 8) for i in range(40)]
    e = ServingEnv(backend="engine", workload=workload, episode_steps=4, control_interval=4, load_range=(0.05, 0.05))
    assert e.profile.name == "tiny-cpu"
    obs, _ = e.reset(seed=0)
    finished = 0
    for _ in range(4):
        obs, reward, terminated, truncated, info = e.step(np.zeros(3, dtype=np.float32))
        assert e.observation_space.contains(obs) and np.isfinite(reward)
        finished += info["finished"]
    assert truncated and finished > 0


def test_bad_kwargs_give_one_sentence():
    with pytest.raises(ValueError, match="backend"):
        ServingEnv(backend="gpu-cluster")
    with pytest.raises(ValueError, match="load_range"):
        ServingEnv(load_range=(2.0, 1.0))
    with pytest.raises(ValueError, match="split"):
        ServingEnv(split="test")
    for bad in (0, 2.5, float("inf"), "100", True):
        with pytest.raises(ValueError, match="max_waiting must be a whole number"):
            ServingEnv(max_waiting=bad)
    assert ServingEnv(max_waiting=100.0).max_waiting == 100  # a YAML 100.0 is the count 100


def test_baseline_prior_pays_only_for_what_the_policy_adds():
    e = ServingEnv(families=["chat", "multi-class"], profile_spread=0.3, load_range=(0.8, 2.5), episode_steps=40,
                   baseline="prior", seed=3)
    e.reset(seed=3)
    assert all(e.step(np.zeros(3))[1] == 0.0 for _ in range(40))  # action 0 is the prior: nothing gained or lost
    e.reset(seed=3)
    throttled = sum(e.step(-np.ones(3))[1] for _ in range(40))  # a quarter of everything: loses to the prior
    assert throttled < 0
    with pytest.raises(ValueError, match="sim backend"):
        ServingEnv(backend="engine", baseline="prior")


def test_the_drain_pays_what_the_engine_settles_in_the_intervals_units():
    e = ServingEnv(families=["chat"], load_range=(2.5, 2.5), episode_steps=20, seed=1,
                   reward_weights={"goodput": 1.0, "slo_miss": 0.0, "rejection": 0.0, "eviction": 0.0})
    e.reset(seed=1)
    for _ in range(19):
        e.step(np.zeros(3))
    before = e.totals["good"]
    *_, info = e.step(np.zeros(3))
    settled = e.totals["good"] - before - round(info["goodput_rps"] * info["interval_s"])
    assert settled > 0  # at 2.5 x lambda_max requests are left to finish
    assert info["drain_reward"] == pytest.approx(settled / (e.lambda_max_rps * e._elapsed_s / 20))
