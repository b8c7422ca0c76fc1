"""OpenAI's ``POST /v1/embeddings`` as vLLM serves it: the request body, its prompts, the engine calls, the response.

The body has OpenAI's ``input`` (a string, a list of strings, a list of token
ids, or a list of token-id lists), ``encoding_format`` (``"float"`` or
``"base64"``: little-endian float32 bytes), ``dimensions`` and ``user``, and
vLLM's ``truncate_prompt_tokens``, ``normalize``, ``priority`` and
``cache_salt``; or, instead of ``input``, vLLM's chat ``messages``, rendered
with the chat template (``add_generation_prompt`` false by default, as vLLM's).
Every input is one `AsyncEngine.embed` call, all of them at once.
"""

from __future__ import annotations

import base64
import struct
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal

import msgspec

from asyncllm.engine.admission import admission_group
from asyncllm.engine.pooling_model import MatryoshkaRefusal
from asyncllm.engine.validation import truncated_prompt
from asyncllm.errors import POOLING_OPERATIONS, InvalidRequestError
from asyncllm.integrations.errors import renamed_fields
from asyncllm.integrations.openai_protocol import CacheSalt, ServerLimits, completion_prompts, request_options
from asyncllm.integrations.openai_request_log import RequestLogger, log_under
from asyncllm.integrations.openai_tokenize import chat_tokens
from asyncllm.integrations.streams import gather_until
from asyncllm.pooling import EmbeddingOutput, PoolingParams

if TYPE_CHECKING:
    from asyncllm.engine.async_engine import AsyncEngine
    from asyncllm.integrations.openai_server import OpenAIServer
    from asyncllm.lora import LoRARequest

__all__ = ["EmbeddingRequest", "embedding_inputs", "embedding_prompts", "embed_all", "embedding_response", "input_prompts"]


class EmbeddingRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The body of ``POST /v1/embeddings``: ``input`` or (vLLM's) ``messages``, not both."""

    model: str | None = None
    """A served name or a LoRA module's name; left out, the served model."""
    input: str | list[Any] | None = None
    """A string, a list of strings, a list of token ids, or a list of token-id lists."""
    messages: list[dict[str, Any]] | None = None
    """vLLM's: chat messages, embedded as the chat template renders them (one embedding)."""
    encoding_format: Literal["float", "base64"] = "float"
    """``"base64"``: each embedding as the base64 text of its little-endian float32 bytes."""
    dimensions: int | None = None
    """Keep the first this many features, then normalize (Matryoshka); at most the model's hidden size."""
    user: str | None = None
    """End-user id for the caller's own abuse tracking; accepted and not used by asyncllm."""
    truncate_prompt_tokens: int | None = None
    """vLLM's: cut the prompt to k tokens (-1: as many as max_model_len allows): a text `input` keeps its first
    tokens, cut by the tokenizer on the right with its special tokens ([CLS] ... [SEP]), and rendered `messages`
    their first k; token ids their last k."""
    normalize: bool | None = None
    """vLLM's: false returns the raw hidden state; null or left out: the model's default (L2-normalized unless
    the engine's ``pooler_config`` says otherwise)."""
    priority: int = 0
    """vLLM's: lower runs first; needs an engine started with scheduling_policy='priority' unless 0."""
    cache_salt: CacheSalt = None
    """vLLM's: requests with different salts never share prefix-cached KV."""
    add_generation_prompt: bool = False
    """For messages (vLLM's): end the rendered prompt with the assistant's turn opening."""
    continue_final_message: bool = False
    """For messages (vLLM's): leave the last message open; needs add_generation_prompt false."""
    chat_template_kwargs: dict[str, Any] | None = None
    """For messages (vLLM's): variables for the chat template."""
    chat_template: str | None = None
    """For messages (vLLM's): a Jinja template; only on a server started with --trust-request-chat-template."""


_CHAT_ONLY = ("add_generation_prompt", "continue_final_message", "chat_template_kwargs", "chat_template")
_DEFAULTS = EmbeddingRequest()


def embedding_inputs(req: EmbeddingRequest, limits: ServerLimits, task: str = "embed") -> list[str | list[int]] | None:
    """The engine prompts of ``input`` (at most `limits.max_prompts`); None for a request with ``messages``
    (the server renders them). A request with both, neither, or an empty input is a 400 (the latter naming the
    `task` served: /pooling's)."""
    if (req.input is None) == (req.messages is None):
        raise InvalidRequestError("input", "give input or messages (one of them)")
    if req.messages is not None:
        return None
    chat_only = [name for name in _CHAT_ONLY if getattr(req, name) != getattr(_DEFAULTS, name)]
    if chat_only:
        raise InvalidRequestError(chat_only[0], "applies to messages only, not to input")
    return input_prompts(req.input, limits, task)


def input_prompts(value: str | list[Any], limits: ServerLimits, task: str) -> list[str | list[int]]:
    """A pooling request's ``input`` as engine prompts (`completion_prompts`); an empty string is a 400 saying there
    is nothing to `task` (embed, classify)."""
    prompts = completion_prompts(value, limits, field="input")
    if any(prompt == "" for prompt in prompts):
        raise InvalidRequestError("input", f"an input is an empty string: there is nothing to {task}")
    return prompts


async def embedding_prompts(server: OpenAIServer, req: EmbeddingRequest, task: str = "embed") -> list[str | list[int]]:
    """`embedding_inputs`, or the request's ``messages`` rendered by the server and cut to ``truncate_prompt_tokens``
    as a text input is: their first k tokens (vLLM's ``_preprocess_chat``; `truncated_prompt`)."""
    prompts = embedding_inputs(req, server.limits, task)
    if prompts is not None:
        return prompts
    token_ids = await chat_tokens(server, req, operation=POOLING_OPERATIONS["embed"],  # the engine started
                              cuttable=req.truncate_prompt_tokens is not None)
    return [truncated_prompt(token_ids, req.truncate_prompt_tokens, server.engine.config.max_model_len, pooling=True,
                             chat=True)]


def pooling_params(req: EmbeddingRequest) -> PoolingParams:
    """The request's `PoolingParams` (the engine checks ``dimensions`` against the model's hidden size)."""
    return PoolingParams(normalize=req.normalize, dimensions=req.dimensions)


async def embed_all(engine: AsyncEngine, prompts: Sequence[str | list[int]], req: EmbeddingRequest,
                    lora: LoRARequest | None = None, *,
                    until: Callable[[], Awaitable[object]] | None = None,
                    request_log: RequestLogger | None = None,
                    request_id: str | None = None, model_name: str | None = None) -> list[EmbeddingOutput]:
    """Embed every prompt at once, results in input order; `request_log` logs each as ``request_id-i`` (the
    response's id; None: ``embd-`` and a random id). A refusal of ``dimensions`` names the model `model_name`
    (the server's served name, as vLLM's ``served_model_name``; None: the engine's, the model as configured).

    The first error cancels the others (each cancelled `embed` aborts its
    request in the engine) and is raised; `until` completing (the client went
    away) does the same and raises `ClientDisconnected`. An engine error naming ``prompt`` names the request's
    field (``input`` or ``messages``), but a context-length error's stays ``prompt``, as on every route.
    """
    pooling = pooling_params(req)
    log_under(request_log, request_id or f"embd-{uuid.uuid4().hex}", prompts, pooling, lora)
    options = {**request_options(req), "truncate_prompt_tokens": req.truncate_prompt_tokens, "lora_request": lora}
    try:
        with renamed_fields({"prompt": "input" if req.messages is None else "messages"}, uncoded_only=True), \
                admission_group(len(prompts)):  # the request's group (`guard`) may pass the limits by its prompts
            return await gather_until([engine.embed(prompt, pooling, **options) for prompt in prompts], until)
    except MatryoshkaRefusal as exc:  # the engine's check names the model as configured (a checkpoint's path)
        if model_name is None:
            raise
        raise exc.naming(model_name) from None


def embedding_response(outputs: Sequence[EmbeddingOutput], model: str, encoding_format: str = "float",
                       response_id: str | None = None) -> dict[str, Any]:
    """The response body: one ``embedding`` item per input, in order, and the prompts' token usage; its id
    `response_id` (None: ``embd-`` and a random id)."""
    data = [{"object": "embedding", "index": i, "embedding": encode_embedding(out.embedding, encoding_format)}
            for i, out in enumerate(outputs)]
    tokens = sum(len(out.prompt_token_ids) for out in outputs)
    return {"id": response_id or f"embd-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": model,
            "data": data, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def encode_embedding(embedding: list[float], encoding_format: str) -> list[float] | str:
    """The floats, or for ``"base64"`` the base64 text of their little-endian float32 bytes (OpenAI's)."""
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(embedding)}f", *embedding)).decode("ascii")
    return embedding
