"""The check a model passes before the real engine serves it: its logits through the paged KV cache
against its own forward pass (docs/DESIGN.md, "Models the real engine serves")."""

from __future__ import annotations

import torch

from tidegate.engine.real.paged_cache import (
    CacheShapeError, PagedKVCache, _long, build_layout, forward_paged, kv_geometry, register_attention,
    set_attention, text_config,
)

#: the largest difference from the model's own logits the check of a model's paged path allows, relative to the
#: spread of a position's logits: float32 computes the same sums in another order; half precision rounds each
#: layer's output, and a model whose attention misses part of its context is off by its whole spread
CHECK_TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-6}
HALF_CHECK_TOLERANCE = 0.1


#: the window every attention window of a model is shortened to for the check's second pass: shorter than its
#: sequences (15 and 6 tokens), across its 4-token blocks
CHECK_WINDOW = 5
#: where models keep an attention window: their configs (the text config of a multimodal one) and, copied from
#: there, their attention modules; Llama 4's chunked attention is a window too, for the check's purpose
WINDOW_FIELDS = ("sliding_window", "attention_chunk_size")


def paged_attention_problem(model) -> str | None:
    """Why ``model`` cannot run on the paged KV cache, in a few words, or None where it can.

    Two short sequences go through the executor's paths in three steps (two prefills that start their
    sequences; a decode beside a chunk after cached tokens; a decode, in blocks of four tokens) and their logits
    are compared with the model's own forward pass over each whole sequence. The check also asks that every
    layer write its keys and values through the cache and read them through the paged attention, once a step:
    a model whose attention does not go through transformers' attention interface (its own code), or that
    computes what the paged attention does not, would otherwise serve wrong tokens without an error.

    A model with an attention window longer than the sequences is checked a second time with every window
    shortened to ``CHECK_WINDOW`` tokens (then restored): a window the model applies only in its attention mask
    (PhiMoE's, Qwen2-MoE's, Llama 4's chunks), which the paged attention does not read, shows there. It costs five
    forward passes of at most 15 tokens, ten with a window.
    """
    params = next(model.parameters())
    device, dtype = params.device, params.dtype
    config = model.config
    try:
        num_layers, kv_heads, head_dim = kv_geometry(config)
        vocab = int(text_config(config).vocab_size)
    except (AttributeError, TypeError) as exc:
        return f"its config does not give the attention's shape ({exc})"
    name = register_attention()
    previous = config._attn_implementation
    try:
        problem = _compare(model, name, num_layers, PagedKVCache(num_layers, 8, 4, kv_heads, head_dim, device, dtype),
                           vocab)
        if problem is not None:
            return problem
        windows = _windows(model)
        if not windows:
            return None
        try:
            for owner, field, _ in windows:
                setattr(owner, field, CHECK_WINDOW)
            problem = _compare(model, name, num_layers,
                               PagedKVCache(num_layers, 8, 4, kv_heads, head_dim, device, dtype), vocab)
        finally:
            for owner, field, value in windows:
                setattr(owner, field, value)
        if problem is not None:
            fields = sorted({f"{field} = {value}" for _, field, value in windows})
            return (f"its attention window ({', '.join(fields)}) is not applied where the paged attention sees it "
                    f"(its attention mask only, which the paged attention does not read): shortened to "
                    f"{CHECK_WINDOW} tokens, {problem}")
        return None
    finally:
        set_attention(config, previous)


def _windows(model) -> list[tuple[object, str, int]]:
    """(owner, field, value) of every attention window of ``model`` longer than ``CHECK_WINDOW``."""
    found: list[tuple[object, str, int]] = []
    owners: list[object] = [model.config]
    text = text_config(model.config)
    if text is not model.config:
        owners.append(text)
    owners.extend(model.modules())
    for owner in owners:
        for field in WINDOW_FIELDS:
            value = getattr(owner, field, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > CHECK_WINDOW:
                found.append((owner, field, value))
    return found


def _compare(model, name: str, num_layers: int, cache: PagedKVCache, vocab: int) -> str | None:
    """The check's pass: the model's own logits against those through ``cache`` (attention ``name``), or why
    they differ."""
    params = next(model.parameters())
    device, dtype = params.device, params.dtype
    block_size = cache.block_size
    seqs = {"a": [(7 * i + 3) % vocab for i in range(15)], "b": [(5 * i + 11) % vocab for i in range(6)]}
    tables = {"a": [0, 1, 2, 3], "b": [4, 5]}
    # (sequence, first position, tokens) of each step, decodes first
    steps = [(0, [("a", 0, 9), ("b", 0, 5)]), (1, [("b", 5, 1), ("a", 9, 5)]), (1, [("a", 14, 1)])]
    tolerance = CHECK_TOLERANCE.get(dtype, HALF_CHECK_TOLERANCE)
    layout = None
    try:
        with torch.inference_mode():
            own = {k: model(input_ids=torch.tensor([ids], device=device), use_cache=False).logits[0].float()
                   for k, ids in seqs.items()}
        for num_decodes, parts in steps:
            layout, positions = build_layout(block_size, num_decodes, [c for _, c, _ in parts],
                                             [n for _, _, n in parts], [tables[k] for k, _, _ in parts], device,
                                             dtype)
            ids = [t for k, c, n in parts for t in seqs[k][c:c + n]]
            logits = forward_paged(model, cache, name, layout, _long(ids, device), positions).float()
            if layout.attended != num_layers:
                return (f"{layout.attended} of its {num_layers} layers attend through transformers' attention "
                        "interface, which tidegate's paged KV cache plugs into")
            if layout.updates != num_layers:
                return (f"{layout.updates} of its {num_layers} layers write their keys and values through the "
                        "cache")
            row = 0
            for k, c, n in parts:
                want = own[k][c:c + n]
                spread = (want.amax(dim=-1) - want.amin(dim=-1)).clamp_min(1e-6)
                err = float(((logits[row:row + n] - want).abs().amax(dim=-1) / spread).max())
                if not err <= tolerance:
                    return (f"its logits through the paged attention differ from its own forward pass by "
                            f"{err:.1%} of their spread (at most {tolerance:.1%} allowed at {dtype})")
                row += n
    except CacheShapeError as exc:
        return str(exc)
    except Exception as exc:  # the model's own code failed on the paged path: say how, in one line
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
        if layout is not None and layout.attended == 0:
            return (f"its attention is its own code, not transformers' attention interface, which tidegate's paged "
                    f"KV cache plugs into (its forward pass fails: {type(exc).__name__}: {first})")
        return f"its forward pass fails on the paged KV cache ({type(exc).__name__}: {first})"
    return None
