"""Pooling requests (embed, classify) of chat messages rendered by the engine, media parts and all.

vLLM's pooling routes take chat ``messages`` whose content holds ``image_url`` (and video / audio) parts: the
chat is rendered with its media by the model's multimodal processor, as a chat completion's is, and pooled
(docs/embeddings.md#multimodal-inputs). Here such a chat runs as `AsyncEngine.chat` renders it, on the processor
thread (asyncllm/mm/host.py), with the request's pooling params: the embedding is the pooled final hidden states of
the rendered prompt, image placeholders included. A text-only chat needs none of this (the OpenAI server renders it
to token ids itself: integrations/openai_embeddings.py).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from asyncllm.engine.stream import RequestOptions
from asyncllm.pooling import ClassificationOutput, EmbeddingOutput, PoolingParams

if TYPE_CHECKING:
    from asyncllm.engine.async_engine import AsyncEngine

__all__ = ["embed_chat", "classify_chat"]


async def embed_chat(engine: AsyncEngine, messages: list[dict[str, Any]], pooling: PoolingParams | None,
                     options: RequestOptions, truncate_prompt_tokens: int | None = None) -> EmbeddingOutput:
    """The embedding of `messages` rendered as `AsyncEngine.chat` renders them (`options`: its chat options,
    ``chat_template_kwargs``, ``mm_processor_kwargs``, ...), pooled as `AsyncEngine.embed` pools a prompt."""
    pooling = PoolingParams() if pooling is None else pooling
    options = dataclasses.replace(options, pooling=pooling)
    collector = await engine._pool(messages, options, truncate_prompt_tokens, chat=True)
    return EmbeddingOutput(collector.request_id, collector.prompt_token_ids, collector.embedding,
                           collector.metrics, collector.num_cached_tokens)


async def classify_chat(engine: AsyncEngine, messages: list[dict[str, Any]], options: RequestOptions,
                        truncate_prompt_tokens: int | None = None) -> ClassificationOutput:
    """`AsyncEngine.classify` of `messages` rendered as `embed_chat`'s."""
    from asyncllm.engine.scoring import classify

    return await classify(engine, messages, options, truncate_prompt_tokens, chat=True)
