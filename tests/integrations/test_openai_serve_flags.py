"""vLLM's server flags around the app: CORS, uvicorn's (mapped, and a real start on a Unix socket),
``--enable-prompt-tokens-details`` and ``--enable-force-include-usage``."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
import time

import httpx
import pytest
import uvicorn

from asyncllm.cli import _parser
from asyncllm.cli_commands import cors_policy, uvicorn_kwargs
from asyncllm.integrations.openai_server import create_app
from asgi_helpers import asgi_client, sse_events

pytestmark = pytest.mark.asyncio(loop_scope="session")

GREEDY = {"max_tokens": 2, "temperature": 0, "ignore_eos": True}


def _serve_args(*flags: str):
    return _parser().parse_args(["serve", *flags])


async def test_cors_flags_answer_preflight_and_mark_responses(bundled_engine) -> None:
    args = _serve_args("--allowed-origins", '["https://ui.example"]', "--allowed-methods", '["GET", "POST"]',
                       "--allow-credentials")
    app = create_app(bundled_engine, manage_engine=False, cors=cors_policy(args))
    preflight_headers = {"Origin": "https://ui.example", "Access-Control-Request-Method": "POST",
                         "Access-Control-Request-Headers": "authorization"}
    async with asgi_client(app) as client:
        preflight = await client.options("/v1/completions", headers=preflight_headers)
        refused = await client.options("/v1/completions",
                                       headers={**preflight_headers, "Origin": "https://evil.example"})
        completion = await client.post("/v1/completions", json={**GREEDY, "prompt": "x"},
                                       headers={"Origin": "https://ui.example"})
    assert preflight.status_code == 200 and refused.status_code == 400
    assert preflight.headers["access-control-allow-origin"] == "https://ui.example"
    assert preflight.headers["access-control-allow-methods"] == "GET, POST"
    assert preflight.headers["access-control-allow-credentials"] == "true"
    assert completion.status_code == 200 and completion.headers["access-control-allow-origin"] == "https://ui.example"
    keyed = create_app(bundled_engine, manage_engine=False, cors=cors_policy(args), api_key="secret")
    async with asgi_client(keyed) as client:  # browsers send no key with a preflight: vLLM's auth skips OPTIONS
        keyed_preflight = await client.options("/v1/completions", headers=preflight_headers)
        unauthorized = await client.post("/v1/completions", json={**GREEDY, "prompt": "x"},
                                         headers={"Origin": "https://ui.example"})
    assert keyed_preflight.status_code == 200
    assert keyed_preflight.headers["access-control-allow-origin"] == "https://ui.example"
    assert unauthorized.status_code == 401  # with the CORS headers: the page can read why
    assert unauthorized.headers["access-control-allow-origin"] == "https://ui.example"
    defaults = cors_policy(_serve_args())  # vLLM's: any origin, method and header, no credentials
    assert (defaults.allowed_origins, defaults.allowed_methods, defaults.allowed_headers,
            defaults.allow_credentials) == (["*"], ["*"], ["*"], False)
    async with asgi_client(create_app(bundled_engine, manage_engine=False)) as client:  # embedders: no CORS
        assert "access-control-allow-origin" not in (await client.get("/v1/models", headers={"Origin": "x"})).headers
    with pytest.raises(SystemExit):
        _serve_args("--allowed-origins", "https://ui.example")  # not a JSON list


async def test_uds_serves_the_app_on_a_unix_socket(bundled_engine) -> None:
    folder = tempfile.mkdtemp(dir="/tmp")  # short: a socket path has at most 108 bytes, tmp_path can be longer
    path = os.path.join(folder, "serve.sock")
    kwargs = uvicorn_kwargs(_serve_args("--uds", path, "--root-path", "/llm", "--log-level", "warning"))
    server = uvicorn.Server(uvicorn.Config(create_app(bundled_engine, manage_engine=False), **kwargs, lifespan="off"))
    task = asyncio.ensure_future(server.serve())
    deadline = time.monotonic() + 10
    try:
        while not server.started:
            assert not task.done() and time.monotonic() < deadline, "uvicorn did not start on the socket"
            await asyncio.sleep(0.02)
        transport = httpx.AsyncHTTPTransport(uds=path)
        async with httpx.AsyncClient(transport=transport, base_url="http://serve") as client:
            models = await client.get("/v1/models")  # the proxy in front of --root-path strips its prefix
    finally:
        server.should_exit = True
        if not server.started:
            task.cancel()  # a start that hangs: should_exit reaches only a started server
        with contextlib.suppress(asyncio.CancelledError):
            await task  # a start that failed raises its error here
        shutil.rmtree(folder, ignore_errors=True)
    assert models.status_code == 200 and models.json()["data"][0]["id"] == "asyncllm-tiny"


async def test_prompt_tokens_details_count_the_prefix_cache_hit(bundled_engine) -> None:
    app = create_app(bundled_engine, manage_engine=False, enable_prompt_tokens_details=True)
    prompt = "class Detailed:\n    def method(self, value):\n        return value + 3\n" * 2
    body = {**GREEDY, "prompt": prompt, "cache_salt": "details"}
    chat = {**GREEDY, "messages": [{"role": "user", "content": prompt}], "cache_salt": "details", "stream": True,
            "stream_options": {"include_usage": True}}
    turn = {"input": prompt + "?", "max_output_tokens": 2, "temperature": 0}  # the Responses API's usage too
    usages, hits = [], []
    async with asgi_client(app) as client:
        for route in ["/v1/completions"] * 2 + ["/v1/chat/completions"] * 2 + ["/v1/responses"] * 2:
            before = bundled_engine.stats().prefix_cache_hits
            response = await client.post(route, json={"/v1/completions": body, "/v1/chat/completions": chat,
                                                      "/v1/responses": turn}[route])
            if route == "/v1/responses":
                usages.append({"prompt_tokens_details": response.json()["usage"]["input_tokens_details"]})
            else:
                usages.append(response.json()["usage"] if route == "/v1/completions"
                              else sse_events(response.text)[-1]["usage"])
            hits.append(bundled_engine.stats().prefix_cache_hits - before)
    cached = [u["prompt_tokens_details"]["cached_tokens"] for u in usages]
    assert cached == hits and cached[0] == cached[2] == 0 and min(cached[1], cached[3], cached[5]) >= 16, hits
    async with asgi_client(create_app(bundled_engine, manage_engine=False)) as client:  # off: vLLM's default
        assert "prompt_tokens_details" not in (await client.post("/v1/completions", json=body)).json()["usage"]
        unflagged = (await client.post("/v1/responses", json=turn)).json()["usage"]  # vLLM's Responses: counted
    assert unflagged["input_tokens_details"]["cached_tokens"] >= 16


@pytest.mark.parametrize("route,extra", [("/v1/completions", {}), ("/v1/chat/completions", {}),
                                         ("/v1/completions", {"use_beam_search": True})])
async def test_force_include_usage_ends_every_stream_with_usage(bundled_engine, route, extra) -> None:
    body = {**GREEDY, **extra, "stream": True, **({"prompt": "x"} if route == "/v1/completions" else
                                                  {"messages": [{"role": "user", "content": "x"}]})}
    forced = create_app(bundled_engine, manage_engine=False, enable_force_include_usage=True)
    async with asgi_client(forced) as client:
        unasked = sse_events((await client.post(route, json=body)).text)
        declined = sse_events((await client.post(route, json={**body, "stream_options": {
            "include_usage": False, "continuous_usage_stats": False}})).text)
    async with asgi_client(create_app(bundled_engine, manage_engine=False)) as client:
        plain = sse_events((await client.post(route, json=body)).text)
    for events in (unasked, declined):  # forced usage is continuous, whatever the request asks (newest vLLM's)
        assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 2
        assert all(event["usage"]["completion_tokens"] <= 2 for event in events[:-1])
    assert all("usage" not in event for event in plain)
