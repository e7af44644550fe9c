"""Structured output: a request's tokens held to a JSON schema, any JSON object, a regular expression, a choice or a
grammar, in the engine (greedy and sampled, beside the other masks, through evictions) and through the server's
three ways of asking for it (OpenAI's ``response_format``, vLLM's ``structured_outputs`` and its older
``guided_*``), whole and streamed.

The tiny model's weights are random, so whatever it writes within the constraint is noise: what is checked is that
the constraint holds (``jsonschema`` validates the JSON) and that the request ends when the constraint is whole.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from tidegate.engine.real.llm import LLM
from tidegate.engine.real.sampling import SamplingParams
from tidegate.engine.real.structured import StructuredOutput
from tests.test_openai_compat import server, tiny  # noqa: F401 (fixtures: the tiny model on a greedy server)
from tests.test_vllm_extensions import chat, complete, events, post

pytestmark = pytest.mark.timeout(300)

#: bounded on every side (closed objects, short strings, bounded integers), so the output is whole within 128 tokens
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
          "required": ["name", "age"], "additionalProperties": False}
REGEX = r"[0-9]{3}-[a-z]{2}"
CHOICES = ["yes", "no", "maybe"]
GRAMMAR = 'root ::= "(" [a-c]+ ")"'
PROMPTS = ["Hello", "Give me JSON", "x" * 40]


@pytest.fixture(scope="module")
def llm():
    return LLM(model="tiny", kv_capacity_tokens=4096)


def _holds(kind: str, text: str) -> bool:
    if kind == "json":
        try:
            jsonschema.validate(json.loads(text), PERSON)
        except (ValueError, jsonschema.ValidationError):
            return False
        return True
    if kind == "json_object":
        try:
            return isinstance(json.loads(text), dict)
        except ValueError:
            return False
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if kind == "choice":
        return text in CHOICES
    return re.fullmatch(r"\([a-c]+\)", text) is not None


CONSTRAINTS = [("json", PERSON, {"flexible_whitespace": False}), ("json_object", None, {"flexible_whitespace": False}),
               ("regex", REGEX, {}), ("choice", CHOICES, {}), ("grammar", GRAMMAR, {})]


@pytest.mark.parametrize("kind, spec, options", CONSTRAINTS, ids=[c[0] for c in CONSTRAINTS])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_output_holds_to_its_constraint_and_ends_when_whole(llm, kind, spec, options, temperature):
    output = StructuredOutput(kind, spec, **options)
    sampling = SamplingParams(temperature=temperature, seed=5, structured_outputs=output)
    # any JSON object has no bound on its length: cut short, it must still be a prefix of one
    max_tokens = 48 if kind == "json_object" else 128
    for out in llm.generate(PROMPTS, sampling, max_tokens=max_tokens):
        if out.finish_reason == "length":
            assert kind == "json_object" and out.text.startswith("{"), (kind, out.text)
            continue
        assert out.finish_reason == "stop", (kind, out.text)
        assert _holds(kind, out.text), (kind, out.text)
    free = llm.generate(PROMPTS, SamplingParams(temperature=temperature, seed=5), max_tokens=16)
    assert not all(_holds(kind, o.text) for o in free)  # the constraint, not the model, made them hold


def test_the_grammar_goes_before_the_other_masks_and_keeps_its_place_when_they_leave_nothing(llm):
    choice = StructuredOutput("choice", ["yes", "no"])
    y = ord("y") + 3
    banned = SamplingParams(structured_outputs=choice, bad_words_token_ids=[[y]])
    assert [o.text for o in llm.generate(PROMPTS, banned, max_tokens=8)] == ["no"] * len(PROMPTS)
    # allowed_token_ids that the grammar never allows: the grammar holds, the other mask is lifted
    stray = SamplingParams(structured_outputs=choice, allowed_token_ids=[ord("z") + 3])
    assert all(o.text in ("yes", "no") for o in llm.generate(PROMPTS, stray, max_tokens=8))


def test_evictions_leave_structured_outputs_as_they_were():
    """Recompute evictions keep each sequence's place in its grammar: the outputs equal those of a cache with room."""
    sampling = SamplingParams(structured_outputs=StructuredOutput("json", PERSON, flexible_whitespace=False))
    prompts = [f"person {i} " * 6 for i in range(12)]
    roomy = LLM(model="tiny", kv_capacity_tokens=16384)
    tight = LLM(model="tiny", kv_capacity_tokens=640, max_num_seqs=12)
    want = [o.text for o in roomy.generate(prompts, sampling, max_tokens=96)]
    got = [o.text for o in tight.generate(prompts, sampling, max_tokens=96)]
    assert tight.core.metrics.evictions > 0
    assert got == want


@pytest.mark.parametrize("kind, spec, message", [
    ("json", {"type": "object", "properties": 3}, "the json of structured output does not compile"),
    ("json", "{not json", "the json of structured output does not compile"),
    ("regex", "[a-", "the regex of structured output does not compile"),
    ("choice", [], "choice must be a non-empty list of strings"),
    ("grammar", "root ::= nowhere", "the grammar of structured output does not compile"),
    ("xml", "<a/>", "structured output must be one of"),
    ("grammar", " ", "grammar must be a string with a rule"),
    ("json", {"const": float("inf")}, "numbers must be finite"),
    ("choice", ["x" * 40_000], "at most 32,768 are served"),
])
def test_a_constraint_that_does_not_compile_is_one_sentence(kind, spec, message):
    with pytest.raises(ValueError, match=message) as caught:
        StructuredOutput(kind, spec)
    assert "\n" not in str(caught.value)


# ---------------------------------------------------------------------------------- the server
def test_response_format_json_schema_on_chat(server):
    body = chat(server, [{"role": "user", "content": "hi"}], max_tokens=128, temperature=0,
                response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
                structured_outputs=None)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choice["message"]["content"]), PERSON)


def test_the_openai_client_gets_json_it_can_parse(server):
    reply = server.client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=128, temperature=1.0, seed=3,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}},
        extra_body={"structured_outputs": {"disable_any_whitespace": True}})
    jsonschema.validate(json.loads(reply.choices[0].message.content), PERSON)


@pytest.mark.parametrize("fields, kind", [
    ({"structured_outputs": {"regex": REGEX}}, "regex"),
    ({"structured_outputs": {"choice": CHOICES}}, "choice"),
    ({"structured_outputs": {"grammar": GRAMMAR}}, "grammar"),
    ({"guided_regex": REGEX}, "regex"),
    ({"guided_choice": CHOICES}, "choice"),
    ({"guided_json": PERSON, "guided_whitespace_pattern": ""}, "json"),
    ({"structured_outputs": {"json": json.dumps(PERSON), "disable_any_whitespace": True}}, "json"),
])
def test_completions_hold_to_every_kind_whole_and_streamed(server, fields, kind):
    whole = complete(server, "Hello", max_tokens=128, temperature=0, n=2, **fields)
    texts = [c["text"] for c in whole["choices"]]
    assert all(_holds(kind, t) for t in texts), texts
    streamed = events(server, "/v1/completions", {"prompt": "Hello", "max_tokens": 128, "temperature": 0, **fields})
    text = "".join(e["choices"][0]["text"] for e in streamed if e["choices"])
    assert text == texts[0]
    assert [e["choices"][0]["finish_reason"] for e in streamed if e["choices"]][-1] == "stop"


def test_closed_objects_take_no_other_properties(server):
    open_schema = {"type": "object", "properties": {"a": {"type": "integer", "maximum": 9, "minimum": 0}},
                   "required": ["a"]}
    body = complete(server, "Hello", max_tokens=96, temperature=0,
                    structured_outputs={"json": open_schema, "disable_additional_properties": True,
                                        "disable_any_whitespace": True})
    assert list(json.loads(body["choices"][0]["text"])) == ["a"]


@pytest.mark.parametrize("fields, param, message", [
    ({"structured_outputs": {}}, "structured_outputs", "names no constraint"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs",
     "were both given"),
    ({"structured_outputs": {"regex": "a+", "disable_any_whitespace": "false"}}, "structured_outputs",
     "must be true or false"),
    ({"structured_outputs": {"regex": "[a&&b]"}}, "structured_outputs", "admits no output at all"),
    ({"guided_json": {"const": 1e400}}, "guided_json", "must be finite"),
])
def test_a_malformed_constraint_is_a_400_naming_its_field(server, fields, param, message):
    r = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 4, **fields})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and message in r.json()["error"]["message"]


def test_an_empty_regex_and_json_object_false_are_constraints_as_in_vllm(server):
    assert complete(server, "hi", max_tokens=8, structured_outputs={"regex": ""})["choices"][0]["text"] == ""
    text = complete(server, "hi", max_tokens=64, temperature=0,
                    structured_outputs={"json_object": False})["choices"][0]["text"]
    assert text.startswith("{")


def test_a_constraint_that_does_not_compile_is_a_400_naming_its_field(server):
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                                              "response_format": {"type": "json_schema",
                                                                  "json_schema": {"schema": {"type": 7}}}})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "response_format" and "does not compile" in error["message"]


# ---------------------------------------------------------------------------------- forced tool calls
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Oslo", "Lima"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
         "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "a forecast", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "clock", "parameters": CLOCK}}]
SCHEMAS = {"weather": WEATHER, "clock": CLOCK}
NAMED = {"type": "function", "function": {"name": "weather"}}


def _call(server, stream: bool, **fields):
    """The tool calls and finish reason of one chat answer through the openai client, the streamed deltas put
    together as a client puts them together."""
    # the random model would write whitespace or more properties without end: neither is allowed here
    options = {"structured_outputs": {"disable_any_whitespace": True, "disable_additional_properties": True}}
    fields = {"max_tokens": 128, **fields}
    reply = server.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                  temperature=0, tools=TOOLS, stream=stream, extra_body=options,
                                                  **fields)
    if not stream:
        message = reply.choices[0].message
        return [(c.id, c.function.name, c.function.arguments) for c in message.tool_calls], \
            reply.choices[0].finish_reason, message.content
    calls: dict[int, list] = {}
    finish = None
    for chunk in reply:
        choice = chunk.choices[0]
        for delta in choice.delta.tool_calls or ():
            entry = calls.setdefault(delta.index, [None, None, ""])
            entry[0] = delta.id or entry[0]
            entry[1] = delta.function.name or entry[1]
            entry[2] += delta.function.arguments or ""
        finish = choice.finish_reason or finish
    return [tuple(calls[i]) for i in sorted(calls)], finish, None


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_tool_call_has_the_functions_arguments(server, stream):
    calls, finish, content = _call(server, stream, tool_choice=NAMED)
    assert finish == "stop" and content in ("", None) and len(calls) == 1
    call_id, name, arguments = calls[0]
    assert name == "weather" and call_id.startswith("chatcmpl-tool-")
    jsonschema.validate(json.loads(arguments), WEATHER)


@pytest.mark.parametrize("stream", [False, True])
def test_required_tool_calls_are_calls_of_the_tools(server, stream):
    calls, finish, _ = _call(server, stream, tool_choice="required", parallel_tool_calls=False)
    assert finish == "tool_calls" and len(calls) == 1
    for call_id, name, arguments in calls:
        assert call_id.startswith("chatcmpl-tool-")
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_streamed_and_whole_tool_calls_agree(server):
    for choice in (NAMED, "required"):
        whole, streamed = _call(server, False, tool_choice=choice), _call(server, True, tool_choice=choice)
        assert [c[1:] for c in whole[0]] == [c[1:] for c in streamed[0]] and whole[1] == streamed[1]


def test_tools_reach_the_chat_template():
    from tidegate.engine.serve.protocol import ChatBody

    body = ChatBody(messages=[{"role": "user", "content": "hi"}], tools=TOOLS, tool_choice="required")
    assert body.template_kwargs()["tools"] == TOOLS and body.unserved() is None


def test_a_matcher_that_fails_midway_fails_the_request_saying_why(llm):
    """A grammar past a limit of llguidance's parser (a row of items) fails at its second token: the request ends
    failed with the parser's first line, never as a finished output that does not hold."""
    wide = {"type": "object", "additionalProperties": False,
            "properties": {f"field_{i}": {"type": "string", "maxLength": 3} for i in range(600)}}
    sampling = SamplingParams(structured_outputs=StructuredOutput("json", wide))
    llm.check_request([1, 5], 60, sampling)  # its first token is fine
    for out in llm.generate(PROMPTS[:2], sampling, max_tokens=60):
        assert out.finish_reason.startswith("structured output failed: Parser Error") and "\n" not in out.finish_reason
        assert out.text == "{"


@pytest.mark.parametrize("kind, spec, message", [
    ("regex", "[a&&b]", "admits no output at all"),
    ("json", {"$ref": "#"}, "admits no output at all"),
])
def test_a_constraint_with_no_first_token_is_refused_before_it_runs(llm, kind, spec, message):
    with pytest.raises(ValueError, match=message):
        llm.check_request([1, 5], 8, SamplingParams(structured_outputs=StructuredOutput(kind, spec)))


def test_many_copies_of_a_request_build_its_matcher_once(llm):
    matchers = llm.executor._matchers
    output = StructuredOutput("regex", "[0-9]{4}")
    outs = llm.generate(PROMPTS, SamplingParams(temperature=1.0, seed=1, structured_outputs=output), max_tokens=8)
    assert all(re.fullmatch("[0-9]{4}", o.text) for o in outs)
    assert list(matchers).count(output.grammar) == 1
    start = matchers[output.grammar]
    llm.generate(PROMPTS, SamplingParams(structured_outputs=output), max_tokens=8)
    assert matchers[output.grammar] is start


def test_required_calls_take_tools_with_shared_definitions(server):
    """A tool whose parameters refer to their own ``$defs`` (what pydantic writes for a nested model): under
    "required" the definitions move to the root of the array's schema, where the references point."""
    nested = {"type": "object", "properties": {"where": {"$ref": "#/$defs/Place"}}, "required": ["where"],
              "additionalProperties": False,
              "$defs": {"Place": {"type": "object", "properties": {"city": {"enum": ["Oslo", "Lima"]}},
                                  "required": ["city"], "additionalProperties": False}}}
    tools = [{"type": "function", "function": {"name": "visit", "parameters": nested}}]
    body = chat(server, [{"role": "user", "content": "hi"}], max_tokens=128, temperature=0, tools=tools,
                tool_choice="required", parallel_tool_calls=False,
                structured_outputs={"disable_any_whitespace": True, "disable_additional_properties": True})
    call = body["choices"][0]["message"]["tool_calls"][0]["function"]
    assert call["name"] == "visit" and json.loads(call["arguments"])["where"]["city"] in ("Oslo", "Lima")
    clash = [tools[0], {"type": "function", "function": {"name": "other", "parameters": {
        "type": "object", "properties": {}, "$defs": {"Place": {"type": "string"}}}}}]
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": clash,
                                              "tool_choice": "required", "max_tokens": 4})
    assert r.status_code == 400 and "'Place' in $defs two different ways" in r.json()["error"]["message"]


def test_a_named_call_cut_short_is_a_call_whole_and_streamed(server):
    whole, streamed = (_call(server, stream, tool_choice=NAMED, max_tokens=5) for stream in (False, True))
    assert whole[1] == streamed[1] == "length"
    assert [c[1:] for c in whole[0]] == [c[1:] for c in streamed[0]] and whole[0][0][2].startswith("{")


def test_an_echoed_message_stays_text_beside_the_call(server):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "pre"}]
    body = chat(server, messages, max_tokens=128, temperature=0, tools=TOOLS, tool_choice=NAMED, echo=True,
                add_generation_prompt=False,
                structured_outputs={"disable_any_whitespace": True, "disable_additional_properties": True})
    message = body["choices"][0]["message"]
    assert message["content"] == "pre"
    jsonschema.validate(json.loads(message["tool_calls"][0]["function"]["arguments"]), WEATHER)


def test_streamed_required_calls_keep_their_tokens_logprobs(server):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 128, "temperature": 0, "tools": TOOLS,
            "tool_choice": "required", "parallel_tool_calls": False, "logprobs": True, "return_token_ids": True,
            "structured_outputs": {"disable_any_whitespace": True, "disable_additional_properties": True}}
    whole = chat(server, **body)
    streamed = events(server, "/v1/chat/completions", body)
    chunks = [e["choices"][0] for e in streamed if e["choices"]]
    assert sum(len(c.get("token_ids") or ()) for c in chunks) == len(whole["choices"][0]["token_ids"])
    entries = [entry for c in chunks if c.get("logprobs") for entry in c["logprobs"]["content"]]
    assert len(entries) == len(whole["choices"][0]["logprobs"]["content"])


def test_tool_call_arguments_reach_the_template_as_objects():
    from tidegate.engine.serve.protocol import ChatMessage

    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    turn = ChatMessage(role="assistant", content=None, tool_calls=[call]).turn()
    assert turn["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    broken = {**call, "function": {"name": "f", "arguments": "not json"}}
    assert ChatMessage(role="assistant", tool_calls=[broken]).turn()["tool_calls"][0]["function"]["arguments"] == {}


def test_an_empty_tools_list_is_refused(server):
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [],
                                              "max_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"


# ---------------------------------------------------------------------------------- tool_choice "auto"
CALL_TEXT = '<tool_call>{"name": "weather", "arguments": {"city": "Oslo", "days": 2}}</tool_call>'


@pytest.fixture(scope="module")
def auto_server(tiny):  # noqa: F811 (the fixture imported above)
    from tests.test_server import Running

    s = Running(tiny, controller="greedy", enable_auto_tool_choice=True, tool_call_parser="hermes")
    yield s
    s.close()


def test_the_hermes_parser_reads_calls_and_the_text_before_them():
    from tidegate.engine.serve.tools import ParsedTools

    hermes = ParsedTools("hermes")
    assert hermes.answer("just text") == ("just text", None)
    text, calls = hermes.answer("Sure. " + CALL_TEXT + "\n<tool_call>\n{\"name\": \"clock\"}")
    assert text == "Sure. " and [c["function"]["name"] for c in calls] == ["weather", "clock"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo", "days": 2}
    assert json.loads(calls[1]["function"]["arguments"]) == {}  # the last one unclosed, as vLLM reads it
    assert hermes.answer("x <tool_call>{not json</tool_call>") == ("x <tool_call>{not json</tool_call>", None)
    assert [hermes.sendable(t) for t in ("abc", "abc<tool", "abc<tool_call>{", "<")] == [3, 3, 3, 0]


@pytest.mark.parametrize("stream", [False, True])
def test_auto_tool_choice_answers_the_calls_the_model_writes(auto_server, stream):
    """The model's text is held to a call here (a regular expression), so the parser has something to read."""
    pattern = re.escape("Hi " + CALL_TEXT)
    reply = auto_server.client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=200, temperature=0, tools=TOOLS,
        stream=stream, extra_body={"structured_outputs": {"regex": pattern}})
    if stream:
        content, calls, finish = "", {}, None
        for chunk in reply:
            delta = chunk.choices[0].delta
            content += delta.content or ""
            for call in delta.tool_calls or ():
                entry = calls.setdefault(call.index, ["", ""])
                entry[0] += call.function.name or ""
                entry[1] += call.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        got = [tuple(calls[i]) for i in sorted(calls)]
    else:
        message = reply.choices[0].message
        content, finish = message.content, reply.choices[0].finish_reason
        got = [(c.function.name, c.function.arguments) for c in message.tool_calls]
    assert content == "Hi " and finish == "tool_calls"
    assert [(name, json.loads(arguments)) for name, arguments in got] == [("weather", {"city": "Oslo", "days": 2})]


def test_auto_tool_choice_answers_text_without_calls_as_text(auto_server):
    body = chat(auto_server, [{"role": "user", "content": "hi"}], max_tokens=32, temperature=0, tools=TOOLS,
                structured_outputs={"regex": "plain words"})
    message = body["choices"][0]["message"]
    assert message["content"] == "plain words" and not message.get("tool_calls")
    assert body["choices"][0]["finish_reason"] == "stop"


def test_auto_tool_choice_needs_a_parser(server):
    from tidegate.engine.serve.config import ServeConfig

    r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS,
                                              "max_tokens": 4})
    assert r.status_code == 400 and "--tool-call-parser hermes" in r.json()["error"]["message"]
    with pytest.raises(ValueError, match="enable_auto_tool_choice needs tool_call_parser"):
        ServeConfig(enable_auto_tool_choice=True)


def test_tools_reach_the_template_in_chat_and_tokenize_alike(tiny):  # noqa: F811 (the fixture imported above)
    from tests.test_server import Running

    template = ("{% for t in tools or [] %}[{{ t.function.name }}]{% endfor %}"
                "{% for m in messages %}{{ m.content }}{% endfor %}")
    s = Running(tiny, controller="greedy", chat_template=template, enable_auto_tool_choice=True,
                tool_call_parser="hermes")
    try:
        messages = [{"role": "user", "content": "hi"}]
        body = chat(s, messages, max_tokens=2, tools=TOOLS, return_prompt_text=True)
        assert body["prompt_text"] == "[weather][clock]hi"
        with_tools = post(s, "/tokenize", {"messages": messages, "tools": TOOLS}).json()["count"]
        without = post(s, "/tokenize", {"messages": messages}).json()["count"]
        assert with_tools - without == len("[weather][clock]") == body["usage"]["prompt_tokens"] - without
    finally:
        s.close()


def _auto(server, text: str, stream: bool, **fields) -> tuple:
    """(content, [(name, arguments)], finish) of an auto answer whose model writes ``text`` (or what ``max_tokens``
    leaves of it)."""
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 200, "temperature": 0, "tools": TOOLS,
            "structured_outputs": {"regex": re.escape(text)}, **fields}
    if not stream:
        choice = chat(server, **body)["choices"][0]
        calls = [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                 for c in choice["message"].get("tool_calls") or ()]
        return choice["message"]["content"], calls, choice["finish_reason"]
    content, calls, finish = "", {}, None
    for event in events(server, "/v1/chat/completions", {**body, "stream_interval": 1}):
        delta = event["choices"][0]["delta"] if event["choices"] else {}
        content += delta.get("content") or ""
        for call in delta.get("tool_calls") or ():
            calls[call["index"]] = (call["function"]["name"], json.loads(call["function"]["arguments"]))
        finish = (event["choices"][0]["finish_reason"] if event["choices"] else None) or finish
    return content, [calls[i] for i in sorted(calls)], finish


def test_auto_calls_cut_short_parallel_and_alone(auto_server):
    second = '<tool_call>{"name": "clock", "arguments": {"zone": "UTC"}}</tool_call>'
    weather = ("weather", {"city": "Oslo", "days": 2})
    # cut short before its closing tag, a call is still read: whole, the finish says tool_calls; streamed, length
    cut = len("Hi " + CALL_TEXT) - len("</tool_call>")  # one byte a token: the JSON whole, no closing tag
    assert _auto(auto_server, "Hi " + CALL_TEXT, False, max_tokens=cut) == ("Hi ", [weather], "tool_calls")
    assert _auto(auto_server, "Hi " + CALL_TEXT, True, max_tokens=cut) == ("Hi ", [weather], "length")
    for stream in (False, True):
        both = _auto(auto_server, "Hi " + CALL_TEXT + second, stream)
        assert both[1] == [weather, ("clock", {"zone": "UTC"})]
        assert _auto(auto_server, "Hi " + CALL_TEXT + second, stream, parallel_tool_calls=False)[1] == [weather]
    assert _auto(auto_server, CALL_TEXT, False)[0] is None  # only calls: no text, as OpenAI and vLLM answer
