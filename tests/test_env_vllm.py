"""The Gymnasium env over vLLM (``ServingEnv(backend="vllm")``): the action channel between the env
and the learned controller inside vLLM's scheduler on its own, and the env's refusals. Episodes on a
real vLLM server are in tests/test_vllm.py (``TestEnv``), whose servers start side by side."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest

from tidegate.engine.vllm.actions import ActionWriter, ChannelPolicy
from tidegate.engine.vllm.config import (
    PluginConfig, PluginConfigError, ReplicaLimits, build_plugin_controller, read_plugin_config, replica_profile,
)
from tidegate.env.serving_env import ServingEnv, record_outcome

ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
needs_vllm = pytest.mark.skipif(not VLLM_PYTHON.exists(),
                                reason=".venv-vllm is missing: `make vllm-setup` makes it (`make test` does)")
LIMITS = ReplicaLimits(kv_capacity_tokens=8064, block_size=128, max_num_seqs=128, max_num_batched_tokens=2048)


def test_a_policy_call_waits_for_the_answer_to_it_and_only_to_it(tmp_path):
    channel = str(tmp_path / "ch")
    with pytest.raises(FileNotFoundError, match="no action channel"):
        ChannelPolicy(channel, 0.01)(np.zeros(18))
    env = ActionWriter(channel)
    assert env.latest_call() == (0, 0.0, None)
    policy = ChannelPolicy(channel, 2.0)
    env.answer(1, (0.1, 0.2, 0.3))  # answered before the call is made: taken at once
    assert policy(np.arange(18.0)) == pytest.approx((0.1, 0.2, 0.3))
    call, _, x = env.latest_call()
    assert call == 1 and x is not None and x.tolist() == list(range(18))

    answers: list = []

    def agent() -> None:  # waits for call 2's features, answers it; an answer to call 1 is ignored
        while env.latest_call()[0] < 2:
            time.sleep(0.001)
        env.answer(1, (0.9, 0.9, 0.9))
        time.sleep(0.05)
        env.answer(2, (-0.5, 0.0, 0.5))

    thread = threading.Thread(target=agent)
    thread.start()
    answers.append(policy(np.ones(18)))
    thread.join()
    assert answers == [pytest.approx((-0.5, 0.0, 0.5))]
    policy.wait_s = 0.02
    with pytest.raises(TimeoutError, match="no action for policy call 3 within 0.02 s"):
        policy(np.zeros(18))
    env.close()
    assert not Path(env.path).exists()


def test_the_plugin_lets_an_env_answer_only_the_learned_controller(tmp_path):
    channel = str(tmp_path / "ch")
    config = read_plugin_config({"tidegate": {"controller": "learned:control_interval=5,time_budget_s=0.04",
                                              "action_channel": channel}})
    assert config.action_channel == channel
    controller = build_plugin_controller(config, replica_profile(config, LIMITS))
    learned = controller.inner  # type: ignore[attr-defined]
    assert isinstance(learned.policy, ChannelPolicy)
    assert learned.residual_scale == 1.0 and learned.control_interval == 5
    assert learned.policy.wait_s == pytest.approx(0.06)  # past the budget only to free the policy's thread
    assert "the env's answers" in learned.policy_status
    bad = PluginConfig(controller="slo-flow", action_channel=channel)
    with pytest.raises(PluginConfigError, match="action_channel answers the learned controller's policy calls; it "
                                                "needs controller 'learned', got 'slo-flow'"):
        build_plugin_controller(bad, replica_profile(bad, LIMITS))


def test_a_streamed_request_counts_as_good_late_rejected_or_failed():
    done = {"status": 200, "outcome": "completed", "start_s": 10.0, "first_token_s": 10.5, "last_token_s": 11.3,
            "tokens": 10}
    assert record_outcome(done, 1.0, 0.1) == "good"
    assert record_outcome(done, 0.4, 0.1) == "late"  # TTFT 0.5 s
    assert record_outcome(done, 1.0, 0.08) == "late"  # TPOT 0.089 s
    assert record_outcome({**done, "tokens": 1, "last_token_s": 10.5}, 1.0, 0.01) == "good"  # one token: no TPOT
    assert record_outcome({"status": 429, "outcome": "http"}, 1.0, 0.1) == "rejected"
    assert record_outcome({**done, "outcome": "closed"}, 1.0, 0.1) == "failed"
    assert record_outcome({"status": 503, "outcome": "http", "first_token_s": None}, 1.0, 0.1) == "failed"


@pytest.mark.parametrize("kwargs, message", [
    ({"max_waiting": 100}, "runs the learned controller's own overload policy"),
    ({"profile_spread": 0.2}, "profile_spread needs the sim backend"),
    ({"ttft_slo_s": 2.0}, "set them in the profile"),
    ({"vllm_options": {"port": 1}}, "vllm_options has no 'port'"),
    ({"vllm_options": {"time_budget_s": 0}}, r"time_budget_s must be in \(0, 10\) seconds"),
    ({"vllm_options": {"vllm_python": "/nowhere/python"}}, "no vLLM python at /nowhere/python"),
    ({"baseline": "prior"}, "needs the sim backend"),
])
def test_the_vllm_backend_refuses_what_it_cannot_honour_before_starting_anything(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ServingEnv(backend="vllm", **kwargs)
