"""vLLM's request log (``--enable-log-requests``, ``--max-log-len``): what each request asks, logged as the server
submits it, as vLLM's ``RequestLogger`` (vllm/entrypoints/logger.py).

One INFO line per prompt, ``Received request ID: params: ..., lora_request: ...``, and its prompt on a DEBUG line,
``Request ID details: prompt: ..., prompt_token_ids: ..., prompt_embeds shape: ...``, the prompt's text and token
ids cut to ``max_log_len`` (characters, token ids). A completion's prompts are logged as ``cmpl-ID-0``, ``cmpl-ID-1``
..., a chat as ``chatcmpl-ID`` (the response's id); a chat's prompt is its messages as JSON (vLLM logs the rendered
template, which the engine makes later, on its processor thread). The routes whose body has no ``request_id`` log
under `route_id` (``classify-ID-i``, ``score-ID-i``, ``rerank-ID-i``, ``tokn-ID``, ``transcribe-ID``, ...). The
logger is ``asyncllm.integrations.openai.requests``: it adds no handler and sets no level (docs/observability.md).
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["RequestLogger", "log_prompts", "log_under", "route_id"]

logger = logging.getLogger("asyncllm.integrations.openai.requests")


@dataclass(frozen=True)
class RequestLogger:
    """vLLM's: `log_inputs` logs one prompt; `max_log_len` cuts its text and token ids (None: whole)."""

    max_log_len: int | None = None

    def log_inputs(self, request_id: str, prompt: str | None, prompt_token_ids: Sequence[int] | None,
                   params: Any, lora_request: Any, prompt_embeds_shape: tuple[int, ...] | None = None) -> None:
        if self.max_log_len is not None:
            prompt = None if prompt is None else prompt[:self.max_log_len]
            prompt_token_ids = None if prompt_token_ids is None else list(prompt_token_ids[:self.max_log_len])
        logger.debug("Request %s details: prompt: %r, prompt_token_ids: %s, prompt_embeds shape: %s.",
                     request_id, prompt, prompt_token_ids, prompt_embeds_shape)
        logger.info("Received request %s: params: %s, lora_request: %s.", request_id, params, lora_request)


def log_prompts(request_log: RequestLogger | None, req: Any, prefix: str, prompts: Sequence[Any], params: Any,
                lora_request: Any, *, indexed: bool = True) -> None:
    """Log a request's prompts (texts, token ids, ``{"prompt_embeds": tensor}`` or a chat's messages) under
    ``prefix-ID-i`` (each prompt of a completion) or, not `indexed`, ``prefix-ID`` (a chat's one), ID the request's
    ``request_id`` (set here when it has none, so that the response's id is the one logged); `params` a list: each
    prompt's own (beam search's); `request_log` None: no log."""
    if request_log is None:
        return
    if getattr(req, "request_id", False) is None:
        req.request_id = uuid.uuid4().hex
    base = f"{prefix}-{getattr(req, 'request_id', None) or uuid.uuid4().hex}"
    log_under(request_log, base, prompts, params, lora_request, indexed=indexed)


def route_id(prefix: str, headers: Mapping[str, str]) -> str:
    """The id of a request to a route whose body has no ``request_id`` (vLLM's ``_base_request_id``): ``prefix-``
    and the ``X-Request-Id`` header when sent, else a random id."""
    return f"{prefix}-{headers.get('x-request-id') or uuid.uuid4().hex}"


def log_under(request_log: RequestLogger | None, request_id: str, prompts: Sequence[Any], params: Any,
              lora_request: Any, *, indexed: bool = True) -> None:
    """Log `prompts` (as `log_prompts` takes them, or ``{"prompt", "prompt_token_ids"}``) under ``request_id-i``,
    or, not `indexed`, ``request_id``; `params` a list: each prompt's own; `request_log` None: no log."""
    if request_log is None:
        return
    detailed = logger.isEnabledFor(logging.DEBUG)  # the prompt is built only for its DEBUG line
    for i, prompt in enumerate(prompts):
        text, token_ids, shape = _prompt_parts(prompt) if detailed else (None, None, None)
        own = params[i] if isinstance(params, list) else params
        request_log.log_inputs(f"{request_id}-{i}" if indexed else request_id, text, token_ids, own, lora_request,
                               shape)


def _prompt_parts(prompt: Any) -> tuple[str | None, Sequence[int] | None, tuple[int, ...] | None]:
    """A prompt's text (a chat's messages as JSON, each media part as its type alone: vLLM logs the rendered
    prompt, its placeholders, never the media's data), token ids and embeddings' shape, as vLLM's log shows them."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):  # a chat's messages
        return json.dumps([_without_media(message) for message in prompt], ensure_ascii=False, default=str), None, None
    if isinstance(prompt, str):
        return prompt, None, None
    if isinstance(prompt, dict) and "prompt_embeds" in prompt:
        return None, None, tuple(prompt["prompt_embeds"].shape)
    if isinstance(prompt, dict):  # a tokenized prompt, its text or None (/tokenize's, /detokenize's)
        return prompt.get("prompt"), prompt["prompt_token_ids"], None
    return None, list(prompt), None


def _without_media(message: dict[str, Any]) -> dict[str, Any]:
    content = message.get("content")
    if not isinstance(content, list):
        return message
    parts = [part if isinstance(part, dict) and part.get("type") == "text" else
             {"type": part.get("type") if isinstance(part, dict) else type(part).__name__} for part in content]
    return {**message, "content": parts}
