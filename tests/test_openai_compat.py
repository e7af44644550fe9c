"""OpenAI compatibility, as a vLLM user meets it: the sampling parameters, logprobs, n and best_of,
echo, the parameters that are refused by name, strict types, request ids and one BOS per chat
prompt; with the official openai client where it can say it."""

from __future__ import annotations

import asyncio
import inspect
import json
import time

import httpx
import openai
import pytest

from tidegate.engine.real.model import load_model
from tidegate.engine.real.sampling import SamplingParams
from tidegate.engine.serve.service import Stream
from tests.helpers import byte_level_bpe
from tests.test_server import Running

pytestmark = pytest.mark.timeout(180)

_BYTE_OFFSET = 3  # the tiny model's byte tokenizer: byte b is token b + 3


def engine_has(*names: str):
    """Skip a test until the engine's SamplingParams has these parameters."""
    missing = [n for n in names if n not in inspect.signature(SamplingParams).parameters]
    return pytest.mark.skipif(bool(missing), reason=f"the engine's SamplingParams has no {', '.join(missing)} "
                                                    f"yet (engine/real/sampling.py)")


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny", "cpu", "float32")


@pytest.fixture(scope="module")
def server(tiny):
    s = Running(tiny, controller="greedy")
    yield s
    s.close()


def post(server, path: str, body: dict | str, **headers) -> httpx.Response:
    content = body if isinstance(body, str) else json.dumps(body)
    return httpx.post(server.url + path, content=content, timeout=60,
                      headers={"content-type": "application/json", **headers})


GREEDY = dict(model="tiny", temperature=0, extra_body={"ignore_eos": True})


# ---------------------------------------------------------------------------------- logprobs
@engine_has("logprobs")
def test_completion_logprobs_whole_and_streamed(server):
    c = server.client
    out = c.completions.create(prompt="Log me", max_tokens=6, logprobs=3, **GREEDY)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and token in top and 1 <= len(top) <= 4
        # greedy: the chosen token is the likeliest (two tokens may share a text, as incomplete
        # characters all read U+FFFD, so a text's entry may hold another token's logprob)
        assert max(top.values()) <= logprob + 1e-5
    chunks = list(c.completions.create(prompt="Log me", max_tokens=6, logprobs=3, stream=True, **GREEDY))
    streamed = [ch.choices[0].logprobs for ch in chunks if ch.choices and ch.choices[0].logprobs]
    assert sum((s.tokens for s in streamed), []) == lp.tokens
    assert sum((s.token_logprobs for s in streamed), []) == pytest.approx(lp.token_logprobs)
    assert sum((s.text_offset for s in streamed), []) == lp.text_offset


@engine_has("logprobs")
def test_chat_logprobs_whole_and_streamed(server):
    c = server.client
    kwargs = dict(messages=[{"role": "user", "content": "hi"}], max_tokens=5, logprobs=True, top_logprobs=2,
                  **GREEDY)
    out = c.chat.completions.create(**kwargs)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens == 5
    for entry in content:
        assert entry.logprob <= 0 and isinstance(entry.bytes, list) and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)  # greedy
    chunks = list(c.chat.completions.create(stream=True, **kwargs))
    streamed = sum((ch.choices[0].logprobs.content for ch in chunks if ch.choices and ch.choices[0].logprobs), [])
    assert [e.token for e in streamed] == [e.token for e in content]
    none = c.chat.completions.create(messages=[{"role": "user", "content": "hi"}], max_tokens=2, **GREEDY)
    assert none.choices[0].logprobs is None


@engine_has("logprobs", "prompt_logprobs")
def test_logprobs_cross_from_an_engine_process():
    s = Running(None, controller="greedy")
    try:
        whole = s.client.completions.create(prompt="Proc", max_tokens=4, logprobs=2, echo=True, **GREEDY)
        chunks = list(s.client.completions.create(prompt="Proc", max_tokens=4, logprobs=2, echo=True, n=2,
                                                  stream=True, **GREEDY))
        for index in (0, 1):
            mine = [ch.choices[0].logprobs for ch in chunks if ch.choices[0].index == index and ch.choices[0].logprobs]
            assert sum((lp.tokens for lp in mine), []) == whole.choices[0].logprobs.tokens
            # n=2 runs the two choices as a batch of two: float32 sums in another order, so a
            # logprob may differ from the single request's in its sixth digit
            assert sum((lp.token_logprobs for lp in mine), [])[1:] == \
                pytest.approx(whole.choices[0].logprobs.token_logprobs[1:], rel=1e-5, abs=1e-5)
    finally:
        s.close()


# ---------------------------------------------------------------------------------- sampling parameters
def test_neutral_penalties_are_accepted_by_any_engine(server):
    out = server.client.completions.create(prompt="p", max_tokens=3, presence_penalty=0, frequency_penalty=0,
                                           model="tiny", extra_body={"repetition_penalty": 1.0, "min_p": 0.0,
                                                                     "min_tokens": 0, "top_k": -1})
    assert out.choices[0].finish_reason in ("stop", "length")


@engine_has("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "min_tokens")
def test_penalties_are_passed_through(server):
    out = server.client.completions.create(
        model="tiny", prompt="penalties", max_tokens=6, presence_penalty=0.5, frequency_penalty=-0.5, seed=3,
        extra_body={"repetition_penalty": 1.3, "min_p": 0.05, "min_tokens": 6, "top_k": 20})
    assert out.usage.completion_tokens == 6  # min_tokens holds EOS back
    r = post(server, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2, "min_tokens": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens"


@engine_has("logit_bias")
def test_logit_bias_forces_a_token(server):
    a = str(ord("a") + _BYTE_OFFSET)
    out = server.client.completions.create(prompt="bias", max_tokens=5, logit_bias={a: 100}, **GREEDY)
    assert out.choices[0].text == "aaaaa"
    r = post(server, "/v1/completions", {"model": "tiny", "prompt": "x", "logit_bias": {"99999": 1}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias"


def test_stop_token_ids_end_the_request(server):
    ids = server.service.tokenizer.encode("stop ids")
    free = server.client.completions.create(prompt=ids, max_tokens=4, **GREEDY)
    first = server.service.tokenizer.encode(free.choices[0].text, add_special_tokens=False)[0] \
        if free.choices[0].text and "\ufffd" not in free.choices[0].text[:1] else None
    if first is None:
        pytest.skip("the tiny model's first byte here is not a whole character")
    out = server.client.completions.create(prompt=ids, max_tokens=4, model="tiny", temperature=0,
                                           extra_body={"ignore_eos": True, "stop_token_ids": [first]})
    assert out.choices[0].finish_reason == "stop" and out.usage.completion_tokens == 1


# ---------------------------------------------------------------------------------- n, best_of, echo
def test_n_choices_whole_and_streamed(server):
    c = server.client
    out = c.completions.create(model="tiny", prompt="two", max_tokens=4, n=2, seed=7, temperature=1.0,
                               extra_body={"ignore_eos": True})
    assert [ch.index for ch in out.choices] == [0, 1]
    assert out.usage.prompt_tokens == len("two") + 1 and out.usage.completion_tokens == 8
    chunks = list(c.completions.create(model="tiny", prompt="two", max_tokens=4, n=2, seed=7, temperature=1.0,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True}))
    texts = {0: "", 1: ""}
    finished = set()
    for ch in chunks:
        for choice in ch.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason:
                finished.add(choice.index)
    assert finished == {0, 1}
    assert texts == {0: out.choices[0].text, 1: out.choices[1].text}  # seeds per choice: seed + index
    assert chunks[-1].usage.completion_tokens == 8 and chunks[-1].usage.prompt_tokens == 4
    chat = list(c.chat.completions.create(messages=[{"role": "user", "content": "x"}], max_tokens=3, n=2,
                                          stream=True, **GREEDY))
    assert {ch.choices[0].index for ch in chat if ch.choices[0].delta.role == "assistant"} == {0, 1}
    assert {ch.choices[0].index for ch in chat if ch.choices[0].finish_reason} == {0, 1}
    server.wait_idle()


def test_streamed_choices_need_not_run_together(tiny):
    """With room for one request at a time the second choice waits for the first to finish; the
    stream starts with the first choice's tokens rather than holding them back."""
    s = Running(tiny, controller="greedy:max_num_seqs=1", stream_buffer_chunks=8)
    try:
        chunks = list(s.client.completions.create(prompt="one by one", max_tokens=30, n=2, stream=True, **GREEDY))
        ends = [ch.choices[0].index for ch in chunks if ch.choices[0].finish_reason]
        assert ends == [0, 1]
        s.wait_idle()
    finally:
        s.close()


@engine_has("logprobs")
def test_best_of_returns_the_likeliest(server):
    out = server.client.completions.create(model="tiny", prompt="best", max_tokens=4, n=2, best_of=4, seed=1,
                                           temperature=1.0, logprobs=0, extra_body={"ignore_eos": True})
    assert [ch.index for ch in out.choices] == [0, 1] and out.usage.completion_tokens == 16
    sums = [sum(ch.logprobs.token_logprobs) for ch in out.choices]
    assert sums[0] >= sums[1]
    plain = server.client.completions.create(model="tiny", prompt="best", max_tokens=2, best_of=2,
                                             extra_body={"ignore_eos": True})
    assert plain.choices[0].logprobs is None  # asked for internally only


def test_best_of_is_not_streamed_nor_below_n(server):
    for body in ({"best_of": 2, "stream": True}, {"best_of": 1, "n": 2}):
        r = post(server, "/v1/completions", {"model": "tiny", "prompt": "b", **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == "best_of", r.text


def test_echo_puts_the_prompt_first(server):
    out = server.client.completions.create(prompt="Echo me", max_tokens=3, echo=True, **GREEDY)
    assert out.choices[0].text.startswith("Echo me") and len(out.choices[0].text) > len("Echo me")
    chunks = list(server.client.completions.create(prompt="Echo me", max_tokens=3, echo=True, stream=True,
                                                   **GREEDY))
    assert chunks[0].choices[0].text == "Echo me"
    assert "".join(ch.choices[0].text for ch in chunks) == out.choices[0].text


@engine_has("logprobs", "prompt_logprobs")
def test_echo_with_logprobs_puts_the_prompts_logprobs_first(server):
    out = server.client.completions.create(prompt="Echo", max_tokens=2, echo=True, logprobs=1, **GREEDY)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len("Echo") + 1 + 2  # BOS, the prompt's bytes, the output
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x is not None for x in lp.token_logprobs[1:])
    assert lp.tokens[1:5] == list("Echo")
    chunks = list(server.client.completions.create(prompt="Echo", max_tokens=2, echo=True, logprobs=1, stream=True,
                                                   **GREEDY))
    streamed = [ch.choices[0].logprobs for ch in chunks if ch.choices[0].logprobs]
    assert sum((s.tokens for s in streamed), []) == lp.tokens
    assert sum((s.text_offset for s in streamed), []) == lp.text_offset


# ---------------------------------------------------------------------------------- refusals
REFUSED = [
    ("/v1/completions", {"suffix": "tail"}, "suffix"),
    ("/v1/completions", {"response_format": {"type": "xml"}}, "response_format"),
    ("/v1/completions", {"response_format": {"type": "structural_tag", "structures": [], "triggers": []}},
     "response_format"),
    ("/v1/completions", {"guided_json": {"type": "object", "properties": 5}}, "guided_json"),
    ("/v1/completions", {"guided_regex": "[a-"}, "guided_regex"),
    ("/v1/completions", {"guided_choice": []}, "guided_choice"),
    ("/v1/completions", {"guided_grammar": "root ::= undefined_rule"}, "guided_grammar"),
    ("/v1/completions", {"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
    ("/v1/completions", {"frobnicate": 1}, "frobnicate"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}],
                              "tool_choice": "required"}, "tools"),
    ("/v1/chat/completions", {"tool_choice": "auto"}, "tool_choice"),
    ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions"),
    ("/v1/chat/completions", {"function_call": "auto"}, "function_call"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema"}}, "response_format"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"best_of": 2}, "best_of"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}]}, "messages"),
]


def _body(path: str, extra: dict) -> dict:
    base = {"model": "tiny", "max_tokens": 2}
    base.update({"prompt": "hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]})
    return {**base, **extra}


@pytest.mark.parametrize("path, extra, param", REFUSED)
def test_unserved_parameters_are_refused_by_name(server, path, extra, param):
    r = post(server, path, _body(path, extra))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    if "image_url" in json.dumps(extra) or "input_audio" in json.dumps(extra):
        assert "only text content parts are served" in error["message"]
    if param == "frobnicate":
        assert "unknown parameter" in error["message"]


def test_openai_metadata_is_accepted(server):
    chat = server.client.chat.completions.create(
        model="tiny", messages=[{"role": "system", "content": "be brief"},
                                {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        max_tokens=2, user="u-1", metadata={"k": "v"}, store=False, service_tier="auto", parallel_tool_calls=None,
        response_format={"type": "text"}, tool_choice="none")
    assert chat.choices[0].message.role == "assistant"
    out = server.client.completions.create(model="tiny", prompt="meta", max_tokens=2, user="u-1")
    assert out.choices


@pytest.mark.parametrize("extra, param", [
    ({"stream": "yes"}, "stream"),
    ({"max_tokens": True}, "max_tokens"),
    ({"max_tokens": 2.0}, "max_tokens"),
    ({"temperature": "0.5"}, "temperature"),
    ({"temperature": 2.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"n": 0}, "n"),
    ({"n": 17}, "n"),
    ({"best_of": 17}, "best_of"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": True}, "logprobs"),
    ({"echo": "true"}, "echo"),
    ({"ignore_eos": 1}, "ignore_eos"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_p": 1.5}, "min_p"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"five": 1}}, "logit_bias"),
    ({"logit_bias": {" 5 ": 1}}, "logit_bias"),
    ({"logit_bias": {"5_0": 1}}, "logit_bias"),
    ({"logit_bias": {"\u0665": 1}}, "logit_bias"),
    ({"logit_bias": {"9" * 5000: 1}}, "logit_bias"),
    ({"stop_token_ids": ["1"]}, "stop_token_ids"),
    ({"stream_options": {"include_usage": "yes"}}, "stream_options"),
    ({"seed": 2**70}, "seed"),
])
def test_strict_types_and_ranges(server, extra, param):
    r = post(server, "/v1/completions", _body("/v1/completions", extra))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_max_tokens_below_one_names_it(server):
    r = post(server, "/v1/chat/completions", _body("/v1/chat/completions", {"max_completion_tokens": 0}))
    assert r.status_code == 400 and "max_completion_tokens must be at least 1" in r.json()["error"]["message"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_lone_surrogate_is_a_400(server, path):
    body = ('{"model": "tiny", "prompt": "\\ud800"}' if path == "/v1/completions" else
            '{"model": "tiny", "messages": [{"role": "user", "content": "a\\udfff"}]}')
    r = post(server, path, body)
    assert r.status_code == 400 and "surrogate" in r.json()["error"]["message"], r.text


def test_an_overlong_prompt_is_refused_before_it_is_tokenized(server):
    t = time.perf_counter()
    r = post(server, "/v1/completions", {"model": "tiny", "prompt": "y" * 2_000_000})
    assert r.status_code == 400 and "at least 2000000 tokens" in r.json()["error"]["message"]
    assert time.perf_counter() - t < 5


# ---------------------------------------------------------------------------------- request ids, first token
def test_the_request_id_is_echoed_on_every_response(server):
    body = _body("/v1/completions", {})
    assert post(server, "/v1/completions", body, **{"X-Request-Id": "abc-1"}).headers["x-request-id"] == "abc-1"
    bad = post(server, "/v1/completions", {**body, "n": 0}, **{"X-Request-Id": "abc-2"})
    assert bad.status_code == 400 and bad.headers["x-request-id"] == "abc-2"
    refused = post(server, "/v1/completions", {**body, "suffix": "s"}, **{"X-Request-Id": "abc-3"})
    assert refused.headers["x-request-id"] == "abc-3"
    with httpx.stream("POST", server.url + "/v1/chat/completions", headers={"X-Request-Id": "abc-4"},
                      json=_body("/v1/chat/completions", {"stream": True})) as r:
        assert r.headers["x-request-id"] == "abc-4"
        assert list(r.iter_lines())[-2] == "data: [DONE]"
    fresh = post(server, "/v1/completions", body)
    assert len(fresh.headers["x-request-id"]) >= 16
    for answer in (httpx.get(server.url + "/no/such/path", headers={"X-Request-Id": "abc-5"}),
                   httpx.get(server.url + "/v1/completions", headers={"X-Request-Id": "abc-5"}),
                   httpx.get(server.url + "/health", headers={"X-Request-Id": "abc-5"})):
        assert answer.headers["x-request-id"] == "abc-5", answer.status_code
    ids = {post(server, "/v1/completions", body).json()["id"] for _ in range(3)}
    assert len(ids) == 3


def test_the_first_token_makes_an_event_even_without_text(server):
    """The first token's event marks the time to first token, though it shows no text: here the
    first character is held back as the start of a stop string (or is an incomplete character)."""
    tokenizer = server.service.tokenizer
    ids = tokenizer.encode("first token")
    first = server.client.completions.create(prompt=ids, max_tokens=1, **GREEDY).choices[0].text
    stops = [first + "\x00\x01"] if first and first != "\ufffd" else []
    loop = asyncio.new_event_loop()
    try:
        stream = Stream(loop, limit=64)
        server.service.submit(stream, ids, SamplingParams(stop=stops, ignore_eos=True), 3)
        deadline = time.time() + 30
        while stream.result is None:
            assert time.time() < deadline
            time.sleep(0.02)
        first = stream.chunks[0]
        assert (first.delta, first.finished, first.logprobs, first.prompt_logprobs) == ("", False, None, None)
        assert stream.last_token_s is not None
        server.service.done(stream)
    finally:
        loop.close()
    server.wait_idle()


# ---------------------------------------------------------------------------------- chat templates
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def bpe_model(tmp_path_factory):
    """A local model folder: a small random Llama and a byte-level BPE tokenizer trained here, whose
    ``add_special_tokens`` puts a BOS first and whose chat template writes ``{{ bos_token }}``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("bpe-model")
    fast = byte_level_bpe()
    bos = fast.bos_token_id
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)
    config = LlamaConfig(vocab_size=len(fast), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                         bos_token_id=bos, eos_token_id=fast.eos_token_id, pad_token_id=0)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder, bos


def test_a_chat_prompt_carries_one_bos(bpe_model):
    folder, bos = bpe_model
    s = Running(load_model(str(folder), "cpu", "float32"), model=str(folder), served_model_name="bpe",
                controller="greedy")
    try:
        assert s.service.tokenizer.encode("hi")[0] == bos  # the tokenizer alone would add a second
        messages = [{"role": "user", "content": "hello there"}]
        out = s.client.chat.completions.create(model="bpe", messages=messages, max_tokens=2, temperature=0)
        prompt = s.engine.core.metrics.terminal[-1].prompt_token_ids
        assert prompt[0] == bos and prompt.count(bos) == 1
        assert out.usage.prompt_tokens == len(prompt)
        s.config.chat_template = "{{ bos_token }}[custom]{% for m in messages %}{{ m['content'] }}{% endfor %}"
        s.client.chat.completions.create(model="bpe", messages=messages, max_tokens=1)
        prompt = s.engine.core.metrics.terminal[-1].prompt_token_ids
        assert prompt.count(bos) == 1 and "[custom]" in s.service.tokenizer.decode(prompt)
        s.config.chat_template = None
        s.service.tokenizer.chat_template = None
        r = httpx.post(s.url + "/v1/chat/completions", json={"model": "bpe", "messages": messages})
        assert r.status_code == 400
        assert "no chat template; start the server with --chat-template FILE" in r.json()["error"]["message"]
        long = httpx.post(s.url + "/v1/completions", json={"model": "bpe", "prompt": "fox " * 100_000})
        assert long.status_code == 400 and "at least" in long.json()["error"]["message"]
        s.wait_idle()
    finally:
        s.close()


def test_openai_client_sees_400s_as_bad_request(server):
    with pytest.raises(openai.BadRequestError) as err:
        server.client.completions.create(model="tiny", prompt="x", max_tokens=2, suffix="tail")
    assert err.value.body["param"] == "suffix"


def test_stop_strings_are_bounded_in_number_and_length(server):
    from tidegate.engine.serve.protocol import MAX_STOP_CHARS, MAX_STOP_STRINGS

    # every generated token of every choice is checked against each stop string inside the engine's
    # step: an unbounded list would let one request slow every other request's tokens
    for stop in (["ab"] * (MAX_STOP_STRINGS + 1), ["x" * (MAX_STOP_CHARS + 1)], "x" * (MAX_STOP_CHARS + 1)):
        r = post(server, "/v1/completions", _body("/v1/completions", {"stop": stop}))
        assert r.status_code == 400 and r.json()["error"]["param"] == "stop", r.text
    ok = post(server, "/v1/completions", _body("/v1/completions", {"stop": ["zq"] * MAX_STOP_STRINGS}))
    assert ok.status_code == 200, ok.text
