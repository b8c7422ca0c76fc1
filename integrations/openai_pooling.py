"""vLLM's ``POST /pooling``: the pooler's output for each input, whatever the model's task.

The body is ``/v1/embeddings``' (openai_embeddings.py: ``input`` in the four
prompt shapes or chat ``messages``, ``encoding_format``, ``dimensions``,
``normalize``, ``truncate_prompt_tokens``, ...) with vLLM's ``task`` and
``use_activation`` (its older names ``softmax`` and ``activation``) and a
``request_id``. ``task`` left out is the model's own: ``classify`` for a
classification model, ``embed`` for any other. ``embed`` runs
`AsyncEngine.embed` (each item's ``data`` is the embedding), ``classify`` and
``score`` `AsyncEngine.classify` (the activated logits: ``classify``'s
activation, or the cross-encoder's ``score`` activation; ``use_activation``
false: the raw logits), ``token_embed`` and ``token_classify``
`AsyncEngine.encode` (each item's ``data`` is a list per prompt token: its
embedding, or its score-head probabilities; vLLM's ALL pooling). A task the
model does not serve is a 400 in vLLM's words; a token classifier
(``BertForTokenClassification``, ...) serves ``token_classify`` only, its own task.
docs/integrations/openai-server.md#pooling has the details.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Literal

import msgspec

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from asyncllm.engine.pooling_model import activate
from asyncllm.errors import InvalidRequestError
from asyncllm.integrations.openai_embeddings import (EmbeddingRequest, embed_all, embedding_prompts, pooled_response,
                                                    pooling_params, pooling_request_id)
from asyncllm.integrations.openai_protocol import decode_request
from asyncllm.integrations.openai_score import classify_all, pooling_options
from asyncllm.integrations.starlette import wait_disconnect
from asyncllm.pooling import PER_TOKEN_TASKS, ClassificationOutput, EmbeddingOutput, PoolingOutput

if TYPE_CHECKING:
    from asyncllm.engine.async_engine import AsyncEngine
    from asyncllm.engine.pooling_model import ClassifierHead
    from asyncllm.integrations.openai_server import OpenAIServer

__all__ = ["PoolingRequest", "POOLING_ROUTE_TASKS", "pooling_routes", "model_pooling_tasks", "pooling_task"]

POOLING_ROUTE_TASKS = ("embed", "classify", "score", "token_embed", "token_classify")
"""vLLM's pooling tasks (its ``PoolingTask``)."""

_TASK_PARAMETERS = {"embed": ("dimensions", "normalize"), "classify": ("use_activation",),
                    "score": ("use_activation",), "token_embed": ("dimensions", "normalize"),
                    "token_classify": ("use_activation",)}
"""The parameters each task takes (vLLM's ``PoolingParams.valid_parameters``)."""
_ACTIVATION_NAMES = ("softmax", "activation", "use_activation")
"""``use_activation`` and its older names, in the order vLLM reads them (``get_use_activation``)."""


class PoolingRequest(EmbeddingRequest, kw_only=True, forbid_unknown_fields=True):
    """The body of ``POST /pooling``: ``/v1/embeddings``' with vLLM's task and activation switch."""

    task: Literal["embed", "classify", "score", "token_embed", "token_classify"] | None = None
    """What to pool (`POOLING_ROUTE_TASKS`); None: the model's own (``classify``, ``token_classify`` or ``embed``)."""
    use_activation: bool | None = None
    """``classify`` and ``score``: false returns the raw logits; null or true the activated ones."""
    softmax: bool | None = None
    """vLLM's older name of ``use_activation``."""
    activation: bool | None = None
    """vLLM's older name of ``use_activation``."""


def pooling_routes(server: OpenAIServer) -> list[Route]:
    """The route, wrapped in the server's error mapping `guard` (the API key is checked before routing:
    openai_auth.py's `ApiKeyGate`)."""
    return [Route("/pooling", server._guarded(functools.partial(_pool, server)), methods=["POST"])]


def model_pooling_tasks(engine: AsyncEngine) -> tuple[str, ...]:
    """The tasks vLLM serves for the engine's (started) model, its own first: a classification model's, or an
    embedding model's (asyncllm's causal LMs embed too)."""
    assert engine.pooling_model is not None, "set by start"
    return engine.pooling_model.pooling_tasks


def pooling_task(req: PoolingRequest, model_tasks: tuple[str, ...]) -> str:
    """The request's task, checked against the model's and against the parameters it sets (400s naming ``task`` or
    the parameter, in vLLM's words)."""
    task = req.task or model_tasks[0]
    if task not in model_tasks:
        raise InvalidRequestError("task", f"Task {task} is not supported, it must be one of {model_tasks}.")
    valid = _TASK_PARAMETERS[task]
    for name in ("dimensions", "normalize", *_ACTIVATION_NAMES):
        parameter = "use_activation" if name in _ACTIVATION_NAMES else name
        if getattr(req, name) is not None and parameter not in valid:
            raise InvalidRequestError(name, f"Task {task} only supports {list(valid)} parameters, does not "
                                            f"support {[name]} parameters")
    return task


async def _pool(server: OpenAIServer, request: Request) -> Response:
    req = decode_request(await server._body(request), PoolingRequest)
    model, lora = server._model(req.model)
    engine = server.engine
    if not engine.started:
        await engine.start()
    task = pooling_task(req, model_pooling_tasks(engine))
    prompts = await embedding_prompts(server, req, task, api="pooling")
    request_id = pooling_request_id("pool", req, request.headers)
    until, log = (lambda: wait_disconnect(request)), server.request_log
    outputs: list[EmbeddingOutput] | list[PoolingOutput] | list[ClassificationOutput]
    if task in ("embed", *PER_TOKEN_TASKS):
        activated = _use_activation(req) if task == "token_classify" else None
        pooling = msgspec.structs.replace(pooling_params(req), task=task, use_activation=activated)
        outputs = await embed_all(engine, prompts, req, lora, until=until, request_log=log, request_id=request_id,
                                  model_name=server.model_name, pooling=pooling)
        pooled = [out.embedding if task == "embed" else out.data for out in outputs]
    else:
        outputs = await classify_all(engine, prompts, pooling_options(req, lora), until=until, request_log=log, request_id=request_id,
                                     field="input" if req.messages is None else "messages", api="pooling")
        assert engine.pooling_model is not None and engine.pooling_model.classifier is not None, "a classify task"
        pooled = [_activated(out, task, _use_activation(req), engine.pooling_model.classifier) for out in outputs]
    return pooled_response(pooled, outputs, model, req, request_id, "pooling")


def _use_activation(req: PoolingRequest) -> bool | None:
    """The first of ``softmax``, ``activation`` and ``use_activation`` set, as vLLM reads them."""
    return next((value for value in (getattr(req, name) for name in _ACTIVATION_NAMES) if value is not None), None)


def _activated(out: ClassificationOutput, task: str, use_activation: bool | None,
               head: ClassifierHead) -> list[float]:
    """A classification's pooled output: its logits, raw or through ``classify``'s or ``score``'s activation."""
    if use_activation is False:
        return out.logits
    return out.probs if task == "classify" else activate(out.logits, head.score_activation)
