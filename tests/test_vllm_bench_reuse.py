"""The vLLM benchmark's ``--reuse``: an earlier run's rows stand for the arms a run leaves out, only where both
runs offered the same arrivals to the same servers (no vLLM is started here)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from tidegate.engine.bench.vllm.arms import ArmError, default_arms, merge_arms
from tidegate.engine.bench.vllm.reuse import SAME, ReuseError, load_result, reused_rows

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = {"model": "llama-24m", "model_seed": 0, "seed": 0, "prompt_tokens": 256, "max_tokens": 128,
            "duration_s": 120.0, "drain_s": 32.4, "ttft_slo_s": 2.0, "tpot_slo_s": 0.2,
            "vllm_args": "--dtype float32 --max-model-len 2048", "kv_cache_gib": "1", "probe_period_s": 0.5,
            "load_processes": 2}


def earlier(**changed) -> dict:
    rows = [{"arm": arm, "load": load, "goodput_rps": 1.0 + load} for arm in ("vllm", "tidegate")
            for load in (0.7, 1.5, 3.0)]
    rows.append({"arm": "vllm-queued-48", "load": None, "error": "ServerError: it never started"})
    return {"settings": {**SETTINGS, **changed}, "capacity": {"capacity_rps": 3.48, "capacity_clients": 32},
            "rows": rows}


def test_the_rows_of_the_arms_left_out_are_taken_at_this_runs_loads_with_the_capacity():
    rows, capacity = reused_rows(earlier(), SETTINGS, {"tidegate"}, (1.5, 3.0), "dec06")
    assert list(rows) == ["vllm"]  # the arm run again is measured again; a failed row is no figure
    assert [(r["load"], r["reused_from"]) for r in rows["vllm"]] == [(1.5, "dec06"), (3.0, "dec06")]
    assert capacity["capacity_rps"] == 3.48 and capacity["reused_from"] == "dec06"


@pytest.mark.parametrize("key", SAME)
def test_a_run_of_other_arrivals_or_servers_is_refused_in_one_sentence(key):
    other = earlier(**{key: "something else"})
    with pytest.raises(ReuseError) as err:
        reused_rows(other, SETTINGS, {"tidegate"}, (1.5,), "dec06")
    message = str(err.value)
    assert key in message and message.count(". ") == 0 and message.endswith(".")


def test_nothing_to_take_and_no_capacity_are_refused():
    with pytest.raises(ReuseError, match="no measured row"):
        reused_rows(earlier(), SETTINGS, {"vllm", "tidegate"}, (1.5,), "dec06")
    with pytest.raises(ReuseError, match="no measured row"):
        reused_rows(earlier(), SETTINGS, {"tidegate"}, (2.0,), "dec06")
    with pytest.raises(ReuseError, match="no capacity"):
        reused_rows({**earlier(), "capacity": None}, SETTINGS, {"tidegate"}, (1.5,), "dec06")


def test_the_result_is_read_from_the_file_or_its_folder(tmp_path):
    (tmp_path / "vllm_overload.json").write_text(json.dumps(earlier()))
    assert load_result(tmp_path) == load_result(tmp_path / "vllm_overload.json") == earlier()
    (tmp_path / "bad.json").write_text("[1, 2]")
    for bad in (tmp_path / "bad.json", tmp_path / "missing"):
        with pytest.raises(ReuseError):
            load_result(bad)


def test_vanilla_may_be_left_out_only_where_an_earlier_run_stands_for_it():
    defaults = default_arms("slo-flow", 2.0, 0.2)
    with pytest.raises(ArmError, match="--reuse"):
        merge_arms(defaults, [], ["tidegate"], (1.5, 3.0))
    assert [a.name for a in merge_arms(defaults, [], ["tidegate"], (1.5, 3.0), need_vanilla=False)] == ["tidegate"]


def _benchmark():
    spec = importlib.util.spec_from_file_location("vllm_overload", ROOT / "benchmarks" / "vllm_overload.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("extra, sentence", [
    ([], "must include vllm"),
    (["--reuse", "{missing}"], "cannot read"),
    (["--reuse", "{dir}", "--capacity-rps", "3"], "leave out --capacity-rps"),
    (["--reuse", "{dir}", "--seed", "1"], "seed"),
])
def test_the_command_refuses_what_it_cannot_compare_before_starting_anything(extra, sentence, tmp_path, capsys):
    (tmp_path / "vllm_overload.json").write_text(json.dumps(earlier()))
    argv = ["--arms", "tidegate", "--vllm-python", sys.executable, "--out", str(tmp_path / "out"),
            "--vllm-args", SETTINGS["vllm_args"], "--capacity-s", "1"]
    argv += [a.format(missing=tmp_path / "nothing.json", dir=tmp_path) for a in extra]
    with pytest.raises(SystemExit) as done:
        _benchmark().main(argv)
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert sentence in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out" / "vllm_overload.json").exists()
