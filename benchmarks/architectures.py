"""Which transformers architectures the real engine serves token for token, and which it refuses.

    python benchmarks/architectures.py [--out docs/bench/architectures] [NAME ...]

Each architecture is a small config (2 layers, 64 wide, 300 tokens, seeded random weights; a sliding window
or attention chunks of 24 where the architecture has them, so prompts of up to 61 tokens outrun them; Gemma 2's
logit cap at 0.3, where it binds). The load check
(``paged_attention_problem``) runs first; a model it passes serves 8 staggered requests on the engine (8-token
blocks, continuous batching) and each request's greedy tokens are compared with transformers' ``generate`` on
that request alone. Writes ``architectures.md`` (one row an architecture: served, the requests that
matched, or the refusal) to ``--out``. A few minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

from tidegate.ctrl import build_controller
from tidegate.engine.core.clock import WallClock
from tidegate.engine.core.engine_core import EngineCore
from tidegate.engine.core.request import Request
from tidegate.engine.real.executor import TorchExecutor
from tidegate.engine.real.model_check import paged_attention_problem
from tidegate.engine.real.model import ByteTokenizer
from tidegate.engine.real.sampling import SamplingParams

VOCAB = 300
WINDOW = 24
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=512, pad_token_id=0,
              # wider than the default 0.02: the attention is then far from uniform, so that a window, a cap or a
              # sink left out changes the tokens
              initializer_range=0.1)
#: model_type -> the config's own fields (a label -> (model_type, fields) where one type appears twice)
ARCHITECTURES: dict[str, tuple[str, dict]] = {
    "llama": ("llama", dict(num_key_value_heads=2)),
    "qwen2": ("qwen2", dict(num_key_value_heads=2)),
    "qwen2, sliding window": ("qwen2", dict(num_key_value_heads=2, use_sliding_window=True, sliding_window=WINDOW,
                                            max_window_layers=1)),
    "qwen3": ("qwen3", dict(num_key_value_heads=2, head_dim=16)),
    "mistral": ("mistral", dict(num_key_value_heads=2, sliding_window=WINDOW)),
    "mixtral": ("mixtral", dict(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)),
    "gemma2": ("gemma2", dict(num_key_value_heads=2, head_dim=16, sliding_window=WINDOW, attn_logit_softcapping=0.3,
                              final_logit_softcapping=3.0)),
    "gemma3_text": ("gemma3_text", dict(num_key_value_heads=2, head_dim=16, sliding_window=WINDOW)),
    "gemma3 (multimodal config)": ("gemma3", dict(
        text_config=dict(num_key_value_heads=2, head_dim=16, sliding_window=WINDOW),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=28, patch_size=14), mm_tokens_per_image=4)),
    "gpt_oss": ("gpt_oss", dict(num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                                sliding_window=WINDOW)),
    "phi3": ("phi3", dict(num_key_value_heads=2, sliding_window=WINDOW)),
    "phimoe": ("phimoe", dict(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)),
    "phimoe, sliding window": ("phimoe", dict(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                                              sliding_window=WINDOW)),
    "qwen2_moe, sliding window": ("qwen2_moe", dict(num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                                                    moe_intermediate_size=32, shared_expert_intermediate_size=32,
                                                    use_sliding_window=True, sliding_window=WINDOW)),
    "llama4_text, chunked attention": ("llama4_text", dict(num_key_value_heads=2, head_dim=16,
                                                           attention_chunk_size=WINDOW, num_local_experts=4,
                                                           intermediate_size_mlp=128)),
    "olmo2": ("olmo2", dict(num_key_value_heads=2)),
    "olmo3": ("olmo3", dict(num_key_value_heads=2, sliding_window=WINDOW)),
    "smollm3": ("smollm3", dict(num_key_value_heads=2)),
    "exaone4": ("exaone4", dict(num_key_value_heads=2, sliding_window=WINDOW)),
    "granite": ("granite", dict(num_key_value_heads=2)),
    "cohere": ("cohere", dict(num_key_value_heads=2)),
    "starcoder2": ("starcoder2", dict(num_key_value_heads=2, sliding_window=WINDOW)),
    "stablelm": ("stablelm", dict(num_key_value_heads=2)),
    "gpt_neox": ("gpt_neox", dict()),
    "gptj": ("gptj", dict(n_embd=64, n_layer=2, n_head=4, rotary_dim=8)),
    "gpt2": ("gpt2", dict(n_embd=64, n_layer=2, n_head=4, n_positions=512)),
    "opt": ("opt", dict(ffn_dim=128, word_embed_proj_dim=64)),
    "falcon": ("falcon", dict(new_decoder_architecture=True, num_kv_heads=2)),
    "bloom": ("bloom", dict(n_head=4, n_layer=2)),
    "mpt": ("mpt", dict(d_model=64, n_heads=4, n_layers=2)),
    "deepseek_v3": ("deepseek_v3", dict(num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
                                        qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
                                        first_k_dense_replace=1, moe_intermediate_size=32, n_group=1, topk_group=1)),
}


def config_of(model_type: str, fields: dict):
    """The config: ``COMMON`` and ``fields``, or, for a multimodal one, ``COMMON`` in its ``text_config``."""
    if "text_config" in fields:
        return AutoConfig.for_model(model_type, **{**fields, "text_config": {**COMMON, **fields["text_config"]}})
    return AutoConfig.for_model(model_type, **COMMON, **fields)


def build(model_type: str, fields: dict):
    """The model with seeded weights: SDPA where the architecture has it, else its eager attention (as
    ``load_model`` loads a folder)."""
    torch.manual_seed(0)
    try:
        return AutoModelForCausalLM.from_config(config_of(model_type, fields), attn_implementation="sdpa").eval()
    except ValueError:
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config_of(model_type, fields), attn_implementation="eager").eval()


def generate(model, prompt: list[int], max_tokens: int) -> list[int]:
    config = GenerationConfig(do_sample=False, eos_token_id=[], pad_token_id=0, max_new_tokens=max_tokens)
    with torch.inference_mode():
        return model.generate(torch.tensor([prompt]), generation_config=config)[0, len(prompt):].tolist()


def serve(model, items: list[tuple[list[int], int]], kv_capacity_tokens: int = 4096,
          controller: str = "greedy") -> tuple[EngineCore, list[Request]]:
    """The engine (8-token blocks) and its requests, served whole with greedy tokens, each joining every other
    step."""
    executor = TorchExecutor(model, ByteTokenizer())
    core = EngineCore(build_controller(controller), executor, WallClock(), kv_capacity_tokens=kv_capacity_tokens,
                      block_size=8)
    executor.attach_pool(core.pool)
    reqs = [Request(str(i), 0.0, len(p), m, prompt_token_ids=p, sampling=SamplingParams(ignore_eos=True))
            for i, (p, m) in enumerate(items)]
    pending, step = list(reqs), 0
    while pending or core.has_unfinished:
        if pending and step % 2 == 0:
            if core.add_request(pending.pop(0)) is not None:
                raise RuntimeError("the engine refused a request it has room for")
        core.step()
        step += 1
    return core, reqs


def check(label: str) -> str:
    """One table row for the architecture ``label``."""
    model_type, fields = ARCHITECTURES[label]
    try:
        model = build(model_type, fields)
    except Exception as exc:  # an architecture this transformers cannot build from the fields above
        return f"| {label} | not built | {type(exc).__name__}: {str(exc).splitlines()[0][:120]} |"
    problem = paged_attention_problem(model)
    if problem is not None:
        return f"| {label} | refused | {problem} |"
    rng = random.Random(1)
    items = [([1] + [rng.randint(3, VOCAB - 1) for _ in range(rng.randint(1, 60))], rng.randint(1, 30))
             for _ in range(8)]
    _, reqs = serve(model, items)
    same = sum(r.output_token_ids == generate(model, p, m) for r, (p, m) in zip(reqs, items))
    return f"| {label} | {'served' if same == len(items) else 'WRONG TOKENS'} | {same} of {len(items)} requests " \
           f"token for token |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*", help="architectures (default: all)")
    ap.add_argument("--out", type=Path, default=Path("docs/bench/architectures"))
    args = ap.parse_args()
    unknown = [n for n in args.names if n not in ARCHITECTURES]
    if unknown:
        ap.error(f"unknown architecture {unknown[0]!r}; one of {', '.join(ARCHITECTURES)}")
    torch.set_num_threads(1)
    import transformers
    rows = []
    for i, label in enumerate(args.names or list(ARCHITECTURES), 1):
        t0 = time.perf_counter()
        rows.append(check(label))
        print(f"[{i}/{len(args.names or ARCHITECTURES)}] {rows[-1]} ({time.perf_counter() - t0:.1f} s)", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    table = (f"Architectures on the real engine (transformers {transformers.__version__}, torch {torch.__version__}; "
             "`python benchmarks/architectures.py`)\n\n| architecture | verdict | detail |\n|---|---|---|\n"
             + "\n".join(rows) + "\n")
    (args.out / "architectures.md").write_text(table)
    print(f"wrote {args.out / 'architectures.md'}")


if __name__ == "__main__":
    main()
