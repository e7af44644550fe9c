"""Workload families: the shipped families, sampling, the YAML checks and perturbed profiles."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from tidegate.engine.core.profile import load_profile
from tidegate.engine.workloads.arrivals import WorkloadError
from tidegate.engine.workloads.families import (FAMILIES_DIR, Family, family_segment, load_family, perturbed_profile,
                                       shipped_families)

SHIPPED = ("bursty", "chat", "code-trace", "conv-trace", "diurnal", "flash-crowd", "long-context", "multi-class",
           "short")


def family(arrival=None, **top):
    """A one-class synthetic family from a mapping; ``top`` overrides top-level keys."""
    spec = {"name": "test", "arrival": arrival or {"process": "poisson"},
            "classes": [{"prompt": {"mean": 300, "sigma": 0.8}, "output": {"mean": 100, "sigma": 0.8}}]}
    return load_family({**spec, **top})


def columns(arrivals):
    return (np.array([a.arrival_time_s for a in arrivals]), np.array([a.prompt_tokens for a in arrivals]),
            np.array([a.output_tokens for a in arrivals]), np.array([a.class_id for a in arrivals]))


# --- the shipped families --------------------------------------------------------------------

def test_shipped_families_are_the_yaml_files_named_after_themselves():
    families = shipped_families()
    assert tuple(families) == SHIPPED
    for name, fam in families.items():
        assert fam.path == FAMILIES_DIR / f"{name}.yaml" and fam.description
        assert load_family(name) == fam == load_family(fam.path)


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_family_samples_a_valid_deterministic_workload(name):
    fam = load_family(name)
    arrivals = fam.sample(np.random.default_rng(11), 1500, rate_rps=4.0)
    assert arrivals == fam.sample(np.random.default_rng(11), 1500, rate_rps=4.0)
    assert arrivals != fam.sample(np.random.default_rng(12), 1500, rate_rps=4.0)
    t, p, o, c = columns(arrivals)
    assert len(arrivals) == 1500 and t[0] >= 0 and np.all(np.diff(t) >= 0)
    assert np.all((p >= 1) & (p <= fam.max_prompt_tokens)) and np.all((o >= 1) & (o <= fam.max_tokens))
    assert all(a.max_tokens == fam.max_tokens for a in arrivals)
    assert set(c) <= set(range(max(1, len(fam.classes))))
    assert 1499 / t[-1] == pytest.approx(4.0, rel=0.6)


def test_shipped_families_cover_the_promised_ranges():
    families = shipped_families().values()
    classes = [c for fam in families for c in fam.classes]
    assert min(c.prompt.mean[0] for c in classes) <= 50 and max(c.prompt.mean[1] for c in classes) >= 16000
    assert min(c.output.mean[0] for c in classes) <= 10 and max(c.output.mean[1] for c in classes) >= 1000
    assert all(c.prompt.sigma[1] >= 0.8 and c.output.sigma[1] >= 0.8 for c in classes)  # heavy tails
    processes = {fam.arrival.process: fam.arrival.params for fam in families if fam.arrival is not None}
    assert set(processes) == {"poisson", "gamma", "diurnal", "flash_crowd"}
    assert processes["gamma"]["cv"][0] <= 0.5 and processes["gamma"]["cv"][1] >= 8
    assert max(len(fam.classes) for fam in families) >= 3
    assert {fam.trace.stem for fam in families if fam.trace is not None} == {"splitwise_conv", "splitwise_code"}


# --- sampling --------------------------------------------------------------------------------

@pytest.mark.parametrize("arrival, tolerance", [
    ({"process": "poisson"}, 0.03),
    ({"process": "gamma", "cv": 2}, 0.08),
    ({"process": "diurnal", "period_requests": 500, "amplitude": 0.9}, 0.05),
    ({"process": "flash_crowd", "peak": 10, "crowd_fraction": 0.2, "windows": 2}, 0.05),
])
def test_long_run_mean_rate_is_rate_rps(arrival, tolerance):
    t, *_ = columns(family(arrival).sample(np.random.default_rng(3), 20000, rate_rps=5.0))
    assert len(t) / t[-1] == pytest.approx(5.0, rel=tolerance)


def test_trace_windows_have_exactly_the_mean_rate_and_wrap_around():
    fam = load_family("code-trace")
    t, *_ = columns(fam.sample(np.random.default_rng(0), 20000, rate_rps=3.0))  # longer than the trace
    assert 19999 / t[-1] == pytest.approx(3.0) and np.all(np.diff(t) >= 0)


@pytest.mark.parametrize("cv", [0.5, 3.0])
def test_gamma_inter_arrival_times_have_the_drawn_cv(cv):
    t, *_ = columns(family({"process": "gamma", "cv": cv}).sample(np.random.default_rng(5), 20000))
    gaps = np.diff(t)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.15)


def test_diurnal_and_flash_crowd_rates_swing():
    def bin_counts(arrival):
        t, *_ = columns(family(arrival).sample(np.random.default_rng(2), 20000))
        return np.histogram(t, bins=np.arange(0, t[-1], 100.0))[0]

    diurnal = bin_counts({"process": "diurnal", "period_requests": 2000, "amplitude": 0.8})
    assert diurnal.max() > 1.5 * 100 and diurnal.min() < 0.5 * 100
    crowd = bin_counts({"process": "flash_crowd", "peak": 10, "crowd_fraction": 0.1})
    assert crowd.max() > 5 * np.median(crowd)


def test_lognormal_lengths_have_the_given_mean():
    fam = load_family({"name": "x", "classes": [{"prompt": {"mean": 300, "sigma": 1.0},
                                                  "output": {"mean": 50, "sigma": 0.5}}]})
    _, p, o, _ = columns(fam.sample(np.random.default_rng(0), 20000))
    assert p.mean() == pytest.approx(300, rel=0.05) and o.mean() == pytest.approx(50, rel=0.05)
    assert p.max() > 10 * 300  # heavy tail


def test_ranges_are_drawn_per_episode_within_bounds():
    fam = load_family({"name": "x", "classes": [{"prompt": {"mean": [100, 10000], "sigma": 0},
                                                  "output": {"mean": 20, "sigma": 0}}]})
    means = []
    for seed in range(200):
        _, p, o, _ = columns(fam.sample(np.random.default_rng(seed), 5))
        assert len(set(p)) == 1 and set(o) == {20}
        means.append(p[0])
    assert 100 <= min(means) and max(means) <= 10000
    assert np.mean(np.log10(means)) == pytest.approx(3, abs=0.15)  # log-uniform: half below 1000


def test_classes_are_picked_by_weight_and_outputs_are_capped():
    short = {"prompt": {"mean": 10, "sigma": 0}, "output": {"mean": 10, "sigma": 0}}
    long = {"weight": 3, "prompt": {"mean": 10, "sigma": 0}, "output": {"mean": 5000, "sigma": 0}}
    fam = load_family({"name": "x", "max_tokens": 256, "classes": [short, long]})
    _, _, o, c = columns(fam.sample(np.random.default_rng(0), 8000))
    assert np.mean(c == 1) == pytest.approx(0.75, abs=0.02)
    assert set(o[c == 1]) == {256} and set(o[c == 0]) == {10}


ARRIVALS = [{"process": "poisson"}, {"process": "gamma", "cv": [0.5, 8]},
            {"process": "diurnal", "period_requests": [1, 2000], "amplitude": [0.01, 1]},
            {"process": "flash_crowd", "peak": [1, 100], "crowd_fraction": [0.01, 0.99], "windows": [1, 5]}]


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(ARRIVALS), st.floats(1, 20000), st.floats(0, 3), st.floats(1, 3000), st.integers(1, 300),
       st.floats(0.01, 100), st.integers(0, 2**32 - 1))
def test_any_valid_family_samples_valid_arrivals(arrival, prompt_mean, sigma, output_mean, n, rate, seed):
    fam = load_family({"name": "x", "max_tokens": 512, "max_prompt_tokens": 4096, "arrival": arrival,
                       "classes": [{"prompt": {"mean": prompt_mean, "sigma": sigma},
                                    "output": {"mean": output_mean, "sigma": sigma}}]})
    t, p, o, _ = columns(fam.sample(np.random.default_rng(seed), n, rate))
    assert len(t) == n and t[0] >= 0 and np.all(np.diff(t) >= 0)
    assert p.min() >= 1 and p.max() <= 4096 and o.min() >= 1 and o.max() <= 512


def test_family_segment_is_named_after_the_family():
    seg = family_segment(load_family("chat"), load_profile("a100-llama2-7b"), np.random.default_rng(0), 300)
    assert seg.name == "chat" and len(seg.prompts) == 300 and seg.lambda_max_rps > 0


def test_describe_shows_ranges_and_fixed_values():
    assert family({"process": "gamma", "cv": [0.5, 8]}).describe()["arrival"] == {"process": "gamma", "cv": [0.5, 8]}
    assert load_family("conv-trace").describe()["trace"] == "splitwise_conv"


# --- bad families ----------------------------------------------------------------------------

CLASS = {"prompt": {"mean": 100, "sigma": 1}, "output": {"mean": 10, "sigma": 1}}


@pytest.mark.parametrize("spec, key", [
    ({"colour": "red", "classes": [CLASS]}, "colour"),
    ({"classes": [{**CLASS, "rate_rps": 1}]}, "classes[0].rate_rps"),
    ({"classes": [{**CLASS, "prompt": {"mean": -5, "sigma": 1}}]}, "classes[0].prompt.mean"),
    ({"classes": [{**CLASS, "output": {"mean": [300, 100], "sigma": 1}}]}, "classes[0].output.mean"),
    ({"classes": [{**CLASS, "output": {"mean": [0, 100], "sigma": 1}}]}, "classes[0].output.mean"),
    ({"classes": [{**CLASS, "output": {"mean": [1, 2, 3], "sigma": 1}}]}, "classes[0].output.mean"),
    ({"classes": [{**CLASS, "output": {"mean": 10}}]}, "classes[0].output.sigma"),
    ({"classes": [CLASS, {**CLASS, "weight": True}]}, "classes[1].weight"),
    ({"classes": [{**CLASS, "name": "a"}, {**CLASS, "name": "a"}]}, "classes[1].name"),
    ({"classes": []}, "classes"),
    ({}, "classes"),
    ({"trace": "splitwise_conv", "classes": [CLASS]}, "classes"),
    ({"trace": "splitwise_conv", "arrival": {"process": "poisson"}}, "arrival"),
    ({"trace": "no_such_trace"}, "trace"),
    ({"trace": "paper_sec41"}, "trace"),
    ({"arrival": {"process": "weibull"}, "classes": [CLASS]}, "arrival.process"),
    ({"arrival": {"process": "gamma"}, "classes": [CLASS]}, "arrival.cv"),
    ({"arrival": {"process": "poisson", "cv": 2}, "classes": [CLASS]}, "arrival.cv"),
    ({"arrival": {"process": "diurnal", "period_requests": 100, "amplitude": 1.5}, "classes": [CLASS]},
     "arrival.amplitude"),
    ({"arrival": {"process": "flash_crowd", "peak": 3, "crowd_fraction": 1}, "classes": [CLASS]},
     "arrival.crowd_fraction"),
    ({"arrival": {"process": "flash_crowd", "peak": 3, "crowd_fraction": 0.1, "windows": 1.5},
      "classes": [CLASS]}, "arrival.windows"),
    ({"max_tokens": 0, "classes": [CLASS]}, "max_tokens"),
])
def test_bad_family_names_the_file_and_the_key(tmp_path, spec, key):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"name": "bad", **spec}))
    with pytest.raises(WorkloadError) as e:
        load_family(path)
    message = str(e.value)
    assert message.startswith(f"{path}: {key}: ") and "\n" not in message, message


def test_unreadable_sources_raise_workload_errors(tmp_path):
    with pytest.raises(WorkloadError, match="unknown family 'nope', expected one of bursty, chat"):
        load_family("nope")
    with pytest.raises(WorkloadError, match="no such file"):
        load_family(tmp_path / "missing.yaml")
    (tmp_path / "broken.yaml").write_text("name: [unclosed\n")
    with pytest.raises(WorkloadError, match="broken.yaml"):
        load_family(tmp_path / "broken.yaml")
    with pytest.raises(WorkloadError, match="family: name: missing"):
        load_family({"classes": [CLASS]})


def test_trace_path_is_relative_to_the_family_file(tmp_path):
    (tmp_path / "traces").mkdir()
    (tmp_path / "traces" / "t.csv").write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n0,5,3\n2,7,4\n")
    (tmp_path / "fam.yaml").write_text("trace: traces/t.csv\n")
    fam = load_family(tmp_path / "fam.yaml")
    assert fam.name == "fam" and fam.trace == tmp_path / "traces" / "t.csv"
    t, p, o, _ = columns(fam.sample(np.random.default_rng(0), 3, rate_rps=1.0))
    assert list(t) == pytest.approx([0, 1, 2]) and sorted(p[:2]) == [5, 7]


def test_bad_sample_arguments():
    fam = family()
    with pytest.raises(ValueError, match="n_requests"):
        fam.sample(np.random.default_rng(0), 0)
    with pytest.raises(ValueError, match="rate_rps"):
        fam.sample(np.random.default_rng(0), 10, rate_rps=0)
    assert isinstance(fam, Family)


# --- perturbed profiles ----------------------------------------------------------------------

PERTURBED = ("base_s", "per_token_s", "per_kv_token_s", "kv_capacity_tokens")


@pytest.mark.parametrize("seed", range(20))
def test_perturbed_profile_stays_within_spread_and_is_deterministic(seed):
    base = load_profile("a100-llama2-7b")
    prof = perturbed_profile(base, np.random.default_rng(seed), spread=0.3)
    assert prof == perturbed_profile(base, np.random.default_rng(seed), spread=0.3)
    assert prof.name == "a100-llama2-7b~p" and isinstance(prof.kv_capacity_tokens, int)
    for name in PERTURBED:
        assert 0.7 - 1e-3 <= getattr(prof, name) / getattr(base, name) <= 1.3 + 1e-3
    unchanged = [f.name for f in dataclasses.fields(base) if f.name not in (*PERTURBED, "name")]
    assert all(getattr(prof, f) == getattr(base, f) for f in unchanged)


def test_perturbed_profile_edges():
    base = load_profile("tiny-cpu")
    same = perturbed_profile(base, np.random.default_rng(0), spread=0)
    assert all(getattr(same, f) == getattr(base, f) for f in PERTURBED)
    one_block = dataclasses.replace(base, kv_capacity_tokens=base.block_size)
    for seed in range(20):
        assert perturbed_profile(one_block, np.random.default_rng(seed), 0.9).kv_capacity_tokens >= base.block_size
    for spread in (-0.1, 1.0, float("nan")):
        with pytest.raises(ValueError, match="spread"):
            perturbed_profile(base, np.random.default_rng(0), spread)
