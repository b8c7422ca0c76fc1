"""Talking to the OpenAI-compatible app in-process: an httpx client over ASGI, and a stream's events."""

from __future__ import annotations

import json

import httpx


def asgi_client(app) -> httpx.AsyncClient:
    """A client whose requests go straight to ``app`` (no socket)."""
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


def http_scope(method: str, path: str, query: bytes = b"", headers: list | None = None,
               spec_version: str | None = "2.4") -> dict:
    """A raw ASGI HTTP scope, by default of ASGI spec 2.4, whose servers' send raises OSError once the client is gone
    (Starlette then stops listening for a disconnect and drops the body iterator); None: no spec version (2.0)."""
    asgi = {"version": "3.0"} if spec_version is None else {"version": "3.0", "spec_version": spec_version}
    return {"type": "http", "asgi": asgi, "http_version": "1.1",
            "method": method, "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": query,
            "root_path": "", "headers": headers or [], "client": ("127.0.0.1", 1), "server": ("test", 80)}


def sse_events(text: str) -> list:
    """The JSON payloads of a server-sent-events body, which must end with ``data: [DONE]``."""
    lines = [line[len("data: "):] for line in text.split("\n\n") if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


async def hang_up_on(app, request: httpx.Request, hang_up) -> list[dict]:
    """Run `request` by raw ASGI; the client hangs up once ``await hang_up()`` returns. The messages the app sent."""
    body, sent = request.read(), []
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict:
        if messages:
            return messages.pop()
        await hang_up()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    headers = [(k.lower(), v) for k, v in request.headers.raw]
    await app(http_scope(request.method, request.url.path, headers=headers, spec_version=None), receive, send)
    return sent
