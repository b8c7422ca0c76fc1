"""An OpenAI-compatible ASGI app (Starlette) over one `AsyncEngine`.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with SSE
streaming and ``stream_options.include_usage``, and vLLM's ``use_beam_search``,
openai_beam_search.py), ``POST /v1/responses`` (OpenAI's Responses API,
responses_api.py; kept responses, ``GET /v1/responses/{id}``, with
ASYNCLLM_ENABLE_RESPONSES_API_STORE: responses_store.py), ``POST /v1/embeddings``
(of ``input`` or, as vLLM's, of chat ``messages``; openai_embeddings.py), ``GET /v1/models``, vLLM's
``POST /tokenize`` and ``POST /detokenize``, ``GET /version``,
vLLM's ``POST /classify``, ``/score`` and ``/rerank`` (openai_score.py),
``GET /health`` (and SageMaker's ``/ping``, with ``POST /invocations``),
``GET /metrics`` (Prometheus text), and with
ASYNCLLM_ALLOW_RUNTIME_LORA_UPDATING vLLM's ``POST /v1/load_lora_adapter``
and ``POST /v1/unload_lora_adapter``. A request whose ``model`` is a LoRA
module's name (``--lora-modules``) runs with that adapter. Chat completions take
``tools`` and ``tool_choice`` (openai_tools.py); ``"auto"`` needs the app made
with a `tool_call_parser`; a `reasoning_parser` splits replies into
``reasoning`` and ``content`` (openai_reply.py). Errors are OpenAI-style
bodies ``{"error": {"message", "type", "param", "code"}}`` with the status
of the asyncllm error (400 invalid request, 401 bad API key, 404 unknown model
or route, 413 body too large, 429 engine overloaded, 503 engine dead). A
client that disconnects aborts its requests in the engine, streaming or not.

``asyncllm serve`` runs this app with uvicorn; ``create_app(engine)`` mounts
it in any ASGI server.
"""

from __future__ import annotations

import functools
import hmac
import logging
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import anyio
import msgspec
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from asyncllm import envs
from asyncllm.errors import AsyncLLMError, InvalidRequestError
from asyncllm.integrations.errors import ApiError, error_body
from asyncllm.integrations.openai_beam_search import beam_search_response
from asyncllm.integrations.openai_embeddings import EmbeddingRequest, embed_all, embedding_inputs, embedding_response
from asyncllm.integrations.openai_lora import LoadLoRAAdapterRequest, LoRAModels, LoRAModule, UnloadLoRAAdapterRequest
from asyncllm.integrations.openai_messages import chat_messages
from asyncllm.integrations.openai_protocol import (
    ChatCompletionRequest, ChatTemplates, CompletionRequest, ServerLimits, TokenizeRequest,
    chat_params, completion_params, completion_prompts, decode_request, echo_only, header_data_parallel_rank,
    request_options, response_id, sets_max_tokens, take_request_id, template_kwargs,
)
from asyncllm.integrations.openai_responses import Choices, chat_chunk, chat_stream_choices, sse_event, token_id_text
from asyncllm.integrations.openai_score import score_routes
from asyncllm.integrations.openai_tokenize import tokenize_routes
from asyncllm.integrations.openai_audio import audio_routes
from asyncllm.integrations.openai_dev import dev_routes
from asyncllm.integrations.openai_tools import tool_mode
from asyncllm.integrations.responses_api import ResponseEvents, ResponsesRequest, response_body
from asyncllm.integrations.responses_store import ResponseStore
from asyncllm.integrations.starlette import engine_lifespan, wait_disconnect
from asyncllm.integrations.streams import ClientDisconnected, first_deltas, merge_streams
from asyncllm.lora import LoRARequest
from asyncllm.reasoning import ReasoningParser, get_reasoning_parser
from asyncllm.integrations.openai_prompt_embeds import completion_embeds_prompts
from asyncllm.tokenizer import apply_chat_template, load_chat_template
from asyncllm.tool_calls import ToolParser, check_parser_pair, get_tool_parser

if TYPE_CHECKING:
    from asyncllm.engine.async_engine import AsyncEngine
    from asyncllm.engine.stream import RequestStream

__all__ = ["create_app", "OpenAIServer", "ServerLimits"]

logger = logging.getLogger("asyncllm.integrations.openai")


def create_app(engine: AsyncEngine | None = None, *, model_name: str | Sequence[str] | None = None,
               api_key: str | None = None,
               limits: ServerLimits | None = None, manage_engine: bool = True,
               tool_call_parser: str | None = None, chat_template: str | None = None,
               trust_request_chat_template: bool = False, reasoning_parser: str | None = None,
               lora_modules: Sequence[LoRAModule] = (), return_tokens_as_token_ids: bool = False) -> Starlette:
    """The app; `engine` defaults to one over the bundled tiny model.

    `model_name` is the id clients pass as ``model`` (default: the model as
    configured, or ``asyncllm-tiny`` for the bundled one); several names are
    all accepted, and responses carry the first (vLLM's ``--served-model-name
    a b``). With `manage_engine`
    the app's lifespan starts the engine and closes it at shutdown.
    `tool_call_parser` (``"hermes"``, ``"llama3_json"``, ``"openai"``, ...) enables
    ``tool_choice: "auto"`` (vLLM's ``--enable-auto-tool-choice --tool-call-parser``).
    `chat_template` (a file path or the Jinja text) replaces the tokenizer's
    for every chat request; a request's own ``chat_template`` is taken only
    with `trust_request_chat_template` (vLLM's flags of the same names).
    `reasoning_parser` (``"deepseek_r1"``, ``"qwen3"``, ``"openai_gptoss"``) splits chat replies
    into ``reasoning`` and ``content`` (vLLM's ``--reasoning-parser``).
    `lora_modules` are LoRA adapters served as models of their own (vLLM's
    ``--lora-modules``; the engine needs enable_lora): a request naming one
    as ``model`` runs with it; the app's startup checks each with
    `AsyncEngine.add_lora`. ASYNCLLM_ALLOW_RUNTIME_LORA_UPDATING adds the
    routes that load and unload adapters while serving. `return_tokens_as_token_ids` names logprobs' tokens
    ``token_id:N`` instead of their text (vLLM's flag: for tokens that are not whole characters).
    """
    parser = get_tool_parser(tool_call_parser) if tool_call_parser is not None else None
    check_parser_pair(parser, reasoning_parser)  # openai (gpt-oss's harmony) reads after openai_gptoss
    templates = ChatTemplates(load_chat_template(chat_template) if chat_template is not None else None,
                              trust_request_chat_template)
    if engine is None:
        from asyncllm import AsyncEngine

        engine = AsyncEngine(disable_log_stats=True)
    names = [model_name] if isinstance(model_name, str) else list(model_name or [])
    server = OpenAIServer(engine, names or [_served_name(engine.config.model)], api_key, limits or ServerLimits(),
                          parser, templates, get_reasoning_parser(reasoning_parser) if reasoning_parser else None,
                          lora_modules=lora_modules, runtime_lora=envs.ALLOW_RUNTIME_LORA_UPDATING.get(),
                          token_ids_as_text=return_tokens_as_token_ids)
    return server.app(manage_engine)


def _served_name(model: str) -> str | None:
    """The bundled model's short name; None for an engine attached to a shared core (its model is known
    once attached); else the model as configured (before the engine resolves it to a folder)."""
    from asyncllm.bundled import BUNDLED_MODEL_NAME, bundled_model_path

    if model.startswith("ipc://"):
        return None
    try:
        return BUNDLED_MODEL_NAME if model == bundled_model_path() else model
    except AsyncLLMError:  # no bundled model in this install
        return model


class OpenAIServer:
    """The route handlers; one per app."""

    def __init__(self, engine: AsyncEngine, model_names: list[str | None], api_key: str | None,
                 limits: ServerLimits, tool_parser: ToolParser | None = None,
                 templates: ChatTemplates = ChatTemplates(), reasoning: ReasoningParser | None = None, *,
                 lora_modules: Sequence[LoRAModule] = (), runtime_lora: bool = False,
                 token_ids_as_text: bool = False) -> None:
        self.engine = engine
        self.token_ids_as_text = token_ids_as_text
        """Logprobs name tokens ``token_id:N`` (vLLM's --return-tokens-as-token-ids)."""
        self.reasoning = reasoning
        self.templates = templates
        self.tool_parser = tool_parser
        """Reads the calls of ``tool_choice: "auto"`` replies; None: "auto" is refused."""
        self._model_names = model_names
        """The names clients may send as ``model``; [None] until a shared core's model is known."""
        self.limits = limits
        self._api_key = api_key.encode() if api_key else None
        self._created = int(time.time())
        self.runtime_lora = runtime_lora
        """Whether the load/unload adapter routes exist (ASYNCLLM_ALLOW_RUNTIME_LORA_UPDATING)."""
        self.loras = LoRAModels(lora_modules, [name for name in model_names if name is not None])
        self.responses_store = ResponseStore.from_env()  # ASYNCLLM_ENABLE_RESPONSES_API_STORE (responses_store.py)

    @property
    def model_names(self) -> list[str]:
        """The ids clients may send as ``model``; responses carry the first."""
        if self._model_names == [None]:  # attached to a shared core: name it after what the core serves
            return [_served_name(self.engine.config.model) or self.engine.config.model]
        return [name for name in self._model_names if name is not None]

    @property
    def model_name(self) -> str:
        """The id responses carry."""
        return self.model_names[0]

    def app(self, manage_engine: bool = True) -> Starlette:
        """The Starlette app; with `manage_engine` its lifespan starts and closes the engine. Its startup
        checks the LoRA modules (`check_lora_modules`)."""
        routes = [
            Route("/v1/completions", self._guarded(self.completions), methods=["POST"]),
            Route("/v1/chat/completions", self._guarded(self.chat_completions), methods=["POST"]),
            Route("/v1/responses", self._guarded(self.responses), methods=["POST"]),
            *self.responses_store.routes(self._guarded),  # GET/DELETE /v1/responses/{id}, POST .../cancel
            Route("/v1/embeddings", self._guarded(self.embeddings), methods=["POST"]),
            *score_routes(self),  # vLLM's /classify, /score, /rerank (openai_score.py)
            Route("/v1/models", self._guarded(self.models), methods=["GET"]),
            *tokenize_routes(self),  # vLLM's /tokenize, /detokenize (openai_tokenize.py)
            *audio_routes(self),  # OpenAI's /v1/audio/transcriptions, /translations (openai_audio.py)
            Route("/version", self.version, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/ping", self.health, methods=["GET", "POST"]),
            Route("/invocations", self._guarded(self.invocations), methods=["POST"]),
            Route("/metrics", self.metrics, methods=["GET"]),
        ]
        if self.runtime_lora:
            logger.warning("runtime LoRA updating is on (%s): API clients may load adapters from this server's "
                           "disk or the hub; serve trusted clients only", envs.ALLOW_RUNTIME_LORA_UPDATING.name)
            routes += [
                Route("/v1/load_lora_adapter", self._guarded(self.load_lora_adapter), methods=["POST"]),
                Route("/v1/unload_lora_adapter", self._guarded(self.unload_lora_adapter), methods=["POST"]),
            ]
        if envs.SERVER_DEV_MODE.get():
            routes += dev_routes(self)
        app = Starlette(routes=routes, lifespan=self._lifespan(manage_engine),
                        exception_handlers={404: _not_found, 405: _not_allowed})
        app.state.openai_server = self
        return app

    def _lifespan(self, manage_engine: bool) -> Any:
        """The engine's lifespan (`manage_engine`) with the LoRA modules checked at startup; None: neither."""
        if not self.loras.loras:
            return engine_lifespan(self.engine) if manage_engine else None
        engine_life = engine_lifespan(self.engine) if manage_engine else None

        @asynccontextmanager
        async def lifespan(app: Starlette) -> AsyncIterator[dict[str, Any] | None]:
            if engine_life is None:
                await self.check_lora_modules()
                yield None
                return
            async with engine_life(app) as state:  # a failed check closes the engine
                await self.check_lora_modules()
                yield state

        return lifespan

    async def check_lora_modules(self) -> None:
        """Start the engine and check every LoRA module with it (`ConfigError` naming the first bad one)."""
        await self.engine.start()
        await self.loras.check(self.engine, self.model_names)

    # ------------------------------------------------------------ routes
    async def completions(self, request: Request, body: bytes | None = None) -> Response:
        req = decode_request(await self._body(request) if body is None else body, CompletionRequest)
        take_request_id(req, request.headers)
        model, lora = self._model(req.model)
        embeds = None if req.prompt_embeds is None else await completion_embeds_prompts(req, self.limits)
        if req.prompt is None and embeds is None:
            raise InvalidRequestError("prompt", "is required (or vLLM's prompt_embeds)")
        if req.use_beam_search:  # vLLM's beam search (openai_beam_search.py)
            return await beam_search_response(self, request, req, model, lora)
        params = completion_params(req, self.limits, await self._sampling_defaults())
        prompts: list[Any] = embeds if embeds is not None else completion_prompts(req.prompt, self.limits)
        self.limits.check_sequences(len(prompts), params.n)
        rank = header_data_parallel_rank(request.headers)
        streams = [self.engine.stream(prompt, params, **request_options(req), lora_request=lora, data_parallel_rank=rank,
                                      check_max_tokens=sets_max_tokens(req)) for prompt in prompts]
        choices = Choices(len(prompts), params.n, params.logprobs, chat=False, token_text=self._token_text,
                          token_ids_as_text=self.token_ids_as_text,
                          echo_only=echo_only(req), return_prompt_logprobs=req.prompt_logprobs is not None,
                          return_token_ids=req.return_token_ids)
        return await self._respond(request, req, model, streams, choices, "cmpl", "text_completion",
                                   echo=prompts if req.echo else None)

    async def chat_completions(self, request: Request, body: bytes | None = None) -> Response:
        req = decode_request(await self._body(request) if body is None else body, ChatCompletionRequest)
        take_request_id(req, request.headers)
        model, lora = self._model(req.model)
        if req.use_beam_search:
            return await beam_search_response(self, request, req, model, lora)
        streams, choices = self._start_chat(req, lora, await self._sampling_defaults(),
                                            header_data_parallel_rank(request.headers))
        return await self._respond(request, req, model, streams, choices, "chatcmpl", "chat.completion")

    async def embeddings(self, request: Request, body: bytes | None = None) -> Response:
        """OpenAI's: one embedding per ``input``, or (vLLM's) of chat ``messages`` (openai_embeddings.py)."""
        req = decode_request(await self._body(request) if body is None else body, EmbeddingRequest)
        model, lora = self._model(req.model)
        prompts = embedding_inputs(req, self.limits)
        if prompts is None:
            prompts = [await self._chat_tokens(req)]
        outputs = await embed_all(self.engine, prompts, req, lora, until=lambda: wait_disconnect(request))
        return _json(embedding_response(outputs, model, req.encoding_format))

    async def invocations(self, request: Request) -> Response:
        """SageMaker's (as vLLM): a body with ``messages`` is a chat completion, one with ``prompt`` a completion,
        one with ``input`` an embedding."""
        body = await self._body(request)
        try:
            keys = msgspec.json.decode(body)
        except msgspec.DecodeError as exc:
            raise InvalidRequestError("body", f"not valid JSON: {exc}") from None
        if isinstance(keys, dict) and "messages" in keys:
            return await self.chat_completions(request, body)
        if isinstance(keys, dict) and "prompt" in keys:
            return await self.completions(request, body)
        if isinstance(keys, dict) and "input" in keys:
            return await self.embeddings(request, body)
        raise InvalidRequestError("body", "an invocation has 'messages' (a chat completion), 'prompt' (a completion) "
                                          "or 'input' (embeddings)")

    async def responses(self, request: Request) -> Response:
        """OpenAI's Responses API over a chat completion (responses_api.py)."""
        req = decode_request(await self._body(request), ResponsesRequest)
        model, lora = self._model(req.model)
        turn = self.responses_store.begin(req)  # store and previous_response_id resolved (responses_store.py)
        streams, choices = self._start_chat(turn.chat_request(), lora, await self._sampling_defaults(),
                                            header_data_parallel_rank(request.headers))
        if req.stream:
            firsts = await first_deltas(streams)  # errors before the first token keep their status code
            _count_prompts(streams, choices)
            events = ResponseEvents(turn.req, model, on_finish=turn.keep)  # kept before its last event is sent
            return StreamingResponse(self._response_events(request, events, streams, firsts, choices),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        async for prompt_index, delta in merge_streams(streams, until=lambda: wait_disconnect(request)):
            choices.add(prompt_index, delta)
        _count_prompts(streams, choices)
        choice = choices.final_choices()[0]
        return _json(turn.keep(response_body(turn.req, model, choice["message"], choice["finish_reason"], choices.usage())))

    async def _sampling_defaults(self) -> dict[str, Any]:
        """The engine's default sampling fields (the model's generation config) for fields a request leaves unset."""
        if not self.engine.started:
            await self.engine.start()
        return self.engine.default_sampling_fields()

    def _start_chat(self, req: ChatCompletionRequest, lora: LoRARequest | None, defaults: dict[str, Any],
                    data_parallel_rank: int | None = None) -> tuple[list[RequestStream], Choices]:
        mode = tool_mode(req.tools, req.tool_choice, req.parallel_tool_calls, self.tool_parser)
        if mode.constraint is not None and self.reasoning is not None and not self.reasoning.forced_tool_calls:
            raise InvalidRequestError("tool_choice", "a named or 'required' choice is not built with this reasoning "
                                      "parser (gpt-oss writes a call as a message of its own); use 'auto'")
        params = chat_params(req, self.limits, mode.constraint, defaults)
        if mode.parser is not None and mode.parser.needs_special_tokens:  # its calls open with a special token
            params.skip_special_tokens = False
        if self.reasoning is not None and self.reasoning.needs_special_tokens:  # harmony's channel markers
            params.skip_special_tokens = False
        if self.reasoning is not None and params.structured is not None:  # think freely, then follow the grammar
            params.structured = msgspec.structs.replace(params.structured, start_after=self.reasoning.end_tag)
        streams = [self.engine.chat(chat_messages(req.messages, images=True), params, **request_options(req),
                                    chat_template_kwargs=template_kwargs(req), tools=req.tools,
                                    chat_template=self.templates.pick(req.chat_template), lora_request=lora,
                                    data_parallel_rank=data_parallel_rank, mm_processor_kwargs=req.mm_processor_kwargs,
                                    check_max_tokens=sets_max_tokens(req))]
        choices = Choices(1, params.n, params.logprobs, chat=True, tool_mode=mode, reasoning=self.reasoning,
                          token_ids_as_text=self.token_ids_as_text,
                          return_prompt_logprobs=req.prompt_logprobs is not None,
                          include_reasoning=req.include_reasoning, return_token_ids=req.return_token_ids)
        return streams, choices

    async def models(self, request: Request) -> Response:
        """The served names, then each LoRA module with its path as ``root`` and its base model as ``parent``."""
        cards = [self._model_card(name, self.engine.config.model) for name in self.model_names]
        cards += [self._model_card(name, served.request.lora_path, served.parent or self.model_name)
                  for name, served in list(self.loras.loras.items())]
        return _json({"object": "list", "data": cards})

    def _model_card(self, name: str, root: str, parent: str | None = None) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": self._created, "owned_by": "asyncllm", "root": root,
                "parent": parent, "max_model_len": self.engine.config.max_model_len}

    async def load_lora_adapter(self, request: Request) -> Response:
        """vLLM's: serve the adapter at ``lora_path`` as the model ``lora_name`` (openai_lora.py)."""
        req = decode_request(await self._body(request), LoadLoRAAdapterRequest)
        lora = await self.loras.load(self.engine, req, self.model_names)
        logger.info("loaded LoRA adapter %r from %s (id %d)", lora.lora_name, lora.lora_path, lora.lora_int_id)
        return _text(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    async def unload_lora_adapter(self, request: Request) -> Response:
        """vLLM's: stop serving the model ``lora_name`` (404 if no adapter has that name)."""
        req = decode_request(await self._body(request), UnloadLoRAAdapterRequest)
        await self.loras.unload(req)
        logger.info("unloaded LoRA adapter %r", req.lora_name)
        return _text(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")

    async def version(self, request: Request) -> Response:
        from asyncllm import __version__

        return _json({"version": __version__})

    async def _chat_tokens(self, req: TokenizeRequest | EmbeddingRequest | ChatCompletionRequest,
                           tools: list[Any] | None = None) -> list[int]:
        """A request's ``messages`` rendered with the chat template (the server's, or the request's when trusted)
        and tokenized, on a worker thread: the ids the engine's chat would run."""
        tokenizer = await self._tokenizer()
        render = functools.partial(apply_chat_template, tokenizer, chat_messages(req.messages),
                                   template_kwargs=template_kwargs(req), tools=tools,
                                   chat_template=self.templates.pick(req.chat_template))
        return await anyio.to_thread.run_sync(render)

    async def _tokenizer(self) -> Any:
        """The engine's tokenizer (the engine starts on first use, as it does for a completion)."""
        if not self.engine.started:
            await self.engine.start()
        if self.engine.tokenizer is None:
            raise InvalidRequestError("tokenizer", "this server loads none (--skip-tokenizer-init): it takes and "
                                                   "returns token ids only")
        return self.engine.tokenizer

    async def health(self, request: Request) -> Response:
        """200 while the engine serves; 503 once it died or was closed (or before it started)."""
        alive = self.engine.started and self.engine.stats().engine_alive
        return _json({"status": "ok" if alive else "unavailable"}, 200 if alive else 503)

    async def metrics(self, request: Request) -> Response:
        registry = getattr(self.engine, "metrics_registry", None)
        if registry is None:
            return error_response(ApiError(404, "this engine exports no Prometheus metrics", "not_found_error"))
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    # ------------------------------------------------------------ shared steps
    def _guarded(self, handler: Any) -> Any:
        """API-key check and error mapping around a /v1 handler."""

        async def guarded(request: Request) -> Response:
            try:
                self._check_api_key(request)
                return await handler(request)
            except (AsyncLLMError, ApiError) as exc:
                return error_response(exc)
            except ClientDisconnected:
                return Response(status_code=499)  # nobody reads it: the client is gone, its requests aborted
            except Exception as exc:  # noqa: BLE001 - an OpenAI-style 500 instead of a bare one; logged
                logger.exception("unexpected error in %s", request.url.path)
                return error_response(ApiError(500, f"internal error: {type(exc).__name__}", "server_error"))

        return guarded

    def _check_api_key(self, request: Request) -> None:
        if self._api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self._api_key):
            raise ApiError(401, "missing or wrong API key (send 'Authorization: Bearer KEY')",
                           "authentication_error", code="invalid_api_key")

    async def _body(self, request: Request) -> bytes:
        limit = self.limits.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise _too_large(limit)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(limit)
            chunks.append(chunk)
        return b"".join(chunks)

    async def _echo(self, choices: Choices, streams: list[RequestStream], prompts: list[str | list[int]],
                    firsts: list[Any] = ()) -> list[tuple[int, dict[str, Any] | None, str]]:
        """Completions' ``echo``: each prompt (its text, and its logprobs when asked) before its choices.

        Streaming, `firsts` (the streams' first deltas, not yet added) carry the
        prompts' logprobs; the result is one (choice index, logprobs, text) per
        choice for the first chunks.
        """
        out = []
        for i, (stream, prompt) in enumerate(zip(streams, prompts)):
            if i < len(firsts) and firsts[i].prompt_logprobs is not None:
                choices.prompt_logprobs[i] = firsts[i].prompt_logprobs
            token_ids = stream.collector.prompt_token_ids if stream.collector is not None else []
            if isinstance(prompt, str):
                text = prompt
            elif self.engine.tokenizer is None:  # --skip-tokenizer-init: no text for ids
                text = ""
            else:  # token ids: their text, decoded off the event loop
                text = await anyio.to_thread.run_sync(self.engine.tokenizer.decode, token_ids)
            out += [(index, logprobs, text) for index, logprobs in choices.echo(i, text, token_ids)]
        return out

    def _token_text(self, token_id: int) -> str:
        """A logprobs entry's token: its text, or vLLM's ``token_id:N`` (without a tokenizer, or asked for)."""
        if self.engine.tokenizer is None or self.token_ids_as_text:
            return token_id_text(token_id)
        return self.engine.tokenizer.decode([token_id], skip_special_tokens=False)

    def _model(self, model: str | None) -> tuple[str, LoRARequest | None]:
        """The name a response carries and the adapter a request runs with: a served name (or none) is the
        base model, a LoRA module's name its adapter; any other name is a 404."""
        if not model or model in self.model_names:  # "" too, as vLLM
            return self.model_name, None
        lora = self.loras.get(model)
        if lora is None:
            raise ApiError(404, f"the model {model!r} does not exist; this server serves "
                                f"{self.model_names + list(self.loras.loras)}",
                           "not_found_error", param="model", code="model_not_found")
        return model, lora

    async def _respond(self, request: Request, req: Any, model: str, streams: list[RequestStream], choices: Choices,
                       id_prefix: str, kind: str, echo: list[str | list[int]] | None = None) -> Response:
        chunk_kind = kind + ".chunk" if choices.chat else kind
        meta = {"id": response_id(id_prefix, req), "object": chunk_kind if req.stream else kind,
                "created": int(time.time()), "model": model}
        if req.stream:
            firsts = await first_deltas(streams)  # errors before the first token keep their status code
            _count_prompts(streams, choices)
            echoed = await self._echo(choices, streams, echo, firsts) if echo is not None else []
            options = req.stream_options
            usage = "none" if options is None or not options.include_usage else (
                "continuous" if options.continuous_usage_stats else "last")
            events = self._sse(request, streams, firsts, choices, meta, usage, echoed)
            return StreamingResponse(events, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        async for prompt_index, delta in merge_streams(streams, until=lambda: wait_disconnect(request)):
            choices.add(prompt_index, delta)
        _count_prompts(streams, choices)
        if echo is not None:
            await self._echo(choices, streams, echo)
        return _json({**meta, "choices": choices.final_choices(), "usage": choices.usage(), **choices.response_fields()})

    async def _response_events(self, request: Request, events: ResponseEvents, streams: list[RequestStream],
                               firsts: list[Any], choices: Choices) -> AsyncIterator[bytes]:
        for event in events.start():
            yield event
        try:
            async for prompt_index, delta in merge_streams(streams, firsts, until=lambda: wait_disconnect(request)):
                index, _ = choices.add(prompt_index, delta)
                parts, finish_reason = choices.chat_deltas(index, delta.text, delta.finish_reason)
                for event in events.feed(parts):
                    yield event
                if finish_reason is not None:
                    for event in events.finish(finish_reason, choices.usage()):
                        yield event
        except AsyncLLMError as exc:  # after the first event the status is sent: report in the stream
            yield events.error(error_body(exc)[1]["error"])
        except ClientDisconnected:
            return

    async def _sse(self, request: Request, streams: list[RequestStream], firsts: list[Any], choices: Choices,
                   meta: dict[str, Any], usage: str,
                   echoed: list[tuple[int, dict[str, Any] | None, str]]) -> AsyncIterator[bytes]:
        """The chunks; `usage` is "none", "last" (a final usage chunk, null in the others) or "continuous"
        (vLLM's continuous_usage_stats: every chunk has the usage so far, then the final chunk)."""

        def chunk(choice: dict[str, Any]) -> bytes:
            extra = {} if usage == "none" else {"usage": choices.usage() if usage == "continuous" else None}
            return sse_event({**meta, "choices": [choice], **extra})

        try:
            if choices.chat:
                for index in range(len(choices.prompt_tokens) * choices.n):
                    yield chunk(chat_chunk(index, {"role": "assistant", "content": ""}))
            for index, logprobs, text in echoed:
                yield chunk({"index": index, "text": text, "logprobs": logprobs, "finish_reason": None,
                             "stop_reason": None})
            async for prompt_index, delta in merge_streams(streams, firsts, until=lambda: wait_disconnect(request)):
                index, logprobs = choices.add(prompt_index, delta)
                if choices.chat:
                    for choice in chat_stream_choices(choices, index, delta, logprobs):
                        yield chunk(choice)
                elif delta.text or delta.finish_reason is not None or logprobs is not None:
                    yield chunk({"index": index, "text": delta.text, "logprobs": logprobs,
                                 "finish_reason": delta.finish_reason, "stop_reason": delta.stop_reason})
            if usage != "none":
                yield sse_event({**meta, "choices": [], "usage": choices.usage()})
        except AsyncLLMError as exc:  # after the first token the status is sent: report in the stream
            yield sse_event(error_body(exc)[1])
        except ClientDisconnected:
            return
        yield b"data: [DONE]\n\n"


def _count_prompts(streams: list[RequestStream], choices: Choices) -> None:
    for i, stream in enumerate(streams):
        if stream.collector is not None:
            choices.prompt_tokens[i] = len(stream.collector.prompt_token_ids)
            if choices.return_token_ids:
                choices.prompt_token_ids[i] = list(stream.collector.prompt_token_ids)


def error_response(exc: AsyncLLMError | ApiError) -> Response:
    status, body, headers = error_body(exc)
    return _json(body, status, headers)


def _json(payload: dict[str, Any], status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(msgspec.json.encode(payload), status_code=status, media_type="application/json", headers=headers)


def _text(message: str) -> Response:
    """A plain-text 200, as vLLM answers its adapter routes."""
    return Response(message, media_type="text/plain")


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is larger than {limit} bytes", "invalid_request_error",
                    code="request_too_large")


async def _not_found(request: Request, exc: Exception) -> Response:
    return error_response(ApiError(404, f"no route {request.url.path}", "not_found_error"))


async def _not_allowed(request: Request, exc: Exception) -> Response:
    return error_response(ApiError(405, f"{request.method} is not allowed on {request.url.path}",
                                   "invalid_request_error"))
