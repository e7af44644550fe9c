"""The model folder that every arm serves: a Llama built from a config, with seeded random weights.

The tokenizer is tidegate's byte-level ``tokenizer.json`` (:mod:`tidegate.engine.real.tiny_folder`):
byte ``b`` is token ``b + 3``, so any id in 3-258 is a valid prompt token and a prompt of ``n`` ids is
``n`` tokens for vLLM exactly. Nothing is downloaded.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

#: shapes the benchmark can build, by name: ``llama-24m`` is the model issue 32's numbers were taken with
#: (8 layers, hidden 512, 4 KV heads); ``tiny`` is ``tidegate serve --model tiny``'s 3M Llama; ``llama-1b`` has
#: TinyLlama-1.1B's layers (22 of hidden 2048, 32 heads, 4 KV heads), its initial weight spread and 8,192
#: positions, for a GPU
SHAPES: dict[str, dict[str, float]] = {
    "llama-24m": {"num_hidden_layers": 8, "hidden_size": 512, "num_attention_heads": 8, "num_key_value_heads": 4,
                  "intermediate_size": 1408},
    "llama-1b": {"num_hidden_layers": 22, "hidden_size": 2048, "num_attention_heads": 32, "num_key_value_heads": 4,
                 "intermediate_size": 5632, "max_position_embeddings": 8192, "initializer_range": 0.02},
    "tiny": {},
}


class ModelFolderError(ValueError):
    """A model name or folder the benchmark cannot use; the message is one sentence naming it."""


def model_folder(name_or_dir: str, cache_dir: Path, seed: int = 0) -> Path:
    """The folder of ``name_or_dir``: a shape of :data:`SHAPES` (built once into ``cache_dir``), or an
    existing Hugging Face folder with a ``config.json``.

    :raises ModelFolderError: neither a known shape nor a folder with a config.
    """
    if name_or_dir not in SHAPES:
        folder = Path(name_or_dir)
        if not (folder / "config.json").is_file():
            raise ModelFolderError(f"--model {name_or_dir!r} is neither one of {', '.join(SHAPES)} nor a folder "
                                   "with a config.json.")
        return folder
    folder = cache_dir / f"{name_or_dir}-seed{seed}"
    if not (folder / "config.json").is_file() or not (folder / "tokenizer.json").is_file():
        _build(name_or_dir, folder, seed)
    return folder


def _build(shape: str, folder: Path, seed: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tidegate.engine.real.model import BOS_TOKEN_ID, EOS_TOKEN_ID, PAD_TOKEN_ID, TINY_CONFIG
    from tidegate.engine.real.tiny_folder import byte_tokenizer_fast

    config = LlamaConfig(**{**TINY_CONFIG, **SHAPES[shape]}, pad_token_id=PAD_TOKEN_ID, bos_token_id=BOS_TOKEN_ID,
                         eos_token_id=EOS_TOKEN_ID)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    byte_tokenizer_fast().save_pretrained(folder)


def describe(folder: Path) -> dict:
    """The folder's architecture and parameter count (from ``config.json``, no weights loaded)."""
    c = json.loads((folder / "config.json").read_text())
    hidden, layers, inter, vocab = c["hidden_size"], c["num_hidden_layers"], c["intermediate_size"], c["vocab_size"]
    heads, kv_heads = c["num_attention_heads"], c.get("num_key_value_heads", c["num_attention_heads"])
    kv_dim = hidden // heads * kv_heads
    per_layer = 2 * hidden * hidden + 2 * hidden * kv_dim + 3 * hidden * inter + 2 * hidden
    embeddings = vocab * hidden * (1 if c.get("tie_word_embeddings") else 2)
    return {"folder": str(folder), "architecture": (c.get("architectures") or ["?"])[0], "layers": layers,
            "hidden": hidden, "heads": heads, "kv_heads": kv_heads, "intermediate": inter, "vocab": vocab,
            "parameters": per_layer * layers + embeddings + hidden}


def prompt_token_ids(folder: Path) -> list[int]:
    """The ids a random prompt draws from: the tokenizer's vocabulary without its special tokens."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    special = set(tok.all_special_ids)
    return [i for i in range(len(tok)) if i not in special]


def random_prompt(rng: random.Random, ids: list[int], length: int) -> list[int]:
    """``length`` ids drawn uniformly from ``ids``: no two prompts share a prefix block in practice."""
    return [rng.choice(ids) for _ in range(length)]
