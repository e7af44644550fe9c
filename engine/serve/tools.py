"""Tool calls of a chat request, as vLLM answers them.

A request that forces calls, of one named function (``tool_choice: {"type": "function", "function": {"name":
...}}``) or of any of its functions (``tool_choice: "required"``), has the model write them under the JSON schema
of the arguments (structured output): a named call's arguments are the generated text (``finish_reason`` ``stop``);
a required call's text is a JSON array of ``{"name", "parameters"}`` objects, one call each (``finish_reason``
``tool_calls``). ``tool_choice: "auto"``, the default with tools, lets the model choose between text and calls in its
own syntax, which a parser reads (``--tool-call-parser``, as vLLM's flag; ``hermes``: ``<tool_call>{"name": ...,
"arguments": {...}}</tool_call>``, what Qwen 2.5 and 3 and the Hermes models write); without one it is refused.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from tidegate.engine.serve.protocol import FieldError

#: the arguments of a function that declares none
EMPTY_OBJECT: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ForcedTools:
    """The calls a request forces: of the function ``name``, or (None) of any of its functions, as the JSON
    ``schema`` the output is held to."""

    name: str | None
    schema: dict

    def calls(self, text: str) -> list[dict] | None:
        """The ``tool_calls`` of an output, each with a new id: a named call's whatever its text (cut short by
        ``max_tokens``, its arguments are too), none where it wrote nothing; None for "required" where the text is
        no whole array of calls: it is then answered as text."""
        if self.name is not None:
            return [call_body(self.name, text)] if text else []
        try:
            items = json.loads(text)
        except ValueError:
            return None
        if not isinstance(items, list) or not all(isinstance(i, dict) and "name" in i for i in items):
            return None
        return [call_body(i["name"], json.dumps(i.get("parameters", {}), ensure_ascii=False)) for i in items]


    def answer(self, text: str) -> tuple[str, list[dict] | None]:
        """(the answer's text, its calls) of an output: the calls take all of it; (text, None) without calls."""
        calls = self.calls(text)
        return ("", calls) if calls else (text, None)


#: the tool-call syntaxes the server reads (``--tool-call-parser``)
TOOL_PARSERS = ("hermes",)
_HERMES_START = "<tool_call>"
_HERMES_CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)


@dataclass(frozen=True)
class ParsedTools:
    """``tool_choice: "auto"``: the model writes text, calls in its own syntax, or both (the text first), and the
    parser (one of :data:`TOOL_PARSERS`) reads the calls out of it."""

    parser: str = "hermes"
    #: False (``parallel_tool_calls: false``): the first call only
    parallel: bool = True
    #: the answer's calls are the model's to choose: none is forced
    name = None

    def answer(self, text: str) -> tuple[str, list[dict] | None]:
        """(the text before the first call, the calls) of an output; (text, None) where it holds no call that
        reads (the text is then answered as it is, as vLLM does). A call that leaves out its arguments takes none
        (``{}``); vLLM answers such an output as text."""
        start = text.find(_HERMES_START)
        if start < 0:
            return text, None
        calls = []
        for closed, open_end in _HERMES_CALL.findall(text):
            try:
                call = json.loads(closed or open_end)
            except ValueError:
                return text, None
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                return text, None
            calls.append(call_body(call["name"], json.dumps(call.get("arguments", {}), ensure_ascii=False)))
        return text[:start], calls if self.parallel else calls[:1]

    @staticmethod
    def sendable(text: str) -> int:
        """How much of an output so far can stream as text: up to its first call, less an end that may begin one."""
        start = text.find(_HERMES_START)
        if start >= 0:
            return start
        for keep in range(min(len(_HERMES_START) - 1, len(text)), 0, -1):
            if _HERMES_START.startswith(text[-keep:]):
                return len(text) - keep
        return len(text)


def call_body(name: str, arguments: str) -> dict:
    """One entry of ``tool_calls``."""
    return {"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def forced_tools(tools: list | None, tool_choice: Any, parallel_tool_calls: bool | None = None,
                 parser: str | None = None) -> ForcedTools | ParsedTools | None:
    """The calls ``tool_choice`` forces among ``tools``, or the ``parser`` that reads the model's own (``"auto"``);
    None: ``"none"``, or no tools.

    :raises FieldError: malformed tools, a tool_choice naming a function the tools do not hold, or ``"auto"``
        without a parser.
    """
    if tools is not None and not tools:
        raise FieldError("tools must hold at least one tool (or be left out)", "tools")
    if not tools:
        if tool_choice not in (None, "none"):
            raise FieldError("tool_choice needs tools", "tool_choice")
        return None
    functions = _functions(tools)
    if tool_choice == "none":
        return None
    if tool_choice in (None, "auto"):
        if parser is not None:
            return ParsedTools(parser, parallel_tool_calls is not False)
        raise FieldError('tool_choice "auto" (the default with tools) needs a parser of the model\'s own tool-call '
                         'syntax: start the server with --enable-auto-tool-choice --tool-call-parser hermes, or name '
                         'a function ({"type": "function", "function": {"name": ...}}) or send "required"',
                         "tool_choice")
    if tool_choice == "required":
        defs = _shared_defs(functions)  # a tool's "#/$defs/..." refers to the root: the array's
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": [
            {"properties": {"name": {"type": "string", "enum": [name]}, "parameters": params},
             "required": ["name", "parameters"]} for name, params in functions.items()]}}
        if parallel_tool_calls is False:
            schema["maxItems"] = 1
        if defs:
            schema["$defs"] = defs
        return ForcedTools(None, schema)
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(tool_choice, dict) or tool_choice.get("type", "function") != "function" \
            or not isinstance(name, str):
        raise FieldError('tool_choice must be "none", "required" or {"type": "function", "function": {"name": ...}}',
                         "tool_choice")
    if name not in functions:
        raise FieldError(f"tool_choice names the function {name!r}, which tools do not hold", "tool_choice")
    return ForcedTools(name, functions[name])


def _shared_defs(functions: dict[str, dict]) -> dict:
    """The ``$defs`` of every function's parameters, taken out of them (as vLLM does): one name defined two ways
    is refused."""
    shared: dict = {}
    for name, params in functions.items():
        if "$defs" not in params:
            continue
        defs = params["$defs"]
        if not isinstance(defs, dict):
            raise FieldError(f"the $defs of tool {name!r} must be an object", "tools")
        functions[name] = {k: v for k, v in params.items() if k != "$defs"}
        for key, value in defs.items():
            if key in shared and shared[key] != value:
                raise FieldError(f"the tools define {key!r} in $defs two different ways", "tools")
            shared[key] = value
    return shared


def _functions(tools: list) -> dict[str, dict]:
    """``{name: the JSON schema of its arguments}`` of a request's tools."""
    functions: dict[str, dict] = {}
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(function, dict) \
                or not isinstance(function.get("name"), str) or not function["name"]:
            raise FieldError('each of tools must be {"type": "function", "function": {"name": ..., "parameters": '
                             '...}}', "tools")
        params = function.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise FieldError(f"the parameters of tool {function['name']!r} must be a JSON schema (an object)", "tools")
        functions[function["name"]] = params or EMPTY_OBJECT
    return functions
