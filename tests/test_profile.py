"""Profiles: loading, the step-time model, the roofline presets and bad input."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from tidegate.engine.sim import roofline
from tidegate.engine.core.profile import PROFILES_DIR, Profile, ProfileError, load_profile, shipped_profiles

SHIPPED = ["a100-llama2-7b", "h200-llama3-8b", "slot", "tiny-vllm-cpu"]


def minimal_profile_dict(**overrides) -> dict:
    data = {
        "name": "toy",
        "step_time": {"base_s": 0.01, "per_token_s": 1e-4, "per_kv_token_s": 1e-6},
        "kv_capacity_tokens": 4096,
    }
    data.update(overrides)
    return data


def write_json(tmp_path: Path, data, name: str = "prof.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


# --- shipped profiles -------------------------------------------------------------------------

def test_shipped_profile_names():
    assert set(SHIPPED) <= set(shipped_profiles())
    assert shipped_profiles() == sorted(shipped_profiles())


@pytest.mark.parametrize("name", SHIPPED)
def test_load_shipped_profile_by_name_and_path(name):
    profile = load_profile(name)
    assert isinstance(profile, Profile)
    assert profile.name == name
    assert profile.description and profile.source
    assert load_profile(PROFILES_DIR / f"{name}.json") == profile
    assert load_profile(str(PROFILES_DIR / f"{name}.json")) == profile


def test_slot_profile_is_the_papers_discrete_model():
    slot = load_profile("slot")
    assert slot.block_size == 1
    assert slot.kv_capacity_tokens == 2000
    # Every step is one slot whatever it does; an idle tick is one slot too.
    assert slot.step_time_s(1, 1) == 1.0
    assert slot.step_time_s(50_000, 10_000) == 1.0
    assert slot.step_time_s(0, 0) == 1.0
    # A whole prompt is prefilled in one step.
    assert slot.max_num_batched_tokens >= 100_000
    assert slot.ttft_slo_s == 50.0 and slot.tpot_slo_s == 1.5


def test_presets_are_plausible_for_their_hardware():
    a100, h200 = load_profile("a100-llama2-7b"), load_profile("h200-llama3-8b")
    # One decode token for one short request: about weights / bandwidth plus overhead.
    assert 0.008 < a100.step_time_s(1, 100) < 0.015
    assert 0.004 < h200.step_time_s(1, 100) < 0.010
    # GQA (8 KV heads instead of 32) and more memory: far more KV tokens on H200.
    assert h200.kv_capacity_tokens > 5 * a100.kv_capacity_tokens
    assert a100.kv_capacity_tokens % a100.block_size == 0
    assert h200.kv_capacity_tokens % h200.block_size == 0


# --- the step-time model ----------------------------------------------------------------------

def test_step_time_is_linear_in_tokens_and_kv_reads():
    p = Profile(name="toy", description="", base_s=0.01, per_token_s=1e-4, per_kv_token_s=1e-6,
                kv_capacity_tokens=4096)
    assert p.step_time_s(1, 0) == pytest.approx(0.0101)
    assert p.step_time_s(100, 10_000) == pytest.approx(0.01 + 0.01 + 0.01)
    assert p.step_time_s(2048, 0) == pytest.approx(0.01 + 0.2048)
    # An empty step is the idle tick, base_s unless given.
    assert p.step_time_s(0, 0) == 0.01
    assert replace(p, idle_s=0.005).step_time_s(0, 0) == 0.005


def test_step_time_rejects_negative_counts():
    p = load_profile("a100-llama2-7b")
    with pytest.raises(ValueError):
        p.step_time_s(-1, 0)


def test_preset_step_times_for_known_inputs():
    a100 = load_profile("a100-llama2-7b")
    base, per_tok, per_kv = a100.base_s, a100.per_token_s, a100.per_kv_token_s
    assert a100.step_time_s(256, 100_000) == pytest.approx(base + 256 * per_tok + 100_000 * per_kv)
    assert a100.step_time_s(256, 100_000) == pytest.approx(0.06083, rel=1e-3)
    h200 = load_profile("h200-llama3-8b")
    assert h200.step_time_s(256, 100_000) == pytest.approx(0.01652, rel=1e-3)


# --- the roofline -----------------------------------------------------------------------------

def test_parameter_counts_match_the_published_checkpoints():
    assert roofline.LLAMA2_7B.num_params == 6_738_415_616
    assert roofline.LLAMA3_8B.num_params == 8_030_261_248


def test_kv_bytes_per_token():
    assert roofline.LLAMA2_7B.kv_bytes_per_token == 2 * 32 * 32 * 128 * 2  # 512 KiB, MHA
    assert roofline.LLAMA3_8B.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2  # 128 KiB, GQA


def test_step_time_coefficients_follow_the_formulas():
    model, gpu, assume = roofline.LLAMA2_7B, roofline.A100_SXM_80GB, roofline.ServingAssumptions()
    base_s, per_token_s, per_kv_token_s = roofline.step_time_coefficients(model, gpu, assume)
    bandwidth = 2.039e12 * assume.bandwidth_efficiency
    assert base_s == pytest.approx(assume.step_overhead_s + 6_738_415_616 * 2 / bandwidth)
    assert per_token_s == pytest.approx(2 * 6_738_415_616 / (312e12 * assume.mfu))
    assert per_kv_token_s == pytest.approx(524_288 / bandwidth)


def test_kv_capacity_follows_the_formula():
    model, gpu, assume = roofline.LLAMA3_8B, roofline.H200_SXM, roofline.ServingAssumptions()
    free = 141e9 * 0.9 - 8_030_261_248 * 2 - 2 * 2**30
    expected = int(free // 131_072) // 16 * 16
    assert roofline.kv_capacity_tokens(model, gpu, assume, block_size=16) == expected


def test_kv_capacity_rejects_a_model_that_does_not_fit():
    tiny_gpu = replace(roofline.A100_SXM_80GB, memory_bytes=16e9)
    with pytest.raises(ValueError):
        roofline.kv_capacity_tokens(roofline.LLAMA2_7B, tiny_gpu, roofline.ServingAssumptions())


def test_roofline_reproduces_the_shipped_preset_files():
    presets = roofline.preset_profiles()
    assert [p.name for p in presets] == ["a100-llama2-7b", "h200-llama3-8b"]
    for profile in presets:
        shipped = json.loads((PROFILES_DIR / f"{profile.name}.json").read_text())
        assert profile.to_dict() == shipped, "regenerate with: tidegate roofline --write"
        assert load_profile(profile.name) == profile


def test_roofline_write_regenerates_identical_files(tmp_path):
    from click.testing import CliRunner

    from tidegate.engine.cli import main

    result = CliRunner().invoke(main, ["roofline", "--write", "--out-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    for name in ("a100-llama2-7b", "h200-llama3-8b"):
        assert (tmp_path / f"{name}.json").read_text() == (PROFILES_DIR / f"{name}.json").read_text()
    assert "| a100-llama2-7b |" in result.output


# --- files: formats, round trip ---------------------------------------------------------------

def test_yaml_and_json_load_the_same_profile(tmp_path):
    data = minimal_profile_dict(description="a toy", slo={"ttft_s": 1.0, "tpot_s": 0.05},
                                extra={"fit": {"r2": 0.99}})
    json_path = write_json(tmp_path, data)
    yaml_path = tmp_path / "prof.yaml"
    yaml_path.write_text(yaml.safe_dump(data))
    yml_path = tmp_path / "prof.yml"
    yml_path.write_text(yaml.safe_dump(data))
    from_json = load_profile(json_path)
    assert load_profile(yaml_path) == from_json
    assert load_profile(yml_path) == from_json
    assert from_json.ttft_slo_s == 1.0 and from_json.tpot_slo_s == 0.05
    assert from_json.extra == {"fit": {"r2": 0.99}}


def test_optional_keys_take_the_dataclass_defaults(tmp_path):
    profile = load_profile(write_json(tmp_path, minimal_profile_dict()))
    assert profile.block_size == 16
    assert profile.idle_s is None
    assert profile.max_num_batched_tokens == 8192 and profile.max_num_seqs == 256
    assert profile.description == "" and profile.source == "" and profile.extra == {}


@pytest.mark.parametrize("idle_s", [None, 0.25])
def test_save_load_round_trip(tmp_path, idle_s):
    original = Profile(
        name="fitted-toy", description="fitted on a toy run", base_s=0.012, per_token_s=3e-5,
        per_kv_token_s=2e-7, kv_capacity_tokens=50_000, block_size=32, ttft_slo_s=1.5,
        tpot_slo_s=0.08, idle_s=idle_s, max_num_batched_tokens=4096, max_num_seqs=128,
        source="fitted", extra={"fit": {"r2": 0.97, "residuals_s": [0.001, -0.002]}})
    path = tmp_path / "fitted.json"
    original.save(path)
    assert json.loads(path.read_text())["name"] == "fitted-toy"
    assert load_profile(path) == original


def test_integral_numbers_are_normalised(tmp_path):
    data = minimal_profile_dict(kv_capacity_tokens=4096.0)
    data["step_time"]["base_s"] = 1
    profile = load_profile(write_json(tmp_path, data))
    assert profile.kv_capacity_tokens == 4096 and isinstance(profile.kv_capacity_tokens, int)
    assert isinstance(profile.base_s, float)


# --- bad input --------------------------------------------------------------------------------

def drop_step_time_key(data):
    del data["step_time"]["per_token_s"]


def negative_coefficient(data):
    data["step_time"]["per_kv_token_s"] = -1e-7


def unknown_top_level_key(data):
    data["kv_capacity_token"] = data.pop("kv_capacity_tokens")


def unknown_step_time_key(data):
    data["step_time"]["per_tokens_s"] = 1e-4


def not_a_number(data):
    data["step_time"]["base_s"] = "fast"


def boolean_is_not_a_number(data):
    data["block_size"] = True


def capacity_below_one_block(data):
    data["kv_capacity_tokens"] = 8


def fractional_capacity(data):
    data["kv_capacity_tokens"] = 100.5


def zero_slo(data):
    data["slo"] = {"ttft_s": 0}


def step_takes_no_time(data):
    data["step_time"] = {"base_s": 0, "per_token_s": 0, "per_kv_token_s": 0, "idle_s": 1.0}


def idle_tick_takes_no_time(data):
    data["step_time"] = {"base_s": 0, "per_token_s": 1e-4, "per_kv_token_s": 0}


def missing_name(data):
    del data["name"]


def section_not_a_mapping(data):
    data["step_time"] = [0.01, 1e-4, 1e-6]


@pytest.mark.parametrize("spoil, expected", [
    (drop_step_time_key, "step_time.per_token_s"),
    (negative_coefficient, "step_time.per_kv_token_s"),
    (unknown_top_level_key, "kv_capacity_token'"),
    (unknown_step_time_key, "step_time.per_tokens_s"),
    (not_a_number, "step_time.base_s"),
    (boolean_is_not_a_number, "block_size"),
    (capacity_below_one_block, "kv_capacity_tokens"),
    (fractional_capacity, "kv_capacity_tokens"),
    (zero_slo, "slo.ttft_s"),
    (step_takes_no_time, "step_time.per_token_s"),
    (idle_tick_takes_no_time, "step_time.idle_s"),
    (missing_name, "'name'"),
    (section_not_a_mapping, "'step_time'"),
])
def test_bad_profile_file_gives_one_sentence_naming_file_and_key(tmp_path, spoil, expected):
    data = minimal_profile_dict()
    spoil(data)
    path = write_json(tmp_path, data, name="bad-profile.json")
    with pytest.raises(ProfileError) as info:
        load_profile(path)
    message = str(info.value)
    assert "bad-profile.json" in message
    assert expected in message
    assert "\n" not in message and message.endswith(".")


def test_unknown_name_lists_the_shipped_profiles():
    with pytest.raises(ProfileError) as info:
        load_profile("a100-llama-7b")
    message = str(info.value)
    assert "'a100-llama-7b'" in message
    for name in SHIPPED:
        assert name in message


@pytest.mark.parametrize("file_name, text, expected", [
    ("broken.json", '{"name": "toy", "step_time": {', "not valid JSON"),
    ("broken.yaml", "name: toy\nstep_time: {base_s: 0.01\n", "not valid YAML"),
    ("broken.yml", "name: [toy\n", "not valid YAML"),
    ("list.yaml", "- 1\n- 2\n", "mapping"),
    ("empty.yaml", "", "mapping"),
    ("nan.json", '{"name": "toy", "step_time": {"base_s": NaN, "per_token_s": 0, '
                 '"per_kv_token_s": 0}, "kv_capacity_tokens": 100}', "step_time.base_s"),
])
def test_unparseable_file_gives_profile_error_with_file_name(tmp_path, file_name, text, expected):
    path = tmp_path / file_name
    path.write_text(text)
    with pytest.raises(ProfileError) as info:
        load_profile(path)
    assert file_name in str(info.value)
    assert expected in str(info.value)
    assert "\n" not in str(info.value)


def test_missing_file_and_wrong_suffix(tmp_path):
    with pytest.raises(ProfileError, match="does not exist"):
        load_profile(tmp_path / "nowhere.json")
    toml = tmp_path / "prof.toml"
    toml.write_text("name = 'toy'\n")
    with pytest.raises(ProfileError, match=r"prof\.toml.*\.json, \.yaml or \.yml"):
        load_profile(toml)


def test_invalid_direct_construction_names_the_profile():
    with pytest.raises(ProfileError, match="'toy'.*per_token_s"):
        Profile(name="toy", description="", base_s=0.01, per_token_s=-1.0, per_kv_token_s=0.0,
                kv_capacity_tokens=1000)
    assert issubclass(ProfileError, ValueError)


def test_yaml_reads_scientific_notation_without_a_dot_as_numbers(tmp_path):
    path = tmp_path / "sci.yaml"
    path.write_text("name: sci\nstep_time: {base_s: 1e-2, per_token_s: 7.2e-5, per_kv_token_s: 3E-7}\n"
                    "kv_capacity_tokens: 1.0e5\n")
    profile = load_profile(path)
    assert (profile.base_s, profile.per_token_s, profile.per_kv_token_s) == (1e-2, 7.2e-5, 3e-7)
    assert profile.kv_capacity_tokens == 100_000


# --- prefill and decode costs, and step-time noise ----------------------------------------------

SPLIT = {"base_s": 0.004, "per_token_s": 1e-4, "per_kv_token_s": 2e-7, "per_decode_token_s": 1.8e-4}


def split_profile(noise_sigma: float = 0.0) -> Profile:
    return Profile(name="split", description="", kv_capacity_tokens=50_000, noise_sigma=noise_sigma, **SPLIT)


def test_a_profile_without_the_split_charges_decodes_like_prefill(tmp_path):
    profile = load_profile(write_json(tmp_path, minimal_profile_dict()))
    assert profile.per_decode_token_s is None and profile.noise_sigma == 0.0
    assert profile.step_time_s(40, 900, 8) == profile.step_time_s(40, 900) == \
        pytest.approx(0.01 + 1e-4 * 40 + 1e-6 * 900)
    assert "per_decode_token_s" not in profile.to_dict()["step_time"]


def test_prefill_and_decode_tokens_have_their_own_costs(tmp_path):
    p = split_profile(0.25)
    assert p.step_time_s(40, 900, 8) == pytest.approx(0.004 + 1e-4 * 32 + 1.8e-4 * 8 + 2e-7 * 900)
    assert p.decode_token_s == 1.8e-4
    with pytest.raises(ValueError, match="decodes"):
        p.step_time_s(4, 10, 5)
    p.save(tmp_path / "split.json")
    assert load_profile(tmp_path / "split.json") == p
    data = minimal_profile_dict()
    data["step_time"].update(per_decode_token_s=2e-4, noise_sigma=0.3)
    (tmp_path / "split.yaml").write_text(yaml.safe_dump(data))
    loaded = load_profile(tmp_path / "split.yaml")
    assert loaded.per_decode_token_s == 2e-4 and loaded.noise_sigma == 0.3


@pytest.mark.parametrize("key, value, expected", [
    ("per_decode_token_s", -1e-4, "non-negative"), ("noise_sigma", -0.1, "non-negative"),
    ("noise_sigma", 5.0, "at most"), ("noise_sigma", "wide", "finite number"),
])
def test_bad_split_or_noise_names_its_key(tmp_path, key, value, expected):
    data = minimal_profile_dict()
    data["step_time"][key] = value
    with pytest.raises(ProfileError, match=f"step_time.{key}.*{expected}"):
        load_profile(write_json(tmp_path, data))


def test_capacity_counts_decode_tokens_at_their_own_cost():
    from tidegate.ctrl.theory import capacity

    p = split_profile()
    prompts, outputs = [200, 600], [100, 300]
    cap = capacity(prompts, outputs, p)
    w = cap.lifetime_kv_workload
    expected = 1 / (p.base_s * w / p.kv_capacity_tokens + p.per_kv_token_s * w + 1e-4 * 400 + 1.8e-4 * 200)
    assert cap.lambda_max_rps == pytest.approx(expected)
    assert cap.lambda_max_rps < capacity(prompts, outputs, replace(p, per_decode_token_s=None)).lambda_max_rps


def _split_rows(n: int, sigma: float, seed: int = 0) -> list[tuple[int, int, float, int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    p = split_profile()
    rows = []
    for _ in range(n):
        decodes = int(rng.integers(0, 64))
        prefill = int(rng.choice([0, 0, 16, 128, 512]))
        if decodes + prefill == 0:
            decodes = 1
        kv = int(decodes * rng.integers(50, 2000) + prefill * 2)
        t = decodes + prefill
        rows.append((t, kv, p.step_time_s(t, kv, decodes) * float(np.exp(sigma * rng.standard_normal())), decodes))
    return rows


def test_fit_recovers_the_split_costs_and_the_noise():
    from tidegate.engine.sim.fit import fit_step_time, profile_fields

    fit = fit_step_time(_split_rows(4000, 0.3), loss="l1")
    for key, value in SPLIT.items():
        assert fit[key] == pytest.approx(value, rel=0.08), key
    assert fit["noise_sigma"] == pytest.approx(0.3, abs=0.04)
    assert profile_fields(fit)["per_decode_token_s"] == fit["per_decode_token_s"]
    exact = fit_step_time(_split_rows(400, 0.0), loss="l1")
    assert exact["noise_sigma"] < 0.01 and exact["mape"] < 1e-3
    # rows without the decode count: one cost per token, as before
    plain = fit_step_time([r[:3] for r in _split_rows(400, 0.0)], loss="l1")
    assert plain["per_decode_token_s"] is None and plain["mape"] > 1e-3


def test_noise_of_pooled_runs_is_fitted_within_each_run():
    from tidegate.engine.sim.fit import fit_step_time

    # two runs of the same steps, the machine 30% slower in the second: drift, not step noise
    first, second = _split_rows(2000, 0.05, seed=1), _split_rows(2000, 0.05, seed=2)
    rows = first + [(t, k, 1.3 * sec, d) for t, k, sec, d in second]
    runs = ["before"] * len(first) + ["after"] * len(second)
    pooled = fit_step_time(rows, loss="l1")
    within = fit_step_time(rows, loss="l1", runs=runs)
    assert within["noise_sigma"] == pytest.approx(0.05, abs=0.015)
    assert within["noise_sigma_below"] == pytest.approx(0.05, abs=0.015)
    assert pooled["noise_sigma"] > 2 * within["noise_sigma"]
    # the coefficients are the pooled median step's either way
    assert within["base_s"] == pooled["base_s"] and within["mape"] == pooled["mape"]
    with pytest.raises(ValueError, match="label every row"):
        fit_step_time(rows, loss="l1", runs=runs[1:])


def test_step_noise_is_seeded_median_one_and_off_at_zero():
    import math
    import statistics

    from tidegate.ctrl import build_controller
    from tidegate.engine.sim.executor import StepNoise
    from tidegate.engine.sim.simulate import simulate
    from tidegate.engine.workloads import Arrival

    noise, again = StepNoise(0.3, seed=1), StepNoise(0.3, seed=1)
    draws = [noise() for _ in range(20_000)]
    assert statistics.median(draws) == pytest.approx(1.0, abs=0.02)
    assert statistics.fmean(draws) == pytest.approx(math.exp(0.3 ** 2 / 2), abs=0.01)
    assert draws[:50] == [again() for _ in range(50)]
    assert StepNoise(0.0)() == 1.0
    arr = [Arrival(0.05 * i, 100 + 7 * i % 300, 20 + i % 50, 128) for i in range(200)]
    quiet = simulate(arr, split_profile(), build_controller("greedy", split_profile())).summary
    noisy = [simulate(arr, split_profile(0.3), build_controller("greedy", split_profile()), noise_seed=s).summary
             for s in (0, 0, 1)]
    drop = {"wall_time_s"}
    assert {k: v for k, v in noisy[0].items() if k not in drop} == {k: v for k, v in noisy[1].items() if k not in drop}
    assert noisy[0]["sim_time_s"] != noisy[2]["sim_time_s"] != quiet["sim_time_s"]
    assert quiet == {**quiet, **simulate(arr, split_profile(), build_controller("greedy", split_profile())).summary,
                     "wall_time_s": quiet["wall_time_s"]}


# --- a fixed cost per prefill chunk, and noise correlated from step to step ------------------------

def test_each_prefill_chunk_adds_its_fixed_cost(tmp_path):
    p = replace(split_profile(), per_prefill_s=2e-3)
    assert p.step_time_s(40, 900, 8, 2) - split_profile().step_time_s(40, 900, 8) == pytest.approx(4e-3)
    assert p.step_time_s(8, 900, 8) == split_profile().step_time_s(8, 900, 8)  # decodes only: no chunk
    with pytest.raises(ValueError, match="prefill chunks"):
        p.step_time_s(10, 10, 8, 3)  # 2 prefill tokens cannot be 3 chunks
    p = replace(p, noise_sigma=0.3, noise_corr=0.9)
    p.save(tmp_path / "chunks.json")
    assert load_profile(tmp_path / "chunks.json") == p
    old = load_profile(write_json(tmp_path, minimal_profile_dict()))  # a file from before: both off
    assert old.per_prefill_s == 0.0 and old.noise_corr == 0.0
    assert "per_prefill_s" not in old.to_dict()["step_time"] and "noise_corr" not in old.to_dict()["step_time"]


@pytest.mark.parametrize("key, value, expected", [
    ("per_prefill_s", -1e-3, "non-negative"), ("noise_corr", -0.1, "non-negative"),
    ("noise_corr", 1.0, "at most"), ("noise_corr", "high", "finite number"),
    ("noise_sigma_below", -0.1, "non-negative"), ("noise_sigma_below", 3.0, "at most"),
])
def test_bad_prefill_cost_or_noise_correlation_names_its_key(tmp_path, key, value, expected):
    data = minimal_profile_dict()
    data["step_time"][key] = value
    with pytest.raises(ProfileError, match=f"step_time.{key}.*{expected}"):
        load_profile(write_json(tmp_path, data))


def test_capacity_counts_one_prefill_chunk_per_request():
    from tidegate.ctrl.theory import capacity

    p = split_profile()
    with_chunks = replace(p, per_prefill_s=2e-3)
    prompts, outputs = [200, 600], [100, 300]
    slow, fast = capacity(prompts, outputs, with_chunks).lambda_max_rps, capacity(prompts, outputs, p).lambda_max_rps
    assert 1 / slow - 1 / fast == pytest.approx(2e-3)


def test_correlated_noise_keeps_each_draw_log_normal_and_the_old_draws_without_it():
    import random

    import numpy as np

    from tidegate.engine.sim.executor import StepNoise

    logs = np.log(_draws(StepNoise(0.3, seed=4, corr=0.9), 60_000))
    z = logs / 0.3
    assert abs(np.median(z)) < 0.08 and np.std(z) == pytest.approx(1.0, abs=0.08)
    assert np.corrcoef(z[:-1], z[1:])[0, 1] == pytest.approx(0.9, abs=0.02)
    assert np.corrcoef(z[:-10], z[10:])[0, 1] == pytest.approx(0.9 ** 10, abs=0.05)
    rng = random.Random(7)
    assert _draws(StepNoise(0.3, seed=7), 100) == [rng.lognormvariate(0.0, 0.3) for _ in range(100)]
    with pytest.raises(ValueError, match="correlation"):
        StepNoise(0.3, corr=1.0)
    assert math.isclose(StepNoise(0.0, corr=0.5)(), 1.0)


def _draws(noise, n: int) -> list[float]:
    return [noise() for _ in range(n)]


def _chunk_rows(n: int, sigma: float, corr: float, seed: int = 0) -> list[tuple[int, int, float, int, int]]:
    """Steps of a profile with a prefill-chunk cost, timed with AR(1) log-normal noise, in order."""
    import numpy as np

    rng = np.random.default_rng(seed)
    p = replace(split_profile(), per_prefill_s=2e-3)
    rows, z = [], float(rng.standard_normal())
    for _ in range(n):
        decodes = int(rng.integers(0, 64))
        chunks = int(rng.choice([0, 0, 0, 1, 1, 2]))
        prefill = sum(int(rng.choice([3, 16, 128, 512])) for _ in range(chunks))
        if decodes + prefill == 0:
            decodes = 1
        kv = int(decodes * rng.integers(50, 2000) + prefill * 2)
        t = decodes + prefill
        z = corr * z + math.sqrt(1 - corr * corr) * float(rng.standard_normal())
        rows.append((t, kv, p.step_time_s(t, kv, decodes, chunks) * math.exp(sigma * z), decodes, chunks))
    return rows


def test_fit_recovers_the_prefill_chunk_cost_and_the_noise_correlation():
    from tidegate.engine.sim.fit import fit_step_time, profile_fields

    fit = fit_step_time(_chunk_rows(6000, 0.3, 0.9), loss="l1")
    assert fit["per_prefill_s"] == pytest.approx(2e-3, rel=0.15)
    for key, value in SPLIT.items():
        assert fit[key] == pytest.approx(value, rel=0.15), key
    assert fit["noise_sigma"] == pytest.approx(0.3, abs=0.05)
    assert fit["noise_corr"] == pytest.approx(0.9, abs=0.05)
    fields = profile_fields(fit)
    assert fields["per_prefill_s"] == fit["per_prefill_s"] and fields["noise_corr"] == fit["noise_corr"]
    independent = fit_step_time(_chunk_rows(6000, 0.3, 0.0), loss="l1")
    assert independent["noise_corr"] < 0.1
    # rows without the chunk count: no chunk cost, as before
    assert fit_step_time([r[:4] for r in _chunk_rows(2000, 0.0, 0.0)], loss="l1")["per_prefill_s"] == 0.0


# --- fresh noise on top of the wander: the variance of a span of steps' mean -----------------------

def _wander_logs(n: int, corr: float, white: float, seed: int):
    """Standard normal Z of an AR(1) series with ``corr`` plus fresh noise of share ``white``."""
    import numpy as np

    rng = np.random.default_rng(seed)
    a = np.empty(n)
    a[0] = rng.standard_normal()
    for i in range(1, n):
        a[i] = corr * a[i - 1] + math.sqrt(1 - corr * corr) * rng.standard_normal()
    return math.sqrt(1 - white) * a + math.sqrt(white) * rng.standard_normal(n)


@pytest.mark.parametrize("corr, white", [(0.9, 0.0), (0.97, 0.2), (0.95, 0.5)])
def test_noise_wander_recovers_the_correlation_and_the_fresh_share(corr, white):
    import numpy as np

    from tidegate.engine.sim.fit import noise_wander

    got_corr, got_white = noise_wander(np.exp(0.2 * _wander_logs(8000, corr, white, seed=3)))
    assert got_corr == pytest.approx(corr, abs=0.02)
    assert got_white == pytest.approx(white, abs=0.08)


def test_noise_wander_finds_independent_steps_and_needs_enough_of_them():
    import numpy as np

    from tidegate.engine.sim.fit import NOISE_MIN_STEPS, noise_wander

    rng = np.random.default_rng(5)
    assert noise_wander(np.exp(0.2 * rng.standard_normal(8000)))[0] < 0.1
    assert noise_wander(np.exp(0.2 * _wander_logs(NOISE_MIN_STEPS - 1, 0.9, 0.0, seed=1))) == (0.0, 0.0)
    # a stall is one large step: a few of them do not make the noise look independent
    logs = 0.2 * _wander_logs(8000, 0.95, 0.2, seed=2)
    logs[::500] += 5.0
    assert noise_wander(np.exp(logs)) == pytest.approx(noise_wander(np.exp(0.2 * _wander_logs(8000, 0.95, 0.2, 2))),
                                                       abs=0.05)


@pytest.mark.parametrize("corr, white", [(0.98, 0.7), (0.95, 0.3), (0.9, 0.0)])
def test_simulated_noise_spreads_a_span_of_steps_as_the_measured_noise_does(corr, white):
    """What a request's TPOT sees: the mean of its decode steps. Noise fitted on measured steps and
    drawn again by the simulator spreads the mean of 32 steps as the measured steps do, also when
    most of the jitter is fresh at every step (an AR(1) series alone, fitted to the first lags'
    correlation, spread it 1.4 times too wide at 70% fresh)."""
    import numpy as np

    from tidegate.engine.sim.executor import StepNoise
    from tidegate.engine.sim.fit import noise_wander

    def mean_spread(logs, span: int = 32) -> float:
        sums = np.concatenate([[0.0], np.cumsum(logs - logs.mean())])
        return float(np.std((sums[span:] - sums[:-span]) / span) / np.std(logs))

    measured = 0.2 * _wander_logs(20_000, corr, white, seed=8)
    got_corr, got_white = noise_wander(np.exp(measured))
    drawn = np.log(_draws(StepNoise(0.2, seed=9, corr=got_corr, white=got_white), 60_000))
    assert mean_spread(drawn) == pytest.approx(mean_spread(measured), rel=0.12)


def test_fresh_noise_keeps_each_draw_standard_and_shortens_the_correlation():
    import random

    import numpy as np

    from tidegate.engine.sim.executor import StepNoise

    z = np.log(_draws(StepNoise(0.3, seed=4, corr=0.9, white=0.3), 60_000)) / 0.3
    assert abs(np.median(z)) < 0.08 and np.std(z) == pytest.approx(1.0, abs=0.08)
    for lag in (1, 10):
        assert np.corrcoef(z[:-lag], z[lag:])[0, 1] == pytest.approx(0.7 * 0.9 ** lag, abs=0.03)
    # a share of 0 draws what the noise drew before it had one: the AR(1) series alone
    rng, z, expected = random.Random(7), None, []
    for _ in range(50):
        e = rng.gauss(0.0, 1.0)
        z = e if z is None else 0.9 * z + math.sqrt(1 - 0.81) * e
        expected.append(math.exp(0.3 * z))
    assert _draws(StepNoise(0.3, seed=7, corr=0.9, white=0.0), 50) == pytest.approx(expected, rel=1e-12)
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="white share"):
            StepNoise(0.3, corr=0.9, white=bad)


def test_fit_recovers_the_fresh_share_and_the_profile_keeps_it(tmp_path):
    from tidegate.engine.sim.executor import SimExecutor, StepNoise
    from tidegate.engine.sim.fit import fit_step_time, profile_fields

    p = replace(split_profile(), per_prefill_s=2e-3)
    rows = _chunk_rows(8000, 0.0, 0.0, seed=6)
    z = _wander_logs(len(rows), 0.95, 0.3, seed=6)
    fit = fit_step_time([(t, k, s * math.exp(0.25 * float(x)), d, c) for (t, k, s, d, c), x in zip(rows, z)],
                        loss="l1")
    assert fit["noise_corr"] == pytest.approx(0.95, abs=0.02)
    assert fit["noise_white"] == pytest.approx(0.3, abs=0.1)
    fields = profile_fields(fit)
    assert fields["noise_white"] == fit["noise_white"]
    assert profile_fields({**fit, "noise_corr": 0.0})["noise_white"] == 0.0  # no wander, nothing to share
    fitted = replace(p, **fields)
    fitted.save(tmp_path / "white.json")
    assert load_profile(tmp_path / "white.json") == fitted
    drawn = StepNoise(fitted.noise_sigma, 3, fitted.noise_corr, fitted.noise_sigma_below, fitted.noise_white)
    assert _draws(SimExecutor(fitted, seed=3).noise, 40) == _draws(drawn, 40)  # the simulator draws the fresh share
    assert _draws(SimExecutor(replace(fitted, noise_white=0.0), seed=3).noise, 40) != _draws(drawn, 40)
    # without a wander the fresh share means nothing: a profile says so one way only
    assert replace(fitted, noise_corr=0.0).noise_white == 0.0
    assert replace(fitted, noise_corr=0.0) == replace(fitted, noise_corr=0.0, noise_white=0.7)
    assert "noise_white" not in replace(fitted, noise_white=0.0).to_dict()["step_time"]
    old = load_profile(write_json(tmp_path, minimal_profile_dict()))
    assert old.noise_white == 0.0


@pytest.mark.parametrize("value, expected", [(-0.1, "non-negative"), (1.5, "at most"), ("some", "finite number")])
def test_bad_fresh_share_names_its_key(tmp_path, value, expected):
    data = minimal_profile_dict()
    data["step_time"]["noise_white"] = value
    with pytest.raises(ProfileError, match=f"step_time.noise_white.*{expected}"):
        load_profile(write_json(tmp_path, data))


def test_noise_below_the_median_has_its_own_sigma_and_the_mean_counts_both():
    import numpy as np

    from tidegate.ctrl.theory import mean_step_factor
    from tidegate.engine.sim.executor import StepNoise

    draws = np.log(_draws(StepNoise(0.4, seed=2, corr=0.5, sigma_below=0.1), 80_000))
    assert abs(np.median(draws)) < 0.01
    assert np.percentile(draws, 10) == pytest.approx(-0.1 * 1.2816, abs=0.01)
    assert np.percentile(draws, 90) == pytest.approx(0.4 * 1.2816, abs=0.03)
    p = replace(split_profile(0.4), noise_sigma_below=0.1)
    assert mean_step_factor(p) == pytest.approx(float(np.mean(np.exp(draws))), rel=0.01)
    assert mean_step_factor(replace(p, noise_sigma_below=0.4)) == pytest.approx(math.exp(0.08))


def test_fit_gives_each_side_of_the_median_its_sigma():
    import numpy as np

    from tidegate.engine.sim.fit import fit_step_time

    rng = np.random.default_rng(3)
    p = split_profile()
    rows = []
    for _ in range(5000):
        decodes = int(rng.integers(1, 64))
        z = float(rng.standard_normal())
        rows.append((decodes, decodes * 500, p.step_time_s(decodes, decodes * 500, decodes)
                     * math.exp((0.35 if z > 0 else 0.08) * z), decodes))
    fit = fit_step_time(rows, loss="l1")
    assert fit["noise_sigma"] == pytest.approx(0.35, abs=0.04)
    assert fit["noise_sigma_below"] == pytest.approx(0.08, abs=0.02)


def test_prefill_attention_pairs_grow_with_the_square_of_the_chunk():
    from tidegate.ctrl import build_controller
    from tidegate.engine.core.request import Request
    from tidegate.engine.sim.executor import SimExecutor
    from tests.helpers import make_engine, step_profile

    seen = []

    class Spy(SimExecutor):
        def execute(self, batch):
            seen.append((batch.num_tokens, batch.num_prefills, batch.prefill_pairs))
            return super().execute(batch)

    core = make_engine(build_controller("greedy:max_num_batched_tokens=4", step_profile()))
    core.executor = Spy(step_profile())
    core.add_request(Request("a", 0.0, 10, 2, target_output_len=2))
    while core.has_unfinished:
        core.step()
    # chunks of 4, 4 and 2 tokens after 0, 4 and 8 cached ones, then a decode
    assert seen == [(4, 1, 10), (4, 1, 4 * 4 + 10), (2, 1, 2 * 8 + 3), (1, 0, 0)]
    p = replace(split_profile(), per_prefill_pair_s=1e-7)
    assert p.step_time_s(100, 100, 0, 1, 5050) - split_profile().step_time_s(100, 100, 0, 1) == pytest.approx(5.05e-4)
    with pytest.raises(ValueError):
        p.step_time_s(100, 100, 0, 1, -1)


def test_fit_recovers_the_cost_per_prefill_pair(tmp_path):
    import numpy as np

    from tidegate.engine.sim.fit import fit_step_time, profile_fields

    rng = np.random.default_rng(5)
    p = replace(split_profile(), per_prefill_s=2e-3, per_prefill_pair_s=1e-7)
    rows = []
    for _ in range(4000):
        decodes = int(rng.integers(0, 32))
        chunk = int(rng.choice([0, 0, 8, 64, 256, 1024]))
        cached = int(rng.choice([0, 0, 512])) if chunk else 0
        pairs = chunk * cached + chunk * (chunk + 1) // 2
        if decodes + chunk == 0:
            decodes = 1
        t = decodes + chunk
        kv = decodes * 700 + cached + chunk
        rows.append((t, kv, p.step_time_s(t, kv, decodes, int(chunk > 0), pairs)
                     * float(np.exp(0.05 * rng.standard_normal())), decodes, int(chunk > 0), pairs))
    fit = fit_step_time(rows, loss="l1")
    assert fit["per_prefill_pair_s"] == pytest.approx(1e-7, rel=0.15)
    assert fit["per_prefill_s"] == pytest.approx(2e-3, rel=0.15)
    fields = profile_fields(fit)
    profile = replace(split_profile(), **fields)
    profile.save(tmp_path / "pairs.json")
    assert load_profile(tmp_path / "pairs.json").per_prefill_pair_s == fields["per_prefill_pair_s"]
    data = minimal_profile_dict()
    data["step_time"]["per_prefill_pair_s"] = -1e-9
    with pytest.raises(ProfileError, match="step_time.per_prefill_pair_s.*non-negative"):
        load_profile(write_json(tmp_path, data))


def test_fit_recovers_the_cost_of_a_first_decode(tmp_path):
    import numpy as np

    from tidegate.engine.sim.fit import fit_step_time, profile_fields

    rng = np.random.default_rng(6)
    p = replace(split_profile(), per_prefill_s=2e-3, per_first_decode_s=8e-4)
    rows = []
    for _ in range(4000):
        decodes = int(rng.integers(1, 32))
        first = int(rng.choice([0, 0, 0, 1, 2])) if decodes >= 2 else 0
        chunk = int(rng.choice([0, 0, 16, 128]))
        t = decodes + chunk
        kv = decodes * 700 + chunk
        rows.append((t, kv, p.step_time_s(t, kv, decodes, int(chunk > 0), chunk * (chunk + 1) // 2, first)
                     * float(np.exp(0.05 * rng.standard_normal())), decodes, int(chunk > 0),
                     chunk * (chunk + 1) // 2, first))
    fit = fit_step_time(rows, loss="l1")
    assert fit["per_first_decode_s"] == pytest.approx(8e-4, rel=0.15)
    profile = replace(split_profile(), **profile_fields(fit))
    profile.save(tmp_path / "first.json")
    assert load_profile(tmp_path / "first.json").per_first_decode_s == fit["per_first_decode_s"]
    assert fit_step_time([r[:6] for r in rows], loss="l1")["per_first_decode_s"] == 0.0
    with pytest.raises(ValueError):
        profile.step_time_s(4, 10, 2, 1, 3, 3)  # more first decodes than decodes


def test_fit_recovers_the_cost_of_a_prefill_with_no_decodes_beside(tmp_path):
    import numpy as np

    from tidegate.engine.sim.fit import fit_step_time, profile_fields

    rng = np.random.default_rng(7)
    p = replace(split_profile(), per_prefill_s=1e-3, per_prefill_alone_s=1.5e-3)
    # 65 prefill tokens alone, against 64 and a decode: the cost alone, less a decode's over a prefill token's
    decode_over_prefill = SPLIT["per_decode_token_s"] - SPLIT["per_token_s"]
    assert p.step_time_s(65, 65, 0, 1) - p.step_time_s(65, 65, 1, 1) == pytest.approx(1.5e-3 - decode_over_prefill)
    assert p.step_time_s(4, 900, 4) == split_profile().step_time_s(4, 900, 4)  # decodes alone: no such cost
    rows = []
    for _ in range(3000):
        decodes = int(rng.choice([0, 0, 1, 2, 8]))
        chunk = int(rng.choice([0, 16, 128])) if decodes else int(rng.choice([16, 64, 128]))
        t = decodes + chunk
        kv = decodes * 300 + chunk
        rows.append((t, kv, p.step_time_s(t, kv, decodes, int(chunk > 0)) * float(np.exp(0.05 * rng.standard_normal())),
                     decodes, int(chunk > 0)))
    fit = fit_step_time(rows, loss="l1")
    assert fit["per_prefill_alone_s"] == pytest.approx(1.5e-3, rel=0.15)
    assert fit["per_prefill_s"] == pytest.approx(1e-3, rel=0.15)
    profile = replace(split_profile(), **profile_fields(fit))
    profile.save(tmp_path / "alone.json")
    assert load_profile(tmp_path / "alone.json").per_prefill_alone_s == fit["per_prefill_alone_s"]
    # without it, one cost per chunk takes the average of the two kinds of prefill step
    assert fit_step_time(rows, loss="l1", prefill_alone=False)["per_prefill_s"] > 1.5e-3
    # steps that never prefill beside decodes cannot tell the two costs apart: none fitted
    assert fit_step_time([r for r in rows if not (r[3] and r[4])], loss="l1")["per_prefill_alone_s"] == 0.0
    data = minimal_profile_dict()
    data["step_time"]["per_prefill_alone_s"] = "fast"
    with pytest.raises(ProfileError, match="step_time.per_prefill_alone_s"):
        load_profile(write_json(tmp_path, data))


def test_after_prefill_weights_sum_the_decayed_prefill_steps_before():
    from tidegate.engine.core.profile import after_prefill_weights

    assert after_prefill_weights([True, False, False, True, False], 0.5) == [0.0, 1.0, 0.5, 0.25, 1.125]
    assert after_prefill_weights([True, False, True], 0.0) == [0.0, 1.0, 0.0]
    # given prefill token counts, each step weighs by its tokens: the weight B
    assert after_prefill_weights([64, 0, 0, 16, 0], 0.5) == [0.0, 64.0, 32.0, 16.0, 24.0]
    p = replace(split_profile(), per_after_prefill_s=1e-3, after_prefill_decay=0.5, per_after_prefill_token_s=2e-6)
    assert p.step_time_s(8, 900, 8, after_prefill=1.5) - split_profile().step_time_s(8, 900, 8) == \
        pytest.approx(1.5e-3)
    assert p.step_time_s(8, 900, 8, after_prefill=1.5, after_prefill_tokens=100.0) - \
        split_profile().step_time_s(8, 900, 8) == pytest.approx(1.7e-3)
    for bad in ({"after_prefill": -1.0}, {"after_prefill_tokens": -1.0}):
        with pytest.raises(ValueError, match="after-prefill weights"):
            p.step_time_s(8, 900, 8, **bad)


def _after_rows(n: int, cost: float, decay: float, seed: int = 0, token_cost: float = 0.0) -> list[tuple]:
    """Serving-like steps in order: a prefill now and then, decodes between, each step charged the
    after-prefill cost of the prefill steps before it (and ``token_cost`` per their prefill
    tokens), with AR(1) log-normal noise."""
    import numpy as np

    from tidegate.engine.core.profile import after_prefill_weights

    rng = np.random.default_rng(seed)
    p = replace(split_profile(), per_prefill_s=2e-3, per_after_prefill_s=cost, after_prefill_decay=decay,
                per_after_prefill_token_s=token_cost)
    shapes = []
    for _ in range(n):
        decodes = int(rng.integers(0, 16))
        chunk = int(rng.choice([128, 512])) if rng.random() < 0.12 or decodes == 0 else 0
        shapes.append((decodes, chunk))
    weights = after_prefill_weights([c > 0 for _, c in shapes], decay)
    token_weights = after_prefill_weights([c for _, c in shapes], decay)
    rows, z = [], float(rng.standard_normal())
    for (decodes, chunk), a, b in zip(shapes, weights, token_weights):
        kv = decodes * int(rng.integers(50, 2000)) + chunk
        t, c, q = decodes + chunk, int(chunk > 0), chunk * (chunk + 1) // 2
        z = 0.5 * z + math.sqrt(0.75) * float(rng.standard_normal())
        rows.append((t, kv, p.step_time_s(t, kv, decodes, c, q, 0, a, b) * math.exp(0.05 * z), decodes, c, q, 0))
    return rows


def test_fit_recovers_the_after_prefill_cost_and_its_decay(tmp_path):
    from tidegate.engine.sim.fit import fit_step_time, profile_fields

    fit = fit_step_time(_after_rows(5000, 1.5e-3, 0.4), loss="l1")
    assert fit["after_prefill_decay"] == pytest.approx(0.4, abs=0.1)
    assert fit["per_after_prefill_s"] == pytest.approx(1.5e-3, rel=0.2)
    for key, value in SPLIT.items():
        assert fit[key] == pytest.approx(value, rel=0.15), key
    profile = replace(split_profile(), **profile_fields(fit))
    profile.save(tmp_path / "after.json")
    assert load_profile(tmp_path / "after.json") == profile
    # steps without the effect, or rows that do not say their prefill chunks: no after-prefill cost
    assert fit_step_time(_after_rows(3000, 0.0, 0.4), loss="l1")["per_after_prefill_s"] == 0.0
    assert fit_step_time([r[:4] for r in _after_rows(3000, 1.5e-3, 0.4)], loss="l1")["per_after_prefill_s"] == 0.0
    assert fit_step_time(_after_rows(3000, 1.5e-3, 0.4), loss="l1",
                         after_prefill=False)["per_after_prefill_s"] == 0.0
    # a cost per prefill step only: none per token
    assert fit["per_after_prefill_token_s"] < 0.05 * 1.5e-3 / 512


def test_after_prefill_weights_of_pooled_runs_start_again_with_each_run():
    import numpy as np

    from tidegate.engine.sim.fit import _run_weights, fit_step_time

    prefilled = np.array([1.0, 0.0, 0.0, 1.0, 0.0])
    assert _run_weights(prefilled, 0.5, None) == [0.0, 1.0, 0.5, 0.25, 1.125]
    # the second run's first step follows nothing: a simulation starts at 0, so does the fit
    assert _run_weights(prefilled, 0.5, np.array([0, 0, 0, 1, 1])) == [0.0, 1.0, 0.5, 0.0, 1.0]
    # two runs, each timed from a fresh start: labelled, the pooled fit sees the weights they ran with
    first, second = _after_rows(3000, 1.5e-3, 0.4, seed=1), _after_rows(3000, 1.5e-3, 0.4, seed=2)
    labelled = fit_step_time(first + second, loss="l1", runs=[0] * len(first) + [1] * len(second))
    assert labelled["per_after_prefill_s"] == pytest.approx(1.5e-3, rel=0.2)
    assert labelled["after_prefill_decay"] == pytest.approx(0.4, abs=0.1)


def test_fit_tells_the_after_prefill_cost_per_token_from_the_one_per_step(tmp_path):
    from tidegate.engine.sim.fit import fit_step_time, profile_fields

    rows = _after_rows(6000, 0.5e-3, 0.5, token_cost=2e-6)
    fit = fit_step_time(rows, loss="l1")
    assert fit["after_prefill_decay"] == pytest.approx(0.5, abs=0.1)
    assert fit["per_after_prefill_token_s"] == pytest.approx(2e-6, rel=0.25)
    assert fit["per_after_prefill_s"] == pytest.approx(0.5e-3, abs=0.3e-3)
    profile = replace(split_profile(), **profile_fields(fit))
    profile.save(tmp_path / "after-tokens.json")
    assert load_profile(tmp_path / "after-tokens.json") == profile
    # kept to the cost per step, the fit misses the token cost it was asked to leave out
    alone = fit_step_time(rows, loss="l1", after_prefill_tokens=False)
    assert alone["per_after_prefill_token_s"] == 0.0 and alone["mape"] > fit["mape"]


def test_simulator_charges_the_decaying_after_prefill_cost():
    from tidegate.engine.core.executor import Batch
    from tidegate.engine.sim.executor import SimExecutor

    base = split_profile()
    p = replace(base, per_after_prefill_s=1e-3, after_prefill_decay=0.5)
    ex, plain = SimExecutor(p), SimExecutor(base)

    def batch(tokens: int, decodes: int) -> Batch:
        b = Batch()
        b.num_tokens, b.num_decodes, b.kv_tokens_read = tokens, decodes, 100 * tokens
        b.num_prefills = int(tokens > decodes)
        return b

    steps = [batch(64, 0), batch(2, 2), batch(2, 2), batch(0, 0), batch(2, 2), batch(66, 2), batch(2, 2)]
    extra = [ex.execute(b).duration_s - plain.execute(b).duration_s for b in steps]
    # the idle tick neither pays nor moves the weight
    assert extra == pytest.approx([0.0, 1e-3, 0.5e-3, 0.0, 0.25e-3, 0.125e-3, 1.0625e-3])
    assert SimExecutor(base).after_prefill == 0.0
    # with a cost per prefill token too: 64 tokens, then 64 more, weighed by the same decay
    per_token = SimExecutor(replace(p, per_after_prefill_token_s=1e-5))
    extra = [per_token.execute(b).duration_s - plain.execute(b).duration_s for b in steps]
    tokens = [0.0, 64.0, 32.0, 0.0, 16.0, 8.0, 68.0]
    assert extra == pytest.approx([a + 1e-5 * t for a, t in
                                   zip([0.0, 1e-3, 0.5e-3, 0.0, 0.25e-3, 0.125e-3, 1.0625e-3], tokens)])


def test_bad_after_prefill_keys_name_themselves(tmp_path):
    for key, value, expected in (("per_after_prefill_s", -1e-3, "non-negative"),
                                 ("per_after_prefill_token_s", -1e-6, "non-negative"),
                                 ("per_after_prefill_token_s", [1e-6], "finite number"),
                                 ("after_prefill_decay", 1.0, "at most"),
                                 ("after_prefill_decay", "slow", "finite number")):
        data = minimal_profile_dict()
        data["step_time"][key] = value
        with pytest.raises(ProfileError, match=f"step_time.{key}.*{expected}"):
            load_profile(write_json(tmp_path, data))


def test_capacity_counts_the_after_prefill_cost_once_per_request():
    from tidegate.ctrl.theory import fluid_lambda_max

    p = split_profile()
    after = replace(p, per_after_prefill_s=1e-3, after_prefill_decay=0.5)
    s, w = 600.0, 50_000.0
    slower = 1.0 / fluid_lambda_max(s, w, after, mean_output_tokens=200) - 1.0 / fluid_lambda_max(
        s, w, p, mean_output_tokens=200)
    assert slower == pytest.approx(2e-3)
    # and the prompt's tokens' after-cost: S - D = 400 tokens at 1e-6 s, over 1 - 0.5
    tokens = replace(after, per_after_prefill_token_s=1e-6)
    more = 1.0 / fluid_lambda_max(s, w, tokens, mean_output_tokens=200) - 1.0 / fluid_lambda_max(
        s, w, after, mean_output_tokens=200)
    assert more == pytest.approx(8e-4)


# --- noise that falls with the step's length ---------------------------------------------------

def test_noise_scale_is_one_up_to_the_knee_then_falls_towards_the_floor(tmp_path):
    p = replace(split_profile(0.2), noise_knee_s=2e-3, noise_floor=0.3)
    assert p.noise_scale(1e-3) == p.noise_scale(2e-3) == 1.0
    assert p.noise_scale(4e-3) == pytest.approx(math.sqrt(0.09 + 0.91 * 0.25))
    assert p.noise_scale(1.0) == pytest.approx(0.3, abs=1e-4)
    scales = [p.noise_scale(t) for t in (2e-3, 3e-3, 5e-3, 1e-2, 1e-1)]
    assert scales == sorted(scales, reverse=True)
    assert replace(p, noise_floor=0.0).noise_scale(8e-3) == pytest.approx(0.25)  # jitter of fixed seconds
    assert replace(p, noise_knee_s=0.0).noise_scale(1.0) == 1.0
    p.save(tmp_path / "sized.json")
    assert load_profile(tmp_path / "sized.json") == p
    old = load_profile(write_json(tmp_path, minimal_profile_dict()))  # a file from before: one sigma
    assert old.noise_knee_s == 0.0 and "noise_knee_s" not in old.to_dict()["step_time"]
    for key, value, expected in (("noise_knee_s", -1e-3, "non-negative"), ("noise_floor", 1.5, "at most 1"),
                                 ("noise_floor", -0.1, "non-negative"), ("noise_knee_s", "long", "finite number")):
        data = minimal_profile_dict()
        data["step_time"][key] = value
        with pytest.raises(ProfileError, match=f"step_time.{key}.*{expected}"):
            load_profile(write_json(tmp_path, data))


def test_scaled_noise_draws_the_same_normals():
    import numpy as np

    from tidegate.engine.sim.executor import StepNoise

    for kwargs in ({}, {"corr": 0.9}, {"corr": 0.5, "sigma_below": 0.1}):
        plain = np.log(_draws(StepNoise(0.3, seed=9, **kwargs), 500))
        noise = StepNoise(0.3, seed=9, **kwargs)
        half = np.log([noise(0.5) for _ in range(500)])
        assert half == pytest.approx(0.5 * plain, rel=1e-9, abs=1e-12)


def test_simulator_gives_long_steps_their_smaller_noise():
    import numpy as np

    from tidegate.engine.core.executor import Batch
    from tidegate.engine.sim.executor import SimExecutor

    flat = replace(split_profile(0.2), noise_corr=0.8, noise_sigma_below=0.1)
    sized = replace(flat, noise_knee_s=6e-3, noise_floor=0.25)

    def batch(tokens: int, decodes: int) -> Batch:
        b = Batch()
        b.num_tokens, b.num_decodes, b.kv_tokens_read = tokens, decodes, 100 * tokens
        b.num_prefills = int(tokens > decodes)
        return b

    steps = [batch(4, 4), batch(64, 4), batch(8, 8), batch(2048, 0), batch(1, 1)] * 40
    a, b = SimExecutor(flat, seed=3), SimExecutor(sized, seed=3)
    for s in steps:
        median = flat.median_step_s(s.num_tokens, s.kv_tokens_read, s.num_decodes, s.num_prefills)
        log_flat = math.log(a.execute(s).duration_s / median)
        log_sized = math.log(b.execute(s).duration_s / median)
        assert log_sized == pytest.approx(sized.noise_scale(median) * log_flat, rel=1e-9, abs=1e-12)
    assert sized.noise_scale(flat.median_step_s(2048, 204800, 0, 1)) < 0.3 < sized.noise_scale(
        flat.median_step_s(64, 6400, 4, 1)) < 1.0 == sized.noise_scale(flat.median_step_s(8, 800, 8))
    assert np.isfinite([a.execute(batch(0, 0)).duration_s, b.execute(batch(0, 0)).duration_s]).all()


def _sized_rows(n: int, sigma: float, knee: float, floor: float, corr: float = 0.9, seed: int = 0):
    """Serving-like steps (mostly short decodes, some long prefills), timed with AR(1) noise whose
    sigma falls with the step's length as ``Profile.noise_scale`` says, in order."""
    import numpy as np

    rng = np.random.default_rng(seed)
    p = replace(split_profile(sigma), per_prefill_s=2e-3, noise_knee_s=knee, noise_floor=floor)
    rows, z = [], float(rng.standard_normal())
    for _ in range(n):
        decodes = int(rng.integers(1, 8))
        chunks = int(rng.random() < 0.15)
        prefill = chunks * int(rng.choice([64, 256, 1024, 4096]))
        kv = int(decodes * rng.integers(50, 500) + prefill)
        t = decodes + prefill
        z = corr * z + math.sqrt(1 - corr * corr) * float(rng.standard_normal())
        median = p.step_time_s(t, kv, decodes, chunks)
        rows.append((t, kv, median * math.exp(sigma * p.noise_scale(median) * z), decodes, chunks))
    return rows


def test_fit_finds_how_the_noise_falls_with_the_step_length():
    from tidegate.engine.sim.fit import fit_step_time, profile_fields

    fit = fit_step_time(_sized_rows(8000, 0.2, knee=8e-3, floor=0.25), loss="l1")
    assert fit["noise_floor"] == pytest.approx(0.25, abs=0.1)
    assert 8e-3 / 1.6 < fit["noise_knee_s"] < 8e-3 * 1.6
    # the sigmas and the correlation are the short steps', not diluted by the quiet long ones
    assert fit["noise_sigma"] == pytest.approx(0.2, abs=0.03)
    assert fit["noise_sigma_below"] == pytest.approx(0.2, abs=0.03)
    assert fit["noise_corr"] == pytest.approx(0.9, abs=0.05)
    fields = profile_fields(fit)
    assert (fields["noise_knee_s"], fields["noise_floor"]) == (fit["noise_knee_s"], fit["noise_floor"])
    # the same sigma at every length: no knee, and none when asked for one sigma
    flat = fit_step_time(_sized_rows(8000, 0.2, knee=0.0, floor=0.0), loss="l1")
    assert flat["noise_knee_s"] == 0.0 and flat["noise_sigma"] == pytest.approx(0.2, abs=0.03)
    one = fit_step_time(_sized_rows(8000, 0.2, knee=8e-3, floor=0.25), loss="l1", noise_by_length=False)
    assert one["noise_knee_s"] == 0.0 and profile_fields(one)["noise_knee_s"] == 0.0
    assert profile_fields(fit, noise=False)["noise_knee_s"] == 0.0


def test_noise_by_length_of_pooled_runs_is_judged_within_each_run():
    import numpy as np

    from tidegate.engine.sim.fit import _within_runs, noise_size

    # the second run's machine was slower for short steps only: the long steps' spread is unchanged
    first = _sized_rows(5000, 0.15, knee=8e-3, floor=0.25, seed=4)
    second = [(t, k, s * (1.25 if s < 8e-3 else 1.0), d, c)
              for t, k, s, d, c in _sized_rows(5000, 0.15, knee=8e-3, floor=0.25, seed=5)]
    p = replace(split_profile(), per_prefill_s=2e-3)
    median = [p.step_time_s(t, k, d, c) for t, k, _, d, c in first + second]
    runs = np.array(["before"] * len(first) + ["after"] * len(second))
    # as the fit hands them over: each run over its own median, which is its short steps'
    ratios = _within_runs(np.array([s / m for (_, _, s, _, _), m in zip(first + second, median)]), runs)
    knee, floor = noise_size(ratios, median, runs)
    assert 8e-3 / 1.6 < knee < 8e-3 * 1.6 and floor == pytest.approx(0.25, abs=0.1)
    # judged against one median per run, the second run's long steps sit 25% below the first's
    shifted = noise_size(ratios, median)
    assert shifted[1] > floor + 0.1 or shifted[0] == 0.0


def test_predicted_steps_carry_the_after_prefill_weights_through_the_run():
    from tidegate.engine.core.executor import Batch
    from tidegate.engine.sim.executor import SimExecutor

    p = replace(split_profile(), per_prefill_s=2e-3, per_after_prefill_s=1e-3, after_prefill_decay=0.5,
                per_after_prefill_token_s=1e-6, per_first_decode_s=3e-4)
    steps = [(64, 64, 0, 1, 2080, 0), (2, 130, 2, 0, 0, 1), (40, 300, 8, 1, 528, 0), (8, 400, 8), (8, 408, 8)]
    sim = SimExecutor(p)

    def batch(t, k, d, c=0, q=0, f=0) -> Batch:
        b = Batch()
        b.num_tokens, b.kv_tokens_read, b.num_decodes, b.num_prefills, b.prefill_pairs, b.first_decodes = \
            t, k, d, c, q, f
        return b

    # the simulator's executor, which keeps the weights as it runs, times them the same
    assert p.predict_steps(steps) == pytest.approx([sim.execute(batch(*s)).duration_s for s in steps], rel=1e-12)
    assert p.predict_steps(steps[3:]) == [p.step_time_s(8, 400, 8), p.step_time_s(8, 408, 8)]


def test_a_fit_without_a_fixed_cost_gives_a_profile_whose_idle_tick_is_one_tokens_cost():
    from tidegate.engine.sim.fit import fit_step_time, profile_fields

    # steps whose best line crosses below 0 at no tokens: the non-negative fit sets base_s to 0
    rows = [(t, 100 * t, 2e-4 * t + 1e-6 * 100 * t - 1e-5) for t in range(1, 60)]
    fit = fit_step_time(rows, loss="l1")
    assert fit["base_s"] == 0.0
    fields = profile_fields(fit)
    assert fields["idle_s"] == fit["per_token_s"] > 0
    profile = replace(load_profile("tiny-cpu"), **fields)  # a valid profile: without idle_s it is refused
    assert profile.median_step_s(0, 0) == fields["idle_s"]
    with pytest.raises(ProfileError, match="idle_s"):
        replace(load_profile("tiny-cpu"), **(fields | {"idle_s": None}))
    # a fit with a fixed cost leaves the idle tick to it
    assert profile_fields(fit_step_time([(t, k, 1e-3 + s) for t, k, s in rows], loss="l1"))["idle_s"] is None
    # a decode that costs nothing of its own: the cheapest positive cost of a token
    costs = {"base_s": 0.0, "per_token_s": 3e-4, "per_kv_token_s": 1e-7, "per_decode_token_s": 0.0}
    assert profile_fields(costs)["idle_s"] == 3e-4
    assert profile_fields(costs | {"per_decode_token_s": 1e-4})["idle_s"] == 1e-4
    # no positive cost at all: nothing to take the tick from, and the profile refuses it in one sentence
    none = profile_fields(costs | {"per_token_s": 0.0})
    assert none["idle_s"] is None
    with pytest.raises(ProfileError, match="idle_s must be given"):
        replace(load_profile("tiny-cpu"), **none)


def test_fit_reports_its_error_by_step_kind_so_a_missing_term_shows():
    import numpy as np

    from tidegate.engine.sim.fit import fit_step_time

    rng = np.random.default_rng(0)
    rows = []
    for _ in range(400):
        d = int(rng.integers(0, 30))
        p = int(rng.integers(0, 200)) if rng.random() < 0.5 or d == 0 else 0
        if p == 0 and d == 0:
            d = 1
        k = int(rng.integers(d + p, 4000))
        t = 0.002 + 1e-4 * p + 5e-5 * d + 1e-6 * k
        if p and d:
            t += 0.004  # a cost of mixed steps that the model has no term for
        rows.append((p + d, k, t, d))
    fit = fit_step_time(rows, after_prefill=False, noise_by_length=False)
    kinds = fit["by_kind"]
    assert set(kinds) == {"decode only", "prefill only", "prefill beside decodes"}
    assert sum(k["steps"] for k in kinds.values()) == fit["points"] == 400
    mixed = kinds["prefill beside decodes"]
    others = max(kinds["decode only"]["bias"], kinds["prefill only"]["bias"])
    assert mixed["bias"] > 0.02 and mixed["bias"] > others + 0.03
    assert mixed["mape"] > 2 * kinds["decode only"]["mape"]
    exact = fit_step_time([r[:2] + (0.002 + 1e-6 * r[1] + 1e-4 * r[0],) for r in rows], noise_by_length=False)
    assert all(abs(k["bias"]) < 1e-6 and k["mape"] < 1e-6 for k in exact["by_kind"].values())
