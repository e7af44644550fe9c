"""Paged KV storage for the real engine, laid out on the engine's BlockPool.

The KV tensors are ``[num_layers, num_blocks, block_size, num_kv_heads, head_dim]`` with the
pool's ``num_blocks`` and ``block_size``: block id ``b`` of a request's block table is row ``b``
here. The pool decides who owns which block (one accounting); this module only stores keys and
values at those blocks and reads them back.

A step runs the model once on the packed sequence: every scheduled request's new tokens
concatenated (batch size 1, ``position_ids`` per token). The model calls
``cache.update(key_states, value_states, layer_idx, kwargs=...)`` once per layer, as with
transformers' ``PagedAttentionCache``: the new keys and values are written at ``write_index``
(their slots in the requests' blocks) and each request's whole context is gathered through
``read_index``. The registered attention function ``tidegate_paged`` then attends each
request's queries to its own context only, causally, so the packing needs no padding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

ATTENTION_NAME = "tidegate_paged"


@dataclass
class StepLayout:
    """Where each request of a step sits in the packed queries and in the gathered context.

    Requests ``0 .. num_decodes-1`` are decodes (one query each, query row ``i``); the others
    are prefill chunks.

    :param write_index: slot (``block * block_size + offset``) of every new token, ``[T]``.
    :param read_index: slots of every request's whole context, concatenated, ``[K]``.
    :param num_decodes: how many leading requests are decodes.
    :param key_start: start of each request's context in the gathered keys.
    :param key_end: end of each request's context in the gathered keys.
    :param prefill_queries: ``(query_start, query_end)`` of each prefill chunk.
    :param prefill_masks: per prefill chunk, the causal mask ``[n, context]`` (None when the
        chunk starts the sequence, where plain causal attention is right).
    """

    write_index: torch.Tensor
    read_index: torch.Tensor
    num_decodes: int
    key_start: list[int]
    key_end: list[int]
    prefill_queries: list[tuple[int, int]]
    prefill_masks: list[torch.Tensor | None]


class PagedKVCache:
    """Keys and values of every layer in the pool's blocks.

    :param num_layers: decoder layers of the model.
    :param num_blocks: blocks of the engine's pool (``pool.num_blocks``).
    :param block_size: tokens per block (``pool.block_size``).
    :param num_kv_heads: key/value heads per layer.
    :param head_dim: size of one head.
    """

    is_compileable = False

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> None:
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        self.key_cache = torch.zeros(shape, device=device, dtype=dtype)
        self.value_cache = torch.zeros(shape, device=device, dtype=dtype)
        self.block_size = block_size
        self.num_blocks = num_blocks
        # Slot-major views: one row per token slot, which is what the indices address.
        flat = (num_layers, num_blocks * block_size, num_kv_heads, head_dim)
        self._keys = self.key_cache.view(flat)
        self._values = self.value_cache.view(flat)
        self.layout: StepLayout | None = None

    @classmethod
    def for_model(cls, config, pool, device, dtype) -> "PagedKVCache":
        """A cache shaped for a transformers model ``config`` on the engine's ``pool``."""
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        return cls(config.num_hidden_layers, pool.num_blocks, pool.block_size, kv_heads, head_dim, device, dtype)

    @property
    def bytes(self) -> int:
        return 2 * self.key_cache.numel() * self.key_cache.element_size()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               kwargs: dict | None = None, **_) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the step's new keys and values and return every request's context.

        :param key_states: ``[1, num_kv_heads, T, head_dim]``, the step's new keys (after RoPE).
        :param value_states: the same for values.
        :param layer_idx: the layer calling.
        :return: keys and values ``[1, num_kv_heads, K, head_dim]``: the contexts of the step's
            requests concatenated in batch order (cached tokens then the new ones).
        """
        layout = self.layout
        keys, values = self._keys[layer_idx], self._values[layer_idx]
        keys.index_copy_(0, layout.write_index, key_states[0].transpose(0, 1))
        values.index_copy_(0, layout.write_index, value_states[0].transpose(0, 1))
        read = layout.read_index
        return (keys.index_select(0, read).transpose(0, 1).unsqueeze(0),
                values.index_select(0, read).transpose(0, 1).unsqueeze(0))

    # Parts of transformers' Cache interface the model may ask about.
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0


def paged_attention_forward(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask, scaling: float, dropout: float = 0.0, **kwargs):
    """Attention of the packed step: each request's queries against its own context only.

    Decodes are one query against their context; prefill chunks use SDPA with a causal mask
    offset by the tokens already cached. Without a ``paged_layout`` keyword (a plain
    ``model.generate`` call) this is transformers' SDPA attention.

    :param query: ``[1, heads, T, head_dim]``; ``key``/``value``: ``[1, kv_heads, K, head_dim]``.
    :return: ``([1, T, heads, head_dim], None)``.
    """
    layout: StepLayout | None = kwargs.get("paged_layout")
    if layout is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                      dropout=dropout, **kwargs)
    q, k, v = query[0], key[0], value[0]
    heads, _, head_dim = q.shape
    kv_heads = k.shape[0]
    group = heads // kv_heads
    parts = []
    nd = layout.num_decodes
    if nd:
        # Query heads h*group .. h*group+group-1 share KV head h (transformers' repeat_kv order).
        qd = (q[:, :nd].transpose(0, 1) * scaling).reshape(nd, kv_heads, group, head_dim)
        starts, ends = layout.key_start, layout.key_end
        outs = []
        for i in range(nd):
            ki = k[:, starts[i]:ends[i]]
            w = torch.softmax(torch.matmul(qd[i], ki.transpose(1, 2)), dim=-1, dtype=torch.float32)
            outs.append(torch.matmul(w.to(v.dtype), v[:, starts[i]:ends[i]]))
        parts.append(torch.stack(outs).view(nd, heads, head_dim))
    for j, (qs, qe) in enumerate(layout.prefill_queries):
        i = nd + j
        ks, ke = layout.key_start[i], layout.key_end[i]
        mask = layout.prefill_masks[j]
        o = F.scaled_dot_product_attention(q[:, qs:qe], k[:, ks:ke], v[:, ks:ke], attn_mask=mask,
                                           is_causal=mask is None, scale=scaling, enable_gqa=group > 1)
        parts.append(o.transpose(0, 1))
    out = parts[0] if len(parts) == 1 else torch.cat(parts, 0)
    return out.unsqueeze(0), None


def register_attention() -> str:
    """Register ``tidegate_paged`` with transformers' AttentionInterface (idempotent)."""
    from transformers import AttentionInterface
    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
    return ATTENTION_NAME
