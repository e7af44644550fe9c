"""Bad input to the fleet and gateway benchmarks: one sentence and exit code 2 before anything runs, no traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(("args", "says"), [
    (["gateway_rule.py", "run", "--out", "{tmp}/o", "--families", "nope"], "unknown family 'nope'"),
    (["gateway_rule.py", "run", "--out", "{tmp}/o", "--loads", "1,,2"], "--loads '1,,2' is not valid"),
    (["gateway_rule.py", "run", "--out", "{tmp}/o", "--draws", "a"], "--draws 'a' is not valid"),
    (["gateway_rule.py", "compare", "{tmp}/a", "{tmp}/b", "--out", "{tmp}/o"], "rule.json: not found"),
    (["gateway_rule.py", "compare", "{tmp}/bad", "{tmp}/bad", "--out", "{tmp}/o"], "not a rule.json"),
    (["fleet_admission.py", "--run", "{tmp}", "--out", "{tmp}/o", "--families", "chat,nope"], "unknown family 'nope'"),
    (["fleet_admission.py", "--run", "{tmp}", "--out", "{tmp}/o", "--fixed", "0,x"], "--fixed '0,x' is not valid"),
    (["fleet_admission.py", "--run", "{tmp}", "--out", "{tmp}/o"], "no model.zip"),
    (["gateway_relay.py", "--out", "{tmp}/o", "--concurrency", "16,x"], "--concurrency '16,x' is not valid"),
    (["gateway_relay.py", "--out", "{tmp}/o", "--concurrency", "0"], "--concurrency '0' is not valid"),
    (["gateway_relay.py", "--out", "{tmp}/o", "--output-len", "0"], "--output-len and --one-by-one must be at least 1"),
    (["gateway_relay.py", "--out", "{tmp}/o", "--before", "{tmp}/bad"], "is not a run of this script"),
    (["gateway_pair.py", "--out", "{tmp}/o", "--loads", "1,x"], "--loads '1,x' is not valid"),
    (["gateway_pair.py", "--out", "{tmp}/o", "--loads", "0,1"], "every load must be above 0"),
    (["gateway_pair.py", "--out", "{tmp}/o", "--replica-controller", "nope"], "unknown controller 'nope'"),
])
def test_fleet_benchmark_bad_input(tmp_path, args, says):
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "rule.json").write_text("{not json")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in args]
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / argv[0]), *argv[1:]], capture_output=True,
                          text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert says in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()  # nothing written before the input was checked
