"""What a request may hand a Hugging Face chat template: ``tidegate serve`` renders with it, and tidegate's
middleware in vLLM counts a chat's prompt with it."""

from __future__ import annotations

#: what a request's ``chat_template_kwargs`` may not set: the template itself (a client's template would run
#: in the server), and the arguments the server sets
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "add_generation_prompt", "continue_final_message", "chat_template",
                                      "tokenize", "conversation", "return_dict", "return_tensors"})


def template_variables(template_kwargs: dict | None) -> dict:
    """A request's ``chat_template_kwargs`` as variables for the template, without ``RESERVED_TEMPLATE_KWARGS``."""
    return {k: v for k, v in (template_kwargs or {}).items() if k not in RESERVED_TEMPLATE_KWARGS}
