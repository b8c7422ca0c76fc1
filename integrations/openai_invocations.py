"""SageMaker's ``POST /invocations`` (as vLLM's): the body's keys choose the route, the served model's tasks where
two could take it (``input`` is a classification on a classifier, an embedding on any other model)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from asyncllm.errors import InvalidRequestError
from asyncllm.integrations.openai_pooling import model_pooling_tasks

if TYPE_CHECKING:
    from starlette.requests import Request
    from starlette.responses import Response

    from asyncllm.integrations.openai_server import OpenAIServer

__all__ = ["invocation_route"]

Route = Callable[["Request", bytes], Awaitable["Response"]]


async def invocation_route(server: OpenAIServer, body: Any) -> Route:
    """The route a SageMaker body goes to: ``messages`` a chat completion, ``prompt`` a completion, ``text_1`` and
    ``text_2`` a score, ``query`` and ``documents`` a rerank, ``input`` a classification on a classifier or else an
    embedding; any other body a 400 naming them."""
    keys = set(body) if isinstance(body, dict) else set()
    handlers = server.score_handlers
    if "messages" in keys:
        return server.chat_completions
    if "prompt" in keys:
        return server.completions
    if {"text_1", "text_2"} <= keys:
        return handlers.score
    if {"query", "documents"} <= keys:
        return handlers.rerank
    if "input" in keys:
        await server.engine.start()
        return handlers.classify if "classify" in model_pooling_tasks(server.engine) else server.embeddings
    raise InvalidRequestError("body", "an invocation has 'messages' (a chat completion), 'prompt' (a completion), "
                                      "'input' (embeddings, or a classification on a classifier), 'text_1' and "
                                      "'text_2' (a score) or 'query' and 'documents' (a rerank)")
