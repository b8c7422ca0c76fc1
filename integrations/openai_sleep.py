"""vLLM's sleep-mode development routes (with ASYNCLLM_SERVER_DEV_MODE=1; docs/sleep-mode.md).

``POST /sleep?level=1`` runs `AsyncEngine.sleep`, ``POST /wake_up`` (optional repeated ``tags``, e.g.
``/wake_up?tags=weights``) `AsyncEngine.wake_up`, and ``GET /is_sleeping`` answers ``{"is_sleeping": bool}``.
The first two answer 200 with no body, as vLLM's do; a bad level or tag is a 400 naming ``level`` / ``tags``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from asyncllm.errors import InvalidRequestError

if TYPE_CHECKING:
    from asyncllm.integrations.openai_server import OpenAIServer

__all__ = ["sleep_routes"]


def sleep_routes(server: "OpenAIServer") -> list[Route]:
    """The routes, each wrapped in the server's API-key check and error mapping."""
    engine, guard = server.engine, server._guarded

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

    return [Route("/sleep", guard(sleep), methods=["POST"]), Route("/wake_up", guard(wake_up), methods=["POST"]),
            Route("/is_sleeping", guard(is_sleeping), methods=["GET"])]
