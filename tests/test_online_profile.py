"""The step model refitted from a replica's own steps while it serves (engine.sim.online)."""

from __future__ import annotations

import dataclasses
import math
import pickle

import numpy as np
import pytest

from tidegate.ctrl import build_controller
from tidegate.ctrl.base import Observation
from tidegate.ctrl.theory import fluid_lambda_max
from tidegate.engine.core.profile import load_profile
from tidegate.engine.sim.fit import fit_core
from tidegate.engine.sim.online import OnlineProfile

#: the prior: the tiny model's CPU profile
PRIOR = load_profile("tiny-cpu")
#: the replica as it really is: 30 times slower a token, 4 times a step, a separate decode cost
TRUE = dataclasses.replace(PRIOR, base_s=4 * PRIOR.base_s, per_token_s=30 * PRIOR.per_token_s,
                           per_decode_token_s=40 * PRIOR.per_token_s, per_kv_token_s=3 * PRIOR.per_kv_token_s)


def served_steps(profile, n: int, seed: int = 0, noise: float = 0.05):
    """``n`` steps of a serving mix (decodes with now and then a prefill chunk), timed by ``profile``
    with log-normal noise: ``(tokens, KV read, seconds, decode tokens, prefill chunks)``."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        decodes = int(rng.integers(1, 64))
        prefill = int(rng.choice([0, 0, 0, rng.integers(16, 512)]))
        kv = decodes * int(rng.integers(100, 600)) + prefill
        decode_s = profile.per_decode_token_s or profile.per_token_s
        t = profile.base_s + profile.per_token_s * prefill + decode_s * decodes + profile.per_kv_token_s * kv
        rows.append((prefill + decodes, kv, t * float(np.exp(noise * rng.standard_normal())), decodes,
                     1 if prefill else 0))
    return rows


def test_the_core_fit_recovers_the_replicas_costs():
    fit = fit_core(served_steps(TRUE, 600))
    assert fit is not None and fit["points"] == 600 and fit["mape"] < 0.08
    for key in ("base_s", "per_token_s", "per_decode_token_s", "per_kv_token_s"):
        assert fit[key] == pytest.approx(getattr(TRUE, key), rel=0.15), key
    assert fit_core(served_steps(TRUE, 7)) is None  # too few steps to say anything


def test_it_reads_as_the_prior_until_enough_steps_then_as_the_replica():
    live = OnlineProfile(PRIOR, window_steps=512, refit_steps=64, min_steps=128, window_s=math.inf, refit_s=math.inf)
    rows = served_steps(TRUE, 400)
    changed = [live.step(*row) for row in rows[:127]]
    assert not any(changed) and live.fits == 0 and live.current is PRIOR
    assert live.per_token_s == PRIOR.per_token_s and live.kv_capacity_tokens == PRIOR.kv_capacity_tokens
    changed = [live.step(*row) for row in rows[127:]]
    assert sum(changed) == live.fits == 5  # at the 128th step, then every 64
    assert live.per_token_s == pytest.approx(TRUE.per_token_s, rel=0.15)
    assert live.per_decode_token_s == pytest.approx(TRUE.per_decode_token_s, rel=0.15)
    # the KV size, the batch limits and the SLOs stay the prior's; the fit brings no optional term or noise
    for key in ("kv_capacity_tokens", "block_size", "max_num_seqs", "max_num_batched_tokens", "ttft_slo_s",
                "tpot_slo_s"):
        assert getattr(live, key) == getattr(PRIOR, key), key
    assert live.extras is None and live.noise_sigma == 0.0 and "refitted" in live.source
    assert pickle.loads(pickle.dumps(live.current)) == live.current  # it travels to vLLM's API process


def test_the_first_fit_comes_once_there_are_enough_steps_then_one_every_refit_steps():
    live = OnlineProfile(PRIOR, refit_steps=256, min_steps=128, refit_s=math.inf)
    fitted_at = [i + 1 for i, row in enumerate(served_steps(TRUE, 700)) if live.step(*row)]
    assert fitted_at == [128, 384, 640]


def test_untimed_steps_are_not_counted_and_the_window_forgets_the_old_machine():
    live = OnlineProfile(PRIOR, window_steps=256, refit_steps=256, min_steps=256, window_s=math.inf,
                         refit_s=math.inf)
    assert not live.step(0, 0, 0.01, 0, 0) and not live.step(10, 100, 0.0, 10, 0)
    for row in served_steps(PRIOR, 256, seed=1):
        live.step(*row)
    assert live.fits == 1 and live.per_token_s == pytest.approx(PRIOR.per_token_s, rel=0.3)
    for row in served_steps(TRUE, 256, seed=2):  # the replica slowed down: the window holds only the new steps
        live.step(*row)
    assert live.fits == 2 and live.per_token_s == pytest.approx(TRUE.per_token_s, rel=0.15)


def test_a_fit_reads_the_last_minute_of_serving_however_many_steps_came_before():
    # a CPU replica's light load is thousands of short steps, its full batches a few hundred long ones: the
    # window is serving time, so a minute of the slow regime is fitted on its own steps
    live = OnlineProfile(PRIOR, window_steps=4096, refit_steps=256, min_steps=128, window_s=60.0, refit_s=5.0)
    for row in served_steps(PRIOR, 3800, seed=3):
        live.step(*row)
    slow = served_steps(TRUE, 2000, seed=4)
    served, taken = 0.0, 0
    for row in slow:
        live.step(*row)
        served, taken = served + row[2], taken + 1
        if served > 70.0:  # a fit after the last fast step left the window
            break
    assert taken < 1500  # far fewer steps than the fast regime left in a window of steps
    assert live.per_token_s == pytest.approx(TRUE.per_token_s, rel=0.15)
    assert live.per_decode_token_s == pytest.approx(TRUE.per_decode_token_s, rel=0.15)
    assert len(live.window()) <= taken
    # a regime of long steps refits every few seconds of serving, not every refit_steps steps
    fits = live.fits
    served = 0.0
    for row in slow[taken:]:
        live.step(*row)
        served += row[2]
        if served > 5.0 * 4 + 1.0:
            break
    assert live.fits - fits >= 4
    # and the fewest a fit reads is min_steps, however long they took
    assert len(OnlineProfile(PRIOR, min_steps=128, window_s=1e-3).window()) == 0
    tiny = OnlineProfile(PRIOR, min_steps=128, window_s=1e-3)
    for row in slow[:300]:
        tiny.step(*row)
    assert len(tiny.window()) == 128 and tiny.fits >= 1


def test_a_controller_built_on_it_sees_each_refit():
    live = OnlineProfile(PRIOR, refit_steps=128, min_steps=128)
    controller = build_controller("slo-flow", live)
    s, w, d = 384.0, 256 * 128 + 128 * 129 / 2, 128.0
    before = fluid_lambda_max(s, w, controller.profile, None, d)
    for row in served_steps(TRUE, 128):
        live.step(*row)
    after = fluid_lambda_max(s, w, controller.profile, None, d)
    assert after == pytest.approx(fluid_lambda_max(s, w, TRUE, None, d), rel=0.15)
    assert after < before / 10  # the prior's bound was more than ten times the replica's

    # the capacity witness: the replica's own bound says this rate is overload where the prior's did not
    rate = 0.5 * (fluid_lambda_max(s, w, TRUE, None, d) + fluid_lambda_max(s, w, PRIOR, None, d) / 2)
    obs = Observation()
    for key, value in (("completed_total", 200), ("offered_prompt_tokens", 256.0), ("offered_output_tokens", 128.0),
                       ("offered_kv_workload", w), ("offered_rate_rps", rate), ("served_rate_rps", rate),
                       ("kv_capacity_tokens", PRIOR.kv_capacity_tokens), ("num_running", 8)):
        setattr(obs, key, value)
    assert fluid_lambda_max(s, w, TRUE, None, d) < rate < 0.5 * fluid_lambda_max(s, w, PRIOR, None, d)
    assert not controller.under_capacity(obs)
    assert build_controller("slo-flow", PRIOR).under_capacity(obs)


def test_its_settings_are_checked():
    with pytest.raises(ValueError, match="min_steps"):
        OnlineProfile(PRIOR, window_steps=64, min_steps=128)
    with pytest.raises(ValueError, match="window_s"):
        OnlineProfile(PRIOR, window_s=0.0)
    with pytest.raises(AttributeError):
        _ = OnlineProfile(PRIOR).no_such_field
