"""What a request body holds its output to: OpenAI's ``response_format``, vLLM's ``structured_outputs`` and its
older ``guided_*`` fields read as vLLM reads them, and the constraint of a forced tool call, each as the engine's
:class:`~tidegate.engine.real.structured.StructuredOutput`. A constraint that is malformed or does not compile raises
:class:`FieldError` naming the field, which the server answers with 400."""

from __future__ import annotations

from tidegate.engine.real.structured import StructuredOutput
from tidegate.engine.serve.protocol import FieldError, SamplingBody
from tidegate.engine.serve.tools import ForcedTools


#: the constraints of vLLM's ``structured_outputs``, and its options
_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
_OPTIONS = ("disable_any_whitespace", "disable_additional_properties", "whitespace_pattern", "disable_fallback")
#: vLLM's older names of the constraints (before ``structured_outputs``)
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def structured_output(body: SamplingBody) -> StructuredOutput | None:
    """The constraint a body holds its output to, as vLLM reads it: ``response_format`` (``json_object``, or
    ``json_schema`` with its ``schema``) over ``structured_outputs`` (one of ``json``, ``regex``, ``choice``,
    ``grammar``, ``json_object``, and its whitespace options), or vLLM's older ``guided_*`` fields; None for free
    text.

    :raises FieldError: a constraint that is malformed or does not compile, naming its field."""
    found: list[tuple[str, str, object]] = []  # (field, kind, spec)
    options = _options(body)
    found += [("structured_outputs", k, options[k]) for k in _CONSTRAINTS if options.get(k) is not None]
    found += [(name, kind, getattr(body, name)) for name, kind in _GUIDED.items() if getattr(body, name) is not None]
    if _has_format(body):
        kind, spec = _response_format(body.response_format)
        found.insert(0, ("response_format", kind, spec))
    if not found:
        if body.structured_outputs is not None:
            raise FieldError("structured_outputs names no constraint (one of json, regex, choice, grammar, "
                              "json_object)", "structured_outputs")
        return None
    if len(found) > 1:
        raise FieldError(f"one structured output constraint a request: {found[0][0]} ({found[0][1]}) and "
                          f"{found[1][0]} ({found[1][1]}) were both given", found[1][0])
    name, kind, spec = found[0]
    if kind == "json_object":  # any value but null asks for it, as in vLLM
        spec = None
    try:
        return StructuredOutput(kind, spec, flexible_whitespace=not options.get("disable_any_whitespace"),
                                closed_objects=bool(options.get("disable_additional_properties")),
                                whitespace_pattern=options.get("whitespace_pattern", body.guided_whitespace_pattern))
    except ValueError as exc:
        raise FieldError(str(exc).rstrip("."), name) from None


def _options(body: SamplingBody) -> dict:
    """``structured_outputs`` checked: known fields, options of their types (FieldError otherwise)."""
    options = dict(body.structured_outputs or {})
    unknown = sorted(set(options) - set(_CONSTRAINTS) - set(_OPTIONS))
    if unknown:
        raise FieldError(f"structured_outputs has no field {unknown[0]!r} (it takes one of "
                          f"{', '.join(_CONSTRAINTS[:-1])} and the options {', '.join(_OPTIONS[:-1])})",
                          "structured_outputs")
    for name in ("disable_any_whitespace", "disable_additional_properties", "disable_fallback"):
        if options.get(name) is not None and not isinstance(options[name], bool):
            raise FieldError(f"structured_outputs.{name} must be true or false", "structured_outputs")
    for name, value in (("structured_outputs.whitespace_pattern", options.get("whitespace_pattern")),
                        ("guided_whitespace_pattern", body.guided_whitespace_pattern)):
        if value is not None and not isinstance(value, str):
            raise FieldError(f"{name} must be a string", name.split(".")[0])
    return options


def tool_output(body: SamplingBody, tools: ForcedTools) -> StructuredOutput:
    """The constraint of a forced tool call, with ``structured_outputs``' options; a constraint of the body's own
    beside it is refused (FieldError)."""
    options = _options(body)
    if _has_format(body) or any(options.get(k) is not None for k in _CONSTRAINTS) \
            or any(getattr(body, name) is not None for name in _GUIDED):
        raise FieldError("a forced tool call is structured output of its own: send tool_choice or "
                          f"{structured_field(body)}, not both", "tool_choice")
    try:
        return StructuredOutput("json", tools.schema, flexible_whitespace=not options.get("disable_any_whitespace"),
                                closed_objects=bool(options.get("disable_additional_properties")))
    except ValueError as exc:
        raise FieldError(str(exc).rstrip("."), "tools") from None


def wants_structured_output(body: SamplingBody) -> bool:
    """Whether a body asks for structured output in any of its three ways."""
    return _has_format(body) or bool(body.structured_outputs) \
        or any(getattr(body, name) is not None for name in _GUIDED)


def structured_field(body: SamplingBody) -> str:
    """The field a body's structured output comes from (for an error naming it)."""
    if _has_format(body):
        return "response_format"
    if body.structured_outputs:
        return "structured_outputs"
    return next((name for name in _GUIDED if getattr(body, name) is not None), "structured_outputs")


def _has_format(body: SamplingBody) -> bool:
    """Whether a body's ``response_format`` asks for more than text."""
    return body.response_format is not None and body.response_format.get("type") != "text"


def _response_format(fmt: dict) -> tuple[str, object]:
    """The constraint of OpenAI's ``response_format`` (type ``json_object`` or ``json_schema``)."""
    kind = fmt.get("type")
    if kind == "json_object":
        return "json_object", None
    if kind == "json_schema":
        schema = fmt.get("json_schema")
        if not isinstance(schema, dict) or schema.get("schema") is None:
            raise FieldError("response_format of type json_schema needs json_schema.schema, the JSON schema",
                              "response_format")
        return "json", schema["schema"]
    raise FieldError(f"response_format.type must be text, json_object or json_schema, got {kind!r}",
                      "response_format")
