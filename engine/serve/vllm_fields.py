"""vLLM's request models against tidegate's: every field of ``CompletionRequest``, ``ChatCompletionRequest`` and
their ``stream_options``, read from the installed vLLM (in its own venv), and what tidegate's server does with
each (``engine.serve.protocol.VLLM_FIELDS``).

``benchmarks/vllm_fields.py`` prints the table; ``tests/test_vllm_fields.py`` keeps it from drifting.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

from tidegate.engine.serve.protocol import vllm_field_handling

#: run in vLLM's python: each model's fields with their defaults (those JSON cannot carry as None)
_DUMP = r"""
import json
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

def fields(cls):
    out = {}
    for name, f in cls.model_fields.items():
        default = None if f.is_required() else f.get_default(call_default_factory=True)
        try:
            json.dumps(default)
        except TypeError:
            default = None
        out[name] = default
    return out

so = CompletionRequest.model_fields["stream_options"].annotation.__args__[0]
print(json.dumps({"completions": fields(CompletionRequest), "chat": fields(ChatCompletionRequest),
                  "stream_options": fields(so)}))
"""


@dataclass(frozen=True)
class FieldRow:
    """One field of one of vLLM's request models and what tidegate does with it."""

    #: ``completions`` or ``chat``
    route: str
    #: the field's name (``stream_options.<name>`` for those of ``stream_options``)
    field: str
    #: vLLM's default value (None where JSON cannot carry it)
    default: object
    #: ``served``, ``ignored: why`` or ``refused: what``; None if tidegate has not classified the field
    handling: str | None

    @property
    def kind(self) -> str:
        return (self.handling or "unclassified").split(":", 1)[0]


def vllm_request_fields(python: Path, timeout_s: float = 300.0) -> dict[str, dict[str, object]]:
    """``{model: {field: vLLM's default}}`` for ``completions``, ``chat`` and ``stream_options``, read by
    ``python`` (vLLM's venv's interpreter).

    :raises RuntimeError: vLLM's models could not be read, with what its python printed.
    """
    done = subprocess.run([str(python), "-c", _DUMP], capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"could not read vLLM's request models: {done.stderr.strip()[-800:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def field_rows(models: dict[str, dict[str, object]]) -> list[FieldRow]:
    """One row per field per route: the fields of ``stream_options`` count once per route, as the field
    ``stream_options.<name>``."""
    rows = []
    for route in ("completions", "chat"):
        names = {**models[route], **{f"stream_options.{k}": v for k, v in models["stream_options"].items()}}
        rows += [FieldRow(route, name, default, vllm_field_handling(route, name)) for name, default in names.items()]
    return rows


def tally(rows: list[FieldRow]) -> dict[str, int]:
    """Rows by kind: served, ignored, refused, unclassified."""
    counts = dict.fromkeys(("served", "ignored", "refused", "unclassified"), 0)
    for row in rows:
        counts[row.kind] += 1
    return counts
