"""The OpenAI server's read-only routes: ``GET /v1/models`` (and ``/v1/models/{model}``), ``/version``, ``/health``
(and SageMaker's ``/ping``) and ``/metrics`` (Prometheus text)."""

from __future__ import annotations

import asyncio
import uuid
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from asyncllm.integrations.errors import ApiError
from asyncllm.integrations.openai_http import error_response, json_response

if TYPE_CHECKING:
    from asyncllm.integrations.openai_server import OpenAIServer

__all__ = ["info_routes", "served_name"]


def info_routes(server: OpenAIServer) -> list[Route]:
    """The routes; /v1/models (and one model's card) in the server's error mapping `guard`, the probes and /metrics
    bare. The API key is checked before routing (openai_auth.py's `ApiKeyGate`): the models' routes need it, the
    probes and /metrics (`OPEN_PATHS`) are open."""
    handlers = _Handlers(server)
    return [
        Route("/v1/models", server._guarded(handlers.models), methods=["GET"]),
        Route("/v1/models/{model:path}", server._guarded(handlers.model), methods=["GET"]),
        Route("/version", handlers.version, methods=["GET"]),
        Route("/health", handlers.health, methods=["GET"]),
        Route("/ping", handlers.health, methods=["GET", "POST"]),
        Route("/metrics", handlers.metrics, methods=["GET"]),
    ]


class _Handlers:
    def __init__(self, server: OpenAIServer) -> None:
        self.server = server

    async def models(self, request: Request) -> Response:
        return json_response({"object": "list", "data": self._model_cards()})

    async def model(self, request: Request) -> Response:
        """OpenAI's ``GET /v1/models/{model}`` (``client.models.retrieve``): the card the list has for that name
        (a name with a slash too); an unknown one a 404 ``model_not_found``, as OpenAI answers it."""
        name = request.path_params["model"]
        card = next((card for card in self._model_cards() if card["id"] == name), None)
        if card is None:
            raise ApiError(404, f"The model '{name}' does not exist", "not_found_error", param="model",
                           code="model_not_found")
        return json_response(card)

    def _model_cards(self) -> list[dict[str, Any]]:
        """The served names, then each LoRA module with its path as ``root`` and its base model as ``parent``; each
        card with vLLM's ``permission`` list."""
        server = self.server
        cards = [self._model_card(name, server.engine.config.model) for name in server.model_names]
        return cards + [self._model_card(name, served.request.lora_path, served.parent or server.model_name)
                        for name, served in list(server.loras.loras.items())]

    def _model_card(self, name: str, root: str, parent: str | None = None) -> dict[str, Any]:
        created = self.server.created
        return {"id": name, "object": "model", "created": created, "owned_by": "asyncllm", "root": root,
                "parent": parent, "max_model_len": self.server.engine.config.max_model_len,
                "permission": [_model_permission(created)]}

    async def version(self, request: Request) -> Response:
        from asyncllm import __version__

        return json_response({"version": __version__})

    async def health(self, request: Request) -> Response:
        """200 while the engine serves; 503 once it died or was closed (or before it started)."""
        engine = self.server.engine
        alive = engine.started and engine.stats().engine_alive
        return json_response({"status": "ok" if alive else "unavailable"}, 200 if alive else 503)

    async def metrics(self, request: Request) -> Response:
        registry = getattr(self.server.engine, "metrics_registry", None)
        if registry is None:
            return error_response(ApiError(404, "this engine exports no Prometheus metrics", "not_found_error"))
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        from asyncllm.metrics.multiprocess import multiprocess_dir, multiprocess_latest
        from asyncllm.metrics.runtime import with_runtime

        if multiprocess_dir() is not None:  # every host process's series, summed (vLLM's multiprocess mode)
            body = await asyncio.to_thread(multiprocess_latest)  # file writes and reads: off the event loop
            return Response(body, media_type=CONTENT_TYPE_LATEST)
        # with prometheus_client's process_*, python_gc_* and python_info, as vLLM's (asyncllm/metrics/runtime.py)
        return Response(with_runtime(generate_latest(registry)), media_type=CONTENT_TYPE_LATEST)


def _model_permission(created: int) -> dict[str, Any]:
    """vLLM's ``ModelPermission`` with its defaults (a fresh id per listing, as vLLM's): what OpenAI's legacy model
    cards carried; nothing here enforces it."""
    return {"id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission", "created": created,
            "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
            "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False, "organization": "*",
            "group": None, "is_blocking": False}


def served_name(model: str) -> str | None:
    """The bundled model's short name; None for an engine attached to a shared core (its model is known
    once attached); else the model as configured (before the engine resolves it to a folder)."""
    from asyncllm.bundled import model_label

    if model.startswith(("ipc://", "tcp://")):  # the engine addresses (asyncllm/engine/connect.py)
        return None
    return model_label(model)
