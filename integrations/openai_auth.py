"""The API key checked before routing (`ApiKeyGate`), as vLLM's ``AuthenticationMiddleware``.

The gate is the server's one key check (its routes' `guard`, openai_http.py, has none), so that a client without
the key gets the same 401 on every path and method, a route that does not exist or a method a route does not take
included: it cannot tell from a 404 or a 405 which routes (optional features: runtime LoRA updating, the dev
routes, the Responses API store) the server has. Only `OPEN_PATHS` answer without it.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from asyncllm.integrations.errors import ApiError
from asyncllm.integrations.openai_http import check_api_key, error_response
from asyncllm.serve_drain import route_path

__all__ = ["OPEN_PATHS", "ApiKeyGate"]

OPEN_PATHS = frozenset({"/health", "/ping", "/metrics", "/version"})
"""Paths served without the key (probes and monitoring, as vLLM's: its middleware guards ``/v1`` paths only)."""


class ApiKeyGate:
    """ASGI middleware: an HTTP request to any path but `OPEN_PATHS` without one of `api_keys` (``Authorization:
    Bearer KEY``, compared in constant time: `check_api_key`) is answered 401 before routing; none: all pass. It sits
    inside the CORS middleware, which answers a browser's preflight itself (a preflight carries no key)."""

    def __init__(self, app: ASGIApp, api_keys: tuple[bytes, ...] = ()) -> None:
        self.app = app
        self.api_keys = api_keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.api_keys and scope["type"] == "http" and route_path(scope).rstrip("/") not in OPEN_PATHS:
            try:
                check_api_key(Request(scope), self.api_keys)
            except ApiError as exc:
                await error_response(exc)(scope, receive, send)
                return
        await self.app(scope, receive, send)
