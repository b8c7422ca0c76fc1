"""Without the API key every path but the open ones is a 401 before routing (integrations/openai_auth.py), as vLLM's
AuthenticationMiddleware: a client without the key cannot tell from a 404 or a 405 which routes (optional features)
the server has. With the key, routing answers as before."""

from __future__ import annotations

import pytest

import re

from starlette.routing import Route

from asyncllm.integrations.openai_auth import OPEN_PATHS
from asyncllm.integrations.openai_http import CorsPolicy
from asyncllm.integrations.openai_server import create_app
from asgi_helpers import asgi_client
from test_openai_asgi import _FailingEngine

pytestmark = pytest.mark.asyncio(loop_scope="session")

PROBES = [("POST", "/v1/load_lora_adapter"), ("POST", "/v1/no_such_route"), ("GET", "/v1/chat/completions"),
          ("DELETE", "/v1/models"), ("GET", "/no_such_route"), ("POST", "/sleep"), ("OPTIONS", "/v1/completions")]


async def test_without_the_key_every_guarded_path_and_method_is_the_same_401(monkeypatch) -> None:
    monkeypatch.setenv("ASYNCLLM_ALLOW_RUNTIME_LORA_UPDATING", "1")  # /v1/load_lora_adapter exists
    app = create_app(_FailingEngine(RuntimeError("unused")), model_name="fake", manage_engine=False, api_key="k")
    async with asgi_client(app) as client:
        bare = [await client.request(method, path) for method, path in PROBES]
        keyed = [await client.request(method, path, headers={"Authorization": "Bearer k"}) for method, path in PROBES]
        open_paths = [(await client.get(path)).status_code for path in ("/health", "/ping", "/version", "/health/")]
    assert {(r.status_code, r.json()["error"]["code"]) for r in bare} == {(401, "invalid_api_key")}
    assert [r.status_code for r in keyed] == [400, 404, 405, 405, 404, 404, 405]
    assert open_paths == [200, 200, 200, 307]  # /health/: redirected to /health, no key asked


async def test_a_browser_preflight_needs_no_key_and_a_401_carries_cors_headers() -> None:
    app = create_app(_FailingEngine(RuntimeError("unused")), model_name="fake", manage_engine=False, api_key="k",
                     cors=CorsPolicy())
    preflight = {"Origin": "https://page.example", "Access-Control-Request-Method": "POST"}
    async with asgi_client(app) as client:
        allowed = await client.options("/v1/chat/completions", headers=preflight)
        refused = await client.post("/v1/no_such_route", headers={"Origin": "https://page.example"})
    assert allowed.status_code == 200
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == "*"


async def test_every_route_of_every_feature_refuses_a_keyless_request(monkeypatch) -> None:
    """The gate is the one key check (the routes' `guard` has none): every route's every method, with the optional
    features on, is a 401 without the key, the `OPEN_PATHS` aside; no mount or websocket route escapes it."""
    monkeypatch.setenv("ASYNCLLM_ALLOW_RUNTIME_LORA_UPDATING", "1")
    monkeypatch.setenv("ASYNCLLM_SERVER_DEV_MODE", "1")
    app = create_app(_FailingEngine(RuntimeError("unused")), model_name="fake", manage_engine=False, api_key="k")
    routes = app.router.routes
    assert all(type(route) is Route for route in routes)  # a Mount or WebSocketRoute: check the gate covers it
    calls = [(method, re.sub(r"{[^}]+}", "x", route.path)) for route in routes for method in route.methods]
    async with asgi_client(app) as client:
        bare = {(method, path): (await client.request(method, path)).status_code for method, path in calls}
    assert {"/v1/load_lora_adapter", "/sleep", "/v1/responses/x", "/invocations"} <= {path for _, path in calls}
    assert {call for call, status in bare.items() if status == 401} == {
        (method, path) for method, path in calls if path not in OPEN_PATHS}
