"""The OpenAI server's streams when the client hangs up while its requests wait for their first token (queued
behind a full engine): the requests are aborted at once, not after a first token, and the client gets a 499."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from asgi_helpers import hang_up_on

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
