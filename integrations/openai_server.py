"""An OpenAI-compatible ASGI app (Starlette) over one `AsyncEngine`.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with SSE
streaming and ``stream_options.include_usage``, and vLLM's ``use_beam_search``,
openai_beam_search.py), ``POST /v1/responses`` (OpenAI's Responses API,
responses_api.py; kept responses, ``GET /v1/responses/{id}``, with
ASYNCLLM_ENABLE_RESPONSES_API_STORE: responses_store.py), ``POST /v1/embeddings``
(of ``input`` or, as vLLM's, of chat ``messages``; openai_embeddings.py), ``GET /v1/models``, vLLM's
``POST /tokenize`` and ``POST /detokenize``, ``GET /version``,
vLLM's ``POST /classify``, ``/score`` and ``/rerank`` (openai_score.py) and ``/pooling`` (openai_pooling.py),
``GET /health`` (and SageMaker's ``/ping``, with ``POST /invocations``), ``GET /metrics`` (Prometheus text), and with
ASYNCLLM_ALLOW_RUNTIME_LORA_UPDATING vLLM's ``POST /v1/load_lora_adapter``
and ``POST /v1/unload_lora_adapter``. A request whose ``model`` is a LoRA
module's name (``--lora-modules``) runs with that adapter. Chat completions take
``tools`` and ``tool_choice`` (openai_tools.py); ``"auto"`` needs the app made
with a `tool_call_parser`; a `reasoning_parser` splits replies into
``reasoning`` and ``content`` (openai_reply.py). Errors are OpenAI-style
bodies (openai_http.py); without the API key every path but /health, /ping, /metrics and /version is a 401
(openai_auth.py). A client that disconnects aborts its requests in the engine, streaming or not.

``asyncllm serve`` runs this app with uvicorn; ``create_app(engine)`` mounts it in any ASGI server.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import msgspec
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.middleware import Middleware
from starlette.routing import Route

from asyncllm import envs
from asyncllm.engine.admission import admission_group
from asyncllm.errors import InvalidRequestError
from asyncllm.integrations.errors import ApiError, renamed_fields
from asyncllm.integrations.openai_beam_search import beam_search_response
from asyncllm.integrations.openai_embeddings import (EmbeddingRequest, embed_all, embedding_prompts, embedding_response,
                                                    pooling_request_id)
from asyncllm.integrations.openai_invocations import invocation_route
from asyncllm.integrations.openai_lora import LoRAModels, LoRAModule, lora_routes, server_lifespan
from asyncllm.integrations.openai_messages import chat_messages
from asyncllm.integrations.openai_auth import ApiKeyGate
from asyncllm.integrations.openai_http import (
    CorsPolicy, EventStream, RequestIdHeaders, api_key_bytes, guard, json_response, not_allowed, not_found, read_body,
)
from asyncllm.integrations.openai_protocol import (
    ChatCompletionRequest, ChatTemplates, CompletionRequest, ServerLimits, chat_echo, chat_role,
    completion_prompts, decode_request, header_data_parallel_rank, request_options, take_request_id,
)
from asyncllm.integrations.openai_responses import Choices, token_id_text
from asyncllm.integrations.openai_sampling import (chat_field_names, chat_params, completion_params, echo_only,
                                                   sets_max_tokens, with_max_tokens_cap)
from asyncllm.integrations.openai_streaming import count_prompts, respond, response_events
from asyncllm.integrations.openai_score import score_routes
from asyncllm.integrations.openai_pooling import pooling_routes
from asyncllm.integrations.openai_info import info_routes
from asyncllm.integrations.openai_tokenize import tokenize_routes
from asyncllm.integrations.openai_audio import audio_routes
from asyncllm.integrations.openai_dev import dev_routes
from asyncllm.integrations.openai_structured import constraint_errors, constraint_field
from asyncllm.integrations.openai_tools import template_tools, tool_mode
from asyncllm.integrations.responses_api import (ResponseEvents, ResponsesRequest, response_body, response_identity,
                                                 responses_errors)
from asyncllm.integrations.responses_store import ResponseStore
from asyncllm.integrations.starlette import wait_disconnect
from asyncllm.integrations.streams import first_deltas, merge_streams
from asyncllm.lora import LoRARequest
from asyncllm.reasoning import ReasoningParser, get_reasoning_parser
from asyncllm.integrations.openai_prompt_embeds import completion_embeds_prompts
from asyncllm.integrations.openai_request_log import RequestLogger, log_prompts
from asyncllm.chat_content import check_content_format
from asyncllm.structured.start_after import Marker
from asyncllm.tool_calls import ToolParser, check_parser_pair, get_tool_parser

if TYPE_CHECKING:
    from asyncllm.engine.async_engine import AsyncEngine
    from asyncllm.engine.stream import RequestStream

__all__ = ["create_app", "OpenAIServer", "ServerLimits"]

logger = logging.getLogger("asyncllm.integrations.openai")


def create_app(engine: AsyncEngine | None = None, *, model_name: str | Sequence[str] | None = None,
               api_key: str | Sequence[str] | None = None,
               limits: ServerLimits | None = None, manage_engine: bool = True,
               tool_call_parser: str | None = None, chat_template: str | None = None,
               trust_request_chat_template: bool = False, reasoning_parser: str | None = None,
               lora_modules: Sequence[LoRAModule] = (), return_tokens_as_token_ids: bool = False,
               enable_request_id_headers: bool = False, response_role: str = "assistant",
               cors: CorsPolicy | None = None, enable_prompt_tokens_details: bool = False,
               enable_force_include_usage: bool = False, default_chat_template_kwargs: dict[str, Any] | None = None,
               request_logger: RequestLogger | None = None, chat_template_content_format: str = "auto") -> Starlette:
    """The app; `engine` defaults to one over the bundled tiny model.

    `model_name` is the id clients pass as ``model`` (default: the model as configured, or ``asyncllm-tiny`` for
    the bundled one); several names are all accepted, and responses carry the first (vLLM's ``--served-model-name
    a b``). With `manage_engine` the app's lifespan starts the engine and closes it at shutdown.
    `api_key`: requests need ``Authorization: Bearer <key>``, one of them if several (vLLM's ``--api-key``; None: none).
    `limits` bound each request (`ServerLimits`: body and upload bytes, n, max_tokens, prompts; None: the defaults).
    `tool_call_parser` (``"hermes"``, ``"llama3_json"``, ``"openai"``, ...) enables
    ``tool_choice: "auto"`` (vLLM's ``--enable-auto-tool-choice --tool-call-parser``).
    `chat_template` (a file path or the Jinja text) replaces the tokenizer's for every chat request; a request's own
    ``chat_template`` is taken only with `trust_request_chat_template`; `default_chat_template_kwargs` are template
    variables under each request's ``chat_template_kwargs`` (vLLM's flags of the same names; `ChatTemplates`).
    `reasoning_parser` (``"deepseek_r1"``, ``"qwen3"``, ``"openai_gptoss"``) splits chat replies
    into ``reasoning`` and ``content`` (vLLM's ``--reasoning-parser``).
    `lora_modules` are LoRA adapters served as models of their own (vLLM's
    ``--lora-modules``; the engine needs enable_lora): a request naming one
    as ``model`` runs with it; the app's startup checks each with
    `AsyncEngine.add_lora`. ASYNCLLM_ALLOW_RUNTIME_LORA_UPDATING adds the
    routes that load and unload adapters while serving. `return_tokens_as_token_ids` names logprobs' tokens
    ``token_id:N`` instead of their text (vLLM's flag: for tokens that are not whole characters).
    `enable_request_id_headers` puts ``X-Request-Id`` on every response (vLLM's flag; `RequestIdHeaders`).
    `response_role` is chat replies' role with a generation prompt (vLLM's ``--response-role``).
    `chat_template_content_format`: how message content reaches the template (vLLM's flag; asyncllm/chat_content.py).
    `cors` lets browsers on other origins call the app (`CorsPolicy`; None: no CORS headers).
    `enable_prompt_tokens_details` adds ``prompt_tokens_details.cached_tokens`` (prompt tokens served from the
    prefix cache) to completions' and chats' usage; `enable_force_include_usage` gives every stream continuous
    usage and the usage chunk, asked for or not (`usage_mode`; vLLM's flags of the same names). `request_logger`
    logs each request (vLLM's ``--enable-log-requests``; openai_request_log.py)."""
    parser = get_tool_parser(tool_call_parser) if tool_call_parser is not None else None
    check_parser_pair(parser, reasoning_parser)  # openai (gpt-oss's harmony) reads after openai_gptoss
    check_content_format(chat_template_content_format, config=True)
    templates = ChatTemplates.create(chat_template, trust_request_chat_template, default_chat_template_kwargs)
    if engine is None:
        from asyncllm import AsyncEngine

        engine = AsyncEngine(disable_log_stats=True)
    names = [model_name] if isinstance(model_name, str) else list(model_name or [])
    server = OpenAIServer(engine, names or [engine.model_name], api_key, limits or ServerLimits(),
                          parser, templates, get_reasoning_parser(reasoning_parser) if reasoning_parser else None,
                          lora_modules=lora_modules, runtime_lora=envs.ALLOW_RUNTIME_LORA_UPDATING.get(),
                          token_ids_as_text=return_tokens_as_token_ids, response_role=response_role,
                          prompt_tokens_details=enable_prompt_tokens_details,
                          force_include_usage=enable_force_include_usage, request_log=request_logger,
                          content_format=chat_template_content_format)
    return server.app(manage_engine, enable_request_id_headers, cors)


class OpenAIServer:
    """The route handlers; one per app."""

    def __init__(self, engine: AsyncEngine, model_names: list[str | None], api_key: str | Sequence[str] | None,
                 limits: ServerLimits, tool_parser: ToolParser | None = None,
                 templates: ChatTemplates = ChatTemplates(), reasoning: ReasoningParser | None = None, *,
                 lora_modules: Sequence[LoRAModule] = (), runtime_lora: bool = False,
                 token_ids_as_text: bool = False, response_role: str = "assistant",
                 prompt_tokens_details: bool = False, force_include_usage: bool = False,
                 request_log: RequestLogger | None = None, content_format: str = "auto") -> None:
        self.engine = engine
        self.content_format = content_format  # vLLM's --chat-template-content-format (create_app)
        self._reasoning_end: Marker | None = None  # `reasoning_end`, once the engine has its tokenizer
        self.request_log = request_log
        """Logs each request's prompts as the server submits them (openai_request_log.py); None: no log."""
        self.prompt_tokens_details = prompt_tokens_details
        """Usage carries ``prompt_tokens_details.cached_tokens`` (vLLM's --enable-prompt-tokens-details)."""
        self.force_include_usage = force_include_usage
        """Streams end with the usage chunk unasked (vLLM's --enable-force-include-usage)."""
        self.response_role = response_role
        """Chat replies' role with a generation prompt (vLLM's --response-role)."""
        self.token_ids_as_text = token_ids_as_text
        """Logprobs name tokens ``token_id:N`` (vLLM's --return-tokens-as-token-ids)."""
        self.reasoning = reasoning
        self.templates = templates
        self.tool_parser = tool_parser
        """Reads the calls of ``tool_choice: "auto"`` replies; None: "auto" is refused."""
        self._model_names = model_names
        """The names clients may send as ``model``; [None] until a shared core's model is known."""
        self.limits = limits
        self.score_handlers: Any = None
        """/classify's, /score's and /rerank's handlers (openai_score.py sets them), which /invocations takes too."""
        self._api_keys = api_key_bytes(api_key)
        self.created = int(time.time())
        """When the server started: its /v1/models cards' ``created``."""
        self.runtime_lora = runtime_lora
        """Whether the load/unload adapter routes exist (ASYNCLLM_ALLOW_RUNTIME_LORA_UPDATING)."""
        self.loras = LoRAModels(lora_modules, [name for name in model_names if name is not None])
        self.responses_store = ResponseStore.from_env()  # ASYNCLLM_ENABLE_RESPONSES_API_STORE (responses_store.py)

    @property
    def model_names(self) -> list[str]:
        """The ids clients may send as ``model``; responses carry the first."""
        if self._model_names == [None]:  # attached to a shared core: named as its launcher named the model
            return [self.engine.model_name or self.engine.config.model]  # (the core's address until attached)
        return [name for name in self._model_names if name is not None]

    @property
    def model_name(self) -> str:
        """The id responses carry."""
        return self.model_names[0]

    def app(self, manage_engine: bool = True, request_id_headers: bool = False,
            cors: CorsPolicy | None = None) -> Starlette:
        """The Starlette app; with `manage_engine` its lifespan starts and closes the engine. Its startup
        checks the LoRA modules (`server_lifespan`). `request_id_headers`: `RequestIdHeaders` outermost, as
        vLLM's (preflights too); `cors`: Starlette's CORS middleware inside it (it answers preflights itself)."""
        routes = [
            Route("/v1/completions", self._guarded(self.completions), methods=["POST"]),
            Route("/v1/chat/completions", self._guarded(self.chat_completions), methods=["POST"]),
            Route("/v1/responses", self._guarded(self.responses), methods=["POST"]),
            *self.responses_store.routes(self._guarded),  # GET/DELETE /v1/responses/{id}, POST .../cancel
            Route("/v1/embeddings", self._guarded(self.embeddings), methods=["POST"]),
            *score_routes(self), *pooling_routes(self),  # vLLM's /classify, /score, /rerank; /pooling (openai_pooling.py)
            *info_routes(self), *tokenize_routes(self), *audio_routes(self),  # /v1/models, /tokenize, /v1/audio/...
            Route("/invocations", self._guarded(self.invocations), methods=["POST"]),
        ]
        if self.runtime_lora:  # ASYNCLLM_ALLOW_RUNTIME_LORA_UPDATING
            routes += lora_routes(self)  # vLLM's /v1/load_lora_adapter, /v1/unload_lora_adapter (openai_lora.py)
        if envs.SERVER_DEV_MODE.get():
            routes += dev_routes(self)
        middleware = ([Middleware(RequestIdHeaders)] if request_id_headers else []) + (
            [cors.middleware()] if cors is not None else []) + [Middleware(ApiKeyGate, api_keys=self._api_keys)]
        app = Starlette(routes=routes, lifespan=server_lifespan(self, manage_engine),
                        exception_handlers={404: not_found, 405: not_allowed}, middleware=middleware)
        app.state.openai_server = self
        return app

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
        log_prompts(self.request_log, req, "cmpl", prompts, params, lora)
        rank = header_data_parallel_rank(request.headers)
        with admission_group(len(prompts) * params.n):  # the request's group (`guard`) may pass the limits by these
            streams = [self.engine.stream(p, params, **request_options(req), lora_request=lora, data_parallel_rank=rank,
                                          check_max_tokens=sets_max_tokens(req), echo_only=echo_only(req),
                                          fit_max_tokens=not sets_max_tokens(req),
                                          add_special_tokens=req.add_special_tokens) for p in prompts]
        as_ids = self.ids_as_text(req)
        choices = Choices(len(prompts), params.n, params.logprobs, chat=False,
                          token_text=functools.partial(self._token_text, as_ids=as_ids), token_ids_as_text=as_ids,
                          echo_only=echo_only(req), num_prompt_logprobs=req.prompt_logprobs,
                          return_token_ids=req.return_token_ids, prompt_tokens_details=self.prompt_tokens_details)
        echo = (prompts, self.engine.tokenizer) if req.echo else None
        field = constraint_field(req)
        with constraint_errors(field):
            return await respond(request, req, model, streams, choices, "cmpl", "text_completion", echo,
                                 force_include_usage=self.force_include_usage, constraint=field)

    async def chat_completions(self, request: Request, body: bytes | None = None) -> Response:
        req = decode_request(await self._body(request) if body is None else body, ChatCompletionRequest)
        take_request_id(req, request.headers)
        model, lora = self._model(req.model)
        with renamed_fields(chat_field_names(req)):
            if req.use_beam_search:
                return await beam_search_response(self, request, req, model, lora)
            streams, choices = self._start_chat(req, lora, await self._sampling_defaults(),
                                                header_data_parallel_rank(request.headers))
            field = constraint_field(req, choices.tool_mode.constraint is not None)
            with constraint_errors(field):
                return await respond(request, req, model, streams, choices, "chatcmpl", "chat.completion",
                                     force_include_usage=self.force_include_usage, constraint=field)

    async def embeddings(self, request: Request, body: bytes | None = None) -> Response:
        """OpenAI's: one embedding per ``input``, or (vLLM's) of chat ``messages`` (openai_embeddings.py)."""
        req = decode_request(await self._body(request) if body is None else body, EmbeddingRequest)
        model, lora = self._model(req.model)
        prompts = await embedding_prompts(self, req)
        response_id = pooling_request_id("embd", req, request.headers)
        outputs = await embed_all(self.engine, prompts, req, lora, until=lambda: wait_disconnect(request),
                                  request_log=self.request_log, request_id=response_id, model_name=self.model_name)
        return embedding_response(outputs, model, req, response_id)

    async def invocations(self, request: Request) -> Response:
        """SageMaker's (as vLLM): a body with ``messages`` is a chat completion, one with ``prompt`` a completion,
        one with ``input`` an embedding (a classification on a classifier), ``text_1`` and ``text_2`` a score,
        ``query`` and ``documents`` a rerank (openai_invocations.py)."""
        body = await self._body(request)
        route = await invocation_route(self, decode_request(body, Any))
        return await route(request, body)

    async def responses(self, request: Request) -> Response:
        """OpenAI's Responses API over a chat completion (responses_api.py)."""
        identity = response_identity()  # id and created_at: the request's arrival (vLLM's created_time)
        req = decode_request(await self._body(request), ResponsesRequest)
        model, lora = self._model(req.model)
        turn = self.responses_store.begin(req)  # store and previous_response_id resolved (responses_store.py)
        with responses_errors():  # the client's names: input, text.format, max_output_tokens
            chat = turn.chat_request(auto_tools=self.tool_parser is not None)  # none: 'auto' calls none (vLLM's)
            streams, choices = self._start_chat(chat, lora, await self._sampling_defaults(),
                                                header_data_parallel_rank(request.headers), responses=True)
            with constraint_errors(constraint_field(chat, choices.tool_mode.constraint is not None)):
                if req.stream:
                    # errors before the first token keep their status code; a client gone while queued: 499
                    firsts = await first_deltas(streams, until=lambda: wait_disconnect(request))
                    count_prompts(streams, choices)
                    self._fit_echo(chat, choices)
                    events = ResponseEvents(turn.req, model, identity, turn.keep,  # kept before its last event
                                            params=choices.sampling)
                    return EventStream(response_events(request, events, streams, firsts, choices))
                async for prompt_index, delta in merge_streams(streams, until=lambda: wait_disconnect(request)):
                    choices.add(prompt_index, delta)
        count_prompts(streams, choices)
        self._fit_echo(chat, choices)
        deltas, finish_reason = choices.reply_deltas(0)
        body = response_body(turn.req, model, deltas, finish_reason, choices.usage(reasoning_tokens=True), identity,
                             choices.sampling)
        return json_response(turn.keep(body))

    def _fit_echo(self, chat: ChatCompletionRequest, choices: Choices) -> None:
        """A Responses request that set no max_output_tokens echoes its default cut to the room its prompt left, as
        the engine ran it (``fit_max_tokens``; vLLM's ``get_max_tokens``), once its prompt's length is known."""
        params = choices.sampling
        if params is not None and params.max_tokens is not None and not sets_max_tokens(chat):
            room = max(self.engine.config.max_model_len - choices.prompt_tokens[0], 1)
            choices.sampling = msgspec.structs.replace(params, max_tokens=min(params.max_tokens, room))

    async def _sampling_defaults(self) -> dict[str, Any]:
        """The engine's default sampling fields for those a request leaves unset, and the max_tokens cap (vLLM's)."""
        if not self.engine.started:
            await self.engine.start()
        return with_max_tokens_cap(self.engine.default_sampling_fields(), self.engine.config)

    def _start_chat(self, req: ChatCompletionRequest, lora: LoRARequest | None, defaults: dict[str, Any],
                    data_parallel_rank: int | None = None,
                    responses: bool = False) -> tuple[list[RequestStream], Choices]:
        """The chat's streams and their `Choices` (`responses`: the Responses API's, token details and reasoning)."""
        mode = tool_mode(req.tools, req.tool_choice, req.parallel_tool_calls, self.tool_parser)
        template_kwargs = self.templates.kwargs(req)
        thinking_off = self.thinking_off(template_kwargs)
        params = chat_params(req, self.limits, mode, self.reasoning, defaults, thinking_off=thinking_off)
        messages = chat_messages(req.messages, images=True, media_root=self.limits.allowed_local_media_path)
        log_prompts(self.request_log, req, "chatcmpl", [messages], params, lora, indexed=False)
        streams = [self.engine.chat(messages, params, **request_options(req),
                                    chat_template_kwargs=template_kwargs, tools=template_tools(req.tools),
                                    chat_template=self.templates.pick(req.chat_template), lora_request=lora,
                                    data_parallel_rank=data_parallel_rank, mm_processor_kwargs=req.mm_processor_kwargs,
                                    check_max_tokens=sets_max_tokens(req), fit_max_tokens=not sets_max_tokens(req),
                                    chat_template_content_format=self.content_format,
                                    add_special_tokens=req.add_special_tokens)]
        choices = Choices(1, params.n, params.logprobs, chat=True, tool_mode=mode, reasoning=self.reasoning,
                          token_ids_as_text=self.ids_as_text(req),
                          num_prompt_logprobs=req.prompt_logprobs,
                          include_reasoning=req.include_reasoning, return_token_ids=req.return_token_ids,
                          chat_echo=chat_echo(req, self.response_role, messages),
                          chat_role=chat_role(req, self.response_role),
                          prompt_tokens_details=self.prompt_tokens_details or responses,
                          reasoning_end=self.reasoning_end(), thinking_off=thinking_off, counts_reasoning=responses,
                          message_starts=responses, sampling=params)
        return streams, choices

    def thinking_off(self, template_kwargs: dict[str, Any]) -> bool:
        """Whether a request's template variables turned the parser's thinking off (qwen3's ``enable_thinking``)."""
        return self.reasoning is not None and self.reasoning.thinking_off(template_kwargs)

    def reasoning_end(self) -> Marker | None:
        """The reasoning parser's end tag, to find a prompt that ended the thinking (None: no parser, or no tokenizer
        yet); tokenized once."""
        if self._reasoning_end is None and self.reasoning is not None and self.reasoning.prompt_ends_thinking \
                and self.engine.tokenizer is not None:
            self._reasoning_end = Marker.of(self.engine.tokenizer, self.reasoning.end_tag, self.reasoning.end_suffix,
                                            self.reasoning.end_max_between, self.reasoning.opener)
        return self._reasoning_end

    async def _tokenizer(self) -> Any:
        """The engine's tokenizer (the engine starts on first use, as it does for a completion)."""
        if not self.engine.started:
            await self.engine.start()
        if self.engine.tokenizer is None:
            raise InvalidRequestError("tokenizer", "this server loads none (--skip-tokenizer-init): it takes and "
                                                   "returns token ids only")
        return self.engine.tokenizer

    # ------------------------------------------------------------ shared steps
    def _guarded(self, handler: Any) -> Any:
        """Error mapping around a handler (openai_http.py; the API key is checked before routing: openai_auth.py)."""
        return guard(handler)

    async def _body(self, request: Request) -> bytes:
        return await read_body(request, self.limits.max_body_bytes)

    def ids_as_text(self, req: Any) -> bool:
        """vLLM's ``return_tokens_as_token_ids``: the request's when it sets it, else the server's flag."""
        own = getattr(req, "return_tokens_as_token_ids", None)
        return self.token_ids_as_text if own is None else own

    def _token_text(self, token_id: int, as_ids: bool = False) -> str:
        """A logprobs entry's token: its text, or vLLM's ``token_id:N`` (without a tokenizer, or asked for)."""
        if self.engine.tokenizer is None or as_ids:
            return token_id_text(token_id)
        return self.engine.tokenizer.decode([token_id], skip_special_tokens=False)

    def _model(self, model: str | None) -> tuple[str, LoRARequest | None]:
        """The name a response carries and the adapter a request runs with: a served name is the base model under
        that name (none: the first), a LoRA module's name its adapter; any other name is a 404."""
        if not model:  # "" too, as vLLM
            return self.model_name, None
        if model in self.model_names:  # the name asked for, as vLLM's (the first for none)
            return model, None
        lora = self.loras.get(model)
        if lora is None:
            raise ApiError(404, f"the model {model!r} does not exist; this server serves "
                                f"{self.model_names + list(self.loras.loras)}",
                           "not_found_error", param="model", code="model_not_found")
        return model, lora
