"""Without the API key every path but the open ones is a 401 before routing (integrations/openai_auth.py), as vLLM's
AuthenticationMiddleware: a client without the key cannot tell from a 404 or a 405 which routes (optional features)
the server has. With the key, routing answers as before."""

from __future__ import annotations

import pytest

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
