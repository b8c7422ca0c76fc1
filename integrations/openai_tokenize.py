"""vLLM's ``POST /tokenize`` and ``POST /detokenize`` for the OpenAI-compatible server (openai_server.py)."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import anyio
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from asyncllm.engine.chat_bounds import check_chat_size
from asyncllm.engine.pooling_model import lowercases, lowered
from asyncllm.engine.validation import max_prompt_chars
from asyncllm.errors import InvalidRequestError
from asyncllm.integrations.openai_http import json_response
from asyncllm.integrations.openai_messages import chat_messages
from asyncllm.integrations.openai_protocol import DetokenizeRequest, TokenizeRequest, decode_request
from asyncllm.integrations.openai_request_log import log_under, route_id
from asyncllm.integrations.openai_tools import template_tools
from asyncllm.tokenizer import apply_chat_template

if TYPE_CHECKING:
    from asyncllm.integrations.openai_embeddings import PoolingPromptRequest
    from asyncllm.integrations.openai_protocol import ChatCompletionRequest
    from asyncllm.integrations.openai_server import OpenAIServer

__all__ = ["chat_tokens", "tokenize_routes"]


async def chat_tokens(server: OpenAIServer, req: TokenizeRequest | PoolingPromptRequest | ChatCompletionRequest,
                      tools: list[Any] | None = None, add_special_tokens: bool = False, *,
                      operation: str | None = None, cuttable: bool = False) -> list[int]:
    """A request's ``messages`` rendered with the chat template (the server's, or the request's when trusted) and
    tokenized on a worker thread as the engine's chat (`tools` as vLLM dumps them, `add_special_tokens` its).

    Bounded before the template renders them as the engine's chat is (`check_chat_size`; `operation` and `cuttable`
    its): the worker thread holds the GIL while Jinja renders, and 100,000 messages took it for seconds."""
    tokenizer, max_model_len = await server._tokenizer(), server.engine.config.max_model_len
    check_chat_size(tokenizer, req.messages, max_model_len, max_prompt_chars(tokenizer, max_model_len), operation,
                    cuttable)
    render = functools.partial(apply_chat_template, tokenizer, chat_messages(req.messages),
                               template_kwargs=server.templates.kwargs(req), content_format=server.content_format,
                               tools=template_tools(tools), chat_template=server.templates.pick(req.chat_template),
                               lower=lowercases(server.engine.pooling_model), add_special_tokens=add_special_tokens)
    return await anyio.to_thread.run_sync(render)


def tokenize_routes(server: OpenAIServer) -> list[Route]:
    """The two routes, each wrapped in the server's error mapping (the API key is checked before routing)."""

    async def tokenize(request: Request) -> Response:
        """The token ids the engine would run for a prompt or for chat messages (on a worker thread)."""
        req = decode_request(await server._body(request), TokenizeRequest)
        _, lora = server._model(req.model)  # an adapter shares the model's tokenizer
        if (req.prompt is None) == (req.messages is None):
            raise InvalidRequestError("prompt", "give a prompt or messages (one of them)")
        tokenizer = await server._tokenizer()
        if req.prompt is not None:  # lowercased as the engine's text prompts are (vLLM's do_lower_case)
            prompt = lowered(server.engine.pooling_model, req.prompt)
            special = req.add_special_tokens is not False
            tokens = await anyio.to_thread.run_sync(lambda: tokenizer(prompt, add_special_tokens=special).input_ids)
        else:  # as a chat completion's: the tools checked there (`template_tools`), special tokens default false;
            # counted past max_model_len as vLLM's, so bounded by its render alone (`cuttable`)
            tokens = await chat_tokens(server, req, req.tools, bool(req.add_special_tokens), cuttable=True)
        tokens = [int(t) for t in tokens]
        log_under(server.request_log, route_id("tokn", request.headers),  # as vLLM's, once tokenized
                  [{"prompt": req.prompt, "prompt_token_ids": tokens}], None, lora, indexed=False)
        token_strs = tokenizer.convert_ids_to_tokens(tokens) if req.return_token_strs else None  # as vLLM's
        return json_response({"count": len(tokens), "max_model_len": server.engine.config.max_model_len,
                      "tokens": tokens, "token_strs": token_strs})

    async def detokenize(request: Request) -> Response:
        """The text of token ids (special tokens included). Any id the model may generate is taken: one past the
        tokenizer's (a model vocabulary padded beyond it) has no text, as in a completion's, and vLLM's decode."""
        req = decode_request(await server._body(request), DetokenizeRequest)
        _, lora = server._model(req.model)
        log_under(server.request_log, route_id("tokn", request.headers), [{"prompt_token_ids": req.tokens}], None, lora,
                  indexed=False)
        tokenizer = await server._tokenizer()
        known, bound = len(tokenizer), max(len(tokenizer), server.engine.vocab_size)
        bad = [t for t in req.tokens if not 0 <= t < bound]
        if bad:
            raise InvalidRequestError("tokens", f"ids must be in [0, {bound}), got {bad[:5]}")
        ids = [t for t in req.tokens if t < known]
        return json_response({"prompt": await anyio.to_thread.run_sync(tokenizer.decode, ids)})

    return [Route("/tokenize", server._guarded(tokenize), methods=["POST"]),
            Route("/detokenize", server._guarded(detokenize), methods=["POST"])]
