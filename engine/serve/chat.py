"""The text of a chat: the chat template (``--chat-template``, else the tokenizer's) over the messages,
one definition for the chat route and ``/tokenize``."""

from __future__ import annotations

import functools
import json
from typing import Any

from tidegate.engine.real.chat_template import template_variables
from tidegate.engine.serve.protocol import ChatMessage


def chat_prompt(tokenizer, messages: list[ChatMessage], chat_template: str | None = None,
                add_generation_prompt: bool = True, continue_final_message: bool = False,
                template_kwargs: dict[str, Any] | None = None) -> str:
    """The text of a chat, as the chat route renders it: ``chat_template`` (else the tokenizer's)
    over the messages. A Hugging Face tokenizer with neither is refused; the tiny model's byte
    tokenizer without one gets ``<|role|>`` headers.

    :param continue_final_message: the last message is left open (the text ends with its content),
        so that the answer goes on from it, as vLLM's parameter of that name
    :param template_kwargs: more variables for the template (vLLM's ``chat_template_kwargs``, ``documents``)
    :raises ValueError: one sentence, when the messages cannot be rendered.
    """
    if not all(m.text_parts_only() for m in messages):
        raise ValueError("only text content is served; a content part must be {'type': 'text', 'text': ...}")
    turns = [m.turn() for m in messages]
    template = chat_template or getattr(tokenizer, "chat_template", None)
    hugging_face = hasattr(tokenizer, "apply_chat_template")
    if not template:
        if hugging_face:
            raise ValueError("the model has no chat template; start the server with --chat-template FILE")
        text = "".join(f"<|{t['role']}|>\n{t['content']}\n" for t in turns)
        if continue_final_message:
            return text[:-1]
        return text + ("<|assistant|>\n" if add_generation_prompt else "")
    from jinja2 import TemplateError

    kwargs = template_variables(template_kwargs)
    try:
        if hugging_face:
            return tokenizer.apply_chat_template(turns, chat_template=template, tokenize=False,
                                                 add_generation_prompt=add_generation_prompt,
                                                 continue_final_message=continue_final_message, **kwargs)
        text = _compiled(template).render(messages=turns, add_generation_prompt=add_generation_prompt,
                                          bos_token="", eos_token="", **kwargs)
    except (TemplateError, TypeError, ValueError) as exc:  # and transformers' own checks of the arguments
        raise ValueError(f"the chat template cannot render these messages ({exc})") from None
    if continue_final_message:  # as transformers does: cut the text after the last message's content
        final = turns[-1]["content"].strip()
        end = text.rfind(final)
        if not final or end < 0:
            raise ValueError("continue_final_message: the template does not show the last message's text")
        text = text[:end + len(final)]
    return text


def check_chat_template(text: str, where: str) -> None:
    """Raise ValueError (one sentence naming ``where``) when ``text`` is not a Jinja template."""
    from jinja2 import TemplateSyntaxError

    try:
        _compiled(text)
    except TemplateSyntaxError as exc:
        raise ValueError(f"{where} is not a valid Jinja template (line {exc.lineno}: {exc.message})") from None


@functools.lru_cache(maxsize=4)
def _compiled(template: str) -> Any:
    """The template in a sandbox set up as transformers sets up chat templates."""
    from jinja2 import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template)
