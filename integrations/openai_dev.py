"""The development routes (with ASYNCLLM_SERVER_DEV_MODE=1), each behind the server's API key (openai_auth.py).

- vLLM's ``POST /reset_prefix_cache``: `AsyncEngine.reset_prefix_cache`, 200 with no body.
- SGLang's ``POST /update_weights_from_disk``: `AsyncEngine.update_weights` (body and answer:
  openai_weights.py, docs/weight-updates.md).
- vLLM's sleep mode (docs/sleep-mode.md): ``POST /sleep?level=1`` runs `AsyncEngine.sleep`, ``POST /wake_up``
  (optional repeated ``tags``, e.g. ``/wake_up?tags=weights``) `AsyncEngine.wake_up`, and ``GET /is_sleeping``
  answers ``{"is_sleeping": bool}``. The first two answer 200 with no body, as vLLM's do; a bad level or tag is
  a 400 naming ``level`` / ``tags``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from asyncllm.errors import InvalidRequestError
from asyncllm.integrations.openai_protocol import decode_request
from asyncllm.integrations.openai_weights import UpdateWeightsFromDiskRequest, update_weights_from_disk

if TYPE_CHECKING:
    from asyncllm.integrations.openai_server import OpenAIServer

__all__ = ["dev_routes"]


def dev_routes(server: "OpenAIServer") -> list[Route]:
    """The routes, each wrapped in the server's error mapping `guard` (the API key is checked before routing:
    openai_auth.py's `ApiKeyGate`)."""
    engine, guard = server.engine, server._guarded

    async def reset_prefix_cache(request: Request) -> Response:
        await engine.reset_prefix_cache()
        return Response(status_code=200)

    async def update_weights(request: Request) -> Response:
        body = decode_request(await server._body(request), UpdateWeightsFromDiskRequest)
        status, payload = await update_weights_from_disk(engine, body)
        return JSONResponse(payload, status)

    async def sleep(request: Request) -> Response:
        raw = request.query_params.get("level", "1")
        try:
            level = int(raw)
        except ValueError:
            raise InvalidRequestError("level", f"1 or 2, got {raw!r}") from None
        await engine.sleep(level)
        return Response(status_code=200)

    async def wake_up(request: Request) -> Response:
        await engine.wake_up(request.query_params.getlist("tags") or None)
        return Response(status_code=200)

    async def is_sleeping(request: Request) -> Response:
        return JSONResponse({"is_sleeping": await engine.is_sleeping()})

    return [Route("/reset_prefix_cache", guard(reset_prefix_cache), methods=["POST"]),
            Route("/update_weights_from_disk", guard(update_weights), methods=["POST"]),
            Route("/sleep", guard(sleep), methods=["POST"]), Route("/wake_up", guard(wake_up), methods=["POST"]),
            Route("/is_sleeping", guard(is_sleeping), methods=["GET"])]
