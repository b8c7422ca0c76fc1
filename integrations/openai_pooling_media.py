"""Pooling requests' chat ``messages`` with media parts (``image_url``, vLLM's ``video_url`` / ``audio_url``,
``input_audio``): /v1/embeddings, /classify and /pooling, as vLLM serves them for a multimodal model.

A chat whose messages hold no media is rendered to token ids by the server (openai_embeddings.py's
`embedding_prompts`). One with media is sent to the engine as chat messages (`MediaChat`), which renders it with its
media by the model's multimodal processor, as a chat completion's, and pools it (asyncllm/engine/pooling_chat.py).
The media urls are checked as a chat completion's (openai_messages.py: ``data:`` URLs, ``file://`` under
``--allowed-local-media-path``); a bad one, media on a model that takes none, ``truncate_prompt_tokens`` or
``add_special_tokens`` true with media are 400s naming the field.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from asyncllm.engine.pooling_chat import classify_chat, embed_chat
from asyncllm.engine import scoring
from asyncllm.engine.stream import RequestOptions
from asyncllm.errors import InvalidRequestError
from asyncllm.pooling import PER_TOKEN_TASKS
from asyncllm.integrations.openai_messages import chat_messages, has_media_parts

if TYPE_CHECKING:
    from collections.abc import Awaitable

    from asyncllm.engine.async_engine import AsyncEngine
    from asyncllm.integrations.openai_embeddings import PoolingPromptRequest
    from asyncllm.integrations.openai_server import OpenAIServer
    from asyncllm.pooling import ClassificationOutput, EmbeddingOutput, PoolingParams

__all__ = ["MediaChat", "media_chat", "logged_prompts", "embed_one", "classify_one"]


@dataclass(frozen=True)
class MediaChat:
    """A pooling request's chat with media parts, as the engine's chat takes it."""

    messages: list[dict[str, Any]]
    """The messages (openai_messages.py's `chat_messages` with media)."""
    options: dict[str, Any]
    """The chat's engine options (`RequestOptions`' ``chat_template_kwargs``, ``chat_template``,
    ``mm_processor_kwargs``, ``chat_template_content_format``, ``add_special_tokens``)."""


def media_chat(server: OpenAIServer, req: PoolingPromptRequest) -> MediaChat | None:
    """The request's ``messages`` as a `MediaChat` when they hold a media part; None otherwise."""
    if req.messages is None or not has_media_parts(req.messages):
        return None
    messages = chat_messages(req.messages, images=True, media_root=server.limits.allowed_local_media_path)
    options = {"chat_template_kwargs": server.templates.kwargs(req),
               "chat_template": server.templates.pick(req.chat_template),
               "mm_processor_kwargs": req.mm_processor_kwargs, "chat_template_content_format": server.content_format,
               "add_special_tokens": req.add_special_tokens}  # true: refused by the engine (its default only)
    return MediaChat(messages, options)


def logged_prompts(prompts: list[Any]) -> list[Any]:
    """The prompts as the request log takes them (a `MediaChat` as its messages: each media part as its type)."""
    return [prompt.messages if isinstance(prompt, MediaChat) else prompt for prompt in prompts]


def embed_one(engine: AsyncEngine, prompt: Any, pooling: PoolingParams,
              options: dict[str, Any]) -> Awaitable[EmbeddingOutput]:
    """`AsyncEngine.embed` of a prompt, or `embed_chat` of a `MediaChat` (`options`: embed's keyword arguments);
    `AsyncEngine.encode` of a prompt for a per-token ``pooling.task`` (/pooling's ``token_embed`` and
    ``token_classify``)."""
    if pooling.task in PER_TOKEN_TASKS:
        if isinstance(prompt, MediaChat):
            raise InvalidRequestError("messages", f"task {pooling.task!r} with media parts in messages is not built "
                                                  "in asyncllm (text messages and input are)")
        return engine.encode(prompt, pooling, pooling_task=pooling.task, **options)
    if not isinstance(prompt, MediaChat):
        return engine.embed(prompt, pooling, **options)
    options = {**options, **prompt.options}
    truncate = options.pop("truncate_prompt_tokens", None)
    return embed_chat(engine, prompt.messages, pooling, RequestOptions(**options), truncate)


def classify_one(engine: AsyncEngine, prompt: Any, options: RequestOptions,
                 truncate: int | None) -> Awaitable[ClassificationOutput]:
    """`scoring.classify` of a prompt, or `classify_chat` of a `MediaChat`."""
    if not isinstance(prompt, MediaChat):
        return scoring.classify(engine, prompt, options, truncate)
    return classify_chat(engine, prompt.messages, dataclasses.replace(options, **prompt.options), truncate)
