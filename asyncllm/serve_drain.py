"""``asyncllm serve --shutdown-timeout N``'s drain at the HTTP layer (vLLM's): a request is in flight from when the
server accepts it (its body still being read, its template rendered, its media fetched, its prompt tokenized, its
beam search between steps) to its response's end. The drain waits for those in flight, up to N s; the engine takes
their calls all along, and its close then aborts what is left (cli_serve.py). New connections are refused from
uvicorn's next tick after the signal on (within 0.1 s it closes its listening socket and idle keep-alive
connections); a request that arrives during the
drain on a connection still open is refused with 503."""

from __future__ import annotations

import asyncio
from typing import Any

import anyio

__all__ = ["RequestGate", "route_path"]

UNCOUNTED = frozenset({"/health", "/ping", "/metrics"})
"""Probes and scrapes: answered during a drain on a connection still open (new connections are refused), never
holding it (vLLM's /metrics reads on while it drains)."""

REFUSAL = "the server is shutting down (--shutdown-timeout drain); it takes no new requests"


class RequestGate:
    """ASGI middleware over the served app (any ASGI app): counts the HTTP requests in flight; once `drain` began, a
    new one (on a connection still open) is refused with 503 (an OpenAI-style error body)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.in_flight = 0
        self.draining = False
        self._idle = asyncio.Event()  # (bound to the loop that first waits on it: the serving one)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or route_path(scope) in UNCOUNTED:
            await self.app(scope, receive, send)
            return
        if self.draining:
            await _refuse(scope, receive, send)
            return
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1
            if not self.in_flight:
                self._idle.set()

    async def drain(self, timeout: float) -> None:
        """Refuse new requests from now on; return once none is in flight, or after `timeout` seconds."""
        self.draining = True
        if self.in_flight:
            self._idle.clear()
            with anyio.move_on_after(timeout):
                await self._idle.wait()


def route_path(scope: dict) -> str:
    """The path the app's routes see: a --root-path prefix that the server left on it removed (the API-key gate's
    too: integrations/openai_auth.py)."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


async def _refuse(scope: dict, receive: Any, send: Any) -> None:
    """503 with the body and ``Retry-After`` of the engine's own refusal while closing (`EngineDeadError`)."""
    from asyncllm.errors import EngineDeadError
    from asyncllm.integrations.openai_http import error_response

    await error_response(EngineDeadError(REFUSAL))(scope, receive, send)
