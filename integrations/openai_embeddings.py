"""OpenAI's ``POST /v1/embeddings`` as vLLM serves it: the request body, its prompts, the engine calls, the response.

The body has OpenAI's ``input`` (a string, a list of strings, a list of token
ids, or a list of token-id lists), ``encoding_format`` (``"float"``,
``"base64"``, vLLM's ``"bytes"`` and ``"bytes_only"``, with vLLM's ``embed_dtype``
and ``endianness``: openai_embed_encoding.py), ``dimensions`` and ``user``, and
vLLM's ``truncate_prompt_tokens``, ``normalize``, ``priority``, ``cache_salt``,
``request_id`` and ``add_special_tokens``; or, instead of ``input``, vLLM's chat
``messages``, rendered with the chat template (``add_generation_prompt`` false by
default, as vLLM's).
Every input is one `AsyncEngine.embed` call, all of them at once.

The prompt part of the body (`PoolingPromptRequest`), its rendering, the
response id and usage are the pooling routes' (/classify and /pooling take them from here too).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import msgspec
from starlette.responses import Response

from asyncllm.engine.admission import admission_group
from asyncllm.engine.pooling_model import MatryoshkaRefusal
from asyncllm.engine.validation import truncated_prompt
from asyncllm.errors import POOLING_OPERATIONS, InvalidRequestError
from asyncllm.integrations.errors import renamed_fields
from asyncllm.integrations.openai_embed_encoding import (BYTES_FORMATS, EmbedDType, EncodingFormat, Endianness,
                                                         bytes_response, encode_vector)
from asyncllm.integrations.openai_http import json_response
from asyncllm.integrations.openai_pooling_media import MediaChat, embed_one, logged_prompts, media_chat
from asyncllm.integrations.openai_protocol import (CacheSalt, ServerLimits, completion_prompts, request_options,
                                                  take_request_id)
from asyncllm.integrations.openai_request_log import RequestLogger, log_under
from asyncllm.integrations.openai_tokenize import chat_tokens
from asyncllm.integrations.streams import gather_until
from asyncllm.pooling import EmbeddingOutput, PoolingParams

if TYPE_CHECKING:
    from asyncllm.engine.async_engine import AsyncEngine
    from asyncllm.integrations.openai_server import OpenAIServer
    from asyncllm.lora import LoRARequest

__all__ = ["PoolingPromptRequest", "EmbeddingRequest", "embedding_inputs", "embedding_prompts",
           "embed_all", "embedding_response", "pooled_response", "input_prompts", "input_special_tokens",
           "pooling_usage", "pooling_request_id"]


class PoolingPromptRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """What a pooling request embeds or classifies: ``input`` or (vLLM's chat request) ``messages``, not both; the
    fields vLLM's pooling completion and chat requests share (/v1/embeddings, /classify, /pooling)."""

    model: str | None = None
    """A served name or a LoRA module's name; left out, the served model."""
    input: str | list[Any] | None = None
    """A string, a list of strings, a list of token ids, or a list of token-id lists."""
    messages: list[dict[str, Any]] | None = None
    """vLLM's: chat messages, pooled as the chat template renders them (one prompt)."""
    user: str | None = None
    """End-user id for the caller's own abuse tracking; accepted and not used by asyncllm."""
    truncate_prompt_tokens: int | None = None
    """vLLM's: cut the prompt to k tokens (-1: as many as max_model_len allows): a text `input` keeps its first
    tokens, cut by the tokenizer on the right with its special tokens ([CLS] ... [SEP]), and rendered `messages`
    their first k; token ids their last k."""
    priority: int = 0
    """vLLM's: lower runs first; needs an engine started with scheduling_policy='priority' unless 0."""
    cache_salt: CacheSalt = None
    """vLLM's: requests with different salts never share prefix-cached KV."""
    request_id: str | None = None
    """vLLM's: the response's id after its prefix (the ``X-Request-Id`` header's over it); left out: a random id."""
    add_special_tokens: bool | None = None
    """vLLM's: for messages, true adds the tokenizer's special tokens (BOS) on top of the template's (null: false,
    vLLM's chat default); for a text input, false leaves them out (null or true: they are added, vLLM's default)."""
    add_generation_prompt: bool = False
    """For messages (vLLM's): end the rendered prompt with the assistant's turn opening."""
    continue_final_message: bool = False
    """For messages (vLLM's): leave the last message open; needs add_generation_prompt false."""
    chat_template_kwargs: dict[str, Any] | None = None
    """For messages (vLLM's): variables for the chat template."""
    chat_template: str | None = None
    """For messages (vLLM's): a Jinja template; only on a server started with --trust-request-chat-template."""
    mm_processor_kwargs: dict[str, Any] | None = None
    """For messages (vLLM's): the image processor's settings for the chat's media, as a chat completion's (on a chat
    without media it changes nothing)."""


class EmbeddingRequest(PoolingPromptRequest, kw_only=True, forbid_unknown_fields=True):
    """The body of ``POST /v1/embeddings``: `PoolingPromptRequest`'s, and how the embeddings are answered."""

    encoding_format: EncodingFormat = "float"
    """``"base64"``: each embedding as the base64 text of its bytes; vLLM's ``"bytes"``: all of them as a binary
    body with a ``metadata`` header, ``"bytes_only"`` without it (openai_embed_encoding.py)."""
    embed_dtype: EmbedDType = "float32"
    """vLLM's: the dtype of base64 and bytes results (float32, float16, bfloat16, fp8_e4m3, fp8_e5m2)."""
    endianness: Endianness = "native"
    """vLLM's: the byte order of base64 and bytes results (native: the server's)."""
    dimensions: int | None = None
    """Keep the first this many features, then normalize (Matryoshka); at most the model's hidden size."""
    normalize: bool | None = None
    """vLLM's: false returns the raw hidden state; null or left out: the model's default (L2-normalized unless
    the engine's ``pooler_config`` says otherwise)."""


_CHAT_ONLY = ("add_generation_prompt", "continue_final_message", "chat_template_kwargs", "chat_template",
              "mm_processor_kwargs")
_DEFAULTS = PoolingPromptRequest()
def embedding_inputs(req: PoolingPromptRequest, limits: ServerLimits,
                     task: str = "embed") -> list[str | list[int]] | None:
    """The engine prompts of ``input`` (at most `limits.max_prompts`); None for a request with ``messages``
    (the server renders them). A request with both, neither, or an empty input is a 400 (the latter naming the
    `task` served: /pooling's), as is a chat-only field with ``input``."""
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


async def embedding_prompts(server: OpenAIServer, req: PoolingPromptRequest, task: str = "embed",
                            api: str = "embed") -> list[str | list[int] | MediaChat]:
    """`embedding_inputs`, or the request's ``messages`` rendered by the server (BOS and the like on top of the
    template's with ``add_special_tokens`` true) and cut to ``truncate_prompt_tokens`` as a text input is: their
    first k tokens (vLLM's ``_preprocess_chat``; `truncated_prompt`); messages with media parts as one `MediaChat`,
    which the engine renders (openai_pooling_media.py). `api` names the route in a context-length
    error (`errors.POOLING_OPERATIONS`: /pooling's "embedding generation" whatever its `task`)."""
    prompts = embedding_inputs(req, server.limits, task)
    if prompts is not None:
        return prompts
    chat = media_chat(server, req)  # media parts: the engine renders the chat with its media
    if chat is not None:
        return [chat]
    token_ids = await chat_tokens(server, req, add_special_tokens=bool(req.add_special_tokens),
                                  operation=POOLING_OPERATIONS[api], cuttable=req.truncate_prompt_tokens is not None)
    return [truncated_prompt(token_ids, req.truncate_prompt_tokens, server.engine.config.max_model_len, pooling=True,
                             chat=True)]


def input_special_tokens(req: PoolingPromptRequest) -> bool | None:
    """The engine's ``add_special_tokens`` for the request's prompts: an ``input``'s (vLLM's completion-form
    pooling requests: false leaves a text's special tokens out); None for rendered ``messages`` (token ids)."""
    return req.add_special_tokens if req.messages is None else None


def pooling_params(req: EmbeddingRequest) -> PoolingParams:
    """The request's `PoolingParams` (the engine checks ``dimensions`` against the model's hidden size)."""
    return PoolingParams(normalize=req.normalize, dimensions=req.dimensions)


async def embed_all(engine: AsyncEngine, prompts: Sequence[str | list[int] | MediaChat], req: EmbeddingRequest,
                    lora: LoRARequest | None = None, *,
                    until: Callable[[], Awaitable[object]] | None = None,
                    request_log: RequestLogger | None = None,
                    request_id: str | None = None, model_name: str | None = None,
                    pooling: PoolingParams | None = None) -> list[Any]:
    """Embed every prompt at once, results in input order (`EmbeddingOutput`s; `pooling` None: the request's
    `pooling_params`; a per-token task's: `PoolingOutput`s of `AsyncEngine.encode`); `request_log` logs each as
    ``request_id-i`` (the
    response's id; None: ``embd-`` and a random id). A refusal of ``dimensions`` names the model `model_name`
    (the server's served name, as vLLM's ``served_model_name``; None: the engine's, the model as configured).

    The first error cancels the others (each cancelled `embed` aborts its
    request in the engine) and is raised; `until` completing (the client went
    away) does the same and raises `ClientDisconnected`. An engine error naming ``prompt`` names the request's
    field (``input`` or ``messages``); a context-length error keeps it (``input_tokens``: `errors.context_param`).
    """
    pooling = pooling_params(req) if pooling is None else pooling
    log_under(request_log, request_id or f"embd-{uuid.uuid4().hex}", logged_prompts(prompts), pooling, lora)
    options = {**request_options(req), "truncate_prompt_tokens": req.truncate_prompt_tokens, "lora_request": lora,
               "add_special_tokens": input_special_tokens(req)}
    try:
        with renamed_fields({"prompt": "input" if req.messages is None else "messages"}, uncoded_only=True), \
                admission_group(len(prompts)):  # (`guard`) may pass the limits by its prompts
            return await gather_until([embed_one(engine, prompt, pooling, options) for prompt in prompts], until)
    except MatryoshkaRefusal as exc:  # the engine's check names the model as configured (a checkpoint's path)
        if model_name is None:
            raise
        raise exc.naming(model_name) from None


def embedding_response(outputs: Sequence[EmbeddingOutput], model: str, req: EmbeddingRequest,
                       response_id: str | None = None) -> Response:
    """The response: one ``embedding`` item per input, in order, and the prompts' token usage, encoded as `req`
    asks (`pooled_response`); its id `response_id` (None: ``embd-`` and a random id)."""
    return pooled_response([out.embedding for out in outputs], outputs, model, req,
                           response_id or f"embd-{uuid.uuid4().hex}", "embedding")


def pooled_response(vectors: Sequence[list[float]], outputs: Sequence[Any], model: str, req: EmbeddingRequest,
                    response_id: str, kind: str) -> Response:
    """vLLM's list of pooled `vectors` (/v1/embeddings' ``embedding`` items, /pooling's ``pooling`` ones: `kind`),
    each encoded as `req` asks (``encoding_format``, ``embed_dtype``, ``endianness``), with the `outputs`' usage;
    ``"bytes"`` and ``"bytes_only"`` as a binary body (openai_embed_encoding.py's `bytes_response`)."""
    usage = pooling_usage(outputs)
    if req.encoding_format in BYTES_FORMATS:
        return bytes_response(vectors, usage["prompt_tokens"], response_id, model, req)
    field = "embedding" if kind == "embedding" else "data"
    data = [{"index": i, "object": kind, field: encode_vector(vector, req.encoding_format, req.embed_dtype,
                                                             req.endianness)} for i, vector in enumerate(vectors)]
    return json_response({"id": response_id, "object": "list", "created": int(time.time()), "model": model,
                          "data": data, "usage": usage})


def pooling_usage(outputs: Sequence[Any]) -> dict[str, Any]:
    """vLLM's ``UsageInfo`` of a pooling response: the tokens of every prompt run (``prompt_tokens`` =
    ``total_tokens``), ``completion_tokens`` 0 and no ``prompt_tokens_details``."""
    tokens = sum(len(out.prompt_token_ids) for out in outputs)
    return {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0, "prompt_tokens_details": None}


def pooling_request_id(prefix: str, req: Any, headers: Mapping[str, str]) -> str:
    """A pooling response's id: `prefix`, ``-`` and the ``X-Request-Id`` header, else the body's ``request_id``, else
    a random id (vLLM's ``_base_request_id``); an id too long is a 400."""
    take_request_id(req, headers)
    return f"{prefix}-{req.request_id or uuid.uuid4().hex}"
