"""OpenAI's ``POST /v1/embeddings`` as vLLM serves it: the request body, its prompts, the engine calls, the response.

The body has OpenAI's ``input`` (a string, a list of strings, a list of token
ids, or a list of token-id lists), ``encoding_format`` (``"float"`` or
``"base64"``: little-endian float32 bytes), ``dimensions`` and ``user``, and
vLLM's ``truncate_prompt_tokens``, ``normalize``, ``priority``, ``cache_salt``
and ``request_id``; or, instead of ``input``, vLLM's chat ``messages``, rendered
with the chat template (``add_generation_prompt`` false by default, as vLLM's).
Every input is one `AsyncEngine.embed` call, all of them at once.

The prompt part of the body (`PoolingPromptRequest`), its rendering, the
response id and usage, and the context-length error's ``param`` (`context_param`)
are the pooling routes' (/classify and /pooling take them from here too).
"""

from __future__ import annotations

import base64
import contextlib
import struct
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import msgspec

from asyncllm.engine.admission import admission_group
from asyncllm.engine.pooling_model import MatryoshkaRefusal
from asyncllm.engine.validation import truncated_prompt
from asyncllm.errors import CONTEXT_LENGTH_EXCEEDED, POOLING_OPERATIONS, InvalidRequestError
from asyncllm.integrations.errors import renamed_fields
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

__all__ = ["PoolingPromptRequest", "EmbeddingRequest", "context_param", "embedding_inputs", "embedding_prompts",
           "embed_all", "embedding_response", "input_prompts", "pooling_usage", "pooling_request_id"]


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
    vLLM's chat default); for input only its default (null or true: they are added) is built."""
    add_generation_prompt: bool = False
    """For messages (vLLM's): end the rendered prompt with the assistant's turn opening."""
    continue_final_message: bool = False
    """For messages (vLLM's): leave the last message open; needs add_generation_prompt false."""
    chat_template_kwargs: dict[str, Any] | None = None
    """For messages (vLLM's): variables for the chat template."""
    chat_template: str | None = None
    """For messages (vLLM's): a Jinja template; only on a server started with --trust-request-chat-template."""


class EmbeddingRequest(PoolingPromptRequest, kw_only=True, forbid_unknown_fields=True):
    """The body of ``POST /v1/embeddings``: `PoolingPromptRequest`'s, and how the embeddings are answered."""

    encoding_format: Literal["float", "base64"] = "float"
    """``"base64"``: each embedding as the base64 text of its little-endian float32 bytes."""
    dimensions: int | None = None
    """Keep the first this many features, then normalize (Matryoshka); at most the model's hidden size."""
    normalize: bool | None = None
    """vLLM's: false returns the raw hidden state; null or left out: the model's default (L2-normalized unless
    the engine's ``pooler_config`` says otherwise)."""


_CHAT_ONLY = ("add_generation_prompt", "continue_final_message", "chat_template_kwargs", "chat_template")
_DEFAULTS = PoolingPromptRequest()
CONTEXT_PARAM = "input_tokens"
"""The ``param`` of a pooling prompt past max_model_len: vLLM's (its ``VLLMValidationError`` parameter since 0.12;
0.11 and earlier name none)."""


@contextlib.contextmanager
def context_param() -> Iterator[None]:
    """A context-length error (code ``context_length_exceeded``) raised inside names `CONTEXT_PARAM`, whichever
    field the engine found it in (``prompt``, a chat's ``messages``): the pooling routes' errors, as vLLM's."""
    try:
        yield
    except InvalidRequestError as exc:
        if exc.code != CONTEXT_LENGTH_EXCEEDED or exc.field == CONTEXT_PARAM:
            raise
        raise InvalidRequestError(CONTEXT_PARAM, exc.message, code=exc.code) from None


def embedding_inputs(req: PoolingPromptRequest, limits: ServerLimits,
                     task: str = "embed") -> list[str | list[int]] | None:
    """The engine prompts of ``input`` (at most `limits.max_prompts`); None for a request with ``messages``
    (the server renders them). A request with both, neither, or an empty input is a 400 (the latter naming the
    `task` served: /pooling's), as is a chat-only field with ``input`` (``add_special_tokens`` false is not built
    there)."""
    if (req.input is None) == (req.messages is None):
        raise InvalidRequestError("input", "give input or messages (one of them)")
    if req.messages is not None:
        return None
    chat_only = [name for name in _CHAT_ONLY if getattr(req, name) != getattr(_DEFAULTS, name)]
    if chat_only:
        raise InvalidRequestError(chat_only[0], "applies to messages only, not to input")
    if req.add_special_tokens is False:
        raise InvalidRequestError("add_special_tokens", "false is not built in asyncllm for input (only for "
                                                        "messages): an input's tokens get the tokenizer's special "
                                                        "tokens, as vLLM's default")
    return input_prompts(req.input, limits, task)


def input_prompts(value: str | list[Any], limits: ServerLimits, task: str) -> list[str | list[int]]:
    """A pooling request's ``input`` as engine prompts (`completion_prompts`); an empty string is a 400 saying there
    is nothing to `task` (embed, classify)."""
    prompts = completion_prompts(value, limits, field="input")
    if any(prompt == "" for prompt in prompts):
        raise InvalidRequestError("input", f"an input is an empty string: there is nothing to {task}")
    return prompts


async def embedding_prompts(server: OpenAIServer, req: PoolingPromptRequest, task: str = "embed",
                            api: str = "embed") -> list[str | list[int]]:
    """`embedding_inputs`, or the request's ``messages`` rendered by the server (BOS and the like on top of the
    template's with ``add_special_tokens`` true) and cut to ``truncate_prompt_tokens`` as a text input is: their
    first k tokens (vLLM's ``_preprocess_chat``; `truncated_prompt`). `api` names the route in a context-length
    error (`errors.POOLING_OPERATIONS`: /pooling's "embedding generation" whatever its `task`)."""
    prompts = embedding_inputs(req, server.limits, task)
    if prompts is not None:
        return prompts
    with context_param():  # the engine started
        token_ids = await chat_tokens(server, req, add_special_tokens=bool(req.add_special_tokens),
                                      operation=POOLING_OPERATIONS[api],
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
    field (``input`` or ``messages``), a context-length error's `CONTEXT_PARAM` (``input_tokens``, vLLM's).
    """
    pooling = pooling_params(req)
    log_under(request_log, request_id or f"embd-{uuid.uuid4().hex}", prompts, pooling, lora)
    options = {**request_options(req), "truncate_prompt_tokens": req.truncate_prompt_tokens, "lora_request": lora}
    try:
        with renamed_fields({"prompt": "input" if req.messages is None else "messages"}, uncoded_only=True), \
                context_param(), admission_group(len(prompts)):  # (`guard`) may pass the limits by its prompts
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
    return {"id": response_id or f"embd-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": model,
            "data": data, "usage": pooling_usage(outputs)}


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


def encode_embedding(embedding: list[float], encoding_format: str) -> list[float] | str:
    """The floats, or for ``"base64"`` the base64 text of their little-endian float32 bytes (OpenAI's)."""
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(embedding)}f", *embedding)).decode("ascii")
    return embedding
