"""Roofline estimates of the step-time coefficients and KV capacity of a datacenter replica.

Every step of a decoder-only transformer streams all weights from HBM once, does about 2·N
FLOPs of matrix multiplies per new token, and its attention reads the K and V entries of every
cached token of every request in the batch. With sustained compute rate F·mfu and sustained
bandwidth BW·bw_eff this gives the coefficients of the linear step-time model of
:mod:`engine.core.profile`::

    base_s         = step_overhead_s + weights_bytes / (BW · bw_eff)
    per_token_s    = 2 · N / (F · mfu)
    per_kv_token_s = kv_bytes_per_token / (BW · bw_eff)

Adding the compute and memory terms instead of taking their max makes this a conservative,
linear upper bound of the roofline; it is chosen so that the derived presets and profiles fitted
on a real engine share one linear form. Every constant, with its source, is listed in
docs/PROFILES.md.

``python -m engine.sim.roofline`` prints the coefficient table; ``--write`` regenerates the preset
files in ``engine/core/profiles/`` from the code below.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from tidegate.engine.core.profile import Profile

GiB = 2**30


@dataclass(frozen=True)
class ModelSpec:
    """A Llama-architecture decoder (untied embeddings, gated MLP, RMSNorm without bias).

    :param name: model name.
    :param num_layers: transformer blocks L.
    :param hidden_size: model width.
    :param intermediate_size: MLP width.
    :param num_attention_heads: query heads.
    :param num_kv_heads: key/value heads (fewer than query heads under GQA).
    :param head_dim: width of one attention head.
    :param vocab_size: vocabulary size.
    :param dtype_bytes: bytes per weight and per KV entry (2 for fp16/bf16).
    :param source: where the numbers come from.
    """

    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    dtype_bytes: int
    source: str

    @property
    def num_params(self) -> int:
        """Parameter count N: embeddings, LM head, per-layer attention, MLP and norms."""
        h, kv_width = self.hidden_size, self.num_kv_heads * self.head_dim
        attention = h * self.num_attention_heads * self.head_dim * 2 + h * kv_width * 2  # q, o; k, v
        mlp = 3 * h * self.intermediate_size  # gate, up, down
        norms = 2 * h
        return 2 * self.vocab_size * h + self.num_layers * (attention + mlp + norms) + h

    @property
    def weights_bytes(self) -> int:
        return self.num_params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """One K and one V vector per KV head per layer."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes


@dataclass(frozen=True)
class GpuSpec:
    """Datasheet figures of one GPU.

    :param name: GPU name.
    :param peak_flops: dense (no sparsity) tensor-core FLOP/s for the model's dtype.
    :param hbm_bandwidth_bytes_per_s: peak HBM bandwidth in bytes/s.
    :param memory_bytes: memory size in bytes (datasheet GB, 1e9 bytes).
    :param source: where the numbers come from.
    """

    name: str
    peak_flops: float
    hbm_bandwidth_bytes_per_s: float
    memory_bytes: float
    source: str


@dataclass(frozen=True)
class ServingAssumptions:
    """What a well-tuned engine achieves on the hardware; justified in docs/PROFILES.md.

    :param mfu: achieved fraction of peak FLOP/s in the linear layers.
    :param bandwidth_efficiency: achieved fraction of peak HBM bandwidth.
    :param step_overhead_s: fixed host-side cost of a step (scheduling, input preparation, launches).
    :param gpu_memory_utilization: fraction of GPU memory the engine may use (vLLM's default).
    :param activation_reserve_bytes: memory kept back from the KV cache for activations,
        CUDA-graph pools and allocations outside the tensor allocator.
    """

    mfu: float = 0.6
    bandwidth_efficiency: float = 0.8
    step_overhead_s: float = 0.002
    gpu_memory_utilization: float = 0.9
    activation_reserve_bytes: int = 2 * GiB


def step_time_coefficients(model: ModelSpec, gpu: GpuSpec,
                           assume: ServingAssumptions) -> tuple[float, float, float]:
    """``(base_s, per_token_s, per_kv_token_s)`` of the linear step-time model."""
    bandwidth = gpu.hbm_bandwidth_bytes_per_s * assume.bandwidth_efficiency
    base_s = assume.step_overhead_s + model.weights_bytes / bandwidth
    per_token_s = 2 * model.num_params / (gpu.peak_flops * assume.mfu)
    per_kv_token_s = model.kv_bytes_per_token / bandwidth
    return base_s, per_token_s, per_kv_token_s


def kv_capacity_tokens(model: ModelSpec, gpu: GpuSpec, assume: ServingAssumptions,
                       block_size: int = 16) -> int:
    """KV tokens that fit in the memory left after weights and the activation reserve.

    Rounded down to whole blocks, as a paged KV cache allocates them.
    """
    free_bytes = (gpu.memory_bytes * assume.gpu_memory_utilization - model.weights_bytes
                  - assume.activation_reserve_bytes)
    if free_bytes < model.kv_bytes_per_token * block_size:
        raise ValueError(f"{model.name} does not leave room for one KV block on {gpu.name}")
    tokens = int(free_bytes // model.kv_bytes_per_token)
    return tokens // block_size * block_size


def roofline_profile(name: str, description: str, model: ModelSpec, gpu: GpuSpec,
                     assume: ServingAssumptions, *, block_size: int, ttft_slo_s: float,
                     tpot_slo_s: float, max_num_batched_tokens: int, max_num_seqs: int) -> Profile:
    """A profile whose coefficients and capacity come from the roofline; inputs kept in ``extra``."""
    base_s, per_token_s, per_kv_token_s = step_time_coefficients(model, gpu, assume)
    return Profile(
        name=name,
        description=description,
        base_s=base_s,
        per_token_s=per_token_s,
        per_kv_token_s=per_kv_token_s,
        kv_capacity_tokens=kv_capacity_tokens(model, gpu, assume, block_size),
        block_size=block_size,
        ttft_slo_s=ttft_slo_s,
        tpot_slo_s=tpot_slo_s,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        source="roofline (tidegate roofline --write)",
        extra={"roofline": {
            "model": asdict(model),
            "gpu": asdict(gpu),
            "assumptions": asdict(assume),
            "derived": {
                "num_params": model.num_params,
                "weights_bytes": model.weights_bytes,
                "kv_bytes_per_token": model.kv_bytes_per_token,
            },
        }},
    )


LLAMA2_7B = ModelSpec(
    name="Llama-2-7B", num_layers=32, hidden_size=4096, intermediate_size=11008,
    num_attention_heads=32, num_kv_heads=32, head_dim=128, vocab_size=32000, dtype_bytes=2,
    source="Touvron et al. 2023 (arXiv 2307.09288); config.json of meta-llama/Llama-2-7b-hf "
           "(float16)")
LLAMA3_8B = ModelSpec(
    name="Llama-3-8B", num_layers=32, hidden_size=4096, intermediate_size=14336,
    num_attention_heads=32, num_kv_heads=8, head_dim=128, vocab_size=128256, dtype_bytes=2,
    source="Meta Llama 3 model card; config.json of meta-llama/Meta-Llama-3-8B (bfloat16)")

A100_SXM_80GB = GpuSpec(
    name="A100-SXM4-80GB", peak_flops=312e12, hbm_bandwidth_bytes_per_s=2.039e12,
    memory_bytes=80e9,
    source="NVIDIA A100 Tensor Core GPU datasheet: 312 TFLOPS dense FP16/BF16 tensor core, "
           "2,039 GB/s HBM2e, 80 GB (SXM)")
H200_SXM = GpuSpec(
    name="H200-SXM-141GB", peak_flops=989e12, hbm_bandwidth_bytes_per_s=4.8e12,
    memory_bytes=141e9,
    source="NVIDIA H200 Tensor Core GPU datasheet: 1,979 TFLOPS BF16 tensor core with "
           "sparsity (989 dense), 4.8 TB/s HBM3e, 141 GB (SXM)")


def preset_profiles() -> list[Profile]:
    """The datacenter presets shipped in ``engine/core/profiles/``."""
    assume = ServingAssumptions()
    # Batch limits: vLLM v1's defaults for the OpenAI server, which keeps the smaller budget on
    # A100 (vllm/engine/arg_utils.py); SLOs: a chat setting, see docs/PROFILES.md.
    return [
        roofline_profile(
            "a100-llama2-7b", "Llama-2-7B fp16 on one A100-SXM4-80GB (roofline estimate).",
            LLAMA2_7B, A100_SXM_80GB, assume, block_size=16, ttft_slo_s=2.0, tpot_slo_s=0.1,
            max_num_batched_tokens=2048, max_num_seqs=256),
        roofline_profile(
            "h200-llama3-8b", "Llama-3-8B bf16 on one H200 SXM 141GB (roofline estimate).",
            LLAMA3_8B, H200_SXM, assume, block_size=16, ttft_slo_s=2.0, tpot_slo_s=0.1,
            max_num_batched_tokens=8192, max_num_seqs=1024),
    ]


def coefficient_table(profiles: list[Profile]) -> str:
    """A markdown table of the coefficients of ``profiles``."""
    rows = ["| profile | base_s | per_token_s | per_kv_token_s | kv_capacity_tokens | "
            "max_num_batched_tokens | max_num_seqs |",
            "|---|---|---|---|---|---|---|"]
    for p in profiles:
        rows.append(f"| {p.name} | {p.base_s:.4g} | {p.per_token_s:.4g} | {p.per_kv_token_s:.4g} "
                    f"| {p.kv_capacity_tokens} | {p.max_num_batched_tokens} | {p.max_num_seqs} |")
    return "\n".join(rows)
