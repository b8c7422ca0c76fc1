"""The aiohttp and Django adapters with their own test clients, on the shared engine's loop."""

from __future__ import annotations

import asyncio
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
from stream_stubs import StalledStream

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
