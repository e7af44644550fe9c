"""vLLM's extensions of the OpenAI API, end to end against a server on loopback: every field of vLLM's
request models accepted at its default, batched and token-id prompts, truncation, the token masks,
special tokens, prompt logprobs, request ids, token ids in the answer, stream intervals, continuous
usage, chat's echo, continuation and per-request templates, priority, and the fields refused by name.

The tiny model's tokenizer is bytes (byte b is token b + 3; BOS is added to completion prompts), so
a prompt's token count is its UTF-8 length plus one, and ``allowed_token_ids`` holding only ASCII
letters makes every generated token a whole character of readable text.
"""

from __future__ import annotations

import json
import math
import time

import httpx
import pytest

from tidegate.engine.real.model import BOS_TOKEN_ID
from tidegate.engine.serve.protocol import MAX_PROMPTS, VLLM_FIELDS
from tests.test_openai_compat import server, tiny  # noqa: F401 (fixtures: the tiny model on a greedy server)

pytestmark = pytest.mark.timeout(180)

_BYTE_OFFSET = 3  # the tiny model's byte tokenizer: byte b is token b + 3
LETTERS = "abcdefgh"
#: only these letters: each generated token is one whole ASCII character
ASCII_ONLY = [ord(ch) + _BYTE_OFFSET for ch in LETTERS]
GREEDY = {"temperature": 0, "ignore_eos": True}
USER_HI = [{"role": "user", "content": "hi"}]


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, content=json.dumps(body), timeout=60,
                      headers={"content-type": "application/json"})


def ok(server, path: str, body: dict) -> dict:
    r = post(server, path, body)
    assert r.status_code == 200, r.text
    return r.json()


def complete(server, prompt, **fields) -> dict:
    return ok(server, "/v1/completions", {"prompt": prompt, **fields})


def chat(server, messages, **fields) -> dict:
    return ok(server, "/v1/chat/completions", {"messages": messages, **fields})


def events(server, path: str, body: dict) -> list[dict]:
    """The data events of a streamed answer, ``[DONE]`` checked and left off."""
    with httpx.stream("POST", server.url + path, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        lines = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def tokenize(server, **body) -> list[int]:
    return ok(server, "/tokenize", body)["tokens"]


def text_of(chunk: dict) -> str:
    choice = chunk["choices"][0]
    return choice["text"] if "text" in choice else choice["delta"].get("content") or ""


# ---------------------------------------------------------------------------------- every field at its default
#: vLLM's defaults of the fields of both request models (a field whose default vLLM makes up, as
#: ``request_id``, is sent as null)
_BOTH_DEFAULTS = {
    "model": None, "frequency_penalty": 0.0, "logit_bias": None, "logprobs": None, "max_tokens": None, "n": 1,
    "presence_penalty": 0.0, "seed": None, "stop": [], "stream": False,
    "stream_options": {"include_usage": False, "continuous_usage_stats": False}, "temperature": None,
    "top_p": None, "top_k": None, "min_p": None, "repetition_penalty": None, "stop_token_ids": [],
    "include_stop_str_in_output": False, "ignore_eos": False, "min_tokens": 0, "skip_special_tokens": True,
    "truncate_prompt_tokens": None, "truncation_side": None, "allowed_token_ids": None, "prompt_logprobs": None,
    "bad_words": [], "add_special_tokens": None, "priority": 0, "request_id": None,
    "return_tokens_as_token_ids": None, "return_token_ids": None, "stream_interval": None, "echo": False,
    "user": None, "response_format": None, "structured_outputs": None, "use_beam_search": False,
    "watermarking": None, "logprob_token_ids": None, "repetition_detection": None, "length_penalty": 1.0,
    "spaces_between_special_tokens": True, "session_id": None, "cache_salt": None, "kv_transfer_params": None,
    "ec_transfer_params": None, "vllm_xargs": None, "thinking_token_budget": None,
    "routed_experts_prompt_start": 0, "return_token_offsets": False, "mm_payload": "tensors",
    "return_mm_kwargs": None,
}
_ROUTE_DEFAULTS = {
    "completions": {"prompt": "defaults", "max_tokens": 16, "add_special_tokens": True, "suffix": None,
                    "prompt_embeds": None},
    "chat": {"messages": USER_HI, "max_completion_tokens": None, "add_special_tokens": False, "logprobs": False,
             "top_logprobs": 0, "add_generation_prompt": True, "continue_final_message": False, "documents": None,
             "chat_template": None, "chat_template_kwargs": None, "reasoning_effort": None,
             "return_prompt_text": False, "parallel_tool_calls": False, "include_reasoning": True,
             "media_io_kwargs": None, "mm_processor_kwargs": None, "tools": None, "tool_choice": "none"},
}
_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_every_vllm_field_at_its_default_is_served(server, route):
    body = {**_BOTH_DEFAULTS, **_ROUTE_DEFAULTS[route]}
    fields = {f for f in {**VLLM_FIELDS["both"], **VLLM_FIELDS[route]} if "." not in f}
    assert set(body) == fields  # the table and this test name the same fields
    out = ok(server, _PATHS[route], body)
    assert out["model"] == "tiny" and len(out["choices"]) == 1
    # completions' default is 16 tokens; chat's is the server's default
    most = 16 if route == "completions" else server.config.default_max_tokens
    assert 1 <= out["usage"]["completion_tokens"] <= most
    # every field that is optional, as null
    nulls = {name: None for name in body if name not in ("prompt", "messages")}
    out = ok(server, _PATHS[route], {**body, **nulls})
    assert len(out["choices"]) == 1 and out["usage"]["completion_tokens"] >= 1


def test_the_model_is_optional(server):
    out = complete(server, "no model", max_tokens=2)
    assert out["model"] == "tiny" and out["usage"]["completion_tokens"] >= 1
    assert chat(server, USER_HI, max_tokens=2)["model"] == "tiny"
    r = post(server, "/v1/completions", {"model": "other", "prompt": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"


# ---------------------------------------------------------------------------------- batched and token-id prompts
def test_a_batch_of_prompts_with_n_choices(server):
    prompts = ["Alpha", "Beta gamma"]
    alone = [complete(server, p, max_tokens=5, **GREEDY)["choices"][0]["text"] for p in prompts]
    out = complete(server, prompts, max_tokens=5, n=2, **GREEDY)
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in out["choices"]] == [alone[0], alone[0], alone[1], alone[1]]
    # each prompt counted once, every choice's output
    assert out["usage"]["prompt_tokens"] == (len("Alpha") + 1) + (len("Beta gamma") + 1)
    assert out["usage"]["completion_tokens"] == 4 * 5
    chunks = events(server, "/v1/completions", {"prompt": prompts, "max_tokens": 5, "n": 2, **GREEDY,
                                                "stream_options": {"include_usage": True}})
    texts: dict[int, str] = {}
    for ch in chunks:
        for c in ch["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    assert texts == {i: c["text"] for i, c in enumerate(out["choices"])}
    assert chunks[-1]["usage"] == out["usage"]
    echoed = complete(server, prompts, max_tokens=2, echo=True, **GREEDY)
    assert len(echoed["choices"]) == 2
    assert all(c["text"].startswith(p) for c, p in zip(echoed["choices"], prompts))
    best = complete(server, prompts, max_tokens=3, n=1, best_of=2, seed=3, temperature=1.0, ignore_eos=True)
    assert [c["index"] for c in best["choices"]] == [0, 1] and best["usage"]["completion_tokens"] == 2 * 2 * 3
    server.wait_idle()


def test_token_id_prompts_alone_and_batched(server):
    ids = [tokenize(server, prompt=p) for p in ("Alpha", "Beta gamma")]
    assert ids[0] == [BOS_TOKEN_ID, *(b + _BYTE_OFFSET for b in b"Alpha")]
    by_text = complete(server, ["Alpha", "Beta gamma"], max_tokens=4, **GREEDY)
    alone = complete(server, ids[0], max_tokens=4, **GREEDY)
    assert alone["choices"][0]["text"] == by_text["choices"][0]["text"]
    assert alone["usage"]["prompt_tokens"] == len(ids[0])
    batch = complete(server, ids, max_tokens=4, **GREEDY)
    assert [c["text"] for c in batch["choices"]] == [c["text"] for c in by_text["choices"]]
    assert batch["usage"] == by_text["usage"]
    too_many = post(server, "/v1/completions", {"prompt": ["p"] * (MAX_PROMPTS + 1), "max_tokens": 1})
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "prompt"
    outside = post(server, "/v1/completions", {"prompt": [[5, 6], [7, 10**6]], "max_tokens": 1})
    assert outside.status_code == 400 and outside.json()["error"]["param"] == "prompt"


def test_add_special_tokens_adds_or_leaves_out_the_bos(server):
    body = {"max_tokens": 1, "return_token_ids": True}
    added = complete(server, "bos", **body)["choices"][0]["prompt_token_ids"]
    assert added[0] == BOS_TOKEN_ID and len(added) == len("bos") + 1
    bare = complete(server, "bos", add_special_tokens=False, **body)["choices"][0]["prompt_token_ids"]
    assert bare == added[1:]
    default = chat(server, USER_HI, **body)["prompt_token_ids"]
    assert default[0] == BOS_TOKEN_ID  # the byte tokenizer's fallback template writes no BOS text
    assert chat(server, USER_HI, add_special_tokens=False, **body)["prompt_token_ids"] == default[1:]


# ---------------------------------------------------------------------------------- truncation
def test_truncate_prompt_tokens_keeps_the_last_or_the_first(server):
    prompt = "0123456789abcdef"
    ids = tokenize(server, prompt=prompt)
    assert len(ids) == 17
    left = complete(server, prompt, max_tokens=4, truncate_prompt_tokens=5, **GREEDY)
    assert left["usage"]["prompt_tokens"] == 5
    assert left["choices"][0]["text"] == complete(server, ids[-5:], max_tokens=4, **GREEDY)["choices"][0]["text"]
    right = complete(server, prompt, max_tokens=4, truncate_prompt_tokens=5, truncation_side="right", **GREEDY)
    assert right["usage"]["prompt_tokens"] == 5
    assert right["choices"][0]["text"] == complete(server, "0123", max_tokens=4, **GREEDY)["choices"][0]["text"]
    assert left["choices"][0]["text"] != right["choices"][0]["text"]
    whole = complete(server, prompt, max_tokens=1, truncate_prompt_tokens=-1)
    assert whole["usage"]["prompt_tokens"] == 17
    echoed = complete(server, prompt, max_tokens=2, truncate_prompt_tokens=5, echo=True, **GREEDY)
    assert echoed["choices"][0]["text"].startswith("bcdef")
    tokens = complete(server, ids, max_tokens=1, truncate_prompt_tokens=3, return_token_ids=True)
    assert tokens["choices"][0]["prompt_token_ids"] == ids[-3:]
    conversation = chat(server, USER_HI, max_tokens=1, truncate_prompt_tokens=3)
    assert conversation["usage"]["prompt_tokens"] == 3
    r = post(server, "/v1/completions", {"prompt": prompt, "truncation_side": "left"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncation_side"


# ---------------------------------------------------------------------------------- token masks, special tokens
def test_allowed_token_ids_limit_the_text(server):
    out = complete(server, "anything", max_tokens=24, temperature=1.0, seed=5, ignore_eos=True,
                   allowed_token_ids=ASCII_ONLY[:3])
    text = out["choices"][0]["text"]
    assert len(text) == 24 and set(text) <= set(LETTERS[:3])
    streamed = "".join(text_of(ch) for ch in events(server, "/v1/completions", {
        "prompt": "anything", "max_tokens": 24, "temperature": 1.0, "seed": 5, "ignore_eos": True,
        "allowed_token_ids": ASCII_ONLY[:3]}) if ch["choices"])
    assert streamed == text
    r = post(server, "/v1/completions", {"prompt": "x", "allowed_token_ids": [10**6]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "allowed_token_ids"


def test_bad_words_never_appear(server):
    body = {"max_tokens": 24, "allowed_token_ids": ASCII_ONLY, **GREEDY}
    free = complete(server, "bad words", **body)["choices"][0]["text"]
    assert len(free) == 24
    one = free[0]
    banned = complete(server, "bad words", bad_words=[one], **body)["choices"][0]["text"]
    assert one not in banned and len(banned) == 24
    pair = free[1:3]  # two tokens: the second is banned after the first
    text = complete(server, "bad words", bad_words=[pair], **body)["choices"][0]["text"]
    assert pair not in text and text != free
    chatted = chat(server, USER_HI, bad_words=[one], **body)["choices"][0]["message"]["content"]
    assert one not in chatted
    r = post(server, "/v1/completions", {"prompt": "x", "bad_words": [" "]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "bad_words"


def test_a_body_of_a_million_bad_items_is_one_error_and_the_lists_are_bounded(server):
    """Each list's items are checked up to the first that fails (FastAPI would build a dict for each error), and the
    lists whose every id or word is copied into each engine request, or checked at every token, are bounded."""
    from pydantic import ValidationError

    from tidegate.engine.serve.protocol import (MAX_LOGPROB_TOKEN_IDS, MAX_STOP_STRINGS, MAX_TOKEN_IDS_AN_ARRIVAL,
                                                ChatBody, CompletionBody)

    for body, model in (({"prompt": [-1] * 200_000}, CompletionBody), ({"prompt": [[-1]] * 200_000}, CompletionBody),
                        ({"prompt": "x", "stop_token_ids": ["a"] * 200_000}, CompletionBody),
                        ({"messages": [{"role": "nobody"}] * 200_000}, ChatBody)):
        with pytest.raises(ValidationError) as caught:
            model.model_validate(body)
        assert caught.value.error_count() <= 8, body.keys()
    r = post(server, "/v1/completions", {"prompt": [-1] * 200_000})
    assert r.status_code == 400 and len(r.content) < 4096
    refused = {"bad_words": {"prompt": "x", "bad_words": ["a"] * (MAX_STOP_STRINGS + 1)},
               "logprob_token_ids": {"prompt": "x", "logprobs": 1,
                                     "logprob_token_ids": list(range(MAX_LOGPROB_TOKEN_IDS + 1))},
               # an arrival of 64 prompts x 16 choices, each engine request with its own copy of the list
               "stop_token_ids": {"prompt": ["x"] * MAX_PROMPTS, "n": 16, "temperature": 1.0,
                                  "stop_token_ids": [5] * (MAX_TOKEN_IDS_AN_ARRIVAL // 1000)}}
    for param, body in refused.items():
        r = post(server, "/v1/completions", body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (param, r.text)
    # the same list on one engine request is served
    assert complete(server, "x", max_tokens=2, stop_token_ids=[5] * (MAX_TOKEN_IDS_AN_ARRIVAL // 1000))["choices"]


def test_skip_special_tokens_hides_or_shows_them(server):
    # only BOS may be generated: its text is "<s>", shown only when special tokens are not skipped
    body = {"max_tokens": 3, "allowed_token_ids": [BOS_TOKEN_ID], "return_token_ids": True, **GREEDY}
    hidden = complete(server, "special", **body)
    assert hidden["choices"][0]["text"] == "" and hidden["choices"][0]["token_ids"] == [BOS_TOKEN_ID] * 3
    shown = complete(server, "special", skip_special_tokens=False, **body)
    assert shown["choices"][0]["text"] == "<s>" * 3 and shown["usage"]["completion_tokens"] == 3
    streamed = events(server, "/v1/completions", {"prompt": "special", "skip_special_tokens": False, **body})
    assert "".join(text_of(ch) for ch in streamed) == "<s>" * 3
    conversation = chat(server, USER_HI, skip_special_tokens=False, **body)
    assert conversation["choices"][0]["message"]["content"] == "<s>" * 3


# ---------------------------------------------------------------------------------- prompt logprobs
def test_prompt_logprobs_have_vllms_shape(server):
    prompt = "Hello"
    ids = tokenize(server, prompt=prompt)
    out = complete(server, prompt, max_tokens=2, prompt_logprobs=2, **GREEDY)
    entries = out["choices"][0]["prompt_logprobs"]
    assert len(entries) == len(ids) and entries[0] is None
    for tid, entry in zip(ids[1:], entries[1:]):
        own = entry[str(tid)]
        assert own["decoded_token"] == chr(tid - _BYTE_OFFSET) and own["logprob"] <= 0 and own["rank"] >= 1
        assert 2 <= len(entry) <= 3  # the two likeliest, and the prompt's own token if not among them
        ranks = sorted(e["rank"] for t, e in entry.items() if t != str(tid))
        assert ranks[:2] == [1, 2]
        best = max(e["logprob"] for e in entry.values())
        assert (own["rank"] == 1) == (own["logprob"] >= best - 1e-6)
    echoed = complete(server, prompt, max_tokens=2, echo=True, logprobs=2, **GREEDY)["choices"][0]["logprobs"]
    assert echoed["tokens"][:len(ids)] == ["<s>", *prompt]
    assert [entry[str(t)]["logprob"] for t, entry in zip(ids[1:], entries[1:])] == \
        pytest.approx(echoed["token_logprobs"][1:len(ids)], rel=1e-5, abs=1e-5)
    only_own = complete(server, prompt, max_tokens=1, prompt_logprobs=0)["choices"][0]["prompt_logprobs"]
    assert [list(e) for e in only_own[1:]] == [[str(t)] for t in ids[1:]]
    # the rank is the token's in the whole vocabulary, however many alternatives were asked for
    assert [e[str(t)]["rank"] for t, e in zip(ids[1:], only_own[1:])] == \
        [e[str(t)]["rank"] for t, e in zip(ids[1:], entries[1:])]
    assert all(e[str(t)]["rank"] > 2 for t, e in zip(ids[1:], entries[1:]) if len(e) == 3)
    none = complete(server, prompt, max_tokens=1)["choices"][0]
    assert "prompt_logprobs" not in none or none["prompt_logprobs"] is None
    conversation = chat(server, USER_HI, max_tokens=1, prompt_logprobs=1)
    prompt_ids = tokenize(server, messages=USER_HI)
    assert len(conversation["prompt_logprobs"]) == len(prompt_ids) and conversation["prompt_logprobs"][0] is None
    assert all(str(t) in e for t, e in zip(prompt_ids[1:], conversation["prompt_logprobs"][1:]))


# ---------------------------------------------------------------------------------- ids in the answer
def test_request_id_names_the_response(server):
    assert complete(server, "rid", max_tokens=1, request_id="abc-123")["id"] == "cmpl-abc-123"
    assert chat(server, USER_HI, max_tokens=1, request_id="abc-123")["id"] == "chatcmpl-abc-123"
    chunks = events(server, "/v1/chat/completions", {"messages": USER_HI, "max_tokens": 3, "request_id": "r-9"})
    assert {ch["id"] for ch in chunks} == {"chatcmpl-r-9"}
    assert post(server, "/v1/completions", {"prompt": "x", "request_id": ""}).status_code == 400
    # the openai client's extra_body reaches the server as the same field
    out = server.client.completions.create(model="tiny", prompt="rid", max_tokens=1,
                                           extra_body={"request_id": "from-client"})
    assert out.id == "cmpl-from-client"


def test_return_token_ids_whole_and_streamed(server):
    body = {"prompt": "Token ids", "max_tokens": 8, "return_token_ids": True, **GREEDY}
    whole = complete(server, **body)["choices"][0]
    assert whole["prompt_token_ids"] == tokenize(server, prompt="Token ids")
    assert len(whole["token_ids"]) == 8
    assert server.service.tokenizer.decode(whole["token_ids"]) == whole["text"]
    chunks = events(server, "/v1/completions", body)
    content = [ch["choices"][0] for ch in chunks if ch["choices"] and ch["choices"][0].get("token_ids")]
    assert sum((c["token_ids"] for c in content), []) == whole["token_ids"]
    assert content[0]["prompt_token_ids"] == whole["prompt_token_ids"]
    assert all("prompt_token_ids" not in c for c in content[1:])
    plain = complete(server, "Token ids", max_tokens=2)["choices"][0]
    assert "token_ids" not in plain or plain["token_ids"] is None


def test_return_token_ids_in_chat(server):
    body = {"max_tokens": 6, "return_token_ids": True, **GREEDY}
    whole = chat(server, USER_HI, **body)
    assert whole["prompt_token_ids"] == tokenize(server, messages=USER_HI)
    ids = whole["choices"][0]["token_ids"]
    assert len(ids) == whole["usage"]["completion_tokens"] == 6
    assert server.service.tokenizer.decode(ids) == whole["choices"][0]["message"]["content"]
    chunks = events(server, "/v1/chat/completions", {"messages": USER_HI, **body})
    assert chunks[0]["prompt_token_ids"] == whole["prompt_token_ids"]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert sum((ch["choices"][0].get("token_ids") or [] for ch in chunks if ch["choices"]), []) == ids


def test_return_tokens_as_token_ids_names_logprob_tokens(server):
    out = complete(server, "names", max_tokens=4, logprobs=2, return_tokens_as_token_ids=True,
                   return_token_ids=True, **GREEDY)["choices"][0]
    assert out["logprobs"]["tokens"] == [f"token_id:{t}" for t in out["token_ids"]]
    for top in out["logprobs"]["top_logprobs"]:
        assert all(k.startswith("token_id:") and k[len("token_id:"):].isdigit() for k in top)
    echoed = complete(server, "names", max_tokens=1, echo=True, logprobs=0, return_tokens_as_token_ids=True)
    prompt_ids = tokenize(server, prompt="names")
    assert echoed["choices"][0]["logprobs"]["tokens"][:len(prompt_ids)] == [f"token_id:{t}" for t in prompt_ids]
    body = {"max_tokens": 3, "logprobs": True, "top_logprobs": 2, "return_tokens_as_token_ids": True,
            "return_token_ids": True, **GREEDY}
    conversation = chat(server, USER_HI, **body)["choices"][0]
    content = conversation["logprobs"]["content"]
    assert [e["token"] for e in content] == [f"token_id:{t}" for t in conversation["token_ids"]]
    assert all(e["bytes"] == list(e["token"].encode()) for e in content)
    assert all(alt["token"].startswith("token_id:") for e in content for alt in e["top_logprobs"])
    chunks = events(server, "/v1/chat/completions", {"messages": USER_HI, **body})
    streamed = [e["token"] for ch in chunks if ch["choices"] and ch["choices"][0]["logprobs"]
                for e in ch["choices"][0]["logprobs"]["content"]]
    assert streamed == [e["token"] for e in content]


# ---------------------------------------------------------------------------------- streaming
def _content_chunks(server, path: str, body: dict) -> list[dict]:
    return [ch["choices"][0] for ch in events(server, path, body)
            if ch["choices"] and (text_of(ch) or ch["choices"][0].get("token_ids"))]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_one_chunk_per_token_or_per_stream_interval(server, path):
    n = 12
    body = {"max_tokens": n, "allowed_token_ids": ASCII_ONLY, "return_token_ids": True, **GREEDY,
            **({"prompt": "count"} if path == "/v1/completions" else {"messages": USER_HI})}
    each = _content_chunks(server, path, body)
    assert [len(c["token_ids"]) for c in each] == [1] * n
    assert all(len(text_of({"choices": [c]})) == 1 for c in each)
    grouped = _content_chunks(server, path, {**body, "stream_interval": 4})
    # the first chunk at once, then 4 tokens a chunk, the last with what is left
    assert [len(c["token_ids"]) for c in grouped] == [1, 4, 4, 3]
    assert len(grouped) == 1 + math.ceil((n - 1) / 4)
    assert "".join(text_of({"choices": [c]}) for c in grouped) == "".join(text_of({"choices": [c]}) for c in each)
    server.wait_idle()


def test_a_stream_interval_beyond_the_buffer_does_not_overflow_it(server):
    """Held-back events wait in the choice's bounded buffer: an interval longer than the buffer
    would fill it and end the stream as a slow client's; chunks are sent before it fills."""
    body = {"prompt": "long interval", "max_tokens": 40, "stream_interval": 100, "return_token_ids": True,
            "allowed_token_ids": ASCII_ONLY, **GREEDY}
    limit = server.config.stream_buffer_chunks
    server.config.stream_buffer_chunks = 8
    try:
        chunks = events(server, "/v1/completions", body)
    finally:
        server.config.stream_buffer_chunks = limit
    assert not any("error" in ch for ch in chunks), chunks[-1]
    choices = [ch["choices"][0] for ch in chunks if ch["choices"]]
    assert choices[-1]["finish_reason"] == "length"
    sizes = [len(c.get("token_ids") or []) for c in choices]
    assert sum(sizes) == 40 and sizes[0] == 1 and max(sizes) <= 8
    server.wait_idle()


def test_a_stream_holding_back_tokens_leaves_the_server_responsive(server):
    """Between two chunks of a long ``stream_interval`` the stream waits for tokens without holding
    the event loop: other requests are answered meanwhile."""
    body = {"prompt": "patient", "max_tokens": 1000, "stream_interval": 900, "stream": True, **GREEDY}
    limit = server.config.stream_buffer_chunks
    server.config.stream_buffer_chunks = 4096
    try:
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))  # the first token, at once
            t = time.perf_counter()
            assert httpx.get(server.url + "/health", timeout=30).status_code == 200
            assert time.perf_counter() - t < 3.0
    finally:
        server.config.stream_buffer_chunks = limit
    server.wait_idle()


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_stats(server, path):
    body = {"max_tokens": 6, **GREEDY, "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            **({"prompt": "usage"} if path == "/v1/completions" else {"messages": USER_HI})}
    chunks = events(server, path, body)
    assert all(ch["usage"] is not None for ch in chunks)
    prompt_tokens = {ch["usage"]["prompt_tokens"] for ch in chunks}
    assert len(prompt_tokens) == 1
    counts = [ch["usage"]["completion_tokens"] for ch in chunks]
    assert counts == sorted(counts) and counts[-1] == 6 and counts[0] <= 1
    assert all(ch["usage"]["total_tokens"] == ch["usage"]["prompt_tokens"] + ch["usage"]["completion_tokens"]
               for ch in chunks)
    assert chunks[-1]["choices"] == []
    plain = events(server, path, {**body, "stream_options": {"include_usage": True}})
    assert all(ch["usage"] is None for ch in plain[:-1]) and plain[-1]["usage"] == chunks[-1]["usage"]
    unasked = events(server, path, {**body, "stream_options": {"continuous_usage_stats": True}})
    assert all("usage" not in ch or ch["usage"] is None for ch in unasked)


# ---------------------------------------------------------------------------------- chat's own extensions
OPEN = [{"role": "user", "content": "Write"}, {"role": "assistant", "content": "Once upon"}]


def test_chat_echo_begins_with_the_assistants_message(server):
    out = chat(server, OPEN, max_tokens=4, echo=True, **GREEDY)
    text = out["choices"][0]["message"]["content"]
    plain = chat(server, OPEN, max_tokens=4, **GREEDY)["choices"][0]["message"]["content"]
    assert text == "Once upon" + plain
    assert out["usage"]["completion_tokens"] == 4
    chunks = events(server, "/v1/chat/completions", {"messages": OPEN, "max_tokens": 4, "echo": True, **GREEDY})
    contents = [text_of(ch) for ch in chunks if ch["choices"] and text_of(ch)]
    assert contents[0] == "Once upon" and "".join(contents) == text
    user_last = chat(server, USER_HI, max_tokens=3, echo=True, **GREEDY)["choices"][0]["message"]["content"]
    assert user_last == chat(server, USER_HI, max_tokens=3, **GREEDY)["choices"][0]["message"]["content"]


def test_continue_final_message_and_add_generation_prompt(server):
    default = chat(server, USER_HI, max_tokens=1, return_prompt_text=True)["prompt_text"]
    assert default.endswith("<|assistant|>\n")
    closed = chat(server, USER_HI, max_tokens=1, return_prompt_text=True, add_generation_prompt=False)
    assert "<|assistant|>" not in closed["prompt_text"] and default.startswith(closed["prompt_text"])
    assert closed["usage"]["prompt_tokens"] == len(closed["prompt_text"]) + 1  # + BOS
    cont = chat(server, OPEN, max_tokens=3, return_prompt_text=True, add_generation_prompt=False,
                continue_final_message=True, return_token_ids=True, **GREEDY)
    prompt = cont["prompt_text"]
    assert prompt.endswith("Once upon") and prompt.count("<|assistant|>") == 1
    assert cont["prompt_token_ids"][-len("Once upon"):] == [b + _BYTE_OFFSET for b in b"Once upon"]
    # the answer goes on from the open message: as the completion of the same text
    same = complete(server, prompt, max_tokens=3, **GREEDY)["choices"][0]["text"]
    assert cont["choices"][0]["message"]["content"] == same
    streamed = events(server, "/v1/chat/completions", {"messages": USER_HI, "max_tokens": 1,
                                                       "return_prompt_text": True})
    assert streamed[0]["prompt_text"] == default
    for extra in ({"continue_final_message": True},
                  {"continue_final_message": True, "add_generation_prompt": False, "messages": USER_HI}):
        r = post(server, "/v1/chat/completions", {"messages": OPEN, "max_tokens": 1, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message", r.text


REQUEST_TEMPLATE = ("[T]{% for m in messages %}{{ m['role'] }}={{ m['content'] }};{% endfor %}"
                    "effort={{ reasoning_effort }};flavour={{ flavour }};"
                    "{% for d in documents or [] %}doc={{ d['title'] }};{% endfor %}"
                    "{% if add_generation_prompt %}>{% endif %}")


def test_a_request_chat_template_needs_trust(server):
    body = {"messages": USER_HI, "max_tokens": 1, "chat_template": REQUEST_TEMPLATE, "return_prompt_text": True}
    r = post(server, "/v1/chat/completions", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template"
    server.config.trust_request_chat_template = True
    try:
        out = chat(server, reasoning_effort="low", chat_template_kwargs={"flavour": "mint"},
                   documents=[{"title": "D1", "text": "x"}], **body)
        assert out["prompt_text"] == "[T]user=hi;effort=low;flavour=mint;doc=D1;>"
        assert out["usage"]["prompt_tokens"] == len(out["prompt_text"]) + 1
        bare = chat(server, **{**body, "add_generation_prompt": False})
        assert bare["prompt_text"] == "[T]user=hi;effort=;flavour=;"
        broken = post(server, "/v1/chat/completions", {**body, "chat_template": "{% for %}"})
        assert broken.status_code == 400
    finally:
        server.config.trust_request_chat_template = False
    # without a request template, the server's: the kwargs change nothing there
    plain = chat(server, USER_HI, max_tokens=1, return_prompt_text=True, chat_template_kwargs={"flavour": "mint"},
                 reasoning_effort="high")
    assert plain["prompt_text"] == "<|user|>\nhi\n<|assistant|>\n"


# ---------------------------------------------------------------------------------- priority
def test_priority_reaches_the_engine_as_the_class(server):
    for priority in (3, -2, 0):
        out = complete(server, "priority", max_tokens=1, priority=priority)
        server.wait_idle()
        last = server.engine.core.metrics.terminal[-1]
        assert last.class_id == priority and out["usage"]["prompt_tokens"] == last.prompt_len
    chat(server, USER_HI, max_tokens=1, priority=7)
    server.wait_idle()
    assert server.engine.core.metrics.terminal[-1].class_id == 7


# ---------------------------------------------------------------------------------- refused and ignored fields
REFUSED = [
    ("completions", {"use_beam_search": True}, "use_beam_search"),
    ("chat", {"use_beam_search": True}, "use_beam_search"),
    ("completions", {"watermarking": True}, "watermarking"),
    ("completions", {"logprob_token_ids": [5]}, "logprob_token_ids"),
    ("chat", {"logprob_token_ids": [5]}, "logprob_token_ids"),
    ("completions", {"repetition_detection": {"max_pattern_size": 4}}, "repetition_detection"),
    ("completions", {"structured_outputs": {"json": {"type": "object"}, "regex": "a+"}}, "structured_outputs"),
    ("chat", {"structured_outputs": {"regex": "(a"}}, "structured_outputs"),
    ("chat", {"structured_outputs": {"disable_any_whitespace": True}}, "structured_outputs"),
    ("chat", {"structured_outputs": {"json_object": True, "frob": 1}}, "structured_outputs"),
    ("completions", {"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format"),
    ("completions", {"suffix": "tail"}, "suffix"),
    ("completions", {"prompt_embeds": "AAAA"}, "prompt_embeds"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}],
              "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required",
              "response_format": {"type": "json_object"}}, "tool_choice"),
    ("chat", {"tool_choice": "auto"}, "tool_choice"),
    ("chat", {"tool_choice": "required"}, "tool_choice"),
    ("chat", {"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
]


def _route_body(route: str, extra: dict) -> dict:
    base = {"prompt": "hi"} if route == "completions" else {"messages": USER_HI}
    return {"max_tokens": 2, **base, **extra}


@pytest.mark.parametrize("route, extra, param", REFUSED)
def test_unserved_vllm_fields_are_refused_by_name(server, route, extra, param):
    r = post(server, _PATHS[route], _route_body(route, extra))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["type"] == "invalid_request_error"


NEUTRAL_OR_IGNORED = {
    "use_beam_search": False, "watermarking": False, "repetition_detection": {"max_pattern_size": 0},
    "response_format": {"type": "text"}, "structured_outputs": None, "length_penalty": 2.0,
    "spaces_between_special_tokens": False, "session_id": "s-1", "cache_salt": "salt",
    "kv_transfer_params": {"do_remote_prefill": False}, "ec_transfer_params": {}, "vllm_xargs": {"k": 1},
    "thinking_token_budget": 10, "routed_experts_prompt_start": 3, "return_token_offsets": True,
    "mm_payload": "none", "return_mm_kwargs": True, "user": "u",
}


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_neutral_and_ignored_fields_change_nothing(server, route):
    plain = ok(server, _PATHS[route], _route_body(route, {"max_tokens": 4, **GREEDY}))
    extra = dict(NEUTRAL_OR_IGNORED)
    if route == "chat":
        extra.update(tool_choice="none", parallel_tool_calls=True, include_reasoning=False,
                     media_io_kwargs={"video": {}}, mm_processor_kwargs={"x": 1})
    out = ok(server, _PATHS[route], _route_body(route, {"max_tokens": 4, **GREEDY, **extra}))
    assert out["choices"][0] == plain["choices"][0] and out["usage"] == plain["usage"]
