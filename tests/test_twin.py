"""The simulator twin against the real engine: the step-time fit, the profiler's grid, fitting on
recorded serving steps and the twin check end to end (tiny model, CPU)."""

from __future__ import annotations

import dataclasses
import json
import math
import random

import numpy as np
import pytest
import torch

from tidegate.engine.core.profile import Profile, load_profile
from tidegate.engine.sim.fit import binned_samples, fit_step_time
from tidegate.engine.core.request import Request, RequestState
from tidegate.engine.twin.check import COMPARED, _runs_text, refit_floor, step_time_errors
from tidegate.engine.twin.seeds import (NOISE_SEEDS, POOLED, ks_distances, latencies, real_sampling, seed_spread,
                               simulate_seeds)
from tidegate.engine.twin.fit import read_steps_csv, run_profile_from_steps

torch.set_num_threads(1)  # as the tiny-cpu profile was fitted

COEFFICIENTS = {"base_s": 0.002, "per_token_s": 1e-4, "per_kv_token_s": 1e-6}


def _step_rows(n: int, seed: int = 0) -> list[tuple[int, int, float]]:
    """``(T, K, seconds)`` of ``n`` steps timed exactly by ``COEFFICIENTS``."""
    rng = random.Random(seed)
    c = COEFFICIENTS
    rows = []
    for _ in range(n):
        t, k = rng.randint(1, 300), rng.randint(1, 20000)
        rows.append((t, k, c["base_s"] + c["per_token_s"] * t + c["per_kv_token_s"] * k))
    return rows


# --- the step-time fit (engine.sim.fit) ------------------------------------------------------

@pytest.mark.parametrize("loss", ["l2", "l1"])
def test_fit_recovers_known_coefficients_from_noiseless_steps(loss):
    fit = fit_step_time(_step_rows(200), loss=loss)
    for key, value in COEFFICIENTS.items():
        assert fit[key] == pytest.approx(value, rel=1e-6), key
    assert fit["mape"] < 1e-6 and fit["heldout_mape"] < 1e-6 and fit["r2"] == pytest.approx(1.0)
    assert fit["points"] == 200 and fit["heldout_points"] == 50 and fit["loss"] == loss


def test_fit_keeps_coefficients_non_negative():
    # Step time that falls with K: the unconstrained fit would give K a negative cost.
    rows = [(t, k, 0.01 + 1e-4 * t - 1e-7 * k) for t in (1, 8, 64) for k in (10, 1000, 10000)]
    fit = fit_step_time(rows)
    assert fit["per_kv_token_s"] == 0.0 and fit["base_s"] > 0 and fit["per_token_s"] > 0


def test_fit_rejects_an_unknown_loss():
    with pytest.raises(ValueError, match="loss must be 'l1' or 'l2'"):
        fit_step_time(_step_rows(10), loss="l3")


def test_l1_fit_recovers_coefficients_despite_stalls():
    rng = random.Random(0)
    rows = []
    for _ in range(400):
        t, k = rng.randint(1, 300), rng.randint(1, 20000)
        s = 0.002 + 1e-4 * t + 1e-6 * k
        if rng.random() < 0.1:
            s *= 3  # a stall from another job
        rows.append((t, k, s * (1 + rng.uniform(-0.01, 0.01))))
    fit = fit_step_time(rows, loss="l1")
    assert abs(fit["base_s"] / 0.002 - 1) < 0.05 and abs(fit["per_token_s"] / 1e-4 - 1) < 0.05
    assert fit["median_ape"] < 0.02


def test_binned_samples_keep_every_step_once():
    rows = _step_rows(500)
    bins = binned_samples(rows)
    assert sum(b["steps"] for b in bins) == 500
    assert bins == sorted(bins, key=lambda b: (b["tokens"], b["kv_tokens_read"]))


# --- predictions come from the one step-time formula -----------------------------------------

class _Recorded:
    tokens = [0, 1, 7, 300]
    kv_tokens_read = [0, 40, 900, 20000]
    decodes = [0, 1, 6, 4]
    prefills = [0, 0, 1, 2]
    prefill_pairs = [0, 0, 6, 30000]
    first_decodes = [0, 1, 2, 0]


@pytest.mark.parametrize("per_decode_token_s", [None, 3e-4])
@pytest.mark.parametrize("per_prefill_s", [0.0, 2e-3])
@pytest.mark.parametrize("per_after_prefill_s", [0.0, 1e-3])
@pytest.mark.parametrize("per_after_prefill_token_s", [0.0, 1e-6])
def test_step_time_errors_predict_with_the_profiles_formula(per_decode_token_s, per_prefill_s, per_after_prefill_s,
                                                            per_after_prefill_token_s):
    profile = Profile("toy", "a toy", kv_capacity_tokens=4096, idle_s=0.5, per_decode_token_s=per_decode_token_s,
                      per_prefill_s=per_prefill_s, per_after_prefill_s=per_after_prefill_s, after_prefill_decay=0.5,
                      per_after_prefill_token_s=per_after_prefill_token_s, **COEFFICIENTS)
    real = [0.5, 0.003, 0.004, 0.06]
    errors = step_time_errors(_Recorded(), real, profile)
    assert errors["steps"] == 3  # the idle step is left out
    after = [0.0, 0.0, 1.0]  # the third busy step follows the second, which prefilled
    prefilled = _Recorded.tokens[2] - _Recorded.decodes[2]
    after_tokens = [0.0, 0.0, float(prefilled)]
    expected = [profile.step_time_s(t, k, n, c, q, f, a, b) for t, k, n, c, q, f, a, b in
                zip(_Recorded.tokens[1:], _Recorded.kv_tokens_read[1:], _Recorded.decodes[1:], _Recorded.prefills[1:],
                    _Recorded.prefill_pairs[1:], _Recorded.first_decodes[1:], after, after_tokens)]
    assert (expected[2] - profile.step_time_s(300, 20000, 4) == pytest.approx(
        2 * per_prefill_s + per_after_prefill_s + per_after_prefill_token_s * prefilled))
    np.testing.assert_array_equal(errors["predicted_s"], expected)
    ape = np.abs(np.array(expected) - real[1:]) / real[1:]
    assert errors["mape"] == pytest.approx(ape.mean())


# --- fitting on recorded serving steps (engine.twin.fit) -------------------------------------

def _write_steps(path, rows) -> None:
    with open(path, "w") as f:
        f.write("tokens,kv_tokens_read,real_s,predicted_s\n")
        f.write("0,0,0.5,0.5\n")  # an idle step: not a row of the fit
        for t, k, s in rows:
            f.write(f"{t},{k},{s:.9g},0\n")


@pytest.mark.slow  # builds the tiny model for its config (importing transformers takes seconds)
def test_profile_from_recorded_steps(tmp_path):
    path = tmp_path / "twin_steps.csv"
    _write_steps(path, _step_rows(40))
    assert len(read_steps_csv(path)) == 40
    profile = run_profile_from_steps(path, name="from-steps")
    for key, value in COEFFICIENTS.items():
        assert getattr(profile, key) == pytest.approx(value, rel=1e-4), key
    assert profile.name == "from-steps" and profile.extra["method"] == "steps"
    assert profile.kv_capacity_tokens == 8 * 2048  # eight contexts of the tiny model
    profile.save(tmp_path / "p.json")
    assert load_profile(tmp_path / "p.json") == profile


def test_steps_file_without_the_columns_is_one_sentence(tmp_path):
    path = tmp_path / "other.csv"
    path.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="expected the columns tokens, kv_tokens_read, real_s"):
        read_steps_csv(path)
    _write_steps(path, _step_rows(2))
    with pytest.raises(ValueError, match="fewer than 3 steps"):
        read_steps_csv(path)


# --- the profiler's grid (engine.real.profiler) ----------------------------------------------

@pytest.mark.slow
def test_profiler_grid_fits_a_loadable_profile(tmp_path):
    from tidegate.engine.real.profiler import QUICK_GRID, grid_points, run_profile

    profile = run_profile("tiny", device="cpu", name="grid-test", quick=True, repeats=1, passes=1)
    assert min(profile.base_s, profile.per_token_s, profile.per_kv_token_s) >= 0
    assert profile.base_s + profile.per_token_s + profile.per_kv_token_s > 0
    assert profile.extra["method"] == "grid" and profile.extra["fit"]["points"] == len(grid_points(QUICK_GRID))
    assert all(s["step_s"] > 0 for s in profile.extra["samples"])
    profile.save(tmp_path / "grid-test.json")
    assert load_profile(tmp_path / "grid-test.json") == profile


# --- the twin check end to end (engine.twin.check) -------------------------------------------

def _finished(ttft: float, tpot: float, arrival: float = 0.0, tokens: int = 11):
    r = Request("r", arrival, 10, 100)
    r.num_output_tokens = tokens
    r.first_token_time_s = arrival + ttft
    r.finish_time_s = r.first_token_time_s + tpot * (tokens - 1)
    r.state = RequestState.FINISHED
    return r


def test_ks_distance_is_zero_for_the_same_latencies_and_one_for_disjoint_ones():
    same = [_finished(0.1 * i, 0.01 * i) for i in range(1, 20)]
    assert ks_distances(same, list(same)) == {"ttft_s": 0.0, "tpot_s": 0.0, "e2e_s": 0.0}
    late = [_finished(10 + 0.1 * i, 1 + 0.01 * i) for i in range(1, 20)]
    assert ks_distances(same, late) == {"ttft_s": 1.0, "tpot_s": 1.0, "e2e_s": 1.0}
    half = same[:10] + late[:9]  # 10 of the 19 from the same distribution
    assert 0.4 < ks_distances(same, half)["ttft_s"] < 0.6
    assert all(math.isnan(v) for v in ks_distances(same, []).values())
    # a request that did not finish (here one cancelled after its first token) is not counted
    cancelled = _finished(5.0, 5.0)
    cancelled.state = RequestState.CANCELLED
    assert ks_distances(same, same + [cancelled]) == {"ttft_s": 0.0, "tpot_s": 0.0, "e2e_s": 0.0}


@pytest.mark.slow
def test_twin_check_end_to_end(tmp_path):
    from tidegate.engine.twin.check import run_twin_check

    report = run_twin_check(model="tiny", trace="splitwise_conv", first_n=16, length_scale=0.05, rate_scale=10.0,
                            profile_name="tiny-cpu", device="cpu", out_dir=tmp_path)
    assert {"trace", "requests", "profile", "model", "step_time", "step_time_by_size", "speed_drift", "metrics",
            "targets_met", "real_summary", "sim_summary", "table"} <= set(report)
    assert report["requests"] == 16 and set(report["metrics"]) == set(COMPARED)
    completed = report["metrics"]["completed"]
    assert completed["real"] == completed["sim"] == 16
    assert report["step_time"]["steps"] > 0 and report["step_time"]["mape"] >= 0
    assert set(report["targets_met"]) == {"step_time_mape", "throughput_rps", "ttft_p50_s"}
    assert set(report["ks_distance"]) == {"ttft_s", "tpot_s", "e2e_s"}
    assert all(0 <= d <= 1 for d in report["ks_distance"].values()) and "KS distance" in report["table"]
    assert report["real_sampling"]["tpot_p99_s"][0] <= 0 <= report["real_sampling"]["tpot_p99_s"][1]
    assert "the real run's own sampling" in report["table"]
    assert json.loads((tmp_path / "twin_report.json").read_text())["requests"] == 16
    assert (tmp_path / "twin_step_time.png").stat().st_size > 0
    # The steps it recorded are what --from-steps fits on.
    assert len(read_steps_csv(tmp_path / "twin_steps.csv")) == report["step_time"]["steps"]
    assert (tmp_path / "twin_requests.csv").read_text().count("\n") == 17


@pytest.mark.slow
def test_fit_around_serves_half_the_profiling_slice_before_the_check_and_half_after():
    from tidegate.engine.twin.fit import fit_around

    events: list[str] = []
    seen: list[Profile] = []

    def check(first: Profile) -> str:
        events.append("check")
        seen.append(first)
        return "checked"

    profile, first, result = fit_around(check, model="tiny", device="cpu", trace="splitwise_conv", skip=16,
                                        first_n=12, length_scale=0.05, rate_scale=10.0,
                                        log=lambda line: events.append(line.split(":")[0]))
    order = [e for e in events if e in ("check", "profiling before the check", "profiling after the check")]
    assert order == ["profiling before the check", "check", "profiling after the check"]
    assert result == "checked" and seen == [first]
    runs = profile.extra["serving"]["runs"]
    assert [r["when"] for r in runs] == ["before", "after"]
    assert [r["when"] for r in first.extra["serving"]["runs"]] == ["before"]
    # the pooled fit has the steps of both halves, the first one only its own
    assert profile.extra["fit"]["points"] == runs[0]["steps"] + runs[1]["steps"] > first.extra["fit"]["points"]
    assert first.extra["fit"]["points"] == runs[0]["steps"]


def test_speed_runs_name_a_run_without_a_single_token_step_instead_of_dropping_it():
    # a short slice can end with no batch-1 decode in one of its runs: both runs are still named
    assert _runs_text({"runs_s": {"before": None, "after": 0.00105}}) == \
        " (before without a single-token step, after 1.05 ms)"
    assert _runs_text({"runs_s": {"before": 0.00102, "after": 0.00105}}) == " (before 1.02 ms, after 1.05 ms)"
    assert _runs_text({}) == ""


@pytest.mark.slow
def test_twin_check_fitted_around_simulates_with_the_profile_it_wrote(tmp_path):
    from tidegate.ctrl import build_controller
    from tidegate.engine.twin.check import run_twin_check
    from tidegate.engine.workloads import read_trace, resolve_trace

    report = run_twin_check(model="tiny", trace="splitwise_conv", first_n=8, length_scale=0.05, rate_scale=10.0,
                            device="cpu", out_dir=tmp_path, fit_around=True)
    profile = load_profile(str(tmp_path / "profile.json"))
    assert report["fit_around"] and report["profile"] == profile.name == "around-check"
    assert set(report["speed_drift"]["runs_s"]) == {"before", "after"}
    assert "(before " in report["table"] and ", after " in report["table"]
    # the profile's serving steps are kept, and fitting on them again gives the same profile
    refit = run_profile_from_steps(tmp_path / "profile_steps.csv", name="around-check")
    for key in ("base_s", "per_token_s", "per_kv_token_s", "noise_sigma", "noise_sigma_below", "noise_corr",
                "noise_white"):
        assert getattr(refit, key) == pytest.approx(getattr(profile, key), rel=1e-6), key
    arrivals = read_trace(resolve_trace("splitwise_conv"), first_n=8, rate_scale=10.0, length_scale=0.05,
                          max_tokens_cap=256)
    seeds = report["noise_seeds"]
    assert seeds == (NOISE_SEEDS if profile.noise_sigma else 1)
    again, requests = simulate_seeds(arrivals, profile, lambda: build_controller("greedy", profile, arrivals), seeds)
    virtual = {k: v for k, v in json.loads(json.dumps(again, default=float)).items() if k != "wall_time_s"}
    assert {k: report["sim_summary"][k] for k in virtual} == virtual
    # every seed's simulated requests are written, and twin_requests.csv has seed 0's
    pooled = (tmp_path / "twin_sim_requests.csv").read_text().splitlines()
    assert len(pooled) == 1 + sum(map(len, requests)) and {line.split(",")[0] for line in pooled[1:]} == {
        str(s) for s in range(seeds)}
    seed0 = {line.split(",")[1]: line.split(",")[3:] for line in pooled[1:] if line.startswith("0,")}
    rows = (tmp_path / "twin_requests.csv").read_text().splitlines()[1:]
    assert {r.split(",")[0]: [r.split(",")[5], r.split(",")[7]] for r in rows} == seed0
    assert report["sim_summary"]["completed"] == 8


def _noisy_check_inputs():
    from tidegate.ctrl import build_controller
    from tidegate.engine.workloads import read_trace, resolve_trace

    arrivals = read_trace(resolve_trace("splitwise_conv"), first_n=60, length_scale=0.1, max_tokens_cap=256)
    profile = dataclasses.replace(load_profile("tiny-cpu"), noise_sigma=0.3, noise_corr=0.9)
    return arrivals, profile, lambda p=profile: build_controller("greedy", p, arrivals)


def test_simulate_seeds_pools_every_seeds_requests_into_the_percentiles():
    from tidegate.engine.sim.simulate import simulate

    arrivals, profile, controller = _noisy_check_inputs()
    summary, requests = simulate_seeds(arrivals, profile, controller, 3)
    assert len(requests) == 3 and all(len(r) == 60 for r in requests)
    runs = [simulate(arrivals, profile, controller(), record_steps=False, noise_seed=s) for s in range(3)]
    # the same requests as each seed's own simulation
    assert [[r.finish_time_s for r in reqs] for reqs in requests] == [
        [r.finish_time_s for r in run.core.metrics.terminal] for run in runs]
    assert len({run.summary["tpot_p99_s"] for run in runs}) == 3  # the seeds do differ
    every = latencies([r for reqs in requests for r in reqs])
    for key, (which, q) in POOLED.items():
        assert summary[key] == pytest.approx(float(np.percentile(every[which], q)), rel=1e-12), key
    # a figure the seeds share keeps its value (an int stays one); one they differ on is their
    # mean, a peak their largest
    assert summary["completed"] == 60 and isinstance(summary["completed"], int)
    assert summary["throughput_rps"] == pytest.approx(np.mean([run.summary["throughput_rps"] for run in runs]))
    assert summary["kv_peak_tokens"] == max(run.summary["kv_peak_tokens"] for run in runs)
    # one seed is that simulation's own summary
    one, _ = simulate_seeds(arrivals, profile, controller, 1)
    assert {k: v for k, v in one.items() if k != "wall_time_s"} == {
        k: v for k, v in runs[0].summary.items() if k != "wall_time_s"}


def test_simulate_seeds_runs_a_noiseless_profile_once_and_refuses_no_seeds():
    arrivals, profile, _ = _noisy_check_inputs()
    quiet = dataclasses.replace(profile, noise_sigma=0.0, noise_corr=0.0)
    from tidegate.ctrl import build_controller

    _, requests = simulate_seeds(arrivals, quiet, lambda: build_controller("greedy", quiet, arrivals), 5)
    assert len(requests) == 1
    with pytest.raises(ValueError, match="at least 1"):
        simulate_seeds(arrivals, quiet, lambda: build_controller("greedy", quiet, arrivals), 0)


def test_seed_spread_brackets_each_single_seed_figure():
    arrivals, profile, controller = _noisy_check_inputs()
    real_summary, (real_requests,) = simulate_seeds(arrivals, dataclasses.replace(profile, noise_sigma=0.0),
                                                    controller, 1)
    _, requests = simulate_seeds(arrivals, profile, controller, 4)
    spread = seed_spread(real_summary, real_requests, requests)
    assert set(spread) == {"ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "ks_tpot"}
    per_seed = [float(np.percentile(latencies(r)["tpot_s"], 99)) / real_summary["tpot_p99_s"] - 1 for r in requests]
    assert spread["tpot_p99_s"] == pytest.approx([min(per_seed), max(per_seed)])
    ks = [ks_distances(real_requests, r)["tpot_s"] for r in requests]
    assert spread["ks_tpot"] == [min(ks), max(ks)] and 0 < min(ks) <= max(ks) <= 1


def test_real_sampling_is_the_bootstrap_range_of_the_real_figures():
    arrivals, profile, controller = _noisy_check_inputs()
    _, (real_requests,) = simulate_seeds(arrivals, profile, controller, 1)
    _, requests = simulate_seeds(arrivals, profile, controller, 4)
    sampling = real_sampling(real_requests, requests)
    assert set(sampling) == {"ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "ks_tpot"}
    for key in ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s"):
        lo, hi = sampling[key]
        assert -1 < lo <= 0 <= hi, key
    # the tail rests on a few requests, the median on many
    assert np.subtract(*sampling["tpot_p99_s"][::-1]) > np.subtract(*sampling["tpot_p50_s"][::-1])
    assert sampling == real_sampling(real_requests, requests)  # seeded
    # the KS floor: two samples of n and m, 1.358 * sqrt((n + m) / (n m))
    n, m = len(latencies(real_requests)["tpot_s"]), sum(len(latencies(r)["tpot_s"]) for r in requests)
    assert sampling["ks_tpot"] == [0.0, pytest.approx(1.3581 * ((n + m) / (n * m)) ** 0.5, rel=1e-3)]
    # requests that all took the same time leave no room for luck
    same = real_sampling([real_requests[0]] * 50, requests)
    assert same["ttft_p99_s"] == [0.0, 0.0]


def test_twin_check_cli_passes_its_noise_seeds_on_and_defaults_to_the_checks(monkeypatch):
    from click.testing import CliRunner

    import tidegate.engine.twin.check
    from tidegate.engine.cli import main

    seen: list[int] = []

    def fake_check(**kw):
        seen.append(kw["noise_seeds"])
        return {"table": "checked"}

    monkeypatch.setattr(tidegate.engine.twin.check, "run_twin_check", fake_check)
    for extra, want in (([], NOISE_SEEDS), (["--noise-seeds", "3"], 3)):
        res = CliRunner().invoke(main, ["twin-check", "--trace", "splitwise_conv", *extra])
        assert res.exit_code == 0 and "checked" in res.output, res.output
        assert seen[-1] == want
    res = CliRunner().invoke(main, ["twin-check", "--trace", "splitwise_conv", "--noise-seeds", "0"])
    assert res.exit_code == 2 and "Traceback" not in res.output


def test_a_check_whose_steps_fit_no_fixed_cost_still_reports_its_refit():
    rows = [(t, 100 * t, 2e-4 * t + 1e-6 * 100 * t - 1e-5) for t in range(1, 60)]
    t, k, s = (np.array(c, dtype=float) for c in zip(*rows))
    zeros = np.zeros(len(rows))
    refit = refit_floor({"tokens": t, "kv_tokens_read": k, "real_s": s, "decodes": zeros, "prefills": zeros,
                         "prefill_pairs": zeros, "first_decodes": zeros})
    assert refit["refit_coefficients"]["base_s"] == 0.0 and refit["refit_coefficients"]["idle_s"] > 0
    assert refit["refit_mape"] < 0.05


def test_twin_check_takes_a_profile_or_fits_one_around_not_both():
    from click.testing import CliRunner

    from tidegate.engine.cli import main

    res = CliRunner().invoke(main, ["twin-check", "--trace", "splitwise_conv", "--fit-around", "--profile", "tiny-cpu"])
    assert res.exit_code == 2 and "exclude each other" in res.output and "Traceback" not in res.output


def test_steps_file_with_decodes_reads_them_and_an_old_one_still_reads(tmp_path):
    path = tmp_path / "twin_steps.csv"
    path.write_text("tokens,kv_tokens_read,real_s,predicted_s,decodes\n0,0,0.5,0.5,0\n9,300,0.01,0,8\n"
                    "1,40,0.002,0,1\n128,128,0.02,0,0\n")
    assert read_steps_csv(path) == [(9, 300, 0.01, 8), (1, 40, 0.002, 1), (128, 128, 0.02, 0)]
    _write_steps(path, _step_rows(5))
    assert all(len(r) == 3 for r in read_steps_csv(path))


def test_steps_file_with_prefill_chunks_and_pairs_reads_them(tmp_path):
    path = tmp_path / "twin_steps.csv"
    path.write_text("tokens,kv_tokens_read,real_s,predicted_s,decodes,prefills,prefill_pairs\n"
                    "0,0,0.5,0.5,0,0,0\n9,300,0.01,0,8,1,1\n1,40,0.002,0,1,0,0\n128,128,0.02,0,0,1,8256\n")
    assert read_steps_csv(path) == [(9, 300, 0.01, 8, 1, 1), (1, 40, 0.002, 1, 0, 0), (128, 128, 0.02, 0, 1, 8256)]
    path.write_text("tokens,kv_tokens_read,real_s,predicted_s,decodes,prefills\n9,300,0.01,0,8,1\n"
                    "1,40,0.002,0,1,0\n128,128,0.02,0,0,1\n")
    assert read_steps_csv(path) == [(9, 300, 0.01, 8, 1), (1, 40, 0.002, 1, 0), (128, 128, 0.02, 0, 1)]


def test_speed_adjusted_errors_scale_every_cost_of_the_profile():
    import dataclasses

    from tidegate.ctrl import build_controller
    from tidegate.engine.twin.check import _speed_adjusted_errors, compare_metrics
    from tidegate.engine.workloads import read_trace, resolve_trace

    profile = Profile("toy", "a toy", kv_capacity_tokens=8192, per_decode_token_s=3e-4, per_prefill_s=2e-3,
                      per_first_decode_s=1e-3, per_after_prefill_s=1e-3, after_prefill_decay=0.5,
                      per_after_prefill_token_s=2e-6, per_prefill_pair_s=1e-8, noise_sigma=0.2, noise_corr=0.8,
                      per_prefill_alone_s=1e-3, **COEFFICIENTS)
    costs = ("base_s", "per_token_s", "per_kv_token_s", "per_decode_token_s", "per_prefill_s", "per_prefill_pair_s",
             "per_first_decode_s", "per_after_prefill_s", "per_after_prefill_token_s", "per_prefill_alone_s")
    slower = dataclasses.replace(profile, **{c: 1.5 * getattr(profile, c) for c in costs})
    arrivals = read_trace(resolve_trace("splitwise_conv"), first_n=40, length_scale=0.1, max_tokens_cap=256)

    def summary(p):
        return simulate_seeds(arrivals, p, lambda: build_controller("greedy", p, arrivals), 3)[0]

    # a machine 1.5x slower than profiled: the profile scaled by 1.5 predicts it exactly, noise
    # seed by noise seed (the diagnostic pools the seeds as the check does)
    rows = compare_metrics(summary(slower), summary(profile))
    _, real_requests = simulate_seeds(arrivals, slower, lambda: build_controller("greedy", slower, arrivals), 1)
    adjusted, ks = _speed_adjusted_errors(arrivals, profile, lambda: build_controller("greedy", profile, arrivals), 1.5,
                                          rows, 3, real_requests[0])
    # the real side here is seed 0 alone, and seed 0 of the scaled profile gives the same requests
    assert 0 < ks["tpot_s"] < 1 and set(ks) == {"ttft_s", "tpot_s", "e2e_s"}
    assert _speed_adjusted_errors(arrivals, profile, lambda: build_controller("greedy", profile, arrivals), 1.5,
                                  rows, 1, real_requests[0])[1] == {"ttft_s": 0.0, "tpot_s": 0.0, "e2e_s": 0.0}
    assert set(adjusted) <= set(COMPARED)
    for key in ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "e2e_p50_s"):
        assert adjusted[key] == pytest.approx(0.0, abs=1e-9), key
        assert abs(rows[key]["rel_error"]) > 0.1, key
