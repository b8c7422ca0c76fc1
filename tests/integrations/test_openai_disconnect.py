"""The OpenAI server's streams when the client hangs up while its requests wait for their first token (queued
behind a full engine): the requests are aborted at once, not after a first token, and the client gets a 499."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from asgi_helpers import hang_up_on, http_scope

from stream_stubs import StalledStream

pytestmark = pytest.mark.asyncio(loop_scope="session")

MODEL = "asyncllm-tiny"


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/completions", {"prompt": ["a", "b"]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/responses", {"input": "hi"}),
])
async def test_a_client_gone_while_queued_aborts_its_stream(app, bundled_engine, monkeypatch, path, body) -> None:
    streams: list[StalledStream] = []

    def queued(*args, **kwargs) -> StalledStream:
        streams.append(StalledStream())
        return streams[-1]

    monkeypatch.setattr(bundled_engine, "stream", queued)
    monkeypatch.setattr(bundled_engine, "chat", queued)
    request = httpx.Request("POST", f"http://test{path}", json={"model": MODEL, "stream": True, **body})

    async def once_all_queued() -> None:
        while not streams or not all(stream.waiting.is_set() for stream in streams):
            await asyncio.sleep(0.001)

    sent = await asyncio.wait_for(hang_up_on(app, request, once_all_queued), 5)
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 499  # no 200 before a first token
    assert len(streams) == len(body.get("prompt", [0])) and all(stream.closed.is_set() for stream in streams)


async def test_a_failed_send_aborts_a_streamed_completion_at_once(app, bundled_engine) -> None:
    """An ASGI spec 2.4 server's send raising OSError (the client gone): Starlette drops the event generator unclosed,
    and the request ran on until a garbage-collection pass (`EventStream` closes it)."""
    import gc

    body = httpx.Request("POST", "http://test/v1/completions", json={
        "model": MODEL, "stream": True, "prompt": "a", "max_tokens": 400, "ignore_eos": True}).read()
    messages, chunks = [{"type": "http.request", "body": body, "more_body": False}], 0

    async def receive() -> dict:
        if messages:
            return messages.pop()
        await asyncio.Event().wait()

    async def send(message: dict) -> None:
        nonlocal chunks
        chunks += message["type"] == "http.response.body"
        if chunks == 3:
            raise OSError("connection reset")

    scope = http_scope("POST", "/v1/completions", headers=[(b"content-type", b"application/json")])
    gc.disable()
    try:
        with pytest.raises(Exception):  # the server's to handle (OSError, or Starlette's ClientDisconnect)
            await asyncio.wait_for(app(scope, receive, send), 10)
        for _ in range(200):  # the abort reaches the core within a step or two
            if bundled_engine.stats().num_requests_running == 0:
                break
            await asyncio.sleep(0.01)
        assert bundled_engine.stats().num_requests_running == 0
    finally:
        gc.enable()
