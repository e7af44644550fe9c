"""The twin check against vLLM (``tidegate twin-check --engine vllm``): its parts on their own, then
one whole check against a real vLLM server (``.venv-vllm``) that the check starts and stops itself."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from click.testing import CliRunner

import numpy as np

from tidegate.ctrl import build_controller
from tidegate.engine.bench.vllm.twin_check import (
    VllmCheckError, VllmRuns, client_overhead, content_prompts, real_requests, replica_limits,
    simulate_twin, step_gaps,
)
from tidegate.engine.core.profile import load_profile
from tidegate.engine.sim.simulate import simulate
from tidegate.engine.workloads import load_workload
from tidegate.engine.cli import main as cli
from tidegate.engine.core.request import RequestState
from tidegate.engine.twin.fit import read_steps_csv, run_profile_from_steps, step_log_limits, step_rows
from tidegate.engine.vllm.step_log import COLUMNS, StepLog, StepRow
from tidegate.engine.workloads import Arrival

ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
needs_vllm = pytest.mark.skipif(not VLLM_PYTHON.exists(),
                                reason=".venv-vllm is missing: `make vllm-setup` makes it (`make test` does)")


def _row(step: int, time_s: float, real_s: float, tokens: int = 1, **more) -> dict[str, str]:
    row = dict.fromkeys(COLUMNS, "0")
    row.update(step=str(step), time_s=str(time_s), real_s=str(real_s), tokens=str(tokens), decodes=str(tokens),
               kv_capacity_tokens="8064", token_budget="2048", running_cap="128")
    row.update({k: str(v) for k, v in more.items()})
    return row


def test_content_prompts_share_tokens_where_the_workload_shares_content():
    ids = list(range(10, 60))
    shared = (7, 8)
    arrivals = [Arrival(0.0, 40, 4, 4, prefix_ids=shared, prefix_block_tokens=16),
                Arrival(1.0, 40, 4, 4, prefix_ids=(*shared, 9), prefix_block_tokens=16),
                Arrival(2.0, 40, 4, 4)]
    a, b, c = content_prompts(arrivals, ids, seed=3)
    assert [len(p) for p in (a, b, c)] == [40, 40, 40]
    assert all(x in ids for p in (a, b, c) for x in p)
    assert a[:32] == b[:32] and a[32:] != b[32:]
    assert a[:32] != c[:32]
    assert content_prompts(arrivals, ids, seed=4)[0][:32] != a[:32]  # another seed: other content


def test_real_requests_take_the_clients_times_and_outcomes():
    arrivals = [Arrival(0.0, 10, 5, 5), Arrival(0.5, 10, 5, 5), Arrival(1.0, 10, 5, 5)]
    t0 = 100.0
    records = [
        {"start_s": 100.0, "first_token_s": 100.2, "last_token_s": 100.6, "tokens": 5, "outcome": "completed",
         "status": 200, "end_s": 100.6},
        {"start_s": 100.5, "first_token_s": None, "last_token_s": None, "tokens": 0, "outcome": "http",
         "status": 429, "end_s": 100.51},
        {"start_s": 101.0, "first_token_s": 101.1, "last_token_s": 101.2, "tokens": 2, "outcome": "closed",
         "status": 200, "end_s": 101.2},
    ]
    done, refused, broken = real_requests(arrivals, t0, records)
    assert done.state is RequestState.FINISHED and done.num_output_tokens == 5
    assert math.isclose(done.first_token_time_s - done.arrival_time_s, 0.2)
    assert math.isclose(done.finish_time_s, 0.6)
    assert refused.state is RequestState.REJECTED and broken.state is RequestState.FAILED


def test_step_gaps_count_only_steps_scheduled_back_to_back():
    rows = [_row(0, 0.000, 0.010), _row(1, 0.011, 0.010), _row(2, 0.022, 0.010),
            _row(5, 3.0, 0.010),  # after an idle spell: not a gap
            _row(6, 3.0125, 0.010)]
    gaps = step_gaps(rows)
    assert gaps["steps"] == 3
    assert math.isclose(gaps["median_s"], 0.001, abs_tol=1e-9)
    assert math.isclose(gaps["of_median_step"], 0.1, rel_tol=1e-6)
    assert step_gaps(rows[:1]) == {"steps": 0}


def test_replica_limits_come_from_the_step_log_and_metrics():
    rows = [_row(0, 0.0, 0.01)]
    limits = replica_limits(rows, {"block_size": "128", "enable_prefix_caching": "True"})
    assert limits == {"kv_capacity_tokens": 8064, "block_size": 128, "max_num_seqs": 128,
                      "max_num_batched_tokens": 2048, "prefix_caching": True}
    rows[0]["token_budget"] = ""  # a step log from before the plugin wrote vLLM's own limits
    with pytest.raises(VllmCheckError, match="limits"):
        replica_limits(rows, {"block_size": "128"})


def test_step_rows_time_each_step_by_its_period_in_the_engine_loop():
    rows = [_row(0, 0.0, 0.010, tokens=3, kv_tokens_read=40, prefills=1, prefill_pairs=6),
            _row(1, 0.0115, 0.002, tokens=0),  # a step without tokens: not fitted, its gap still counts
            _row(2, 0.0140, 0.005),
            _row(7, 5.0, 0.004)]  # after an idle spell, and the last: the median gap
    got = step_rows(rows)
    assert [row[:2] + row[3:] for row in got] == [(3, 40, 3, 1, 6, 0), (1, 0, 1, 0, 0, 0), (1, 0, 1, 0, 0, 0)]
    assert [round(row[2], 9) for row in got] == [0.0115, 0.006, 0.005]


def test_profile_from_a_vllm_step_log_takes_its_replica_and_loop_periods(tmp_path):
    """``tidegate profile --from-steps`` on the plugin's step log: vLLM's KV, block size and batch
    limits, and each step timed by its period in the loop (a perfectly linear engine, a 1 ms loop gap)."""
    path = tmp_path / "steps.csv"
    log = StepLog(path)
    time_s = 0.0
    for i in range(60):
        tokens = 1 + (i * 7) % 40
        real_s = 0.002 + 1e-4 * tokens
        log.write(StepRow(i, time_s, real_s, tokens, 0, tokens, tokens, tokens, 0, 0, 0, 10 * tokens, 0, 0, 0,
                          tokens, 0, 8064, token_budget=2048, running_cap=128, block_size=128))
        time_s += real_s + 0.001
    log.close()
    rows = read_steps_csv(path)
    assert all(math.isclose(sec, 0.003 + 1e-4 * t, rel_tol=1e-6) for t, _, sec, *_ in rows)
    assert step_log_limits(path) == {"kv_capacity_tokens": 8064, "block_size": 128, "max_num_seqs": 128,
                                     "max_num_batched_tokens": 2048}
    profile = run_profile_from_steps(path, name="vllm")
    assert (profile.kv_capacity_tokens, profile.block_size, profile.max_num_seqs,
            profile.max_num_batched_tokens) == (8064, 128, 128, 2048)
    assert math.isclose(profile.step_time_s(20, 200, 20), 0.005, rel_tol=0.05)


def test_client_overhead_is_the_median_gap_between_measured_and_simulated_ttft():
    """Requests whose measured times are the twin's own, 5 ms later at the client: the overhead is 5 ms,
    and the twin with it added reproduces the measured TTFTs."""
    profile = load_profile("tiny-cpu")
    arrivals = load_workload("splitwise_conv", length_scale=0.1, max_tokens_cap=64)[:40]
    sim = simulate(arrivals, profile, build_controller("greedy", profile, arrivals), prefix_caching=True)
    ended = {int(r.request_id): r for r in sim.core.metrics.terminal}
    t0 = 1000.0
    records = [{"start_s": t0 + ended[i].arrival_time_s, "first_token_s": t0 + ended[i].first_token_time_s + 0.005,
                "last_token_s": t0 + ended[i].finish_time_s + 0.005, "tokens": ended[i].num_output_tokens,
                "outcome": "completed", "status": 200, "end_s": None} for i in range(len(arrivals))]
    runs = VllmRuns({"before": (t0, records)}, {}, {}, None)
    overhead = client_overhead([("before", arrivals)], runs, profile, "vllm", seed=0, prefix_caching=True)
    assert overhead == pytest.approx(0.005, abs=1e-9)
    summary, requests = simulate_twin(arrivals, profile, "greedy", 0, 1, True, overhead)
    assert summary["ttft_p50_s"] == pytest.approx(
        float(np.median([r["first_token_s"] - r["start_s"] for r in records])), rel=1e-9)


@pytest.mark.parametrize("args, message", [
    (["--engine", "vllm", "--device", "cpu"], "--device applies to tidegate's own engine"),
    (["--vllm-arg", "--max-num-seqs 8"], "--vllm-arg applies to --engine vllm"),
    (["--engine", "vllm", "--vllm-python", "/nowhere/python"], "vLLM's python '/nowhere/python' is missing"),
])
def test_twin_check_refuses_options_of_the_other_engine(args, message, tmp_path):
    result = CliRunner().invoke(cli, ["twin-check", "--trace", "splitwise_conv", "--out", str(tmp_path), *args])
    assert result.exit_code == 2
    assert message in result.output and "Traceback" not in result.output


def test_twin_check_says_in_one_line_that_vllm_exited_while_starting(tmp_path):
    """A vLLM that refuses its arguments exits while starting (a python that exits at once stands for it
    here: vLLM's own refusal of an unknown flag costs the half-minute of its imports first)."""
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\necho 'vllm: error: unrecognized arguments: --no-such-flag' >&2\nexit 2\n")
    python.chmod(0o755)
    result = CliRunner().invoke(cli, ["twin-check", "--engine", "vllm", "--trace", "splitwise_conv", "--first", "4",
                                      "--vllm-python", str(python), "--model", "tiny", "--out", str(tmp_path / "o")])
    assert result.exit_code == 2, result.output
    assert "vLLM exited with code 2" in result.output and "Traceback" not in result.output


@needs_vllm
def test_twin_check_against_vllm_refuses_a_model_it_cannot_find_in_one_line(tmp_path):
    result = CliRunner().invoke(cli, ["twin-check", "--engine", "vllm", "--trace", "splitwise_conv", "--first", "4",
                                      "--out", str(tmp_path), "--model", "/nowhere"])
    assert result.exit_code == 2, result.output
    assert "--model '/nowhere' is neither one of" in result.output and "Traceback" not in result.output


@needs_vllm
def test_twin_check_against_vllm(tmp_path):
    """The whole check on a small slice: vLLM serves the profiling halves and the check, the twin
    simulates the check with the profile fitted on vLLM's steps, and the report has the shape of the
    check against tidegate's engine. Loose bounds: a 2-core machine shared with the client. vLLM runs eager
    (``--vllm-arg``), as this suite's other vLLM servers: it starts without compiling its model first."""
    out = tmp_path / "out"
    result = CliRunner().invoke(cli, ["twin-check", "--engine", "vllm", "--trace", "splitwise_conv", "--first", "24",
                                      "--noise-seeds", "2", "--out", str(out), "--json",
                                      "--vllm-arg", "--enforce-eager"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output.strip().splitlines()[-1])
    assert report["engine"] == "vllm" and report["twin_controller"] == "greedy" and report["fit_around"]
    assert report["vllm_limits"]["block_size"] == 128 and report["vllm_limits"]["prefix_caching"]
    metrics = report["metrics"]
    assert metrics["completed"]["real"] == 24 and metrics["completed"]["sim"] == 24
    for key in ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s"):
        assert metrics[key]["real"] > 0 and abs(metrics[key]["rel_error"]) < 3.0, (key, metrics[key])
    assert 0 <= report["ks_distance"]["tpot_s"] <= 1
    assert report["step_time"]["steps"] > 0 and report["step_gaps"]["steps"] > 0
    profile = json.loads((out / "profile.json").read_text())
    assert profile["block_size"] == 128 and profile["max_num_batched_tokens"] == 2048
    assert profile["extra"]["serving"]["engine"] == "vllm"
    # tidegate profile --from-steps fits vLLM's step log as it is
    fitted = CliRunner().invoke(cli, ["profile", "--from-steps", str(out / "vllm_steps.csv"),
                                      "--out", str(tmp_path / "p.json")])
    assert fitted.exit_code == 0, fitted.output
    for name in ("twin_steps.csv", "twin_requests.csv", "twin_sim_requests.csv", "twin_step_time.png", "vllm.log"):
        assert (out / name).is_file()
