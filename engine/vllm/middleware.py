"""The 429 on vLLM's own OpenAI server: an ASGI middleware for its API process.

``--middleware tidegate.engine.vllm.middleware.AdmissionMiddleware`` (with the plugin's
``--scheduler-cls`` and the same settings). On ``POST /v1/completions`` and
``/v1/chat/completions`` it reads the body (and hands it to vLLM unchanged), counts the prompt's
tokens with the model's tokenizer (chat: through its chat template) and the ``max_tokens`` (vLLM's
default when absent), and asks the twin controller (``admission``): a refusal is answered at once
with 429, an OpenAI-style error body and ``Retry-After`` (whole seconds, from the drain rate), and
never enters vLLM's queue; anything else goes to vLLM exactly as it came, and vLLM's answer comes
back untouched. It also registers tidegate's counters on vLLM's ``/metrics`` (``metrics``).

With ``controller: vllm`` (the pass-through) or settings it cannot read, it passes everything through.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from tidegate.ctrl.base import RETRY_AFTER_MAX_S, RETRY_AFTER_MIN_S, Rejection
from tidegate.engine.real.chat_template import template_variables
from tidegate.engine.vllm.admission import AdmissionGate
from tidegate.engine.vllm.config import PluginConfigError, read_plugin_config, share_vllm_log_handlers

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

#: the endpoints whose arrivals are decided, and whether their body is a chat
ENDPOINTS = {"/v1/completions": False, "/v1/chat/completions": True}
#: a prompt text is tokenized up to this many characters for each token of the context; the rest is estimated
#: at four characters a token (a prompt that long is past the context for any text of tokens shorter than this,
#: and the tokenizer runs on vLLM's event loop, which a prompt of megabytes would hold for seconds)
_CHARS_TOKENIZED_PER_CONTEXT_TOKEN = 16
#: max_tokens of a completion request that sets none (vLLM's CompletionRequest default, OpenAI's too); a chat
#: request that sets none gets the model's generation config's, else the rest of the context, as in vLLM
_COMPLETIONS_DEFAULT_MAX_TOKENS = 16


class PromptCounter:
    """Prompt tokens of a request body, with the model's tokenizer; a cheap estimate if that fails.

    :param tokenizer: a Hugging Face tokenizer (None: the estimate only).
    """

    def __init__(self, tokenizer: Any, max_model_len: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.estimated = 0
        self.max_chars = (max_model_len + 1) * _CHARS_TOKENIZED_PER_CONTEXT_TOKEN if max_model_len else None

    def completion(self, prompt: Any) -> tuple[int, int]:
        """(the longest prompt's tokens, how many prompts) of a completion request's ``prompt``."""
        if isinstance(prompt, list) and prompt and not all(isinstance(t, int) for t in prompt):
            sizes = [self._one(p) for p in prompt]
            return max(sizes), len(sizes)
        return self._one(prompt), 1

    def chat(self, body: dict) -> int:
        messages = body.get("messages")
        if self.tokenizer is not None and isinstance(messages, list):
            try:
                # never the client's own template (it would run on vLLM's event loop; vLLM takes one only from a
                # server that trusts request templates), nor the arguments set here
                kwargs = body.get("chat_template_kwargs")
                variables = template_variables(kwargs if isinstance(kwargs, dict) else None)
                text = self.tokenizer.apply_chat_template(
                    messages, tokenize=False, add_generation_prompt=body.get("add_generation_prompt", True),
                    **variables)
                return self._tokens(text, add_special_tokens=False)
            except Exception:
                pass
        self.estimated += 1
        if not isinstance(messages, list):
            return 1
        return sum(_estimate(m.get("content") if isinstance(m, dict) else m) for m in messages) + 4 * len(messages)

    def _one(self, prompt: Any) -> int:
        if isinstance(prompt, list):
            return len(prompt)  # token ids
        if isinstance(prompt, str) and self.tokenizer is not None:
            try:
                return self._tokens(prompt)
            except Exception:
                pass
        self.estimated += 1
        return _estimate(prompt)

    def _tokens(self, text: str, **kwargs: Any) -> int:
        """The tokens of ``text``: counted up to ``max_chars``, the rest estimated."""
        head, rest = (text, "") if self.max_chars is None else (text[:self.max_chars], text[self.max_chars:])
        return len(self.tokenizer(head, **kwargs)["input_ids"]) + (_estimate(rest) if rest else 0)


def _estimate(content: Any) -> int:
    """About four characters a token."""
    if isinstance(content, list):  # content parts
        return sum(_estimate(part.get("text") if isinstance(part, dict) else part) for part in content)
    return len(content) // 4 + 1 if isinstance(content, str) else 1


class AdmissionMiddleware:
    """The ASGI middleware vLLM's ``--middleware`` installs (``app.add_middleware(AdmissionMiddleware)``).

    Its settings come from the app's ``state.vllm_config`` (the additional config, else the
    TIDEGATE_* environment, as the engine's scheduler reads them), on the first call (vLLM's
    lifespan start-up), when the tokenizer is loaded too.
    """

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        self.app = app
        self.gate: AdmissionGate | None = None
        self.counter: PromptCounter | None = None
        self.max_model_len: int | None = None
        self.default_max_tokens: int | None = None
        self._started = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self._started:
            self._start(scope)
        gate = self.gate
        path = scope.get("path")
        if gate is None or scope["type"] != "http" or scope.get("method") != "POST" or path not in ENDPOINTS:
            await self.app(scope, receive, send)
            return
        body, disconnected = await _read_body(receive)
        replay = _replay(body, receive)
        if disconnected:
            await self.app(scope, replay, send)
            return
        arrival = self._arrival(body, ENDPOINTS[path])
        if arrival is None:  # not a body vLLM will run: its own 400
            await self.app(scope, replay, send)
            return
        prompt_tokens, max_tokens, requests = arrival
        rejection = gate.admit(prompt_tokens, max_tokens, requests)
        if rejection is not None:
            await _too_many_requests(send, rejection)
            return

        async def watch(message: Message) -> None:
            if message["type"] == "http.response.start" and message["status"] >= 400:
                gate.not_queued(requests)
            await send(message)

        await self.app(scope, replay, watch)

    def _arrival(self, raw: bytes, chat: bool) -> tuple[int, int, int] | None:
        """(prompt tokens, max_tokens, engine requests) of a request body; None for one that is not JSON."""
        try:
            body = json.loads(raw)
        except ValueError:
            return None
        if not isinstance(body, dict) or self.counter is None:
            return None
        n = body.get("n")
        choices = n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1
        if chat:
            prompt, prompts = self.counter.chat(body), 1
            asked = body.get("max_completion_tokens", body.get("max_tokens"))
            default = self.default_max_tokens
        else:
            prompt, prompts = self.counter.completion(body.get("prompt"))
            asked = body.get("max_tokens", _COMPLETIONS_DEFAULT_MAX_TOKENS)
            default = None
        rest = max((self.max_model_len or prompt + 1) - prompt, 1)
        if isinstance(asked, int) and not isinstance(asked, bool) and asked > 0:
            max_tokens = min(asked, rest)
        else:
            max_tokens = min(default or rest, rest)
        return prompt, max_tokens, prompts * choices

    def _start(self, scope: Scope) -> None:
        app = scope.get("app")
        vllm_config = getattr(getattr(app, "state", None), "vllm_config", None)
        if vllm_config is None:  # not yet set: try again at the next call
            return
        self._started = True
        share_vllm_log_handlers()
        try:
            config = read_plugin_config(vllm_config.additional_config)
        except PluginConfigError as exc:  # the engine refuses the same settings at its start-up
            log.warning("tidegate: %s No admission in the API process.", exc)
            return
        from tidegate.engine.vllm.metrics import register_metrics

        model_config = vllm_config.model_config
        if config.passes_through:
            register_metrics(None, _model_name(model_config))
            return
        self.gate = AdmissionGate(config)
        self.max_model_len = int(model_config.max_model_len)
        self.counter = PromptCounter(_load_tokenizer(model_config), self.max_model_len)
        try:
            self.default_max_tokens = model_config.get_diff_sampling_param().get("max_tokens")
        except Exception:
            self.default_max_tokens = None
        register_metrics(self.gate, _model_name(model_config))
        log.info("tidegate: arrivals decided in the API process by a twin of %r (reading %s.obs)",
                 config.controller, self.gate.channel)


def _model_name(model_config: Any) -> str:
    name = getattr(model_config, "served_model_name", None) or getattr(model_config, "model", "")
    return str(name[0] if isinstance(name, (list, tuple)) else name)


def _load_tokenizer(model_config: Any) -> Any:
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model_config.tokenizer,
                                             trust_remote_code=bool(getattr(model_config, "trust_remote_code",
                                                                            False)))
    except Exception as exc:
        log.warning("tidegate: the model's tokenizer did not load (%s); prompt tokens are estimated at four "
                    "characters a token", exc)
        return None


async def _read_body(receive: Receive) -> tuple[bytes, bool]:
    """The whole request body, and whether the client went away first."""
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return b"".join(chunks), True
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks), False


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that gives the body once, as one message, then whatever the client sends next."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def retry_after_header(seconds: float) -> str:
    """Whole seconds, rounded up, within tidegate's bounds (a NaN: the least)."""
    wait = seconds if seconds >= RETRY_AFTER_MIN_S else RETRY_AFTER_MIN_S
    return str(int(math.ceil(min(wait, RETRY_AFTER_MAX_S))))


def rejection_body(rejection: Rejection) -> bytes:
    """The OpenAI-style error body of a 429, as ``tidegate serve`` answers it."""
    return json.dumps({"error": {"message": rejection.reason, "type": "rate_limited", "param": None,
                                 "code": 429}}).encode()


async def _too_many_requests(send: Send, rejection: Rejection) -> None:
    body = rejection_body(rejection)
    await send({"type": "http.response.start", "status": 429,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"retry-after", retry_after_header(rejection.retry_after_s).encode())]})
    await send({"type": "http.response.body", "body": body})
