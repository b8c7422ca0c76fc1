"""The aiohttp and Django adapters with their own test clients, on the shared engine's loop."""

from __future__ import annotations

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from asyncllm import SamplingParams
from asyncllm.integrations import aiohttp as aiohttp_adapter

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
    assert response.status == 200 and response.headers["Content-Type"].startswith("text/plain")
    assert b"".join(chunks).decode() == await _expected(bundled_engine, "while True:")
    assert bad.status == 400 and bad_body["error"]["param"] == "temperature"
    assert unknown.status == 400 and unknown_body["error"]["param"] == "body"
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


# ---------------------------------------------------------------- Django
urlpatterns: list = []  # this module is the test project's ROOT_URLCONF


@pytest.fixture(scope="module")
def django_client(bundled_engine):
    import django
    from django.conf import settings

    if not settings.configured:
        settings.configure(DEBUG=False, ROOT_URLCONF=__name__, ALLOWED_HOSTS=["*"], SECRET_KEY="test",
                           INSTALLED_APPS=[], MIDDLEWARE=[])
        django.setup()
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
