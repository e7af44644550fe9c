"""Model folders an operator brings: a folder whose weights fall short of its config or go beyond it, whose
tokenizer spells nothing, whose config asks to run its own code, or whose checkpoint is cut off is refused with
one sentence naming the folder, never served as a model with random or missing weights; a long-context rotary
embedding whose frequencies depend on the whole forward pass (Phi-3's ``longrope``) is served, token for token,
within the context it computes per request."""

from __future__ import annotations

import json
import random

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

from tidegate.engine.real.llm import LLM
from tidegate.engine.real.model import ModelLoadError, context_limit, load_model, sampling_defaults
from tidegate.engine.real.sampling import SamplingParams
from tidegate.engine.real.tiny_folder import byte_tokenizer_fast

torch.set_num_threads(1)

COMMON = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2,
              initializer_range=0.1)
LONGROPE = dict(rope_type="longrope", short_factor=[1.0] * 8, long_factor=[6.0, 5, 4, 3, 2, 8, 9, 7],
                original_max_position_embeddings=48, rope_theta=1e4)


def _folder(path, model_type="llama", **fields):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **{**COMMON, **fields}))
    model.save_pretrained(path)
    byte_tokenizer_fast().save_pretrained(path)
    return path


def _edit_weights(path, edit) -> None:
    weights = load_file(path / "model.safetensors")
    edit(weights)
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})


def test_weights_short_of_the_config_are_refused_by_name(tmp_path):
    folder = _folder(tmp_path / "m")
    _edit_weights(folder, lambda w: w.pop("lm_head.weight"))
    with pytest.raises(ModelLoadError, match=r"cannot be served: its checkpoint has no weights for lm_head\.weight\."):
        load_model(str(folder))


def test_weights_beyond_the_config_are_refused_by_name(tmp_path):
    deeper = _folder(tmp_path / "deep", num_hidden_layers=3)
    folder = _folder(tmp_path / "m")
    extra = load_file(deeper / "model.safetensors")
    _edit_weights(folder, lambda w: w.update({k: v for k, v in extra.items() if ".layers.2." in k}))
    with pytest.raises(ModelLoadError, match=r"weights its config has no place for model\.layers\.2\."):
        load_model(str(folder))


def _edit_config(folder, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("changes, message", [
    ({"intermediate_size": 96}, r"of another shape than its config gives for model\.layers\.0\.mlp"),  # the weights
    ({"num_attention_heads": 5}, r"cannot be read .*not a multiple of the number of attention heads"),  # itself
])
def test_a_config_its_weights_or_itself_contradict_is_refused_naming_what(tmp_path, changes, message):
    folder = _folder(tmp_path / "m")
    _edit_config(folder, **changes)
    with pytest.raises(ModelLoadError, match=message):
        load_model(str(folder))


def test_a_cut_off_checkpoint_is_one_sentence(tmp_path):
    folder = _folder(tmp_path / "m")
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[:len(data) // 2])
    with pytest.raises(ModelLoadError, match=r"cannot be loaded \(SafetensorError: ") as caught:
        load_model(str(folder))
    assert "\n" not in str(caught.value)


def test_a_config_with_its_own_code_is_refused_without_running_it(tmp_path):
    folder = _folder(tmp_path / "m")
    marker = tmp_path / "ran"
    (folder / "custom.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n"
                                      "from transformers import LlamaConfig\n"
                                      "class CustomConfig(LlamaConfig):\n    model_type = 'custom'\n")
    _edit_config(folder, model_type="custom", auto_map={"AutoConfig": "custom.CustomConfig"})
    with pytest.raises(ModelLoadError, match=r"the config\.json of model folder .* cannot be read"):
        load_model(str(folder))
    assert not marker.exists()


def test_a_tokenizer_that_spells_nothing_is_refused(tmp_path):
    folder = _folder(tmp_path / "m")
    (folder / "tokenizer.json").unlink()
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer"}))
    with pytest.raises(ModelLoadError, match=r"turns text into no tokens"):
        load_model(str(folder))


def test_longrope_serves_token_for_token_within_its_original_context(tmp_path):
    """Batched with a longer prompt and prefilled in chunks, each request's tokens are its own ``generate``'s:
    the context stops where transformers would switch to the long factors for the whole pass."""
    folder = _folder(tmp_path / "m", model_type="phi3", max_position_embeddings=256, rope_parameters=LONGROPE,
                     original_max_position_embeddings=48)
    llm = LLM(str(folder), kv_capacity_tokens=4096, dtype="float32", device="cpu", max_num_batched_tokens=16)
    assert llm.max_model_len == context_limit(llm.model.config) == 48
    rng = random.Random(1)
    prompts = [[1] + [rng.randint(3, 258) for _ in range(n - 1)] for n in (5, 9, 30)]
    outs = llm.generate(prompts, SamplingParams(ignore_eos=True), max_tokens=14)
    config = GenerationConfig(do_sample=False, eos_token_id=[], pad_token_id=0, max_new_tokens=14)
    for prompt, out in zip(prompts, outs):
        with torch.inference_mode():
            want = llm.model.generate(torch.tensor([prompt]), generation_config=config)[0, len(prompt):].tolist()
        assert out.token_ids == want
    with pytest.raises(ValueError, match="exceeds the model context of 48 tokens"):
        llm.generate([prompts[2]], max_tokens=20)


def test_the_generation_config_gives_the_defaults_a_request_leaves_out(tmp_path):
    from tidegate.engine.serve.arrival import Ask, sampling_params
    from tidegate.engine.serve.protocol import CompletionBody

    folder = _folder(tmp_path / "m")
    GenerationConfig(do_sample=True, temperature=0.6, top_p=0.9, repetition_penalty=1.1, eos_token_id=2,
                     bos_token_id=1).save_pretrained(folder)
    defaults = sampling_defaults(str(folder))
    assert defaults == {"temperature": 0.6, "top_p": 0.9, "repetition_penalty": 1.1}
    assert sampling_defaults("tiny") == {} and sampling_defaults(str(_folder(tmp_path / "plain"))) == {}

    def params(**fields):
        body = CompletionBody(prompt="hi", **fields)
        return sampling_params(body, Ask.of(body, chat=False, max_tokens=4), 300, None, defaults)

    left_out = params()
    assert (left_out.temperature, left_out.top_p, left_out.repetition_penalty) == (0.6, 0.9, 1.1)
    sent = params(temperature=0.0, top_p=None, repetition_penalty=1.0)  # null is left out, as vLLM takes it
    assert (sent.temperature, sent.top_p, sent.repetition_penalty) == (0.0, 0.9, 1.0)
    (folder / "generation_config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=r"the generation_config\.json of model folder .* cannot be read"):
        sampling_defaults(str(folder))
    # checked once, at start: a value no request could take is the folder's to fix, not each client's
    for bad, message in (({"temperature": "0.7"}, "which is no finite number"),
                         ({"top_p": 0}, "out of its range: top_p must be in"),
                         ({"max_new_tokens": 0}, "max_new_tokens. must be greater than 0")):
        (folder / "generation_config.json").write_text(json.dumps({"do_sample": True, **bad}))
        with pytest.raises(ModelLoadError, match=message):
            sampling_defaults(str(folder))
    (folder / "generation_config.json").write_text(json.dumps({"max_new_tokens": 5, "top_k": -1, "do_sample": True}))
    assert sampling_defaults(str(folder)) == {"max_tokens": 5, "top_k": 0}


def test_generation_config_is_auto_or_vllm():
    from tidegate.engine.serve.config import ServeConfig

    assert ServeConfig().generation_config == "auto" and ServeConfig(generation_config="vllm")
    with pytest.raises(ValueError, match="generation_config must be 'auto' or 'vllm'"):
        ServeConfig(generation_config="model")
