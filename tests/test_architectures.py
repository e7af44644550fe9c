"""Model architectures besides the tiny Llama, each a small config with seeded random weights: greedy
generation on the engine (chunked prefill, prefix caching, batched decodes) gives the tokens of
transformers' own ``generate``, and a model whose attention the paged KV cache cannot compute is refused
at load with one sentence instead of being served wrong.

Each architecture stands for a mechanism of the paged attention: a sliding window (Mistral), logit
soft-capping beside a window on every other layer (Gemma 2, which has no SDPA path of its own),
attention sinks (gpt-oss), a decoder layer that does not pass its keywords on to its attention
(StableLM), learned positions and one KV head per head (GPT-2), and per-head norms of queries and
keys (Qwen3)."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from tidegate.engine.core.request import Request, RequestState
from tidegate.engine.real.model_check import paged_attention_problem
from tidegate.engine.real.model import ModelLoadError, build_tiny_model, load_model
from tidegate.engine.real.tiny_folder import byte_tokenizer_fast

torch.set_num_threads(1)

_spec = importlib.util.spec_from_file_location("architectures", Path(__file__).parents[1] / "benchmarks" /
                                               "architectures.py")
BENCH = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(BENCH)

VOCAB = 300
WINDOW = 12  # shorter than most prompts, so the window hides keys in prefill chunks and in decodes
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2,
              # wider than the default 0.02: the random model's next token is then never a near tie
              initializer_range=0.1)
ARCHITECTURES = {
    "mistral": dict(num_key_value_heads=2, sliding_window=WINDOW),
    "gemma2": dict(num_key_value_heads=2, head_dim=16, sliding_window=WINDOW, attn_logit_softcapping=0.3,
                   final_logit_softcapping=3.0),
    "gpt_oss": dict(num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                    sliding_window=WINDOW),
    "stablelm": dict(num_key_value_heads=2),
    "gpt2": dict(n_embd=64, n_layer=2, n_head=4, n_positions=512),
    "qwen3": dict(num_key_value_heads=2, head_dim=16),
}
#: architectures whose attention is their own code, not transformers' attention interface, and one whose window
#: is in its attention mask only, with what the refusal says
REFUSED = {
    "falcon": (dict(new_decoder_architecture=True, num_kv_heads=2), "attention is its own code"),
    "bloom": (dict(n_head=4, n_layer=2), "attention is its own code"),
    "phimoe": (dict(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, sliding_window=2 * WINDOW),
               "attention window (sliding_window = 24)"),
}


def _model(name: str, overrides: dict):
    config = AutoConfig.for_model(name, **COMMON, **overrides)
    torch.manual_seed(0)
    try:
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    except ValueError:  # no SDPA path of its own (Gemma 2): its eager attention
        config = AutoConfig.for_model(name, **COMMON, **overrides)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    return model.eval()


def _workload(seed: int = 3) -> list[tuple[list[int], int]]:
    """Prompts of 3-40 tokens, half of them after one shared 20-token prefix (cached after its first request)."""
    rng = random.Random(seed)
    shared = [1] + [rng.randint(3, VOCAB - 1) for _ in range(19)]
    items = []
    for i in range(8):
        tail = [rng.randint(3, VOCAB - 1) for _ in range(rng.randint(2, 20))]
        items.append(((shared + tail) if i % 2 else ([1] + tail + tail)[:40], rng.randint(4, 24)))
    return items


_generate = BENCH.generate  # transformers' greedy generate on one request alone


def _serve(model, items) -> list[Request]:
    """``benchmarks/architectures.py``'s engine with 16 tokens a step (prefills chunked, decodes beside them)."""
    core, reqs = BENCH.serve(model, items, kv_capacity_tokens=2048, controller="greedy:max_num_batched_tokens=16")
    assert core.metrics.cached_prompt_tokens > 0  # the shared prefix was reused: chunks after cached tokens ran
    return reqs


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_greedy_matches_generate(name):
    model = _model(name, ARCHITECTURES[name])
    assert paged_attention_problem(model) is None
    items = _workload()
    reqs = _serve(model, items)
    for r, (prompt, max_tokens) in zip(reqs, items):
        assert r.state is RequestState.FINISHED
        assert r.output_token_ids == _generate(model, prompt, max_tokens), f"{name}: request {r.request_id} diverged"


def test_a_window_longer_than_the_sequences_changes_nothing():
    """The window's masks are built only where it hides keys: with a window of 4,096 Mistral's tokens are
    Llama's path's, and the same model with a window of 12 gives other tokens (the window is applied)."""
    items = _workload()
    wide = _serve(_model("mistral", dict(num_key_value_heads=2, sliding_window=4096)), items)
    narrow = _serve(_model("mistral", ARCHITECTURES["mistral"]), items)
    assert [r.output_token_ids for r in wide] != [r.output_token_ids for r in narrow]
    model = _model("mistral", dict(num_key_value_heads=2, sliding_window=4096))
    assert [r.output_token_ids for r in wide] == [_generate(model, p, m) for p, m in items]


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_model_whose_attention_the_paged_cache_cannot_compute_is_refused(name):
    """PhiMoE's window is longer than the check's sequences and is applied in its mask only: the check's second
    pass, with the window shortened, finds it."""
    fields, says = REFUSED[name]
    model = _model(name, fields)
    problem = paged_attention_problem(model)
    assert problem is not None and says in problem and "\n" not in problem
    assert [getattr(m, "sliding_window", None) for m in model.modules()] == \
        [getattr(m, "sliding_window", None) for m in _model(name, fields).modules()]  # the windows put back


def test_the_mechanisms_bind():
    """The cases above test something: Gemma 2's cap moves its logits, and gpt-oss's sinks do."""
    ids = torch.tensor([[1, *range(5, 45)]])
    for name, field, off in (("gemma2", "attn_logit_softcapping", None), ("gpt_oss", "sinks", 0.0)):
        model = _model(name, ARCHITECTURES[name])
        with torch.inference_mode():
            own = model(ids).logits[0]
            if field == "sinks":
                for layer in model.model.layers:
                    layer.self_attn.sinks.fill_(-1e4)  # a sink that takes no weight
            else:
                for layer in model.model.layers:
                    layer.self_attn.attn_logit_softcapping = off
            without = model(ids).logits[0]
        spread = float((own.amax(-1) - own.amin(-1)).min())
        assert float((own - without).abs().max()) > 0.05 * spread, name


def test_the_check_passes_the_tiny_model_and_restores_its_attention():
    model, _ = build_tiny_model()
    before = model.config._attn_implementation
    assert paged_attention_problem(model) is None
    assert model.config._attn_implementation == before


def test_loading_a_folder_checks_its_attention(tmp_path):
    """A folder of a refused architecture is one sentence naming the folder and the reason; Gemma 2, which has
    no SDPA path, loads with its eager attention and serves."""
    tokenizer = byte_tokenizer_fast()
    bad = tmp_path / "falcon"
    _model("falcon", REFUSED["falcon"][0]).save_pretrained(bad)
    tokenizer.save_pretrained(bad)
    with pytest.raises(ModelLoadError) as err:
        load_model(str(bad), device="cpu", dtype="float32")
    message = str(err.value)
    assert str(bad) in message and "cannot be served by tidegate's engine" in message and "\n" not in message
    good = tmp_path / "gemma2"
    _model("gemma2", ARCHITECTURES["gemma2"]).save_pretrained(good)
    tokenizer.save_pretrained(good)
    model, _ = load_model(str(good), device="cpu", dtype="float32")
    assert model.config._attn_implementation == "eager"
    items = _workload()[:3]
    reqs = _serve(model, items + [(items[1][0], 5)])
    assert reqs[0].output_token_ids == _generate(model, *items[0])
