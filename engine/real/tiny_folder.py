"""The tiny model as a Hugging Face folder that other engines (vLLM) serve as they serve any model.

The folder holds the tiny Llama's config and seeded random weights (``save_pretrained``) and a
``tokenizer.json`` that gives exactly :class:`~tidegate.engine.real.model.ByteTokenizer`'s ids:
PAD, BOS and EOS are 0-2 and byte ``b`` is token ``b + 3`` (a byte-level BPE without merges), so
the same prompt is the same token ids in tidegate's engine and in vLLM. It carries a plain chat
template too, so chat routes work. Nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path

from tidegate.engine.real.model import BOS_TOKEN_ID, EOS_TOKEN_ID, PAD_TOKEN_ID, build_tiny_model

#: one line per message, then the assistant's turn
CHAT_TEMPLATE = ("{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant: {% endif %}")
_SPECIAL = {"<pad>": PAD_TOKEN_ID, "<s>": BOS_TOKEN_ID, "</s>": EOS_TOKEN_ID}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from a byte to the printable character byte-level BPE writes it as."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


def byte_tokenizer_fast():
    """A ``PreTrainedTokenizerFast`` with :class:`ByteTokenizer`'s ids (BOS first) and :data:`CHAT_TEMPLATE`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    offset = max(_SPECIAL.values()) + 1
    vocab = dict(_SPECIAL)
    vocab.update({char: b + offset for b, char in _bytes_to_unicode().items()})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B",
                                                       special_tokens=[("<s>", BOS_TOKEN_ID)])
    tok.add_special_tokens(list(_SPECIAL))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   chat_template=CHAT_TEMPLATE)


def save_tiny_model(out_dir: str | Path, seed: int = 0) -> Path:
    """Write the tiny model (weights drawn from ``seed``) and its tokenizer into ``out_dir``.

    :param out_dir: the folder; made if missing, its files of the same names replaced.
    :param seed: the weights' seed (0: the weights ``--model tiny`` runs).
    :return: the folder.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model, _ = build_tiny_model(seed=seed)
    model.save_pretrained(out)
    byte_tokenizer_fast().save_pretrained(out)
    return out
