"""vLLM's classification and scoring routes: ``POST /classify``, ``/score`` (``/v1/score``) and ``/rerank``
(``/v1/rerank``, ``/v2/rerank``, Jina's and Cohere's shape).

``/classify`` runs `AsyncEngine.classify` on each ``input`` (the four prompt
shapes of /v1/completions) or on chat ``messages`` rendered as
/v1/embeddings'; ``/score`` runs `AsyncEngine.score` on ``text_1`` and
``text_2`` (1:1, 1:N, N:N); ``/rerank`` scores ``query`` against each of
``documents`` and answers them sorted by relevance, best first (``top_n`` of
them). A model that cannot answer (a generative model asked to classify, a
classifier with several labels asked to score) is a 400 from the engine's
`InvalidRequestError`. Every route runs its requests at once; a client that
leaves aborts them all. docs/integrations/openai-server.md has the details.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from asyncllm.engine import scoring
from asyncllm.engine.admission import admission_group
from asyncllm.engine.stream import RequestOptions
from asyncllm.errors import InvalidRequestError
from asyncllm.integrations.errors import renamed_fields
from asyncllm.integrations.openai_embeddings import (PoolingPromptRequest, embedding_prompts,
                                                    input_special_tokens, pooling_request_id, pooling_usage)
from asyncllm.integrations.openai_http import json_response
from asyncllm.integrations.openai_pooling_media import MediaChat, classify_one, logged_prompts
from asyncllm.integrations.openai_protocol import CacheSalt, decode_request
from asyncllm.integrations.openai_request_log import RequestLogger, log_under
from asyncllm.integrations.starlette import wait_disconnect
from asyncllm.integrations.streams import gather_until
from asyncllm.pooling import ClassificationOutput, EmbeddingOutput, PoolingParams, ScoringOutput

if TYPE_CHECKING:
    from asyncllm.engine.async_engine import AsyncEngine
    from asyncllm.integrations.openai_server import OpenAIServer
    from asyncllm.lora import LoRARequest

__all__ = ["ClassificationRequest", "ScoreRequest", "RerankRequest", "score_routes", "classify_all", "rerank_results",
           "pooling_listing", "pooling_options"]


class _Activation:
    """The activation switch of vLLM's classify and score requests (their fields ``use_activation`` and its older
    names ``softmax`` and ``activation``)."""

    __slots__ = ()
    softmax: bool | None
    activation: bool | None
    use_activation: bool | None

    def activated(self) -> bool:
        """The first of ``softmax``, ``activation`` and ``use_activation`` set (vLLM's order), else true."""
        return next((v for v in (self.softmax, self.activation, self.use_activation) if v is not None), True)

    def activation_field(self) -> str:
        """The field `activated` read (``use_activation`` when none is set): an error about the switch names it, the
        name the client wrote, as /pooling's do."""
        return next((name for name in ("softmax", "activation") if getattr(self, name) is not None), "use_activation")


class _PoolingRequest(msgspec.Struct, _Activation, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None
    """A served name or a LoRA module's name; left out, the served model."""
    user: str | None = None
    """Accepted, unused (vLLM's pooling requests take it)."""
    request_id: str | None = None
    """vLLM's: the response's id after its prefix (the ``X-Request-Id`` header's over it); left out: a random id."""
    truncate_prompt_tokens: int | None = None
    """vLLM's: cut each prompt to k tokens (-1: as many as max_model_len allows): a text keeps its first tokens,
    cut by the tokenizer on the right with its special tokens (a pair longest-first); token ids their last k."""
    priority: int = 0
    """vLLM's: lower runs first; needs an engine started with scheduling_policy='priority' unless 0."""
    cache_salt: CacheSalt = None
    """Requests with different salts never share prefix-cached KV."""
    use_activation: bool | None = None
    """vLLM's: false returns a classification's raw logits as its ``probs`` and a cross-encoder's raw logit as its
    score; null or true the activated ones (a bi-encoder's cosine similarity has no activation)."""
    softmax: bool | None = None
    """vLLM's older name of ``use_activation`` (read first)."""
    activation: bool | None = None
    """vLLM's older name of ``use_activation`` (read before it)."""
    mm_processor_kwargs: dict[str, Any] | None = None
    """vLLM's: the image processor's settings for multimodal texts, which asyncllm's scores do not take (texts only),
    so it changes nothing, as on a chat completion without media."""


class ClassificationRequest(PoolingPromptRequest, _Activation, kw_only=True, forbid_unknown_fields=True):
    """The body of ``POST /classify``: ``input`` or (vLLM's ClassificationChatRequest) chat ``messages`` with their
    fields (openai_embeddings.py's `PoolingPromptRequest`), and the activation switch."""

    use_activation: bool | None = None
    """vLLM's: false returns the raw logits as ``probs``; null or true the activated ones."""
    softmax: bool | None = None
    """vLLM's older name of ``use_activation`` (read first)."""
    activation: bool | None = None
    """vLLM's older name of ``use_activation`` (read before it)."""


class ScoreRequest(_PoolingRequest, kw_only=True, forbid_unknown_fields=True):
    """The body of ``POST /score``: ``text_1`` against each of ``text_2``."""

    text_1: str | list[str]
    text_2: str | list[str]


class RerankDocument(msgspec.Struct, forbid_unknown_fields=True):
    text: str


class RerankRequest(_PoolingRequest, kw_only=True, forbid_unknown_fields=True):
    """The body of ``POST /rerank``: ``documents`` ranked by their relevance to ``query``."""

    query: str
    documents: list[str | RerankDocument]
    """Strings, or Jina's ``{"text": ...}`` objects."""
    top_n: int = 0
    """The best this many; 0 (vLLM's default) or more than there are: all of them."""
    return_documents: bool = True
    """Each result carries its ``document`` (vLLM always does); false: index and score only."""


def score_routes(server: OpenAIServer) -> list[Route]:
    """The routes, each wrapped in the server's error mapping `guard` (the API key is checked before routing:
    openai_auth.py's `ApiKeyGate`)."""
    handlers = server.score_handlers = _Handlers(server)  # /invocations dispatches to them too
    guard = server._guarded
    scoring = [Route(path, guard(handlers.score), methods=["POST"]) for path in ("/score", "/v1/score")]
    rerank = [Route(path, guard(handlers.rerank), methods=["POST"]) for path in ("/rerank", "/v1/rerank", "/v2/rerank")]
    return [Route("/classify", guard(handlers.classify), methods=["POST"]), *scoring, *rerank]


class _Handlers:
    def __init__(self, server: OpenAIServer) -> None:
        self.server = server

    async def classify(self, request: Request, body: bytes | None = None) -> Response:
        req = decode_request(await self.server._body(request) if body is None else body, ClassificationRequest)
        model, lora = self.server._model(req.model)
        prompts = await embedding_prompts(self.server, req, "classify", api="classify")
        request_id = pooling_request_id("classify", req, request.headers)
        outputs = await classify_all(self.server.engine, prompts, pooling_options(req, lora),
                                     until=lambda: wait_disconnect(request), request_log=self.server.request_log,
                                     request_id=request_id, field="input" if req.messages is None else "messages")
        activated = req.activated()
        data = [{"index": i, "label": out.label, "probs": out.probs if activated else out.logits,
                 "num_classes": out.num_classes} for i, out in enumerate(outputs)]
        return json_response(pooling_listing(request_id, model, data, outputs))

    async def score(self, request: Request, body: bytes | None = None) -> Response:
        req = decode_request(await self.server._body(request) if body is None else body, ScoreRequest)
        model, lora = self.server._model(req.model)
        _check_count("text_2", req.text_2, self.server.limits.max_prompts)
        request_id = pooling_request_id("score", req, request.headers)
        with renamed_fields({"use_activation": req.activation_field()}):  # softmax: false names softmax
            outputs = await self._score(request, request_id, req.text_1, req.text_2, pooling_options(req, lora),
                                        activated=req.activated())
        data = [{"index": i, "object": "score", "score": out.score} for i, out in enumerate(outputs)]
        return json_response(pooling_listing(request_id, model, data, outputs))

    async def rerank(self, request: Request, body: bytes | None = None) -> Response:
        req = decode_request(await self.server._body(request) if body is None else body, RerankRequest)
        model, lora = self.server._model(req.model)
        if not req.documents:
            raise InvalidRequestError("documents", "is empty: give at least one document to rank")
        _check_count("documents", req.documents, self.server.limits.max_prompts)
        texts = [doc if isinstance(doc, str) else doc.text for doc in req.documents]
        request_id = pooling_request_id("rerank", req, request.headers)
        try:
            with renamed_fields({"use_activation": req.activation_field()}):  # softmax: false names softmax
                outputs = await self._score(request, request_id, req.query, texts, pooling_options(req, lora),
                                            "rerank", req.activated())
        except InvalidRequestError as exc:  # the engine names its own fields: name the request's
            field = {"text_1": "query", "text_2": "documents"}.get(exc.field, exc.field)
            raise InvalidRequestError(field, exc.message, code=exc.code) from None
        tokens = sum(len(out.prompt_token_ids) for out in outputs)  # vLLM's RerankUsage: these two
        return json_response({"id": request_id, "model": model,
                              "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
                              "results": rerank_results(texts, outputs, req.top_n, req.return_documents)})

    async def _score(self, request: Request, request_id: str, text_1: Any, text_2: Any, options: dict[str, Any],
                     api: str = "score", activated: bool = True) -> list[ScoringOutput]:
        """`AsyncEngine.score`, with `api` naming the route in a context-length error (vLLM's words: a rerank's is
        "embedding generation", `errors.POOLING_OPERATIONS`); its prompts logged under `request_id`."""
        await self._log_scoring(request_id, text_1, text_2, options["lora_request"])
        truncate = options.pop("truncate_prompt_tokens")
        call = scoring.score(self.server.engine, text_1, text_2, RequestOptions(**options, pooling_api=api), truncate,
                             activated)
        return (await gather_until([call], lambda: wait_disconnect(request)))[0]

    async def _log_scoring(self, request_id: str, text_1: Any, text_2: Any, lora: LoRARequest | None) -> None:
        """Log a scoring's prompts as vLLM's: a cross-encoder's pairs (``text_1``, the tokenizer's sep token,
        ``text_2``), any other model's texts (``text_1``'s, then ``text_2``'s)."""
        request_log, engine = self.server.request_log, self.server.engine
        if request_log is None:
            return
        await engine.start()
        assert engine.pooling_model is not None, "set by start"
        firsts, seconds = scoring.score_pairs(text_1, text_2)
        if engine.pooling_model.classifier is None:
            texts = [text_1] if isinstance(text_1, str) else list(text_1)
            task = "token_embed" if engine.pooling_model.late_interaction else "embed"  # ColBERT's: MaxSim
            log_under(request_log, request_id, texts + seconds, PoolingParams(task=task), lora)
            return
        sep = getattr(engine.tokenizer, "sep_token", None) or ""
        pairs = [f"{first}{sep}{second}" for first, second in zip(firsts, seconds)]
        log_under(request_log, request_id, pairs, PoolingParams(task="classify"), lora)


async def classify_all(engine: AsyncEngine, prompts: Sequence[str | list[int] | MediaChat], options: dict[str, Any], *,
                       until: Callable[[], Awaitable[object]], request_log: RequestLogger | None, request_id: str,
                       field: str = "input", api: str | None = None) -> list[ClassificationOutput]:
    """`AsyncEngine.classify` on every prompt at once (`options`: `_options`'), results in input order, each
    logged as ``request_id-i``. The first error cancels the others; `until` completing (the client went away)
    raises `ClientDisconnected`. An engine error naming ``prompt`` names `field`, but a context-length error
    ``input_tokens`` (`errors.context_param`), saying `api`'s word (`errors.POOLING_OPERATIONS`;
    None: "classification")."""
    log_under(request_log, request_id, logged_prompts(prompts), PoolingParams(task="classify"),
              options["lora_request"])
    options = dict(options)
    truncate = options.pop("truncate_prompt_tokens")
    calls = [classify_one(engine, prompt, RequestOptions(**options, pooling_api=api), truncate) for prompt in prompts]
    with renamed_fields({"prompt": field}, uncoded_only=True), \
            admission_group(len(calls)):  # the engine's field: the request's; the group may pass the limits
        return await gather_until(calls, until)


def rerank_results(documents: Sequence[str], outputs: Sequence[ScoringOutput], top_n: int,
                   return_documents: bool) -> list[dict[str, Any]]:
    """Best first (ties in input order), the first `top_n` (0 or less: all, as vLLM)."""
    order = sorted(range(len(outputs)), key=lambda i: -outputs[i].score)
    results = []
    for i in order[: top_n if top_n > 0 else None]:
        result: dict[str, Any] = {"index": i, "relevance_score": outputs[i].score}
        if return_documents:
            result["document"] = {"text": documents[i]}
        results.append(result)
    return results


def pooling_options(req: Any, lora: LoRARequest | None) -> dict[str, Any]:
    """A pooling request's engine options (`_PoolingRequest`'s fields, or an embeddings body's on /pooling; an
    ``input``'s ``add_special_tokens``, `input_special_tokens`)."""
    special = input_special_tokens(req) if isinstance(req, PoolingPromptRequest) else None
    return {"priority": req.priority, "cache_salt": req.cache_salt, "lora_request": lora,
            "truncate_prompt_tokens": req.truncate_prompt_tokens, "add_special_tokens": special}


def _check_count(field: str, texts: str | Sequence[Any], limit: int) -> None:
    if not isinstance(texts, str) and len(texts) > limit:
        raise InvalidRequestError(field, f"at most {limit} per request, got {len(texts)}")


def pooling_listing(request_id: str, model: str, data: list[dict[str, Any]],
                    outputs: Sequence[EmbeddingOutput | ClassificationOutput | ScoringOutput]) -> dict[str, Any]:
    """vLLM's list response: ``data`` in input order and the prompts' token usage."""
    return {"id": request_id, "object": "list", "created": int(time.time()), "model": model,
            "data": data, "usage": pooling_usage(outputs)}
