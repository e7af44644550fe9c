"""What an operator of the server sets and sees: the API key, the size limit, OpenAI's error body for
every error, /version, /tokenize and /detokenize, the context cap, and the start-up checks."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from importlib.metadata import version

import httpx
import openai
import pytest
from click.testing import CliRunner

from tidegate.engine.cli import main
from tidegate.engine.real.model import ByteTokenizer, load_model
from tests.test_server import Running, free_port

pytestmark = pytest.mark.timeout(180)

KEY = "sekret-key"
LIMIT_BYTES = 4096
CONTEXT = 200
TEMPLATE = ("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
            "{% if add_generation_prompt %}[assistant]{% endif %}")


@pytest.fixture(scope="module")
def server():
    s = Running(load_model("tiny", "cpu", "float32"), controller="greedy", api_key=KEY,
                max_request_bytes=LIMIT_BYTES, max_model_len=CONTEXT, chat_template=TEMPLATE)
    s.http = httpx.Client(base_url=s.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    yield s
    s.http.close()
    s.close()


def assert_error_body(r: httpx.Response, status: int, fragment: str = "") -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert fragment in body["error"]["message"], body
    return body["error"]


# ---------------------------------------------------------------------------------- the API key
def test_the_api_key_is_needed_on_the_api_and_not_on_the_probes(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    out = client.completions.create(model="tiny", prompt="hi", max_tokens=3, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 3
    wrong = openai.OpenAI(base_url=server.url + "/v1", api_key="not-the-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "hi"})
    assert_error_body(r, 401, "needs an API key")
    assert r.headers["WWW-Authenticate"] == "Bearer"
    assert_error_body(httpx.post(server.url + "/tokenize", json={"prompt": "hi"}), 401)
    assert_error_body(httpx.get(server.url + "/nowhere"), 401)
    for probe in ("/health", "/ready", "/metrics", "/version"):
        assert httpx.get(server.url + probe).status_code == 200, probe


# ---------------------------------------------------------------------------------- error bodies
JSON = {"content-type": "application/json"}


@pytest.mark.parametrize("method, path, content, headers, status, fragment", [
    ("GET", "/nowhere", None, {}, 404, "no route GET /nowhere"),
    ("GET", "/v1/completions", None, {}, 405, "does not take GET"),
    ("POST", "/v1/models", b"{}", JSON, 405, "does not take POST"),
    ("POST", "/v1/completions", b'{"model": "tiny", "prompt": ', JSON, 400, "not valid JSON"),
    ("POST", "/v1/completions", b'{"model": "tiny", "prompt": "\xff\xfe"}', JSON, 400, "not valid UTF-8"),
    ("POST", "/v1/completions", b"", JSON, 400, "empty"),
    ("POST", "/v1/chat/completions", b"", {}, 400, "empty"),
    ("POST", "/v1/completions", b"[1, 2]", JSON, 400, "JSON object"),
    ("POST", "/v1/completions", b'{"model": "tiny", "prompt": "hi"}', {"content-type": "text/plain"}, 415,
     "Content-Type: application/json"),
    ("POST", "/tokenize", b"prompt=hi", {"content-type": "application/x-www-form-urlencoded"}, 415, "must be JSON"),
])
def test_every_error_has_the_openai_error_body(server, method, path, content, headers, status, fragment):
    r = server.http.request(method, path, content=content, headers=headers)
    error = assert_error_body(r, status, fragment)
    assert error["code"] == status
    if status == 405:
        assert r.headers["Allow"]


def test_a_body_over_the_limit_gets_413_before_it_is_read(server):
    body = json.dumps({"model": "tiny", "prompt": "x" * LIMIT_BYTES}).encode()
    assert_error_body(server.http.post("/v1/completions", content=body, headers=JSON), 413, f"{LIMIT_BYTES} bytes")

    def chunked():  # no Content-Length: the bytes are counted as they arrive
        for i in range(0, len(body), 1000):
            yield body[i:i + 1000]

    assert_error_body(server.http.post("/v1/completions", content=chunked(), headers=JSON), 413)
    small = server.http.post("/v1/completions", json={"model": "tiny", "prompt": "x" * 100, "max_tokens": 2})
    assert small.status_code == 200, small.text


# ---------------------------------------------------------------------------------- routes
def test_version(server):
    assert server.http.get("/version").json() == {"version": version("tidegate")}


def test_tokenize_a_prompt_and_messages_and_detokenize_them(server):
    tok = ByteTokenizer()
    r = server.http.post("/tokenize", json={"model": "tiny", "prompt": "héllo"}).json()
    assert r == {"tokens": tok.encode("héllo"), "count": len(tok.encode("héllo")), "max_model_len": CONTEXT}
    back = server.http.post("/detokenize", json={"model": "tiny", "tokens": r["tokens"]}).json()
    assert back == {"prompt": "héllo"}
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    chat = server.http.post("/tokenize", json={"messages": messages, "add_generation_prompt": True}).json()
    # the byte tokenizer has no BOS text for a template to write: BOS comes as a token, as in the chat route
    assert chat["tokens"] == tok.encode("[system]be brief[user]hi[assistant]")
    served = server.http.post("/v1/chat/completions", json={"model": "tiny", "messages": messages, "max_tokens": 1})
    assert served.json()["usage"]["prompt_tokens"] == chat["count"]
    plain = server.http.post("/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()
    assert tok.decode(plain["tokens"]) == "[system]be brief[user]hi"
    strs = server.http.post("/tokenize", json={"prompt": "hi", "return_token_strs": True}).json()
    assert strs["token_strs"] == ["<s>", "h", "i"] and len(strs["tokens"]) == 3


@pytest.mark.parametrize("path, body, fragment", [
    ("/tokenize", {"model": "tiny"}, "exactly one of prompt or messages"),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "exactly one"),
    ("/tokenize", {"model": "other", "prompt": "a"}, "not served here"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/tokenize", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "only text content"),
    ("/detokenize", {"tokens": [5, 99999]}, "outside the vocabulary"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
])
def test_tokenize_bad_input_gets_a_400(server, path, body, fragment):
    assert_error_body(server.http.post(path, json=body), 400, fragment)


def test_max_model_len_caps_the_context(server):
    assert server.http.get("/v1/models").json()["data"][0]["max_model_len"] == CONTEXT
    r = server.http.post("/v1/completions", json={"model": "tiny", "prompt": "x" * 150, "max_tokens": 100})
    assert_error_body(r, 400, f"model context of {CONTEXT} tokens")
    ok = server.http.post("/v1/completions", json={"model": "tiny", "prompt": "x" * 150, "max_tokens": 40})
    assert ok.status_code == 200, ok.text


# ---------------------------------------------------------------------------------- the command
def test_version_option():
    for args in (["--version"], ["serve", "--version"]):
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 0 and version("tidegate") in result.output


def test_a_port_in_use_fails_at_once_with_one_sentence():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = CliRunner().invoke(main, ["serve", "--port", str(port)])
    assert result.exit_code == 2
    assert result.output.strip() == f"error: port {port} on 127.0.0.1 is already in use"


def test_the_options_reach_the_config(tmp_path, monkeypatch):
    import tidegate.engine.serve

    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE)
    seen = {}

    def build_service(config):
        seen["config"] = config
        raise ValueError("stopped before the model loads")

    monkeypatch.setattr(tidegate.engine.serve, "build_service", build_service)
    monkeypatch.setenv("TIDEGATE_API_KEY", KEY)
    result = CliRunner().invoke(main, ["serve", "--model", str(tmp_path), "--port", str(free_port()),
                                       "--chat-template", str(template), "--max-model-len", "300",
                                       "--max-request-bytes", "1000", "--log-level", "warning", "--access-log"])
    assert result.exit_code == 2 and "stopped before the model loads" in result.output
    # a model of one's own on the tiny model's step-time profile is said plainly
    assert "no --profile" in result.output and "tidegate profile --model" in result.output
    config = seen["config"]
    assert (config.chat_template, config.api_key, config.max_model_len) == (TEMPLATE, KEY, 300)
    assert (config.max_request_bytes, config.log_level, config.access_log) == (1000, "warning", True)


@pytest.mark.parametrize("args, warning", [([], None), (["--dtype", "bfloat16"], "off for dtype bfloat16"),
                                           (["--device", "cpu", "--dtype", "fp32"], None)])
def test_the_tiny_models_profile_is_called_off_where_it_was_not_fitted(monkeypatch, args, warning):
    import torch

    import tidegate.engine.serve
    from tidegate.engine.real.model import cpu_has_bf16_matmul

    def build_service(config):
        raise ValueError("stopped before the model loads")

    monkeypatch.setattr(tidegate.engine.serve, "build_service", build_service)
    result = CliRunner().invoke(main, ["serve", "--port", str(free_port()), *args])
    assert result.exit_code == 2 and "stopped before the model loads" in result.output
    if not args and torch.cuda.is_available():
        warning = "off for device cuda"  # the default device is not the profile's
    elif not args and cpu_has_bf16_matmul():
        warning = "off for dtype bf16"  # this CPU's default dtype is not the profile's
    if warning is None:
        assert "no --profile" not in result.output
    else:
        assert "no --profile" in result.output and warning in result.output


@pytest.mark.parametrize("content, fragment", [(None, "does not exist"), ("{% for %}", "not a valid Jinja template")])
def test_a_bad_chat_template_file_is_one_sentence(tmp_path, content, fragment):
    path = tmp_path / "chat.jinja"
    if content is not None:
        path.write_text(content)
    result = CliRunner().invoke(main, ["serve", "--chat-template", str(path)])
    assert result.exit_code == 2 and fragment in result.output
    assert "Traceback" not in result.output


def test_the_banner_comes_once_the_server_listens_and_ctrl_c_stops_it_in_one_line():
    port = free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1", TIDEGATE_API_KEY=KEY)
    proc = subprocess.Popen([sys.executable, "-m", "tidegate", "serve", "--port", str(port), "--engine-thread",
                             "--kv-capacity-tokens", "4096", "--max-model-len", "100", "--access-log"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if "serving 'tiny'" in line:
                break
        assert "context 100 tokens" in lines[-1], "".join(lines)
        # the defaults it took for this machine: vLLM's batch limits on a CPU, a dtype this CPU computes fast
        compute = proc.stdout.readline()
        assert "the engine computes in " in compute and "steps of up to 2048 tokens and 128 requests" in compute
        from tidegate.engine.real.model import cpu_has_bf16_matmul

        assert ("bf16 on cpu" if cpu_has_bf16_matmul() else "fp32 on cpu") in compute
        # listening by the time the banner is out
        assert httpx.get(f"http://127.0.0.1:{port}/version").status_code == 200
        r = httpx.post(f"http://127.0.0.1:{port}/tokenize", json={"prompt": "a"},
                       headers={"Authorization": f"Bearer {KEY}"})
        assert r.json()["max_model_len"] == 100
        proc.send_signal(signal.SIGINT)  # Ctrl-C: a stop asked for, with one line and exit status 0
        rest = proc.communicate(timeout=30)[0]
        assert '"POST /tokenize HTTP/1.1" 200' in rest, rest
        assert proc.returncode == 0, rest
        assert "tidegate: stopped" in rest and "Aborted" not in rest and "Traceback" not in rest
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.slow
def test_a_quick_profile_fit_at_start_up(tmp_path):
    from tidegate.engine.core.profile import load_profile
    from tidegate.engine.serve.config import ServeConfig
    from tidegate.engine.serve.launch import fit_profile

    t0 = time.perf_counter()
    path = fit_profile(ServeConfig(device="cpu", threads=1), tmp_path / "fit.json")
    profile = load_profile(path)
    assert profile.name == "fit-tiny" and profile.base_s > 0 and "fitted" in profile.description
    assert time.perf_counter() - t0 < 120


def test_tokenize_refuses_what_the_completion_routes_refuse(server):
    # longer than the context: refused before it is tokenized, as the completion routes do
    assert_error_body(server.http.post("/tokenize", json={"prompt": "y" * 3 * CONTEXT}), 400, "model context")
    long_chat = {"messages": [{"role": "user", "content": "y" * 3 * CONTEXT}]}
    assert_error_body(server.http.post("/tokenize", json=long_chat), 400, "model context")
    r = server.http.post("/tokenize", content=b'{"prompt": "\\ud800"}', headers=JSON)
    assert_error_body(r, 400, "not valid Unicode")
    assert r.json()["error"]["param"] == "prompt"
    # the bodies' types are strict, as the completion bodies' are
    assert_error_body(server.http.post("/tokenize", json={"prompt": "a", "add_special_tokens": "no"}), 400)
    assert_error_body(server.http.post("/detokenize", json={"tokens": [5.0]}), 400)


def test_probes_answer_head(server):
    for path in ("/health", "/ready", "/metrics"):
        r = server.http.head(path)
        assert r.status_code == 200 and not r.content, path
