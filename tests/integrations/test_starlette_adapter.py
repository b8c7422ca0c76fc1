"""The Starlette adapter's `text_stream_response`, in process over the shared engine's loop."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from urllib.parse import urlencode

import pytest
from asgi_helpers import asgi_client, http_scope
from starlette.applications import Starlette
from starlette.routing import Route

from asyncllm import SamplingParams
from asyncllm.integrations.starlette import text_stream_response
from stream_stubs import MID_STREAM_ENDS, FailingStream, StalledStream, error_line_of

pytestmark = pytest.mark.asyncio(loop_scope="session")

PARAMS = {"temperature": 0, "max_tokens": 8}


def _app(make_stream) -> Starlette:
    async def complete(request):
        return text_stream_response(make_stream(request.query_params["prompt"]), request)

    return Starlette(routes=[Route("/complete", complete)])


async def _call(app: Starlette, prompt: str, hang_up: Callable[[list[dict]], Awaitable[None]]) -> list[dict]:
    """Run one request by raw ASGI; the client hangs up once `hang_up(messages sent so far)` returns."""
    sent: list[dict] = []

    async def receive() -> dict:
        await hang_up(sent)
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = http_scope("GET", "/complete", urlencode({"prompt": prompt}).encode())  # 2.4: Starlette does not listen
    await asyncio.wait_for(app(scope, receive, send), 10)
    return sent


async def test_text_stream_response_streams_and_refuses_bad_prompts(bundled_engine) -> None:
    app = _app(lambda prompt: bundled_engine.stream(prompt, SamplingParams(**PARAMS)))
    async with asgi_client(app) as client:
        good = await client.get("/complete", params={"prompt": "while True:"})
        empty = await client.get("/complete", params={"prompt": ""})
        too_long = await client.get("/complete", params={"prompt": "x " * bundled_engine.config.max_model_len})
    expected = (await bundled_engine.generate("while True:", SamplingParams(**PARAMS))).text
    assert good.status_code == 200 and good.text == expected
    assert good.headers["content-type"] == "text/plain; charset=utf-8"
    empty_text = (await bundled_engine.generate("", SamplingParams(**PARAMS))).text  # from [BOS], as vLLM's
    assert empty.status_code == 200 and empty.text == empty_text
    assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "context_length_exceeded"
    several = _app(lambda prompt: bundled_engine.stream(prompt, SamplingParams(**PARAMS, n=2)))
    async with asgi_client(several) as client:  # two samples' texts would interleave in one text stream
        refused = await client.get("/complete", params={"prompt": "x"})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "n"


async def test_disconnect_while_queued_aborts() -> None:
    stream = StalledStream()

    async def once_queued(sent: list[dict]) -> None:
        await stream.waiting.wait()

    sent = await _call(_app(lambda prompt: stream), "x", once_queued)
    assert stream.closed.is_set()
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 499  # no 200 before the first delta


async def test_disconnect_while_queued_aborts_without_the_request() -> None:
    """`text_stream_response(stream)` with no `request` (it is optional) listens to its own connection: a client
    gone while its request was queued left it queued until it ran and its first token came."""
    stream = StalledStream()

    async def complete(request):
        return text_stream_response(stream)

    async def once_queued(sent: list[dict]) -> None:
        await stream.waiting.wait()

    sent = await _call(Starlette(routes=[Route("/complete", complete)]), "x", once_queued)
    assert stream.closed.is_set() and sent[0]["status"] == 499


async def test_disconnect_between_tokens_aborts(bundled_engine) -> None:
    aborted_before = bundled_engine.stats().request_success_total.get("abort", 0)
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)  # seconds of work on this model

    async def after_some_text(sent: list[dict]) -> None:
        while not any(message.get("body") for message in sent):
            await asyncio.sleep(0.005)

    sent = await _call(_app(lambda prompt: bundled_engine.stream(prompt, params)), "def f():", after_some_text)
    assert sent[0]["status"] == 200 and sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
    for _ in range(250):
        if bundled_engine.stats().request_success_total.get("abort", 0) > aborted_before:
            break
        await asyncio.sleep(0.02)
    assert bundled_engine.stats().request_success_total.get("abort", 0) == aborted_before + 1


@pytest.mark.parametrize("end", list(MID_STREAM_ENDS))
async def test_error_mid_stream_ends_the_text_with_an_error_line(end) -> None:
    """An engine error after the first bytes (the engine died, an error found late, an abort): the request is
    aborted and the text ends with a line of its JSON error body, the body ended as usual (was: the exception out
    of the app, a traceback in the server's log and a connection cut mid-body; an abort ended as a whole text)."""
    make, kind, code = MID_STREAM_ENDS[end]
    texts = ("héllo ", "wörld")
    stream = FailingStream(texts, make())
    async with asgi_client(_app(lambda prompt: stream)) as client:
        response = await client.get("/complete", params={"prompt": "x"})
    assert response.status_code == 200 and response.headers["content-type"] == "text/plain; charset=utf-8"
    assert response.headers["cache-control"] == "no-cache" and response.headers["x-accel-buffering"] == "no"
    error = error_line_of(response.text, texts)
    assert (error["type"], error["code"]) == (kind, code) and stream.closed.is_set()


async def test_a_request_aborted_before_its_first_token_is_an_error_status() -> None:
    """Aborted while queued (`AsyncEngine.abort`, the engine closing): no status was sent, so its error's (was: a 200
    with no text, as if the completion were empty)."""
    stream = FailingStream((), "abort")
    async with asgi_client(_app(lambda prompt: stream)) as client:
        response = await client.get("/complete", params={"prompt": "x"})
    assert response.status_code == 500 and response.json()["error"]["code"] == "request_aborted"
    assert stream.closed.is_set()


async def test_head_request_is_not_generated() -> None:
    """HEAD on a GET route (Starlette's Route adds it): GET's status and headers, no body, the request aborted after
    its first delta (was: the whole text generated, for the server to drop)."""
    stream = FailingStream(("a", "b", "c"), "abort")
    async with asgi_client(_app(lambda prompt: stream)) as client:
        response = await client.head("/complete", params={"prompt": "x"})
    assert response.status_code == 200 and response.headers["content-type"] == "text/plain; charset=utf-8"
    assert response.content == b"" and stream.texts == ["b", "c"] and stream.closed.is_set()


async def test_a_request_aborted_mid_stream_ends_with_an_error_line(bundled_engine) -> None:
    """`AsyncEngine.abort` by the host's code (or the engine's close) mid-stream: the text said nothing of it."""
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)  # seconds of work on this model
    streams = []

    def make(prompt: str):
        streams.append(bundled_engine.stream(prompt, params))
        return streams[-1]

    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)
        if message.get("body") and len(sent) == 2:  # the first text: abort it
            await bundled_engine.abort(streams[0].request_id)

    scope = http_scope("GET", "/complete", b"prompt=def+f():")
    await asyncio.wait_for(_app(make)(scope, asyncio.Event().wait, send), 20)
    body = b"".join(message.get("body", b"") for message in sent[1:]).decode()
    assert sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
    error = error_line_of(body, (body.rsplit("\n", 2)[0],))
    assert error["code"] == "request_aborted"


async def test_a_failed_send_closes_the_stream_at_once() -> None:
    """A spec 2.4 server's send raising OSError (the client gone): Starlette drops the body iterator unclosed, so the
    response closes the stream itself, not a garbage-collection pass later."""
    import gc

    stream = StalledStream(("a", "b", "c"))
    app = _app(lambda prompt: stream)
    chunks = 0

    async def send(message: dict) -> None:
        nonlocal chunks
        chunks += message["type"] == "http.response.body"
        if chunks == 2:
            raise OSError("connection reset")

    scope = http_scope("GET", "/complete", b"prompt=x")
    gc.disable()
    try:
        with pytest.raises(Exception):  # the server's to handle (OSError, or Starlette's ClientDisconnect)
            await asyncio.wait_for(app(scope, asyncio.Event().wait, send), 10)
        assert stream.closed.is_set()
    finally:
        gc.enable()


async def test_a_lifespan_given_a_factory_makes_an_engine_per_startup() -> None:
    """A closed engine never starts again: an app started twice (a TestClient per test) gives a factory, and each
    startup serves and closes an engine of its own."""
    from asyncllm import AsyncEngine
    from asyncllm.integrations.starlette import engine_lifespan

    made: list[AsyncEngine] = []

    def factory() -> AsyncEngine:
        made.append(AsyncEngine(disable_log_stats=True))
        return made[-1]

    lifespan = engine_lifespan(factory)
    for startup in range(2):
        async with lifespan(None) as state:
            assert state["engine"] is made[startup] and made[startup].is_running
        assert made[startup].is_stopped
    assert len(made) == 2
