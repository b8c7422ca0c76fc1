"""The OpenAI-compatible app's own errors and limits over httpx's ASGI transport: HTTP-level errors, the body size
and request limits, the API key, and engine errors (overloaded, dead, invalid) mapped to statuses over a fake
engine; the routes are in tests/integrations/test_openai_asgi.py."""

from __future__ import annotations

import json

import pytest
from starlette.requests import Request

from asyncllm import EngineDeadError, EngineOverloadedError, InvalidRequestError
from asyncllm.integrations.openai_audio import _form
from asyncllm.integrations.openai_protocol import ServerLimits
from asyncllm.integrations.openai_server import create_app
from asyncllm.integrations.streams import ClientDisconnected
from asgi_helpers import asgi_client, http_scope
from test_openai_asgi import GREEDY, MODEL, _FailingEngine

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def test_http_level_errors(app) -> None:
    async with asgi_client(app) as client:
        wrong_model = await client.post("/v1/completions", json={**GREEDY, "model": "gpt-4", "prompt": "x"})
        no_route = await client.get("/v1/nothing")
        wrong_method = await client.get("/v1/completions")
        bad_json = await client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert (wrong_model.status_code, wrong_model.json()["error"]["code"]) == (404, "model_not_found")
    assert no_route.status_code == 404 and no_route.json()["error"]["type"] == "not_found_error"
    assert wrong_method.status_code == 405
    assert bad_json.status_code == 400 and bad_json.json()["error"]["param"] == "body"


async def test_deeply_nested_json_is_a_400_naming_the_field(app, caplog) -> None:
    deep = b"[" * 1000 + b"]" * 1000  # a 2 kB body past Python's recursion limit
    arguments = '{"a":' * 3000 + "1" + "}" * 3000  # a tool call's arguments, parsed for the chat template
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}]}]
    async with asgi_client(app) as client:
        replies = [await client.post("/v1/completions", content=b'{"prompt": ' + deep + b"}"),
                   await client.post("/invocations", content=b'{"prompt": ' + deep + b"}"),
                   await client.post("/tokenize", json={"model": MODEL, "messages": messages})]
        not_an_object = await client.post("/invocations", content=b"[1]")
    assert [(r.status_code, r.json()["error"]["param"]) for r in replies] == [(400, "body"), (400, "body"),
                                                                             (400, "messages")]
    assert "nested too deeply" in replies[0].text and "nested too deeply" in replies[2].text
    assert not_an_object.status_code == 400 and "'messages'" in not_an_object.json()["error"]["message"]
    assert not [r for r in caplog.records if r.levelname == "ERROR"]


def _gone_mid_upload(part: bytes):
    """An ASGI receive whose client sends `part` of the body, then hangs up."""
    messages = [{"type": "http.disconnect"}, {"type": "http.request", "body": part, "more_body": True}]

    async def receive() -> dict:
        return messages.pop()

    return receive


async def test_client_gone_mid_upload_is_a_quiet_499(app, caplog) -> None:
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    headers = [(b"content-type", b"application/json"), (b"content-length", b"1000")]
    await app(http_scope("POST", "/v1/completions", headers=headers), _gone_mid_upload(b'{"prompt": "ab'), send)
    assert sent[0]["status"] == 499  # as a disconnect while generating (guard), not a logged 500
    assert not [r for r in caplog.records if r.levelname == "ERROR"]
    form = Request(http_scope("POST", "/v1/audio/transcriptions",
                              headers=[(b"content-type", b"multipart/form-data; boundary=b")]),
                   _gone_mid_upload(b'--b\r\nContent-Disposition: form-data; name="model"\r\n\r\nw'))
    with pytest.raises(ClientDisconnected):  # an audio upload's form, as the body (guard answers 499)
        await _form(form, 1000)


async def test_body_size_and_limits(bundled_engine) -> None:
    app = create_app(bundled_engine, manage_engine=False,
                     limits=ServerLimits(max_body_bytes=200, max_n=2, max_tokens=4))
    async with asgi_client(app) as client:
        too_big = await client.post("/v1/completions", json={**GREEDY, "prompt": "x" * 300})
        too_many = await client.post("/v1/completions", json={**GREEDY, "prompt": "x", "n": 3})
        too_long = await client.post("/v1/completions", json={**GREEDY, "prompt": "x", "max_tokens": 5})
        capped = await client.post("/v1/chat/completions", json={"model": MODEL, "temperature": 0, "ignore_eos": True,
                                                                   "messages": [{"role": "user", "content": "x"}]})
    assert (too_big.status_code, too_big.json()["error"]["code"]) == (413, "request_too_large")
    assert (too_many.status_code, too_many.json()["error"]["param"]) == (400, "n")
    assert (too_long.status_code, too_long.json()["error"]["param"]) == (400, "max_tokens")
    assert capped.json()["usage"]["completion_tokens"] == 4  # no max_tokens: the server's limit applies


async def test_api_key(bundled_engine) -> None:
    app = create_app(bundled_engine, manage_engine=False, api_key="sekret")
    async with asgi_client(app) as client:
        missing = await client.get("/v1/models")
        wrong = await client.get("/v1/models", headers={"Authorization": "Bearer nope"})
        right = await client.get("/v1/models", headers={"Authorization": "Bearer sekret"})
        health = await client.get("/health")
    assert (missing.status_code, missing.json()["error"]["code"]) == (401, "invalid_api_key")
    assert wrong.status_code == 401 and right.status_code == 200 and health.status_code == 200
    app = create_app(bundled_engine, manage_engine=False, api_key=["k1", "k2"])  # vLLM's --api-key K1 K2: any
    async with asgi_client(app) as client:
        statuses = [(await client.get("/v1/models", headers={"Authorization": f"Bearer {key}"})).status_code
                    for key in ("k1", "k2", "k3", "k1k2")]
    assert statuses == [200, 200, 401, 401]


@pytest.mark.parametrize(("error", "status", "kind"), [
    (EngineOverloadedError("the queue is full"), 429, "rate_limit_error"),
    (EngineDeadError("engine core exited"), 503, "server_error"),
    (InvalidRequestError("prompt", "too long"), 400, "invalid_request_error"),
])
@pytest.mark.parametrize("stream", [False, True])
async def test_engine_errors_map_to_status(error, status, kind, stream) -> None:
    app = create_app(_FailingEngine(error), model_name="fake", manage_engine=False)
    async with asgi_client(app) as client:
        response = await client.post("/v1/completions", json={"model": "fake", "prompt": "x", "stream": stream})
    assert (response.status_code, response.json()["error"]["type"]) == (status, kind)
    assert response.json()["error"]["message"] == str(error)
    assert ("retry-after" in response.headers) == (status in (429, 503))


async def test_health_and_metrics_of_a_dead_engine() -> None:
    app = create_app(_FailingEngine(EngineDeadError("x"), alive=False), model_name="fake", manage_engine=False)
    async with asgi_client(app) as client:
        health = await client.get("/health")
        metrics = await client.get("/metrics")
    assert (health.status_code, health.json()) == (503, {"status": "unavailable"})
    assert metrics.status_code == 404


class _BreaksMidStream(_FailingEngine):
    """An engine whose streams hand out one delta, then fail with an error that is no asyncllm error (a bug)."""

    closed = 0

    def stream(self, prompt, params, **options):
        return self._Broken(self.error)

    chat = stream

    class _Broken(_FailingEngine._Stream):
        def __init__(self, error: Exception) -> None:
            super().__init__(error)
            self.sent = False

        async def __anext__(self):
            from asyncllm.outputs import StreamDelta

            if not self.sent:
                self.sent = True
                return StreamDelta(0, "Hello", [1])
            raise self.error

        async def aclose(self) -> None:
            _BreaksMidStream.closed += 1


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_an_unexpected_error_mid_stream_is_an_error_event(path, caplog) -> None:
    """As vLLM's stream generators (and a 500 before the stream starts: `guard`): the stream ends with an OpenAI error
    event and ``[DONE]``, not a connection dropped mid-body (clients saw an incomplete chunked read, no message)."""
    from asgi_helpers import sse_events

    app = create_app(_BreaksMidStream(RuntimeError("boom")), model_name="fake", manage_engine=False)
    body = {"model": "fake", "stream": True,
            **({"messages": [{"role": "user", "content": "x"}]} if "chat" in path else {"prompt": "x"})}
    async with asgi_client(app) as client:
        response = await client.post(path, json=body)
    events = sse_events(response.text)
    assert response.status_code == 200 and "Hello" in response.text
    assert events[-1] == {"error": {"message": "internal error: RuntimeError", "type": "server_error", "param": None,
                                    "code": None}}
    assert "unexpected error in a stream of " + path in caplog.text and _BreaksMidStream.closed >= 1


async def test_an_unexpected_error_mid_response_stream_is_an_error_event(caplog) -> None:
    """The Responses API's stream as chat's: an ``error`` event ends it (OpenAI's ``ResponseErrorEvent``), logged,
    its request aborted; until 2026-12-08 the exception left the response, cut off mid-body."""
    app = create_app(_BreaksMidStream(RuntimeError("boom")), model_name="fake", manage_engine=False)
    async with asgi_client(app) as client:
        response = await client.post("/v1/responses", json={"model": "fake", "input": "x", "stream": True})
    events = [json.loads(line[len("data: "):]) for line in response.text.splitlines() if line.startswith("data: ")]
    assert response.status_code == 200 and "Hello" in response.text
    assert events[-1]["type"] == "error" and events[-1]["message"] == "internal error: RuntimeError"
    assert "unexpected error in a stream of /v1/responses" in caplog.text and _BreaksMidStream.closed >= 1
