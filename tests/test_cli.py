import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

from tidegate.engine.cli import main

SIMULATE_KEYS = {"requests", "completed", "rejected", "expired", "evictions", "wasted_tokens", "throughput_rps",
                 "output_tps", "goodput_rps", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s",
                 "e2e_p99_s", "kv_usage_mean", "kv_usage_std", "kv_peak_tokens", "kv_capacity_tokens",
                 "mean_waiting", "final_waiting", "sim_time_s", "wall_time_s"}


def run(*args):
    return CliRunner().invoke(main, list(args))


def test_simulate_json_has_every_field():
    res = run("simulate", "--trace", "splitwise_conv", "--first", "300", "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert SIMULATE_KEYS <= set(data)
    assert data["requests"] == 300
    assert data["completed"] + data["rejected"] + data["expired"] == 300
    assert 0 <= data["kv_usage_mean"] <= 1 and data["kv_peak_tokens"] <= data["kv_capacity_tokens"]


def test_simulate_at_a_load_multiple_and_with_a_workload():
    res = run("simulate", "--workload", "paper_sec41", "--profile", "slot", "--controller", "class-budgets",
              "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["evictions"] == 0
    hi = json.loads(run("simulate", "--trace", "splitwise_code", "--first", "400", "--load", "2.0", "--json").output)
    lo = json.loads(run("simulate", "--trace", "splitwise_code", "--first", "400", "--load", "0.5", "--json").output)
    assert hi["sim_time_s"] < lo["sim_time_s"]


def test_simulate_eviction_modes():
    args = ("simulate", "--trace", "splitwise_conv", "--first", "400", "--load", "3.0", "--json")
    recompute = json.loads(run(*args).output)
    reset = json.loads(run(*args, "--eviction", "reset").output)
    assert recompute["eviction"] == "recompute" and reset["eviction"] == "reset"
    assert recompute["evictions"] > 0 and reset["evictions"] > 0
    assert recompute["requests"] == reset["requests"] == 400
    assert "the paper's model" in " ".join(run("simulate", "--help").output.split())  # however click wraps it
    bad = run("simulate", "--trace", "splitwise_conv", "--eviction", "lifo")
    assert bad.exit_code == 2 and "Traceback" not in bad.output


def test_capacity_json():
    res = run("capacity", "--trace", "splitwise_conv", "--profile", "a100-llama2-7b", "--json")
    data = json.loads(res.output)
    assert data["lambda_max_rps"] > 0 and data["lifetime_kv_workload"] > data["mean_tokens_per_request"]


@pytest.mark.parametrize("args, message", [
    (["simulate", "--trace", "missing.csv"], "missing.csv"),
    (["simulate", "--trace", "splitwise_conv", "--controller", "nope"], "unknown controller 'nope'"),
    (["simulate", "--trace", "splitwise_conv", "--profile", "nope"], "unknown profile 'nope'"),
    (["capacity", "--trace", "splitwise_conv", "--workload", "paper_sec41"], "exactly one of"),
    (["bench", "--loads", "a,b"], "--loads must be"),
    (["twin-check", "--trace", "splitwise_conv", "--pin-cpu", "100000"], "core 100000 is not one this process"),
    (["profile", "--quick", "--out", "/tmp/unused.json", "--pin-cpu", "100000"], "core 100000 is not one"),
    (["simulate", "--trace", "splitwise_conv", "--first", "5", "--controller", "learned:policy=/nonexistent.onnx"],
     "cannot load /nonexistent.onnx"),
    (["simulate", "--trace", "splitwise_conv", "--load", "nan"], "is not a positive finite number"),
    (["bench", "--loads", "1,inf"], "--loads must be positive finite numbers"),
    (["simulate", "--workload", "paper_sec41", "--seed=-1"], "-1 is not in the range x>=0"),
    (["loadgen", "--dataset", "random", "--url", "http://127.0.0.1:1", "--duration", "1"], "needs --rate"),
    (["loadgen", "--dataset", "random", "--url", "notaurl", "--num-requests", "1"], "cannot be reached"),
    (["roofline", "--write", "--out-dir", "/proc/unwritable"], "/proc/unwritable"),
    (["train", "--timesteps", "0"], "0 is not in the range x>=1"),
    (["capacity", "--trace", "splitwise_conv", "--load", "5"], "--load applies to simulate"),
    (["tune", "--minutes", "nan"], "is not a positive finite number"),
    (["bench", "--controllers", ";"], "names no controller"),
    (["simulate", "--trace", "splitwise_conv", "--replicas", "2", "--replica-profiles", "slot,slot,slot"],
     "names 3 profiles for 2 replicas"),
])
def test_bad_input_gets_one_line_and_exit_2(args, message):
    res = run(*args)
    assert res.exit_code == 2
    assert message in res.output
    assert "Traceback" not in res.output


def test_a_controller_that_admits_nothing_ends_the_run_with_one_line(tmp_path, monkeypatch):
    from tidegate.engine.core import driver

    monkeypatch.setattr(driver, "STALL_STEPS", 1000)
    trace = tmp_path / "one.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,100,10\n")
    res = run("simulate", "--trace", str(trace), "--controller", "flow:budget=0")
    assert res.exit_code == 2 and "admitted none of 1 waiting requests in 1,000 steps" in res.output


def test_json_figures_that_are_no_number_are_null(tmp_path):
    trace = tmp_path / "huge.csv"  # no request fits the KV cache: no latency to report
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,10000000,10\n")
    res = run("simulate", "--trace", str(trace), "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.output, parse_constant=lambda name: pytest.fail(f"{name} in --json"))
    assert data["rejected"] == 1 and data["ttft_p50_s"] is None


def test_a_mooncake_number_past_a_floats_range_is_one_line(tmp_path):
    trace = tmp_path / "big.jsonl"
    trace.write_text(json.dumps({"timestamp": 0, "input_length": 10 ** 400, "output_length": 10}) + "\n")
    res = run("simulate", "--trace", str(trace))
    assert res.exit_code == 2 and "Traceback" not in res.output and "input_length" in res.output


def test_malformed_trace_names_file_and_line(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n0.0,10,5\n0.5,ten,5\n")
    proc = subprocess.run([sys.executable, "-m", "tidegate", "simulate", "--trace", str(bad)],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert f"{bad}:3:" in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_bench_writes_table_csv_and_plots(tmp_path):
    res = run("bench", "--trace", "splitwise_code", "--first", "150", "--loads", "1.0,2.0",
              "--controllers", "greedy;flow:adaptive=true", "--jobs", "1", "--out", str(tmp_path))
    assert res.exit_code == 0, res.output
    assert "| splitwise_code | 2 | flow:adaptive=true |" in res.output
    for name in ("results.csv", "results.md", "kv_usage_splitwise_code.png", "ttft_cdf_splitwise_code.png",
                 "goodput_splitwise_code.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    assert len((tmp_path / "results.csv").read_text().splitlines()) == 1 + 4


def test_pin_cpu_runs_the_process_on_one_core_with_one_thread():
    import subprocess
    import sys

    code = ("import os, torch; from engine.cli.real import _threads; core = max(os.sched_getaffinity(0)); "
            "_threads(None, core); print(sorted(os.sched_getaffinity(0)) == [core], torch.get_num_threads())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["True", "1"]


def test_serve_help_gives_the_engine_niceness_the_server_uses():
    from tidegate.engine.serve.config import ENGINE_NICE, ServeConfig

    assert ServeConfig().engine_nice == ENGINE_NICE
    assert f"[default: {ENGINE_NICE}]" in " ".join(run("serve", "--help").output.split())
    for bad in (-1, 20):
        with pytest.raises(ValueError, match="engine_nice"):
            ServeConfig(engine_nice=bad)
