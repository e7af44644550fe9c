"""Paged KV storage for the real engine, laid out on the engine's BlockPool.

The KV tensors are ``[num_layers, num_kv_heads, num_blocks, block_size, head_dim]`` with the
pool's ``num_blocks`` and ``block_size``: block id ``b`` of a request's block table is row ``b``
of each head here. Head-major, a gather of a request's blocks is each KV head's context laid out
whole, as attention reads it (no transposed copy). The pool decides who owns which block (one
accounting); this module only stores keys and values at those blocks and reads them back.

A step runs the model once on the packed sequence: every scheduled request's new tokens
concatenated (batch size 1, ``position_ids`` per token). The model calls
``cache.update(key_states, value_states, layer_idx, kwargs=...)`` once per layer, as with
transformers' ``PagedAttentionCache``; ``update`` writes the new keys and values at
``write_index`` (their slots in the requests' blocks). The registered attention function
``tidegate_paged`` then attends each request's queries to its own context only:

- decodes (one query each) are batched: the requests are sorted by block count and split into
  a few buckets (chosen once per step to trade padding against calls); each bucket gathers its
  requests' blocks into one padded ``[kv_heads, n, blocks * block_size]`` context (whole blocks, no
  per-token indexing) and runs one SDPA with a key-padding mask, the query heads that share a KV
  head as that head's rows of queries (grouped-query attention without repeating keys and values);
- a prefill chunk that starts its sequence attends causally to its own new keys (no gather);
  a chunk after cached tokens gathers its blocks and uses a causal mask offset by the cache;
- a layer with a sliding window (Mistral, Gemma 2 and 3, Qwen2 with ``use_sliding_window``) sees
  the window's keys only: its masks hide the keys older than the window as the model's own mask
  does (the blocks behind the window stay allocated; whole blocks behind every request's window are not
  read); a layer with logit
  soft-capping (Gemma 2) or attention sinks (gpt-oss) attends by matmul and softmax, as the
  model's eager attention does.

The step's layout reaches the attention function through a context variable that the executor
sets around the forward pass (:func:`paged_step`), not through the model's keyword arguments,
which some decoder layers do not pass on to their attention (StableLM's). Loading a model folder
checks the whole path against the model's own forward pass first
(``engine.real.model_check.paged_attention_problem``): a model whose attention computes what this
module does not is refused there, not served wrong.

All index tensors and masks are built once per step (``StepLayout``), not per layer, and the
gathered contexts go into reusable workspace buffers, so the step allocates no large tensors
per layer (fresh multi-MB allocations cost page faults on every call).
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

ATTENTION_NAME = "tidegate_paged"


@dataclass
class DecodeBucket:
    """Decodes attended by one padded SDPA call.

    :param rows: packed query rows of the bucket's requests, ``[n]`` (None: rows ``start..start+n``).
    :param start: first row when ``rows`` is None.
    :param count: requests in the bucket.
    :param blocks: block ids ``[n * num_blocks]``, each request's table padded to ``num_blocks``.
    :param num_blocks: blocks per request in the padded context.
    :param mask: additive key-padding mask ``[n, 1, 1, num_blocks * block_size]`` (None: no padding).
    :param lengths: each request's context, its new token's included.
    """

    rows: torch.Tensor | None
    start: int
    count: int
    blocks: torch.Tensor
    num_blocks: int
    mask: torch.Tensor | None
    lengths: list[int] = field(default_factory=list)
    #: by sliding window, what the step's layers with that window read (built at the first layer that asks): the
    #: blocks from the first any request's window reaches, how many a request, and their mask
    window_masks: dict[int, tuple[torch.Tensor, int, torch.Tensor]] = field(default_factory=dict)


@dataclass
class PrefillChunk:
    """A prefill chunk: queries ``[query_start, query_end)`` of the packed sequence.

    :param blocks: the request's block ids covering its context (None when the chunk starts the
        sequence: it attends to its own new keys with a causal mask).
    :param mask: additive mask ``[n, num_blocks * block_size]``: causal, offset by the cached tokens.
    :param position: the position of the chunk's first token (the tokens cached before it).
    """

    query_start: int
    query_end: int
    blocks: torch.Tensor | None = None
    num_blocks: int = 0
    mask: torch.Tensor | None = None
    position: int = 0
    #: by sliding window, what the step's layers with that window read: the blocks from the one the first query's
    #: window reaches (None: the chunk's own keys) and their mask
    window_masks: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = field(default_factory=dict)


@dataclass
class StepLayout:
    """Where each request of a step sits in the packed queries and in the KV blocks.

    Requests ``0 .. num_decodes-1`` are decodes (one query each, query row ``i``); the others
    are prefill chunks, after them in the packed sequence.

    :param write_index: slot (``block * block_size + offset``) of every new token, ``[T]``.
    :param num_decodes: how many leading requests are decodes.
    :param decode_buckets: the batched decode attention calls.
    :param prefills: one entry per prefill chunk.
    :param cache: the cache the attention reads (set by ``PagedKVCache.update``).
    :param updates: ``PagedKVCache.update`` calls in this step (one per layer).
    :param attended: attention calls that read this layout (one per layer).
    """

    write_index: torch.Tensor
    num_decodes: int
    decode_buckets: list[DecodeBucket] = field(default_factory=list)
    prefills: list[PrefillChunk] = field(default_factory=list)
    cache: "PagedKVCache | None" = None
    updates: int = 0
    attended: int = 0


_ACTIVE: ContextVar[StepLayout | None] = ContextVar("tidegate_paged_layout", default=None)


@contextmanager
def paged_step(layout: StepLayout) -> Iterator[StepLayout]:
    """The attention function reads ``layout`` while the block runs (the executor's forward pass)."""
    token = _ACTIVE.set(layout)
    try:
        yield layout
    finally:
        _ACTIVE.reset(token)



# Relative cost of one more attention call against one more padded block per request: a bucket
# costs about CALL_COST_BLOCKS blocks' worth of gathering and attention (measured on CPU: about
# 1.3 us per gathered-and-attended block per layer, 35-45 us per call and its per-step set-up).
CALL_COST_BLOCKS = 32
MAX_DECODE_BUCKETS = 4


def plan_buckets(num_blocks: list[int], call_cost: float = CALL_COST_BLOCKS,
                 max_buckets: int = MAX_DECODE_BUCKETS) -> list[list[int]]:
    """Split requests (by their block counts) into buckets padded to the bucket's longest.

    Greedy on ``sum(n_bucket * max_blocks_bucket) + call_cost * buckets``: requests sorted by
    block count, cut at the boundary between two block counts that lowers the cost most, again
    while a cut pays for itself (at most ``max_buckets`` buckets). Linear in the distinct block
    counts per cut, so it costs a few microseconds per step.

    :return: lists of request indices, each sorted by block count.
    """
    order = sorted(range(len(num_blocks)), key=num_blocks.__getitem__)
    if len(order) <= 1:
        return [order]
    # Distinct block counts (ascending) and the cumulative number of requests up to each.
    vals: list[int] = []
    cum: list[int] = [0]
    for i in order:
        v = num_blocks[i]
        if vals and vals[-1] == v:
            cum[-1] += 1
        else:
            vals.append(v)
            cum.append(cum[-1] + 1)
    m = len(vals)
    if m == 1:
        return [order]
    cuts = [0, m]  # bucket k spans distinct values cuts[k] .. cuts[k+1]-1
    while len(cuts) - 1 < max_buckets:
        best_gain, best_at = call_cost, -1
        for k in range(len(cuts) - 1):
            a, b = cuts[k], cuts[k + 1]
            whole = (cum[b] - cum[a]) * vals[b - 1]
            for s_ in range(a + 1, b):
                gain = whole - (cum[s_] - cum[a]) * vals[s_ - 1] - (cum[b] - cum[s_]) * vals[b - 1]
                if gain > best_gain:
                    best_gain, best_at = gain, s_
        if best_at < 0:
            break
        cuts.append(best_at)
        cuts.sort()
    return [order[cum[cuts[k]]:cum[cuts[k + 1]]] for k in range(len(cuts) - 1)]


def text_config(config):
    """The config of the language model itself (a multimodal config's ``text_config``; a text model's own)."""
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def kv_geometry(config) -> tuple[int, int, int]:
    """``(num_layers, num_kv_heads, head_dim)`` of a transformers model ``config``.

    Grouped-query models give ``num_key_value_heads``; older configs leave it out (one KV head per
    attention head) or leave out ``head_dim`` (``hidden_size / num_attention_heads``).
    """
    config = text_config(config)
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return config.num_hidden_layers, num_kv_heads, head_dim


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """Bytes of KV cache one token takes in every layer (keys and values) at ``dtype``."""
    num_layers, num_kv_heads, head_dim = kv_geometry(config)
    return 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize


class CacheShapeError(ValueError):
    """A layer's keys or values are not of the shape the cache was made for (its model's config)."""


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
        shape = (num_layers, num_kv_heads, num_blocks, block_size, head_dim)
        self.key_cache = torch.zeros(shape, device=device, dtype=dtype)
        self.value_cache = torch.zeros(shape, device=device, dtype=dtype)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        # Slot views: one row per token slot of each head, which is what write_index addresses.
        flat = (num_layers, num_kv_heads, num_blocks * block_size, head_dim)
        self._keys = self.key_cache.view(flat)
        self._values = self.value_cache.view(flat)
        self.layout: StepLayout | None = None
        # Reusable buffers for gathered contexts and the attention output (grown on demand).
        self._ws_k = torch.empty(0, device=device, dtype=dtype)
        self._ws_v = torch.empty(0, device=device, dtype=dtype)
        self._ws_out = torch.empty(0, device=device, dtype=dtype)

    @classmethod
    def for_model(cls, config, pool, device, dtype) -> "PagedKVCache":
        """A cache shaped for a transformers model ``config`` on the engine's ``pool``."""
        num_layers, num_kv_heads, head_dim = kv_geometry(config)
        return cls(num_layers, pool.num_blocks, pool.block_size, num_kv_heads, head_dim, device, dtype)

    @property
    def bytes(self) -> int:
        return 2 * self.key_cache.numel() * self.key_cache.element_size()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               kwargs: dict | None = None, **_) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the step's new keys and values in their blocks.

        :param key_states: ``[1, num_kv_heads, T, head_dim]``, the step's new keys (after RoPE).
        :param value_states: the same for values.
        :param layer_idx: the layer calling.
        :return: the new keys and values unchanged; the attention reads the contexts from the
            blocks itself (``StepLayout.cache``), batched as the layout says.
        """
        layout = self.layout
        layout.cache = self
        layout.updates += 1
        if key_states.shape[1] != self.num_kv_heads or key_states.shape[-1] != self.head_dim \
                or value_states.shape[-1] != self.head_dim:
            raise CacheShapeError(f"its keys and values of a token ({list(key_states.shape[1::2])} and "
                                  f"{list(value_states.shape[1::2])}) are not the {self.num_kv_heads} heads of "
                                  f"{self.head_dim} its config gives, the one shape the paged KV cache holds")
        self._keys[layer_idx].index_copy_(1, layout.write_index, key_states[0])
        self._values[layer_idx].index_copy_(1, layout.write_index, value_states[0])
        return key_states, value_states

    def gather(self, layer_idx: int, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of ``blocks`` of one layer, ``[kv_heads, len(blocks) * block_size, head_dim]``.

        The result lives in a workspace buffer that the next ``gather`` overwrites.
        """
        n = blocks.numel()
        per = self.block_size * self.num_kv_heads * self.head_dim
        if self._ws_k.numel() < n * per:
            size = max(n * per, 2 * self._ws_k.numel())
            self._ws_k = torch.empty(size, device=self.key_cache.device, dtype=self.key_cache.dtype)
            self._ws_v = torch.empty(size, device=self.key_cache.device, dtype=self.key_cache.dtype)
        shape = (self.num_kv_heads, n, self.block_size, self.head_dim)
        k = self._ws_k[:n * per].view(shape)
        v = self._ws_v[:n * per].view(shape)
        torch.index_select(self.key_cache[layer_idx], 1, blocks, out=k)
        torch.index_select(self.value_cache[layer_idx], 1, blocks, out=v)
        flat = (self.num_kv_heads, n * self.block_size, self.head_dim)
        return k.view(flat), v.view(flat)

    def output_buffer(self, tokens: int, heads: int, head_dim: int) -> torch.Tensor:
        """A reusable ``[tokens, heads, head_dim]`` buffer for one layer's attention output."""
        n = tokens * heads * head_dim
        if self._ws_out.numel() < n:
            self._ws_out = torch.empty(max(n, 2 * self._ws_out.numel()), device=self.key_cache.device,
                                       dtype=self.key_cache.dtype)
        return self._ws_out[:n].view(tokens, heads, head_dim)

    # Parts of transformers' Cache interface the model may ask about.
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0


def paged_attention_forward(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask, scaling: float | None = None, dropout: float = 0.0,
                            sliding_window: int | None = None, softcap: float | None = None,
                            s_aux: torch.Tensor | None = None, **kwargs):
    """Attention of the packed step: each request's queries against its own context only.

    The executor selects it for its step only; outside a :func:`paged_step` it raises.

    :param query: ``[1, heads, T, head_dim]``; ``key``/``value``: the step's new keys and values
        ``[1, kv_heads, T, head_dim]`` (already written to the blocks by ``update``).
    :param sliding_window: the layer sees its last ``sliding_window`` positions only (None: all).
    :param softcap: the layer caps its attention logits at ``softcap * tanh(logit / softcap)``.
    :param s_aux: one sink logit per head, in every softmax's denominator and attending to nothing (gpt-oss).
    :return: ``([1, T, heads, head_dim], None)``.
    """
    layout = _ACTIVE.get()
    if layout is None:
        raise RuntimeError("tidegate's paged attention runs only inside the engine's step (paged_step); the "
                           "executor sets it for the step and puts the model's own attention back after")
    layout.attended += 1
    cache = layout.cache
    layer = module.layer_idx
    q = query[0]  # [heads, T, head_dim]
    heads, total, head_dim = q.shape
    kv_heads = key.shape[1]
    gqa = heads != kv_heads
    if scaling is None:
        scaling = head_dim ** -0.5
    window = int(sliding_window) if sliding_window else None
    out = cache.output_buffer(total, heads, head_dim)
    attention = _Attention(cache, layer, gqa, scaling, window, softcap, s_aux)
    for bucket in layout.decode_buckets:
        attention.decodes(q, bucket, out)
    for chunk in layout.prefills:
        attention.prefill(q, key, value, chunk, out)
    return out.unsqueeze(0), None


class _Attention:
    """One layer's attention over the step's decode buckets and prefill chunks."""

    __slots__ = ("cache", "layer", "gqa", "scale", "window", "softcap", "sinks")

    def __init__(self, cache: "PagedKVCache", layer: int, gqa: bool, scale: float, window: int | None,
                 softcap: float | None, sinks: torch.Tensor | None) -> None:
        self.cache, self.layer, self.gqa, self.scale = cache, layer, gqa, scale
        self.window, self.softcap, self.sinks = window, softcap, sinks

    def decodes(self, q: torch.Tensor, b: DecodeBucket, out: torch.Tensor) -> None:
        """The bucket's queries (rows of ``q``, ``[heads, T, head_dim]``) into their rows of ``out``."""
        heads, _, head_dim = q.shape
        n, nb, bs = b.count, b.num_blocks, self.cache.block_size
        kv_heads = self.cache.num_kv_heads
        qb = q[:, b.start:b.start + n] if b.rows is None else q.index_select(1, b.rows)  # [heads, n, head_dim]
        blocks, mask, window = b.blocks, b.mask, self.window
        if window is not None and max(b.lengths) > window:
            # the blocks from the first any request's window reaches: the ones before are never read
            seen = b.window_masks.get(window)
            if seen is None:
                first = min(max(0, c - window) for c in b.lengths) // bs
                lengths = [c - first * bs for c in b.lengths]
                width = (nb - first) * bs
                seen = b.window_masks[window] = (
                    b.blocks.view(n, nb)[:, first:].reshape(-1) if first else b.blocks, nb - first,
                    _band_mask([max(0, c - window) for c in lengths], lengths, width, q.dtype, q.device)
                    .view(n, 1, 1, width))
            blocks, nb, mask = seen
        k, v = self.cache.gather(self.layer, blocks)
        k = k.view(kv_heads, n, nb * bs, head_dim)
        v = v.view(kv_heads, n, nb * bs, head_dim)
        if self.softcap is None and self.sinks is None:
            # each KV head's query heads as its rows of queries: [kv_heads, n, group, head_dim]
            qf = qb.view(kv_heads, heads // kv_heads, n, head_dim).transpose(1, 2)
            o = F.scaled_dot_product_attention(qf, k, v, attn_mask=None if mask is None else mask.view(1, n, 1, -1),
                                               scale=self.scale)
            o = o.permute(1, 0, 2, 3).reshape(n, heads, head_dim)
        else:
            o = _attend(qb.transpose(0, 1).unsqueeze(2), k.transpose(0, 1), v.transpose(0, 1), mask, self.scale,
                        self.gqa, self.softcap, self.sinks).view(n, heads, head_dim)
        if b.rows is None:
            out[b.start:b.start + n] = o
        else:
            out.index_copy_(0, b.rows, o)

    def prefill(self, q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, p: PrefillChunk,
                out: torch.Tensor) -> None:
        """The chunk's queries against its context (its own new ``key``/``value`` rows when it starts the
        sequence, else its blocks) into its rows of ``out``."""
        qs, qe, window = p.query_start, p.query_end, self.window
        qp = q[:, qs:qe].unsqueeze(0)
        blocks, mask = p.blocks, p.mask
        if window is not None and p.position + (qe - qs) > window:
            seen = p.window_masks.get(window)
            if seen is None:
                bs = self.cache.block_size
                # from the block the first query's window reaches: the ones before are never read
                first = max(0, p.position + 1 - window) // bs if p.blocks is not None else 0
                start = first * bs
                ends = list(range(p.position + 1 - start, p.position + qe - qs + 1 - start))
                width = p.num_blocks * bs - start if p.blocks is not None else qe - qs
                seen = p.window_masks[window] = (
                    p.blocks[first:] if p.blocks is not None else None,
                    _band_mask([max(0, e - window) for e in ends], ends, width, q.dtype, q.device))
            blocks, mask = seen
        if blocks is None:
            o = _attend(qp, key[:, :, qs:qe], value[:, :, qs:qe], mask, self.scale, self.gqa, self.softcap,
                        self.sinks, causal=mask is None)
        else:
            k, v = self.cache.gather(self.layer, blocks)
            o = _attend(qp, k.unsqueeze(0), v.unsqueeze(0), mask, self.scale, self.gqa, self.softcap, self.sinks)
        out[qs:qe] = o[0].transpose(0, 1)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float, gqa: bool,
            softcap: float | None, sinks: torch.Tensor | None = None, causal: bool = False) -> torch.Tensor:
    """``q`` ``[B, heads, Tq, D]`` attends to ``k``, ``v`` ``[B, kv_heads, Tk, D]`` with the additive ``mask`` (or a
    causal one): SDPA, or by matmul and softmax (in float32) as the models' eager attention computes it, with
    ``softcap`` the logits capped as Gemma 2 caps them (``softcap * tanh(logit / softcap)``), with ``sinks`` (one
    logit a head) a column in every softmax that attends to nothing, as gpt-oss has it."""
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=gqa)
    if gqa:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if causal:
        tq, tk = scores.shape[-2], scores.shape[-1]
        scores = scores.masked_fill(torch.ones(tq, tk, dtype=torch.bool, device=q.device).triu(tk - tq + 1),
                                    float("-inf"))
    if mask is not None:
        scores = scores + mask
    if sinks is not None:
        column = sinks.to(scores.dtype).reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        scores = torch.cat([scores, column], dim=-1)
        scores = scores - scores.amax(dim=-1, keepdim=True)
        return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32)[..., :-1].to(q.dtype), v)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


def _band_mask(starts: list[int], ends: list[int], width: int, dtype, device) -> torch.Tensor:
    """Additive masks ``[len(starts), width]``: row i is 0 on keys ``starts[i] <= j < ends[i]``, -inf elsewhere
    (a sliding window's)."""
    keys = torch.arange(width, device=device)
    lo = torch.tensor(starts, device=device).unsqueeze(1)
    hi = torch.tensor(ends, device=device).unsqueeze(1)
    inside = (keys >= lo) & (keys < hi)
    return torch.zeros(inside.shape, dtype=dtype, device=device).masked_fill_(~inside, float("-inf"))


def _long(values: list[int], device) -> torch.Tensor:
    """A long tensor from a list of ints (through ``array``: several times faster than torch.tensor)."""
    t = torch.frombuffer(array("q", values), dtype=torch.long) if values else torch.empty(0, dtype=torch.long)
    return t if device.type == "cpu" else t.to(device, non_blocking=True)


_MASK_TABLES: dict = {}


def _prefix_mask(lengths: list[int], width: int, dtype, device) -> torch.Tensor:
    """Additive masks ``[len(lengths), width]``: row i is 0 on keys ``< lengths[i]``, -inf after.

    Rows are windows of one cached ``[0]*cap + [-inf]*cap`` vector (``unfold``), so a step's
    mask is a single ``index_select`` instead of building a comparison grid.
    """
    key = (dtype, device)
    table = _MASK_TABLES.get(key)
    cap = max(width, max(lengths))
    if table is None or table.shape[0] // 2 < cap:
        cap = max(cap, 2048)
        table = torch.cat([torch.zeros(cap, dtype=dtype, device=device),
                           torch.full((cap,), float("-inf"), dtype=dtype, device=device)])
        _MASK_TABLES[key] = table
    cap = table.shape[0] // 2
    windows = table.unfold(0, width, 1)  # windows[s] = table[s:s + width]
    starts = _long([cap - n for n in lengths], device)
    return windows.index_select(0, starts)


def build_layout(block_size: int, num_decodes: int, positions: list[int], counts: list[int],
                 tables: list[list[int]], device, dtype) -> tuple[StepLayout, torch.Tensor]:
    """The step's layout and ``position_ids`` from per-request lists, built once per step.

    :param positions: tokens already cached per request (position of its first new token).
    :param counts: new tokens per request.
    :param tables: each request's block ids.
    :return: ``(layout, position_ids [T])``.
    """
    bs = block_size
    # Decodes: one token each at position c.
    dec_pos = positions[:num_decodes]
    write = [t[c // bs] * bs + c % bs for t, c in zip(tables, dec_pos)]
    pos_ids = list(dec_pos)
    dec_blocks = [c // bs + 1 for c in dec_pos]
    buckets: list[DecodeBucket] = []
    if num_decodes:
        for members in plan_buckets(dec_blocks):
            nb = dec_blocks[members[-1]]
            flat: list[int] = []
            for i in members:
                have = dec_blocks[i]
                if have < nb:
                    t = tables[i]
                    flat += t[:have]
                    flat += [t[0]] * (nb - have)
                else:
                    flat += tables[i][:nb]
            n = len(members)
            ctx = [positions[i] + 1 for i in members]
            mask = None
            if min(ctx) < nb * bs:
                mask = _prefix_mask(ctx, nb * bs, dtype, device).view(n, 1, 1, nb * bs)
            first = members[0]
            contiguous = members[-1] - first == n - 1 and members == list(range(first, first + n))
            rows = None if contiguous else _long(members, device)
            buckets.append(DecodeBucket(rows, first, n, _long(flat, device), nb, mask, ctx))
    prefills: list[PrefillChunk] = []
    row = num_decodes
    for i in range(num_decodes, len(counts)):
        c, n = positions[i], counts[i]
        t = tables[i]
        end = c + n
        # Slots of positions c .. end-1, block by block.
        for blk_i in range(c // bs, (end - 1) // bs + 1):
            base = t[blk_i] * bs
            lo = max(c, blk_i * bs) - blk_i * bs
            hi = min(end, (blk_i + 1) * bs) - blk_i * bs
            write.extend(range(base + lo, base + hi))
        pos_ids.extend(range(c, end))
        chunk = PrefillChunk(row, row + n, position=c)
        if c:
            nb = -(-end // bs)
            chunk.blocks = _long(t[:nb], device)
            chunk.num_blocks = nb
            # Query j (position c + j) sees keys 0 .. c + j; padding past `end` is hidden too.
            chunk.mask = _prefix_mask(list(range(c + 1, end + 1)), nb * bs, dtype, device)
        prefills.append(chunk)
        row += n
    layout = StepLayout(_long(write, device), num_decodes, buckets, prefills)
    return layout, _long(pos_ids, device)


def forward_paged(model, cache: "PagedKVCache", attention: str, layout: StepLayout, input_ids: torch.Tensor,
                  position_ids: torch.Tensor, logits_to_keep: torch.Tensor | None = None) -> torch.Tensor:
    """The model's logits over one packed step ``[T or len(logits_to_keep), vocab]``: its attention switched to
    ``attention`` (the registered paged one), the step's ``layout`` on ``cache`` and in the context the
    attention reads (:func:`paged_step`), under ``inference_mode``; the model's own attention and an empty
    layout put back after, also when the forward pass fails.

    :param input_ids: the step's new tokens ``[T]``; ``position_ids``: theirs ``[T]``.
    """
    config = model.config
    previous = config._attn_implementation
    set_attention(config, attention)
    cache.layout = layout
    try:
        with torch.inference_mode(), paged_step(layout):
            kept = {} if logits_to_keep is None else {"logits_to_keep": logits_to_keep}
            return model(input_ids=input_ids.unsqueeze(0), position_ids=position_ids.unsqueeze(0), cache=cache,
                         use_cache=False, **kept).logits[0]
    finally:
        set_attention(config, previous)
        cache.layout = None


def set_attention(config, name: str) -> None:
    """Switch a model's attention function (its config's ``_attn_implementation``), as the executor does
    for each step.

    The ``_attn_implementation`` setter validates and walks sub-configs (tens of microseconds per step);
    a config without sub-configs only needs the stored name changed.
    """
    if not getattr(config, "sub_configs", None) and "_attn_implementation_internal" in vars(config):
        vars(config)["_attn_implementation_internal"] = name
    else:
        config._attn_implementation = name


def register_attention() -> str:
    """Register ``tidegate_paged`` with transformers' AttentionInterface (idempotent)."""
    from transformers import AttentionInterface
    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
    return ATTENTION_NAME
