"""Structured output: a request's tokens held to a JSON schema, any JSON object, a regular expression, a choice
of strings or a grammar, through llguidance (the library behind vLLM's ``guidance`` backend).

A request's :class:`StructuredOutput` is compiled to an llguidance grammar once, where the request arrives (a bad
schema, pattern or grammar is refused there with one sentence); the executor gives each running sequence a
matcher over the model's tokenizer. Every step the matcher's mask of the tokens that can extend a valid output
goes on the sequence's logits before the sampler's own masks, and the sampled token advances it; the sequence
ends (``stop``) when the grammar admits nothing more, which for JSON is the closing brace. As in vLLM, the
grammar's whitespace is flexible unless ``disable_any_whitespace`` says otherwise, and ``max_tokens`` can still
cut an output short of valid.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass, field
from typing import Any

#: what a request may hold its output to, as vLLM's ``structured_outputs`` names them
KINDS = ("json", "json_object", "regex", "choice", "grammar")
#: the largest constraint served, as UTF-8 (a JSON schema or a choice as JSON text): compiling one and building its
#: matcher grow with the square of its size (a schema of 2,000 properties, 57 KB: 0.4 s a matcher on this CPU; a
#: GBNF grammar of 1,000 rules, 33 KB: 1 s to convert, in Python)
MAX_CONSTRAINT_BYTES = 32 * 1024
#: schema keywords whose values map names to subschemas, and keywords holding subschemas (vLLM's list)
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies")
_SUBSCHEMAS = ("additionalProperties", "unevaluatedProperties", "propertyNames", "contains", "additionalItems",
               "unevaluatedItems", "not", "if", "then", "else", "contentSchema", "items", "prefixItems", "allOf",
               "anyOf", "oneOf")


@dataclass(frozen=True)
class StructuredOutput:
    """One constraint on a request's output.

    :param kind: one of :data:`KINDS`.
    :param spec: the JSON schema (a dict or its text) for ``json``, the pattern for ``regex``, the strings for
        ``choice``, the Lark or GBNF grammar for ``grammar``; None for ``json_object``.
    :param flexible_whitespace: JSON may hold any whitespace between tokens (vLLM's default); False: none.
    :param closed_objects: objects of the schema that do not say otherwise take no properties beyond theirs
        (vLLM's ``disable_additional_properties``).
    :param whitespace_pattern: a regular expression for the whitespace JSON may hold (over
        ``flexible_whitespace``); None: the default.
    :raises ValueError: one sentence naming what is wrong, when the constraint does not compile.
    """

    kind: str
    spec: Any = None
    flexible_whitespace: bool = True
    closed_objects: bool = False
    whitespace_pattern: str | None = None
    #: the llguidance grammar the constraint compiles to (set at construction)
    grammar: str = field(default="", init=False, compare=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"structured output must be one of {', '.join(KINDS)}, got {self.kind!r}")
        object.__setattr__(self, "grammar", _compile(self))


def _compile(s: StructuredOutput) -> str:
    """The llguidance grammar of ``s``, checked; raises ValueError with one sentence."""
    import llguidance
    from llguidance import LLMatcher

    size = len((s.spec if isinstance(s.spec, str) else json.dumps(s.spec, default=str)).encode("utf-8", "replace"))
    if size > MAX_CONSTRAINT_BYTES:
        raise ValueError(f"the {s.kind} of structured output is {size:,} bytes; at most {MAX_CONSTRAINT_BYTES:,} are "
                         f"served")
    options: dict[str, Any] = {"whitespace_flexible": s.flexible_whitespace}
    if s.whitespace_pattern is not None:
        options["whitespace_pattern"] = s.whitespace_pattern
    try:
        if s.kind == "json":
            schema = s.spec
            if isinstance(schema, str):
                schema = json.loads(schema)
            if not isinstance(schema, (dict, bool)):
                raise ValueError(f"a JSON schema is an object, got {type(schema).__name__}")
            if not _finite(schema):
                raise ValueError("a JSON schema's numbers must be finite (NaN, Infinity and 1e400 are not)")
            if s.closed_objects:
                schema = copy.deepcopy(schema)
                _close_objects(schema)
            grammar = LLMatcher.grammar_from_json_schema(schema, defaults=options)
        elif s.kind == "json_object":
            grammar = LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=options)
        elif s.kind == "choice":
            if not isinstance(s.spec, (list, tuple)) or not s.spec or not all(isinstance(c, str) for c in s.spec):
                raise ValueError("choice must be a non-empty list of strings")
            grammar = llguidance.grammar_from("choice", list(s.spec))
        else:
            if not isinstance(s.spec, str) or (s.kind == "grammar" and not s.spec.strip()):
                raise ValueError(f"{s.kind} must be a string" + (" with a rule" if s.kind == "grammar" else ""))
            grammar = llguidance.grammar_from(s.kind, s.spec)
    except (ValueError, TypeError, KeyError, RuntimeError) as exc:
        raise ValueError(f"the {s.kind} of structured output does not compile: {_first_line(exc)}") from None
    problem = LLMatcher.validate_grammar(grammar)
    if problem:
        raise ValueError(f"the {s.kind} of structured output does not compile: {_first_line(problem)}")
    return grammar


def _finite(value: object) -> bool:
    """Whether every number in a JSON value is finite (Python's parser reads NaN, Infinity and 1e400 as floats)."""
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(_finite(v) for v in value.values())
    if isinstance(value, list):
        return all(_finite(v) for v in value)
    return True


def _first_line(problem: object) -> str:
    text = str(problem).strip()
    return text.splitlines()[0][:300] if text else type(problem).__name__


def _close_objects(schema: object) -> None:
    """``additionalProperties: false`` on every object of ``schema`` with properties that does not set it."""
    if isinstance(schema, list):
        for item in schema:
            _close_objects(item)
        return
    if not isinstance(schema, dict):
        return
    for key in _SCHEMA_MAPS:
        value = schema.get(key)
        if isinstance(value, dict):
            for sub in value.values():
                _close_objects(sub)
    for key in _SUBSCHEMAS:
        if isinstance(schema.get(key), (dict, list)):
            _close_objects(schema[key])
    if "additionalProperties" not in schema and (isinstance(schema.get("properties"), dict)
                                                 or isinstance(schema.get("patternProperties"), dict)):
        schema["additionalProperties"] = False


class _ByteVocabulary:
    """The byte tokenizer's vocabulary as llguidance reads a tokenizer: each id's bytes, and text to ids."""

    def __init__(self, tokenizer) -> None:
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        self.special_token_ids = list(tokenizer.all_special_ids)
        self.tokens = [tokenizer.decode_bytes([i], skip_special_tokens=False) for i in range(len(tokenizer))]
        self._tokenizer = tokenizer

    def __call__(self, text: bytes) -> list[int]:
        return self._tokenizer.encode(text.decode("utf-8", errors="replace"), add_special_tokens=False)


def check_grammar(output: StructuredOutput, tokenizer):
    """Raise ValueError (one sentence) where ``output``'s grammar cannot run over ``tokenizer`` (from
    :func:`grammar_tokenizer`): it names a special token the model does not have, or it admits no first token (an
    empty character class, a rule that never ends).

    :return: the matcher at the start of the grammar that the check built (a sequence's own is a copy of it).
    """
    from llguidance import LLMatcher

    problem = LLMatcher.validate_grammar(output.grammar, tokenizer)
    if problem:
        raise ValueError(f"the {output.kind} of structured output does not compile for this model's tokenizer: "
                         f"{_first_line(problem)}")
    matcher = LLMatcher(tokenizer, output.grammar, log_level=0)
    matcher.compute_bitmask()  # the first mask: it does not advance the matcher
    if matcher.is_error():
        raise ValueError(f"the {output.kind} of structured output admits no output at all "
                         f"({_first_line(matcher.get_error())})")
    return matcher


def grammar_tokenizer(tokenizer, vocab_size: int, eos_token_ids):
    """The llguidance tokenizer of a model's ``tokenizer`` (a fast Hugging Face one, or the byte tokenizer) with
    ``vocab_size`` ids (the model's logits; ids past the tokenizer's are never allowed) and ``eos_token_ids``.

    :raises ValueError: the tokenizer is of a kind llguidance cannot read (a slow, Python one).
    """
    import llguidance
    import llguidance.hf

    eos = sorted(eos_token_ids) or None
    if hasattr(tokenizer, "decode_bytes"):
        return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteVocabulary(tokenizer)),
                                      n_vocab=max(vocab_size, len(tokenizer)), eos_token=eos)
    try:
        return llguidance.hf.from_tokenizer(tokenizer, max(vocab_size, len(tokenizer)), eos_token=eos)
    except (ValueError, TypeError, AttributeError, RuntimeError) as exc:
        raise ValueError(f"structured output needs a fast (tokenizers) tokenizer; this model's "
                         f"{type(tokenizer).__name__} cannot be read ({_first_line(exc)})") from None
