"""The aiohttp and Django adapters with their own test clients, on the shared engine's loop."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import SimpleNamespace

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from asyncllm import SamplingParams
from asyncllm.integrations import aiohttp as aiohttp_adapter
from stream_stubs import MID_STREAM_ENDS, FailingStream, StalledStream, error_line_of

pytestmark = pytest.mark.asyncio(loop_scope="session")

PARAMS = {"temperature": 0, "max_tokens": 8}


async def _expected(engine, prompt: str) -> str:
    return (await engine.generate(prompt, SamplingParams(**PARAMS))).text


# ---------------------------------------------------------------- aiohttp
async def test_aiohttp_streams_generated_text(bundled_engine) -> None:
    app = web.Application()
    aiohttp_adapter.setup_engine(app, bundled_engine, close=False)
    app.router.add_post("/generate", aiohttp_adapter.generate_handler)
    async with TestClient(TestServer(app)) as client:
        response = await client.post("/generate", json={"prompt": "while True:", **PARAMS})
        chunks = [chunk async for chunk in response.content.iter_any()]
        bad = await client.post("/generate", json={"prompt": "x", "temperature": -1})
        bad_body = await bad.json()
        unknown = await client.post("/generate", json={"prompt": "x", "colour": "red"})
        unknown_body = await unknown.json()
        several = await client.post("/generate", json={"prompt": "x", **PARAMS, "n": 2})  # texts would interleave
        several_body = await several.json()
    assert response.status == 200 and response.headers["Content-Type"].startswith("text/plain")
    assert b"".join(chunks).decode() == await _expected(bundled_engine, "while True:")
    assert bad.status == 400 and bad_body["error"]["param"] == "temperature"
    assert unknown.status == 400 and unknown_body["error"]["param"] == "body"
    assert several.status == 400 and several_body["error"]["param"] == "n"
    assert bundled_engine.started  # close=False: the app's cleanup left the shared engine running


async def test_aiohttp_error_found_late_in_a_real_request_ends_with_its_error_line(bundled_engine) -> None:
    """The engine finds an error after the first tokens (a grammar whose next token allowed_token_ids forbid): the
    text so far, then its error line, the body complete (was: a traceback in aiohttp's log, the connection cut)."""
    a = (await bundled_engine.get_tokenizer()).encode("a", add_special_tokens=False)
    app = web.Application()
    aiohttp_adapter.setup_engine(app, bundled_engine, close=False)
    app.router.add_post("/generate", aiohttp_adapter.generate_handler)
    async with TestClient(TestServer(app)) as client:
        response = await client.post("/generate", json={"prompt": "x", "max_tokens": 8, "temperature": 0,
                                                        "structured_outputs": {"regex": "aab"},
                                                        "allowed_token_ids": a})
        body = await response.text()
    assert response.status == 200
    assert error_line_of(body, ("aa",))["param"] == "allowed_token_ids"


async def test_aiohttp_generate_constraint_errors_name_the_field_sent(bundled_engine) -> None:
    """An invalid constraint in ``/generate``'s body names the field the client sent it in, found on the host or in
    the core's compile alike (was: ``param: "structured"``, the engine's name)."""
    app = web.Application()
    aiohttp_adapter.setup_engine(app, bundled_engine, close=False)
    app.router.add_post("/generate", aiohttp_adapter.generate_handler)
    errors = {}
    async with TestClient(TestServer(app)) as client:
        for field, regex in [("structured_outputs", ""), ("guided_decoding", ""), ("structured_outputs", "("),
                             ("guided_decoding", "("), ("structured", "")]:
            response = await client.post("/generate", json={"prompt": "x", **PARAMS, field: {"regex": regex}})
            assert response.status == 400
            errors[field, regex] = (await response.json())["error"]
    assert {key: error["param"] for key, error in errors.items()} == {key: key[0] for key in errors}
    assert errors["guided_decoding", "("]["message"].startswith("guided_decoding: invalid regex")


async def test_aiohttp_custom_handler_with_engine_key(bundled_engine) -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        engine = request.app[aiohttp_adapter.ENGINE_KEY]
        return await aiohttp_adapter.stream_text(request, engine.stream(request.query["q"], SamplingParams(**PARAMS)))

    app = web.Application()
    aiohttp_adapter.setup_engine(app, bundled_engine, close=False)
    app.router.add_get("/q", handler)
    async with TestClient(TestServer(app)) as client:
        text = await (await client.get("/q", params={"q": "import re"})).text()
    assert text == await _expected(bundled_engine, "import re")


@asynccontextmanager
async def _served(make_stream) -> AsyncIterator[str]:
    """``GET /q`` streaming `make_stream()`, served with `web.run_app`'s defaults: unlike aiohttp's
    TestServer, a client that disconnects does not cancel the handler. Yields the URL."""

    async def handler(request: web.Request) -> web.StreamResponse:
        return await aiohttp_adapter.stream_text(request, make_stream())

    app = web.Application()
    app.router.add_get("/q", handler)
    runner = web.AppRunner(app, shutdown_timeout=1)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield "http://127.0.0.1:%d/q" % runner.addresses[0][1]
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("texts", [(), ("def",)], ids=["queued", "stalled-mid-stream"])
async def test_aiohttp_disconnect_while_waiting_aborts(texts, caplog) -> None:
    """A client that leaves while no delta comes (queued, or preempted) aborts the request, without an ERROR log."""
    stream = StalledStream(texts)
    async with _served(lambda: stream) as url, aiohttp.ClientSession() as client:

        async def read() -> None:
            async with client.get(url) as response:
                await response.read()

        call = asyncio.ensure_future(read())
        await asyncio.wait_for(stream.waiting.wait(), 5)
        call.cancel()  # closes the connection
        await asyncio.wait_for(stream.closed.wait(), 2)
    assert not [record for record in caplog.records if record.levelno >= logging.ERROR]


async def test_aiohttp_disconnect_between_tokens_aborts(bundled_engine, caplog) -> None:
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)  # seconds of work on this model
    aborted_before = bundled_engine.stats().request_success_total.get("abort", 0)
    async with _served(lambda: bundled_engine.stream("x", params)) as url, aiohttp.ClientSession() as client:
        response = await client.get(url)
        assert response.status == 200 and await response.content.readany()
        response.close()  # hang up mid-stream
        for _ in range(250):
            if bundled_engine.stats().request_success_total.get("abort", 0) > aborted_before:
                break
            await asyncio.sleep(0.02)
    assert bundled_engine.stats().request_success_total.get("abort", 0) == aborted_before + 1
    assert not [record for record in caplog.records if record.levelno >= logging.ERROR]


@pytest.mark.parametrize("end", list(MID_STREAM_ENDS))
async def test_aiohttp_error_mid_stream_ends_the_text_with_an_error_line(end, caplog) -> None:
    """An engine error after the first bytes (the engine died, an error found late, an abort): the request is
    aborted and the text ends with a line of its JSON error body, the body complete (was: a traceback in aiohttp's
    log, the connection cut mid-body: the client's ClientPayloadError, no reason; an abort ended as a whole text)."""
    make, kind, code = MID_STREAM_ENDS[end]
    texts = ("héllo ", "wörld")
    stream = FailingStream(texts, make())
    async with _served(lambda: stream) as url, aiohttp.ClientSession() as client:
        async with client.get(url) as response:
            body = (await response.read()).decode()
    assert response.status == 200 and response.headers["Content-Type"] == "text/plain; charset=utf-8"
    assert response.headers["Cache-Control"] == "no-cache" and response.headers["X-Accel-Buffering"] == "no"
    error = error_line_of(body, texts)
    assert (error["type"], error["code"]) == (kind, code) and stream.closed.is_set()
    errors = [record for record in caplog.records if record.levelno >= logging.ERROR]
    assert [record.name for record in errors] == (["asyncllm.integrations"] if end == "bug" else [])


@pytest.mark.parametrize("given, sent", [("text/markdown", "text/markdown; charset=utf-8"),
                                         ("text/plain; charset=utf-8", "text/plain; charset=utf-8")])
async def test_aiohttp_content_type_names_one_charset(given, sent) -> None:
    """`content_type` with its charset already (as Starlette's media_type and Django's content_type take it) was
    sent with a second one, ``text/plain; charset=utf-8; charset=utf-8``."""
    app = web.Application()

    async def handler(request: web.Request) -> web.StreamResponse:
        return await aiohttp_adapter.stream_text(request, FailingStream(("a",), StopAsyncIteration()),
                                                 content_type=given)

    app.router.add_get("/q", handler)
    async with TestClient(TestServer(app)) as client:
        response = await client.get("/q")
        assert await response.text() == "a" and response.headers["Content-Type"] == sent


async def test_aiohttp_request_aborted_before_its_first_token_is_an_error_status() -> None:
    """Aborted while queued (`AsyncEngine.abort`, the engine closing): its error's status (was: an empty 200)."""
    stream = FailingStream((), "abort")
    async with _served(lambda: stream) as url, aiohttp.ClientSession() as client:
        async with client.get(url) as response:
            body = await response.json()
    assert response.status == 500 and body["error"]["code"] == "request_aborted" and stream.closed.is_set()


async def test_aiohttp_head_request_is_not_generated_and_sends_no_body() -> None:
    """HEAD on a GET route (aiohttp routes it to the GET handler): GET's status and headers, the request aborted
    after its first delta (was: the whole text generated, and written after the headers as a body a HEAD response
    has none of, so the next response on the connection was read from the middle of it)."""
    streams = [FailingStream(("a", "b", "c"), "abort"), FailingStream(("d",), "abort")]
    async with _served(iter(streams).__next__) as url, aiohttp.ClientSession() as client:
        async with client.head(url) as head:
            assert await head.read() == b""
        async with client.get(url) as after:  # the same kept-alive connection
            after_body = await after.text()
    assert head.status == 200 and head.headers["Content-Type"] == "text/plain; charset=utf-8"
    assert head.headers["Cache-Control"] == "no-cache"
    assert streams[0].texts == ["b", "c"] and streams[0].closed.is_set()
    assert after.status == 200 and after_body.startswith("d\n")  # then its abort's error line


# ---------------------------------------------------------------- Django
urlpatterns: list = []  # this module is the test project's ROOT_URLCONF


def _django_settings() -> None:
    import django
    from django.conf import settings

    if not settings.configured:
        settings.configure(DEBUG=False, ROOT_URLCONF=__name__, ALLOWED_HOSTS=["*"], SECRET_KEY="test",
                           INSTALLED_APPS=[], MIDDLEWARE=[])
        django.setup()


@pytest.fixture(scope="module")
def django_client(bundled_engine):
    _django_settings()
    from django.test import AsyncClient
    from django.urls import path

    from asyncllm.integrations import django as django_adapter

    async def complete(request):
        engine = django_adapter.get_engine()
        return await django_adapter.stream_response(engine.stream(request.GET["prompt"], SamplingParams(**PARAMS)))

    urlpatterns[:] = [path("complete", complete)]
    django_adapter.use_engine(bundled_engine)
    return AsyncClient()


async def test_django_streaming_view(django_client, bundled_engine) -> None:
    response = await django_client.get("/complete", {"prompt": "if x:"})
    assert response.status_code == 200 and response.streaming
    body = b"".join([chunk async for chunk in response.streaming_content]).decode()
    assert body == await _expected(bundled_engine, "if x:")


async def test_django_error_is_json(django_client, bundled_engine) -> None:
    response = await django_client.get("/complete", {"prompt": "x " * bundled_engine.config.max_model_len})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "prompt"


async def test_django_lazy_engine_from_settings(django_client) -> None:
    """No engine given: `get_engine` makes one from settings.ASYNCLLM without starting it."""
    from django.conf import settings

    from asyncllm.bundled import bundled_model_path
    from asyncllm.integrations import django as django_adapter

    previous = django_adapter.get_engine()
    settings.ASYNCLLM = {"max_num_seqs": 3}
    try:
        django_adapter.use_engine(None)  # forget the shared one
        engine = django_adapter.get_engine()
        assert engine is django_adapter.get_engine() and not engine.started
        assert engine.config.model == bundled_model_path() and engine.config.max_num_seqs == 3
        await django_adapter.close_engine()
    finally:
        del settings.ASYNCLLM
        django_adapter.use_engine(previous)


async def test_django_engine_moves_to_the_next_loop_once_the_first_closed() -> None:
    """Django's sync test Client and WSGI run each async view under asgiref's async_to_sync, on a new loop closed
    after it: a started engine was refused on the second loop though the first had closed. A loop still open is."""
    _django_settings()
    from django.core.exceptions import ImproperlyConfigured

    from asyncllm.integrations import django as django_adapter

    previous, engine = django_adapter.get_engine(), SimpleNamespace(started=True)

    def get_engine(loop: asyncio.AbstractEventLoop) -> object:
        async def get() -> object:
            return django_adapter.get_engine()

        return loop.run_until_complete(get())

    def views() -> None:
        first, second, third = (asyncio.new_event_loop() for _ in range(3))
        try:
            assert get_engine(first) is engine
            first.close()
            assert get_engine(second) is engine
            with pytest.raises(ImproperlyConfigured, match="another event loop"):
                get_engine(third)  # the second is still open
        finally:
            for loop in (first, second, third):
                loop.close()

    django_adapter.use_engine(engine)  # type: ignore[arg-type]
    try:
        await asyncio.to_thread(views)
    finally:
        django_adapter.use_engine(previous)


_WSGI_SCRIPT = """
import json, sys
import django
from django.conf import settings
settings.configure(DEBUG=False, ROOT_URLCONF="__main__", ALLOWED_HOSTS=["*"], SECRET_KEY="t", INSTALLED_APPS=[],
                   MIDDLEWARE=[], ASYNCLLM={"disable_log_stats": True})
django.setup()
from asgiref.sync import async_to_sync
from django.test import Client
from django.urls import path
from asyncllm import SamplingParams
from asyncllm.integrations.django import close_engine, get_engine, stream_response

async def complete(request):
    stream = get_engine().stream(request.GET["prompt"], SamplingParams(**json.loads(sys.argv[1])))
    return await stream_response(stream, request)

urlpatterns = [path("complete", complete)]
client = Client()
answers = [client.get("/complete", {"prompt": prompt}) for prompt in ("if x:", "if x:", "x " * 100000)]
print(json.dumps([[a.status_code, a.content.decode()] for a in answers]))
async_to_sync(close_engine)()
"""


async def test_django_under_wsgi_answers_the_whole_text(bundled_engine) -> None:
    """The sync test Client (WSGI): each async view runs on a fresh loop that closes after it, and Django would read
    a streamed body on another; given the request, `stream_response` answers the whole text (one request after
    another, the engine taking each new loop over), an error still as JSON."""
    import json
    import subprocess
    import sys

    result = await asyncio.to_thread(subprocess.run, [sys.executable, "-c", _WSGI_SCRIPT, json.dumps(PARAMS)],
                                     capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    answers = json.loads(result.stdout.strip().splitlines()[-1])
    expected = await _expected(bundled_engine, "if x:")
    assert answers[:2] == [[200, expected], [200, expected]] and expected
    assert answers[2][0] == 400 and json.loads(answers[2][1])["error"]["param"] == "prompt"


@pytest.mark.parametrize("end", list(MID_STREAM_ENDS))
async def test_django_error_mid_stream_ends_the_text_with_an_error_line(django_client, end) -> None:
    """As aiohttp's: an error after the first bytes ends the text with its error line (was: Django's ASGI handler
    raised it, a traceback and a connection cut mid-body)."""
    from django.urls import path

    from asyncllm.integrations import django as django_adapter

    make, kind, code = MID_STREAM_ENDS[end]
    texts = ("héllo ", "wörld")
    stream = FailingStream(texts, make())

    async def failing(request):
        return await django_adapter.stream_response(stream, request)

    urlpatterns.append(path("failing", failing))
    try:
        response = await django_client.get("/failing")
        body = b"".join([chunk async for chunk in response.streaming_content]).decode()
    finally:
        urlpatterns.pop()
    assert response.status_code == 200 and response.streaming
    assert response["Cache-Control"] == "no-cache" and response["X-Accel-Buffering"] == "no"
    error = error_line_of(body, texts)
    assert (error["type"], error["code"]) == (kind, code) and stream.closed.is_set()


@pytest.mark.parametrize("end", list(MID_STREAM_ENDS))
async def test_django_wsgi_error_after_the_first_delta_is_the_json_error(django_client, end) -> None:
    """A WSGI request's whole text: an error after the first delta is its JSON error response, an abort too (it
    answered the text so far as if whole)."""
    from django.test import RequestFactory

    from asyncllm.integrations import django as django_adapter

    make, kind, code = MID_STREAM_ENDS[end]
    stream = FailingStream(("a", "b"), make())
    if end == "bug":
        with pytest.raises(RuntimeError):  # a bug: Django's 500 page, as any view's
            await django_adapter.stream_response(stream, RequestFactory().get("/"))
        return
    response = await django_adapter.stream_response(stream, RequestFactory().get("/"))
    error = json.loads(response.content)["error"]
    assert not response.streaming and (error["type"], error["code"]) == (kind, code) and stream.closed.is_set()


@pytest.mark.parametrize("wsgi", [False, True], ids=["asgi", "wsgi"])
async def test_django_head_request_is_not_generated(django_client, wsgi) -> None:
    """HEAD on a GET view (Django serves it by the GET view): GET's status and headers, no body, the request
    aborted after its first delta (was: the whole text generated, for the server to drop)."""
    from django.test import RequestFactory

    from asyncllm.integrations import django as django_adapter

    stream = FailingStream(("a", "b", "c"), "abort")
    if wsgi:
        response = await django_adapter.stream_response(stream, RequestFactory().head("/"))
    else:
        from django.urls import path

        async def view(request):
            return await django_adapter.stream_response(stream, request)

        urlpatterns.append(path("head", view))
        try:
            response = await django_client.head("/head")
        finally:
            urlpatterns.pop()
    assert response.status_code == 200 and response["Cache-Control"] == "no-cache"
    assert stream.texts == ["b", "c"] and stream.closed.is_set()


async def test_django_request_aborted_before_its_first_token_is_an_error_status(django_client) -> None:
    """Aborted while queued (`AsyncEngine.abort`, the engine closing): its error's status (was: an empty 200)."""
    from asyncllm.integrations import django as django_adapter

    stream = FailingStream((), "abort")
    response = await django_adapter.stream_response(stream)
    assert response.status_code == 500 and not response.streaming and stream.closed.is_set()
    assert json.loads(response.content)["error"]["code"] == "request_aborted"

