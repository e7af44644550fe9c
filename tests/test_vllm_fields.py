"""Every field of vLLM's request models, read from the installed vLLM, against what ``tidegate serve`` does
with it: a field a later vLLM adds fails here until ``engine.serve.protocol.VLLM_FIELDS`` classifies it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tidegate.engine.serve.vllm_fields import field_rows, tally, vllm_request_fields
from tidegate.engine.serve.protocol import VLLM_FIELDS, ChatBody, CompletionBody, StreamOptions

ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
pytestmark = pytest.mark.skipif(not VLLM_PYTHON.exists(),
                                reason=".venv-vllm is missing: `make vllm-setup` makes it (`make test` does)")
BODIES = {"completions": CompletionBody, "chat": ChatBody}


@pytest.fixture(scope="module")
def models():
    return vllm_request_fields(VLLM_PYTHON)


def test_every_field_of_vllms_request_models_is_classified(models):
    rows = field_rows(models)
    unclassified = [f"{r.route}.{r.field}" for r in rows if r.handling is None]
    assert not unclassified, f"classify these in engine.serve.protocol.VLLM_FIELDS: {unclassified}"
    assert len(rows) == len(models["completions"]) + len(models["chat"]) + 2 * len(models["stream_options"])
    counts = tally(rows)
    print(f"vLLM's {len(rows)} request-field rows: {counts}")
    assert counts["refused"] <= 15


def test_the_table_names_only_fields_vllm_has(models):
    known = {name for route in BODIES for name in models[route]}
    known |= {f"stream_options.{name}" for name in models["stream_options"]}
    stale = [name for table in VLLM_FIELDS.values() for name in table if name not in known]
    assert not stale, f"VLLM_FIELDS names fields vLLM does not have: {stale}"


@pytest.mark.parametrize("route", list(BODIES))
def test_tidegate_accepts_every_field_at_vllms_default(models, route):
    """The whole body of defaults that vLLM's model holds validates, and nothing in it is refused: a
    client that sends every field it knows, at its default, is served."""
    body = {name: value for name, value in models[route].items()}
    body["stream_options"] = dict(models["stream_options"])
    body.update({"prompt": "hi"} if route == "completions" else {"messages": [{"role": "user", "content": "hi"}]})
    parsed = BODIES[route].model_validate(body)
    assert parsed.unserved() is None
    for name in models[route]:
        assert name in BODIES[route].model_fields, f"{route}: {name} would be an unknown parameter"
    assert set(models["stream_options"]) <= set(StreamOptions.model_fields)


def test_every_refused_field_is_listed_in_the_readme_as_not_served(models):
    readme = (ROOT / "README.md").read_text()
    row = next(line for line in readme.splitlines() if line.startswith("| Not served"))
    listed = set(re.findall(r"`([a-z_.]+)`", row))
    refused = {r.field for r in field_rows(models) if r.kind == "refused"}
    assert refused <= listed, f"refused but not in the README's 'Not served' row: {sorted(refused - listed)}"
