"""The tiny model: a small Llama with seeded random weights and a byte-level tokenizer.

It needs no files and no network, so tests, the profiler and the twin check run anywhere. Its
outputs are gibberish; its step times grow with batch and context like a real model's, which is
what the controllers and the twin need. ``load_model`` also opens a local Hugging Face folder.
"""

from __future__ import annotations

import codecs
import math
from pathlib import Path

import torch

PAD_TOKEN_ID = 0
BOS_TOKEN_ID = 1
EOS_TOKEN_ID = 2
_BYTE_OFFSET = 3  # byte b is token b + 3

TINY_CONFIG = dict(
    num_hidden_layers=4, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=688, vocab_size=256 + _BYTE_OFFSET, max_position_embeddings=2048,
    rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
    # Wider than the default 0.02 so the random model's next-token distribution is peaked:
    # greedy comparisons then never hinge on near-equal logits.
    initializer_range=0.08,
)


class ModelLoadError(ValueError):
    """A model name or folder that cannot be loaded; the message is one sentence naming it."""


class ByteTokenizer:
    """UTF-8 bytes as tokens: ids 0-2 are PAD, BOS and EOS, id ``b + 3`` is byte ``b``.

    transformers' ``ByT5Tokenizer`` is also byte-level and file-free, but it has no BOS token
    and its ``decode`` silently drops incomplete UTF-8, which streaming cannot use.
    """

    pad_token_id = PAD_TOKEN_ID
    bos_token_id = BOS_TOKEN_ID
    eos_token_id = EOS_TOKEN_ID
    vocab_size = 256 + _BYTE_OFFSET
    all_special_ids = (PAD_TOKEN_ID, BOS_TOKEN_ID, EOS_TOKEN_ID)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``: BOS (when ``add_special_tokens``) then one id per UTF-8 byte."""
        ids = [b + _BYTE_OFFSET for b in text.encode("utf-8")]
        return [BOS_TOKEN_ID, *ids] if add_special_tokens else ids

    def decode(self, token_ids, skip_special_tokens: bool = True) -> str:
        """Text of ``token_ids``; invalid or incomplete UTF-8 becomes U+FFFD, special tokens are dropped."""
        return self.decode_bytes(token_ids, skip_special_tokens).decode("utf-8", errors="replace")

    def decode_bytes(self, token_ids, skip_special_tokens: bool = True) -> bytes:
        out = bytearray()
        names = {PAD_TOKEN_ID: b"<pad>", BOS_TOKEN_ID: b"<s>", EOS_TOKEN_ID: b"</s>"}
        for t in token_ids:
            t = int(t)
            if t >= _BYTE_OFFSET:
                out.append(t - _BYTE_OFFSET)
            elif not skip_special_tokens:
                out += names[t]
        return bytes(out)

    def __len__(self) -> int:
        return self.vocab_size


class IncrementalDetokenizer:
    """Text deltas of a growing token sequence, safe for multi-byte characters split across tokens.

    Bytes of an incomplete UTF-8 character are held back until the character completes. A Hugging
    Face fast tokenizer decodes through the tokenizers library's ``DecodeStream`` (as vLLM v1 does),
    which decodes only a window around each new token, so a token costs the same however long the
    output has grown; other tokenizers decode the whole output again and hold back a trailing U+FFFD
    (an incomplete character). Either way the text is the tokenizer's decode of the whole sequence.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.text = ""
        self.num_tokens = 0
        self._bytes = isinstance(tokenizer, ByteTokenizer)
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace") if self._bytes else None
        # transformers' decode may also clean up spaces around punctuation, which DecodeStream does not
        plain = not getattr(tokenizer, "clean_up_tokenization_spaces", False)
        self._backend = None if self._bytes or not plain else getattr(tokenizer, "backend_tokenizer", None)
        self._stream = None
        if self._backend is not None:
            from tokenizers.decoders import DecodeStream

            self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._ids: list[int] = []
        self.finished = False

    def finish(self) -> str:
        """The sequence ended: an incomplete trailing character becomes U+FFFD; returns that delta."""
        if self.finished:
            return ""
        self.finished = True
        if self._bytes:
            delta = self._decoder.decode(b"", final=True)
        else:
            full = self.tokenizer.decode(self._ids, skip_special_tokens=self.skip_special_tokens)
            delta = full[len(self.text):] if full.startswith(self.text) else ""
        self.text += delta
        return delta

    def push(self, token_ids) -> str:
        """Add tokens; returns the newly completed text (possibly empty)."""
        self.num_tokens += len(token_ids)
        if self._bytes:
            delta = self._decoder.decode(self.tokenizer.decode_bytes(token_ids,
                                                                     skip_special_tokens=self.skip_special_tokens))
        elif self._stream is not None:
            delta = self._step(token_ids)
        else:
            self._ids.extend(int(t) for t in token_ids)
            delta = self._redecoded()
        self.text += delta
        return delta

    def _step(self, token_ids) -> str:
        """The text ``DecodeStream`` completes with these tokens; on a sequence it cannot decode by
        windows (it raises on some byte-fallback runs), this sequence decodes whole from then on."""
        pieces = []
        for i, t in enumerate(token_ids):
            self._ids.append(int(t))
            try:
                piece = self._stream.step(self._backend, int(t))
            except Exception:  # the tokenizers library raises a bare Exception here
                self._stream = None
                self._ids.extend(int(u) for u in token_ids[i + 1:])
                done = "".join(pieces)
                return done + self._redecoded(done)
            if piece:
                pieces.append(piece)
        return "".join(pieces)

    def _redecoded(self, pending: str = "") -> str:
        """The new text of the whole sequence decoded again, past the text shown and ``pending``, the
        text about to be; a trailing U+FFFD (an incomplete character) is held back."""
        full = self.tokenizer.decode(self._ids, skip_special_tokens=self.skip_special_tokens)
        if full.endswith("\ufffd"):
            return ""
        shown = self.text + pending
        return full[len(shown):] if full.startswith(shown) else ""


def build_tiny_model(seed: int = 0, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """The tiny Llama (4 layers, hidden 256, 4 heads, 2 KV heads, about 3M parameters) with
    weights drawn from ``seed``, in eval mode.

    :return: ``(model, tokenizer)``.
    """
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**TINY_CONFIG, pad_token_id=PAD_TOKEN_ID, bos_token_id=BOS_TOKEN_ID,
                         eos_token_id=EOS_TOKEN_ID, attn_implementation="sdpa")
    devices = [torch.device(device)] if torch.device(device).type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(bos_token_id=BOS_TOKEN_ID, eos_token_id=EOS_TOKEN_ID,
                                               pad_token_id=PAD_TOKEN_ID)
    model.to(device=device, dtype=dtype).eval()
    return model, ByteTokenizer()


def eos_token_ids(model, tokenizer) -> frozenset[int]:
    """Every id that ends generation: the tokenizer's EOS and the model's
    ``generation_config.eos_token_id``, which may be a list (chat models end a turn with their own
    token, e.g. ``[1, 106]``)."""
    ids: set[int] = set()
    config = getattr(model, "generation_config", None)
    for value in (getattr(tokenizer, "eos_token_id", None), getattr(config, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return frozenset(ids)


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_device(device=None) -> torch.device:
    """``None`` -> CUDA when available, else CPU; a name such as ``cuda:1`` -> that device, checked to exist.

    :raises ModelLoadError: the name is not a device, or names a device this machine or torch build lacks.
    """
    if device is None:
        return default_device()
    if isinstance(device, torch.device):
        resolved = device
    else:
        try:
            resolved = torch.device(device)
        except (RuntimeError, TypeError, ValueError):
            raise ModelLoadError(f"unknown device {device!r}: expected cpu, cuda or cuda:N.") from None
    if resolved.type == "cpu" or (resolved.type == "mps" and torch.backends.mps.is_available()):
        return resolved
    if resolved.type != "cuda":
        raise ModelLoadError(f"device {str(device)!r} is not available here: expected cpu, cuda or cuda:N.")
    if not torch.cuda.is_available():
        why = (f"this torch build ({torch.__version__}) has no CUDA support" if torch.version.cuda is None
               else "no CUDA GPU is visible")
        raise ModelLoadError(f"device {str(device)!r} is not available: {why}; expected cpu.")
    count = torch.cuda.device_count()
    if resolved.index is not None and resolved.index >= count:
        raise ModelLoadError(f"device {str(device)!r} does not exist: expected cuda:0 to cuda:{count - 1}.")
    return resolved


def default_dtype(device: torch.device) -> torch.dtype:
    """The fastest dtype the device computes natively.

    - CUDA: bf16, or fp16 on a GPU without bf16 arithmetic (before Ampere).
    - CPU: bf16 where the CPU multiplies bf16 in hardware (AMX tiles or AVX512-BF16), fp32 elsewhere: without
      them torch converts bf16 matmuls to fp32 and back, and a step takes several times longer (about 4x on an
      AVX2 machine, docs/BENCHMARKS.md).
    """
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported(including_emulation=False) else torch.float16
    if dev.type == "cpu" and cpu_has_bf16_matmul():
        return torch.bfloat16
    return torch.float32


def cpu_has_bf16_matmul() -> bool:
    """Whether this CPU multiplies bf16 matrices in hardware (AMX tiles or AVX512-BF16), as torch sees it."""
    probes = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in probes)


#: vLLM 0.32's defaults for its OpenAI server (``EngineArgs.get_batch_defaults``): the step's token budget
#: and the most running requests, on a CPU and on GPUs by memory
CPU_BATCH_LIMITS = (2048, 128)
GPU_BATCH_LIMITS = ((160, 16384, 1024), (70, 8192, 1024))  # (at least GiB, tokens, requests); A100s excepted
SMALL_GPU_BATCH_LIMITS = (2048, 256)


def default_batch_limits(device: torch.device | str) -> tuple[int, int]:
    """``(max_num_batched_tokens, max_num_seqs)`` as vLLM's server chooses them for ``device``.

    On a CPU, 2,048 tokens and 128 requests. On CUDA, it goes by the GPU's memory: 16,384 and 1,024 from
    160 GiB, 8,192 and 1,024 from 70 GiB (but not an A100, where vLLM measured the larger budget as slower),
    2,048 and 256 below.
    """
    dev = torch.device(device)
    if dev.type != "cuda":
        return CPU_BATCH_LIMITS
    props = torch.cuda.get_device_properties(dev)
    gib = props.total_memory / (1 << 30)
    for at_least, tokens, seqs in GPU_BATCH_LIMITS:
        if gib >= at_least and (at_least >= 160 or "a100" not in props.name.lower()):
            return tokens, seqs
    return SMALL_GPU_BATCH_LIMITS


_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def resolve_dtype(dtype, device: torch.device) -> torch.dtype:
    """``None`` -> the device's default; a name such as ``bf16`` -> the torch dtype."""
    if dtype is None:
        return default_dtype(device)
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}: expected one of {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def load_tokenizer(model: str = "tiny"):
    """The tokenizer of ``"tiny"`` or of a local Hugging Face model folder, without the model.

    :raises ModelLoadError: the folder is missing or holds no tokenizer that can spell text.
    """
    if model == "tiny":
        return ByteTokenizer()
    return _folder_tokenizer(_model_folder(model))


def _folder_tokenizer(path: Path):
    """The tokenizer of a model folder whose config reads (``_model_folder``), or ModelLoadError."""
    if not any((path / name).is_file() for name in _TOKENIZER_FILES):
        raise ModelLoadError(f"model folder {str(path)!r} holds no tokenizer (none of {', '.join(_TOKENIZER_FILES)}).")
    from transformers import AutoTokenizer
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
    except Exception as exc:  # transformers and tokenizers raise many kinds; one sentence for all
        raise ModelLoadError(f"the tokenizer in {str(path)!r} cannot be loaded ({_first_line(exc)}).") from None
    try:
        spelled = tokenizer.encode("Hello, world", add_special_tokens=False)
    except Exception as exc:
        raise ModelLoadError(f"the tokenizer in {str(path)!r} cannot encode text ({_first_line(exc)}).") from None
    if not spelled:
        raise ModelLoadError(f"the tokenizer in {str(path)!r} ({type(tokenizer).__name__}, {len(tokenizer)} tokens) "
                             f"turns text into no tokens: its vocabulary files (tokenizer.json, tokenizer.model) are "
                             f"missing or empty.")
    return tokenizer


#: the files a Hugging Face tokenizer is read from (one is enough)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model", "tiktoken.model",
                    "tokenizer_config.json")


def _model_folder(model: str) -> Path:
    """The folder of a model name with a config that reads, or ModelLoadError saying what is wrong."""
    path = Path(model)
    if not path.is_dir():
        raise ModelLoadError(f"model {model!r} is neither 'tiny' nor an existing model folder.")
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"model folder {str(path)!r} has no config.json.")
    from transformers import AutoConfig
    try:
        AutoConfig.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
    except Exception as exc:  # transformers and huggingface_hub raise many kinds; one sentence for all
        raise ModelLoadError(f"the config.json of model folder {str(path)!r} cannot be read "
                             f"({_first_line(exc)}).") from None
    return path


def _first_line(exc: BaseException) -> str:
    """``Type: first line`` of an exception's message (a bare KeyError's is just the key)."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    first = lines[0] if lines else ""
    if first.endswith(":") and len(lines) > 1:  # a heading (huggingface_hub's validation errors): its first item too
        first = f"{first} {lines[1]}"
    first = first[:300]
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def _weights_problem(info: dict) -> str | None:
    """What transformers' loading info says is wrong with a folder's weights, or None."""
    for key, what in (("missing_keys", "has no weights for"), ("unexpected_keys", "has weights its config has no "
                      "place for"), ("mismatched_keys", "has weights of another shape than its config gives for")):
        names = sorted(str(k[0] if isinstance(k, tuple) else k) for k in info.get(key) or ())
        if names:
            more = f" and {len(names) - 3} more" if len(names) > 3 else ""
            return f"its checkpoint {what} {', '.join(names[:3])}{more}"
    return None


#: the sampling parameters a model folder's ``generation_config.json`` may give as its defaults (vLLM's list)
SAMPLING_DEFAULT_FIELDS = ("repetition_penalty", "presence_penalty", "frequency_penalty", "temperature", "top_k",
                           "top_p", "min_p")


def sampling_defaults(model: str) -> dict[str, float]:
    """The sampling parameters a model folder's ``generation_config.json`` sets (its non-default values among
    :data:`SAMPLING_DEFAULT_FIELDS`, and ``max_new_tokens`` as ``max_tokens``), which a request that leaves one out
    gets, as vLLM's ``--generation-config auto`` gives them (Llama 3's instruct models: temperature 0.6, top_p
    0.9); none for ``"tiny"`` or a folder without the file.

    :raises ModelLoadError: the file is there and cannot be read, or sets a value that is no number or out of its
        range (checked once, at start, not at every request that would take it).
    """
    if model == "tiny" or not (Path(model) / "generation_config.json").is_file():
        return {}
    from transformers import GenerationConfig

    from tidegate.engine.real.sampling import SamplingParams
    where = f"the generation_config.json of model folder {model!r}"
    try:
        diff = GenerationConfig.from_pretrained(model, local_files_only=True).to_diff_dict()
    except Exception as exc:  # transformers raises many kinds; one sentence for all
        raise ModelLoadError(f"{where} cannot be read ({_first_line(exc)}).") from None
    defaults = {name: diff[name] for name in SAMPLING_DEFAULT_FIELDS if diff.get(name) is not None}
    for name, value in defaults.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ModelLoadError(f"{where} sets {name} to {value!r}, which is no finite number.")
    if defaults.get("top_k") == -1:  # vLLM's and some folders' "all tokens"; transformers' is 0
        defaults["top_k"] = 0
    try:
        SamplingParams(**defaults)
    except ValueError as exc:
        raise ModelLoadError(f"{where} sets a sampling default out of its range: {exc}.") from None
    longest = diff.get("max_new_tokens")
    if longest is not None:  # transformers' max_new_tokens is the default max_tokens, as vLLM takes it
        if isinstance(longest, bool) or not isinstance(longest, int) or longest < 1:
            raise ModelLoadError(f"{where} sets max_new_tokens to {longest!r}, which is no whole number >= 1.")
        defaults["max_tokens"] = longest
    return defaults


def context_limit(config) -> int | None:
    """The longest sequence a model serves token for token on the paged path: its ``max_position_embeddings``,
    and for a ``longrope`` rotary embedding (Phi-3's and Phi-4's long-context models) no more than its
    ``original_max_position_embeddings``. transformers picks longrope's frequencies by the longest position of
    the whole forward pass, which in a packed step is another request's; below the original length every
    position takes the short factors, the ones the model's own forward pass takes there."""
    from tidegate.engine.real.paged_cache import text_config

    text = text_config(config)
    limit = getattr(text, "max_position_embeddings", None)
    params = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    groups = [params] if "rope_type" in params or "type" in params else list(params.values())
    for group in groups:
        if isinstance(group, dict) and (group.get("rope_type") or group.get("type")) == "longrope":
            original = group.get("original_max_position_embeddings") \
                or getattr(text, "original_max_position_embeddings", None)
            if original:
                limit = min(limit, int(original)) if limit else int(original)
    return limit


def load_model(model: str = "tiny", device=None, dtype=None):
    """Load ``"tiny"`` or a local Hugging Face model folder.

    :param model: ``"tiny"`` or the path of a folder with ``config.json``, weights and tokenizer files.
    :param device: torch device; None: CUDA when available, else CPU.
    :param dtype: torch dtype or its name; None: the device's fastest (``default_dtype``).
    :return: ``(model, tokenizer)`` with the model in eval mode on ``device``.
    :raises ModelLoadError: the folder is missing or does not hold a loadable model (its weights short of its
        config, or beyond it), the device is unknown or absent, or the engine cannot serve the model correctly.
    """
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    if model == "tiny":
        return build_tiny_model(seed=0, dtype=dtype, device=device)
    path = _model_folder(model)
    from transformers import AutoModelForCausalLM

    from tidegate.engine.real.model_check import paged_attention_problem
    tokenizer = _folder_tokenizer(path)
    kwargs = dict(local_files_only=True, dtype=dtype, trust_remote_code=False, output_loading_info=True,
                  ignore_mismatched_sizes=True)
    try:
        try:
            hf_model, info = AutoModelForCausalLM.from_pretrained(str(path), attn_implementation="sdpa", **kwargs)
        except ValueError as exc:
            if "attention implementation" not in str(exc):
                raise
            # a model without SDPA support (Gemma 2): its eager attention, which the engine replaces in its steps
            hf_model, info = AutoModelForCausalLM.from_pretrained(str(path), attn_implementation="eager", **kwargs)
    except Exception as exc:  # transformers, safetensors and huggingface_hub raise many kinds; one sentence for all
        raise ModelLoadError(f"model folder {str(path)!r} cannot be loaded ({_first_line(exc)}).") from None
    problem = _weights_problem(info)
    if problem is not None:
        raise ModelLoadError(f"model folder {str(path)!r} cannot be served: {problem}.")
    hf_model = hf_model.to(device).eval()
    problem = paged_attention_problem(hf_model)
    if problem is not None:
        raise ModelLoadError(f"model folder {str(path)!r} cannot be served by tidegate's engine: {problem}.")
    return hf_model, tokenizer
