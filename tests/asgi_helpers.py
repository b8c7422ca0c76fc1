"""Talking to the OpenAI-compatible app in-process: an httpx client over ASGI, and a stream's events."""

from __future__ import annotations

import json

import httpx


def asgi_client(app) -> httpx.AsyncClient:
    """A client whose requests go straight to ``app`` (no socket)."""
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


def sse_events(text: str) -> list:
    """The JSON payloads of a server-sent-events body, which must end with ``data: [DONE]``."""
    lines = [line[len("data: "):] for line in text.split("\n\n") if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]
