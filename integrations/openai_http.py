"""The OpenAI server's HTTP steps every route shares: the API key, the caller's trace context, one admission group,
the body's size bound, the replies, and the optional middleware (`CorsPolicy`, `RequestIdHeaders`).

Errors become OpenAI-style bodies ``{"error": {"message", "type", "param",
"code"}}`` with the status of the asyncllm error (errors.py: 400 invalid
request, 401 bad API key, 404 unknown model or route, 413 body too large, 429
engine overloaded, 503 engine dead); anything else a handler raises is logged
and answered as a 500 of that shape.
"""

from __future__ import annotations

import hmac
import logging
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
from starlette.datastructures import Headers, MutableHeaders
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from asyncllm.engine.admission import admission_group
from asyncllm.errors import AsyncLLMError
from asyncllm.integrations.errors import ApiError, context_param, error_body
from asyncllm.integrations.streams import ClientDisconnected
from asyncllm.metrics.tracing import remote_parent

__all__ = ["SSE_HEADERS", "EventStream", "CorsPolicy", "RequestIdHeaders", "guard", "read_body", "error_response", "json_response",
           "text_response", "not_found", "not_allowed", "api_key_bytes"]

logger = logging.getLogger("asyncllm.integrations.openai")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
"""An event stream's headers: not cached, and not buffered by a proxy (nginx) that would hold its chunks back."""


class EventStream(StreamingResponse):
    """A server-sent events reply (`SSE_HEADERS`) that closes its event generator however the reply ends: Starlette
    drops the body iterator unclosed when a send fails (ASGI spec 2.4 servers), and the requests' abort (the
    generator's ``finally``) then waited for a garbage-collection pass."""

    def __init__(self, events: Any) -> None:
        super().__init__(events, media_type="text/event-stream", headers=SSE_HEADERS)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]

Handler = Callable[[Request], Awaitable[Response]]


def guard(handler: Handler) -> Handler:
    """`handler` with its errors mapped to OpenAI-style bodies (the API key is checked before routing, by
    `openai_auth.ApiKeyGate`); it runs in the caller's trace context (`remote_parent`: its requests' spans under the
    caller's, as vLLM's) and in an `admission_group`: the engine requests it makes (its prompts) are admitted
    together, the group's size set where they are made (its prompts × n, `admission_group(size)`); a beam search's
    steps are groups of their own."""

    async def guarded(request: Request) -> Response:
        try:
            with remote_parent(request.headers), admission_group():  # spans under the caller's trace
                return await handler(request)
        except (AsyncLLMError, ApiError) as exc:
            return error_response(context_param(exc))  # a prompt past the context: ``input_tokens``, as vLLM's
        except ClientDisconnected:
            return Response(status_code=499)  # nobody reads it: the client is gone, its requests aborted
        except Exception as exc:  # noqa: BLE001 - an OpenAI-style 500 instead of a bare one; logged
            logger.exception("unexpected error in %s", request.url.path)
            return error_response(ApiError(500, f"internal error: {type(exc).__name__}", "server_error"))

    return guarded


def api_key_bytes(api_key: str | Sequence[str] | None) -> tuple[bytes, ...]:
    """The keys a request may send (`ApiKeyGate`'s): one, or several as vLLM's ``--api-key K1 K2``; "" and None:
    none."""
    keys = [api_key] if isinstance(api_key, str) else list(api_key or ())
    return tuple(key.encode() for key in keys if key)


def check_api_key(request: Request, api_keys: tuple[bytes, ...]) -> None:
    """A 401 `ApiError` unless the request sends ``Authorization: Bearer`` and one of the keys (each compared, in
    constant time)."""
    if not api_keys:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    sent = token.strip().encode()
    if scheme.lower() != "bearer" or not any([hmac.compare_digest(sent, key) for key in api_keys]):
        raise ApiError(401, "missing or wrong API key (send 'Authorization: Bearer KEY')",
                       "authentication_error", code="invalid_api_key")


async def read_body(request: Request, limit: int) -> bytes:
    """The request's body; a 413 `ApiError` as soon as it declares or sends more than `limit` bytes,
    `ClientDisconnected` when the client goes before sending it all."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(limit)
            chunks.append(chunk)
    except ClientDisconnect:  # gone mid-upload: a quiet 499 (`guard`), as a disconnect while generating
        raise ClientDisconnected() from None
    return b"".join(chunks)


def error_response(exc: AsyncLLMError | ApiError) -> Response:
    status, body, headers = error_body(exc)
    return json_response(body, status, headers)


def json_response(payload: dict[str, Any], status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(msgspec.json.encode(payload), status_code=status, media_type="application/json", headers=headers)


def text_response(message: str) -> Response:
    """A plain-text 200, as vLLM answers its adapter routes."""
    return Response(message, media_type="text/plain")


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is larger than {limit} bytes", "invalid_request_error",
                    code="request_too_large")


async def not_found(request: Request, exc: Exception) -> Response:
    return error_response(ApiError(404, f"no route {request.url.path}", "not_found_error"))


async def not_allowed(request: Request, exc: Exception) -> Response:
    return error_response(ApiError(405, f"{request.method} is not allowed on {request.url.path}",
                                   "invalid_request_error"))


class RequestIdHeaders:
    """vLLM's ``--enable-request-id-headers``: every HTTP response carries ``X-Request-Id``, the request's own
    header when it sent one, else a random id (as vLLM's: the body's ``request_id`` does not change it)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = Headers(scope=scope).get("x-request-id") or uuid.uuid4().hex

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)["X-Request-Id"] = request_id
            await send(message)

        await self.app(scope, receive, send_with_id)


@dataclass(frozen=True, slots=True)
class CorsPolicy:
    """Which browser origins may call the server (vLLM's ``--allowed-origins``, ``--allowed-methods``,
    ``--allowed-headers``, ``--allow-credentials``, with vLLM's defaults); Starlette's `CORSMiddleware` applies it."""

    allowed_origins: Sequence[str] = ("*",)
    allowed_methods: Sequence[str] = ("*",)
    allowed_headers: Sequence[str] = ("*",)
    allow_credentials: bool = False

    def middleware(self) -> Middleware:
        return Middleware(CORSMiddleware, allow_origins=list(self.allowed_origins),
                          allow_methods=list(self.allowed_methods), allow_headers=list(self.allowed_headers),
                          allow_credentials=self.allow_credentials)
