"""Stored responses (ASYNCLLM_ENABLE_RESPONSES_API_STORE): ``store``, ``previous_response_id``, ``GET /v1/responses/{id}``."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import openai
import pytest
from asgi_helpers import asgi_client

from asyncllm import SamplingParams, envs
from asyncllm.errors import ConfigError
from asyncllm.integrations.errors import ApiError
from asyncllm.integrations.openai_server import create_app
from asyncllm.integrations.responses_api import ResponsesRequest, response_body
from asyncllm.integrations.responses_store import DEFAULT_MAX_ENTRIES, ResponseStore, StoredResponse

on_session_loop = pytest.mark.asyncio(loop_scope="session")

MODEL = "asyncllm-tiny"
GREEDY = {"model": MODEL, "temperature": 0, "max_output_tokens": 8}


def _app(bundled_engine, monkeypatch, *, enabled: bool = True, max_entries: int | None = None):
    monkeypatch.setenv(envs.ENABLE_RESPONSES_API_STORE.name, "1" if enabled else "0")
    if max_entries is not None:
        monkeypatch.setenv(envs.RESPONSES_API_STORE_MAX_ENTRIES.name, str(max_entries))
    return create_app(bundled_engine, manage_engine=False)


def _openai(app) -> openai.AsyncOpenAI:
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test/v1")
    return openai.AsyncOpenAI(api_key="unused", base_url="http://test/v1", http_client=http)


def _streamed_response(text: str) -> dict:
    """The response of a streamed create's last event (``response.completed`` or ``response.incomplete``)."""
    payloads = [json.loads(line[len("data: "):]) for block in text.split("\n\n") for line in block.split("\n")
                if line.startswith("data: ")]
    assert payloads[-1]["type"] in ("response.completed", "response.incomplete")
    return payloads[-1]["response"]


# ------------------------------------------------------------------ the store alone
def _stored(response_id: str) -> StoredResponse:
    return StoredResponse({"id": response_id, "status": "completed", "output": []}, ())


def test_lru_bound_recency_and_delete() -> None:
    store = ResponseStore(3)
    for i in range(5):
        store.put(_stored(f"resp_{i}"))
    assert len(store) == 3 and "resp_0" not in store and "resp_1" not in store
    store.get("resp_2")  # retrieved: now the most recent, so resp_3 goes first
    store.put(_stored("resp_5"))
    assert [i for i in range(6) if f"resp_{i}" in store] == [2, 4, 5]
    store.delete("resp_4")
    assert len(store) == 2
    with pytest.raises(ApiError) as missing:
        store.get("resp_4", "previous_response_id")
    assert (missing.value.status, missing.value.param) == (404, "previous_response_id")
    with pytest.raises(ValueError):
        ResponseStore(0)
    off = ResponseStore(enabled=False)
    off.put(_stored("resp_x"))
    assert len(off) == 0 and off.max_entries == DEFAULT_MAX_ENTRIES == 1000


def test_store_is_thread_safe_and_stays_bounded() -> None:
    store, errors = ResponseStore(50), []

    def hammer(worker: int) -> None:
        try:
            for i in range(2000):
                store.put(_stored(f"resp_{worker}_{i}"))
                for j in (i, i - 1, i - 60):  # just kept, likely kept, likely gone
                    try:
                        assert store.get(f"resp_{worker}_{j}").body["id"] == f"resp_{worker}_{j}"
                    except ApiError as exc:  # a 404 (evicted) is fine
                        assert exc.status == 404
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=hammer, args=(w,)) for w in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == [] and len(store) == 50


def test_env_vars(monkeypatch) -> None:
    monkeypatch.delenv(envs.ENABLE_RESPONSES_API_STORE.name, raising=False)
    monkeypatch.delenv(envs.RESPONSES_API_STORE_MAX_ENTRIES.name, raising=False)
    default = ResponseStore.from_env()
    assert (default.enabled, default.max_entries) == (False, 1000)
    monkeypatch.setenv(envs.ENABLE_RESPONSES_API_STORE.name, "1")
    monkeypatch.setenv(envs.RESPONSES_API_STORE_MAX_ENTRIES.name, "7")
    configured = ResponseStore.from_env()
    assert (configured.enabled, configured.max_entries) == (True, 7)
    for bad in ("0", "-3", "many"):
        monkeypatch.setenv(envs.RESPONSES_API_STORE_MAX_ENTRIES.name, bad)
        with pytest.raises(ConfigError, match=envs.RESPONSES_API_STORE_MAX_ENTRIES.name):
            ResponseStore.from_env()


# ------------------------------------------------------------------ through the server
@on_session_loop
async def test_store_and_retrieve_whole_and_streamed(bundled_engine, monkeypatch) -> None:
    app = _app(bundled_engine, monkeypatch)
    async with asgi_client(app) as http:
        made = await http.post("/v1/responses", json={**GREEDY, "input": "def add(a, b):"})
        assert made.status_code == 200 and made.json()["store"] is True
        got = await http.get(f"/v1/responses/{made.json()['id']}")
        assert (got.status_code, got.json()) == (200, made.json())
        streamed = await http.post("/v1/responses", json={**GREEDY, "input": "import os", "stream": True})
        final = _streamed_response(streamed.text)
        assert final["store"] is True
        assert (await http.get(f"/v1/responses/{final['id']}")).json() == final
        unstored = (await http.post("/v1/responses", json={**GREEDY, "input": "x", "store": False})).json()
        assert unstored["store"] is False
        assert (await http.get(f"/v1/responses/{unstored['id']}")).status_code == 404
    assert len(app.state.openai_server.responses_store) == 2
    client = _openai(app)
    retrieved = await client.responses.retrieve(made.json()["id"])
    assert retrieved.output_text == "".join(
        part["text"] for item in made.json()["output"] if item["type"] == "message" for part in item["content"])


async def _aborted(engine, http, body: dict):
    """`body` posted to /v1/responses and aborted in the engine once it runs (`AsyncEngine.abort`: an operator's,
    or a drain's end), its client still there."""
    posted = asyncio.ensure_future(http.post("/v1/responses", json=body))

    async def running() -> list[str]:
        while not (ids := [c.request_id for c in list(engine._in_flight) if not c.finished]):
            await asyncio.sleep(0.005)
        return ids

    await engine.abort(await asyncio.wait_for(running(), 30))
    return await asyncio.wait_for(posted, 30)


@on_session_loop
async def test_a_response_aborted_in_the_engine_is_cancelled_and_kept_so(bundled_engine, monkeypatch) -> None:
    """vLLM's status for an abort, whole and streamed (the last event a response.completed, as vLLM's, OpenAI
    having no event of a cancelled response); kept as finished, as an incomplete one is."""
    app = _app(bundled_engine, monkeypatch)
    long = {**GREEDY, "input": "def f(x):", "max_output_tokens": 400, "ignore_eos": True}
    async with asgi_client(app) as http:
        whole = (await _aborted(bundled_engine, http, long)).json()
        streamed = _streamed_response((await _aborted(bundled_engine, http, {**long, "stream": True})).text)
        for body in (whole, streamed):
            assert (body["status"], body["incomplete_details"]) == ("cancelled", None), body
            assert body["usage"]["output_tokens"] < 400
            assert (await http.get(f"/v1/responses/{body['id']}")).json() == body


@on_session_loop
async def test_previous_response_id_equals_the_whole_conversation(bundled_engine, monkeypatch) -> None:
    client = _openai(_app(bundled_engine, monkeypatch))
    first = await client.responses.create(**GREEDY, instructions="Be brief.", input="def add(a, b):")
    assert first.output_text and first.store is True
    second = await client.responses.create(**GREEDY, previous_response_id=first.id, input="def sub(a, b):")
    assert second.previous_response_id == first.id
    # OpenAI's definition: the earlier inputs, the previous output items, then the new input; the previous
    # instructions are not carried over
    whole = [{"role": "user", "content": "def add(a, b):"}, *[item.model_dump() for item in first.output],
             {"role": "user", "content": "def sub(a, b):"}]
    explicit = await client.responses.create(**GREEDY, input=whole, store=False)
    assert second.output_text == explicit.output_text
    assert second.usage.input_tokens == explicit.usage.input_tokens
    messages = [{"role": "user", "content": "def add(a, b):"}, {"role": "assistant", "content": first.output_text},
                {"role": "user", "content": "def sub(a, b):"}]
    deltas = [d async for d in bundled_engine.chat(messages, SamplingParams(temperature=0, max_tokens=8))]
    assert second.output_text == "".join(d.text for d in deltas)
    # a third turn, streamed, continues the whole chain (and its instructions apply to it alone)
    events = [e async for e in await client.responses.create(
        **GREEDY, previous_response_id=second.id, input="def mul(a, b):", instructions="Be brief.", stream=True)]
    third = events[-1].response
    explicit = await client.responses.create(
        **GREEDY, instructions="Be brief.", store=False,
        input=[*whole, *[item.model_dump() for item in second.output], {"role": "user", "content": "def mul(a, b):"}])
    assert third.output_text == explicit.output_text and third.usage.input_tokens == explicit.usage.input_tokens
    assert (await client.responses.retrieve(third.id)).output_text == third.output_text
    # branching: two follow-ups of one response are independent
    again = await client.responses.create(**GREEDY, previous_response_id=first.id, input="def sub(a, b):")
    assert again.output_text == second.output_text and again.id != second.id


@on_session_loop
async def test_a_function_call_continued_with_its_output(bundled_engine, monkeypatch) -> None:
    """A kept function call (made as the server makes one, without a grammar to compile) and its output."""
    tools = [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]
    app = _app(bundled_engine, monkeypatch)
    req = ResponsesRequest(input="Weather in Paris?", tools=tools)
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "paris"}'}}
    usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
    turn = app.state.openai_server.responses_store.begin(req)
    kept = turn.keep(response_body(turn.req, MODEL, [{"tool_calls": [{"index": 0, **call}]}], "tool_calls", usage))
    assert [item["type"] for item in kept["output"]] == ["function_call"]
    client = _openai(app)
    result = [{"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]
    follow_up = await client.responses.create(**GREEDY, previous_response_id=kept["id"], input=result, tools=tools,
                                              tool_choice="none")
    explicit = await client.responses.create(**GREEDY, store=False, tools=tools, tool_choice="none",
                                             input=[{"role": "user", "content": "Weather in Paris?"},
                                                    *kept["output"], *result])
    assert follow_up.output_text == explicit.output_text
    assert follow_up.usage.input_tokens == explicit.usage.input_tokens


@on_session_loop
async def test_unknown_ids_are_404s(bundled_engine, monkeypatch) -> None:
    app = _app(bundled_engine, monkeypatch)
    async with asgi_client(app) as http:
        follow_up = await http.post("/v1/responses", json={**GREEDY, "input": "x", "previous_response_id": "resp_no"})
        retrieve = await http.get("/v1/responses/resp_no")
        cancel = await http.post("/v1/responses/resp_no/cancel")
        delete = await http.delete("/v1/responses/resp_no")
        made = (await http.post("/v1/responses", json={**GREEDY, "input": "x"})).json()
        cancel_done = await http.post(f"/v1/responses/{made['id']}/cancel")
        deleted = await http.delete(f"/v1/responses/{made['id']}")
        gone = await http.get(f"/v1/responses/{made['id']}")
    error = follow_up.json()["error"]
    assert follow_up.status_code == 404 and error["param"] == "previous_response_id"
    assert (error["type"], error["code"]) == ("invalid_request_error", "response_not_found")
    assert "resp_no" in error["message"]
    for response in (retrieve, cancel, delete, gone):
        assert (response.status_code, response.json()["error"]["param"]) == (404, "response_id"), response.text
    assert (cancel_done.status_code, cancel_done.json()["error"]["param"]) == (400, "response_id")
    assert deleted.json() == {"id": made["id"], "object": "response", "deleted": True}
    with pytest.raises(openai.NotFoundError):
        await _openai(app).responses.retrieve("resp_no")


@on_session_loop
async def test_bad_combinations_name_the_field(bundled_engine, monkeypatch) -> None:
    app = _app(bundled_engine, monkeypatch)
    async with asgi_client(app) as http:
        made = (await http.post("/v1/responses", json={**GREEDY, "input": "x"})).json()
        cases = [
            (await http.post("/v1/responses", json={**GREEDY, "input": "x", "background": True}), "background"),
            (await http.post("/v1/responses", json={**GREEDY, "input": "x", "previous_response_id": ""}),
             "previous_response_id"),
            (await http.post("/v1/responses", json={**GREEDY, "input": "x", "store": "yes"}), "store"),
            (await http.get(f"/v1/responses/{made['id']}?stream=true"), "stream"),
            (await http.get(f"/v1/responses/{made['id']}?include=reasoning.encrypted_content"), "include"),
        ]
    for response, param in cases:
        assert (response.status_code, response.json()["error"]["param"]) == (400, param), response.text


@on_session_loop
async def test_disabled_store_keeps_nothing(bundled_engine, monkeypatch) -> None:
    app = _app(bundled_engine, monkeypatch, enabled=False)
    async with asgi_client(app) as http:
        made = await http.post("/v1/responses", json={**GREEDY, "input": "x", "store": True})  # accepted
        assert made.status_code == 200 and made.json()["store"] is False
        retrieve = await http.get(f"/v1/responses/{made.json()['id']}")
        follow_up = await http.post("/v1/responses", json={**GREEDY, "input": "y",
                                                           "previous_response_id": made.json()["id"]})
    assert len(app.state.openai_server.responses_store) == 0
    for response, param in ((retrieve, "response_id"), (follow_up, "previous_response_id")):
        error = response.json()["error"]
        assert (response.status_code, error["param"]) == (404, param)
        assert envs.ENABLE_RESPONSES_API_STORE.name in error["message"]  # says how to turn it on


@on_session_loop
async def test_eviction_bound_under_concurrent_requests(bundled_engine, monkeypatch) -> None:
    app = _app(bundled_engine, monkeypatch, max_entries=2)
    store = app.state.openai_server.responses_store
    quick = {**GREEDY, "max_output_tokens": 1}
    async with asgi_client(app) as http:
        ids = [(await http.post("/v1/responses", json={**quick, "input": f"x{i}"})).json()["id"] for i in range(3)]
        assert [(await http.get(f"/v1/responses/{i}")).status_code for i in ids] == [404, 200, 200]
        await http.get(f"/v1/responses/{ids[1]}")  # now the most recent: the next one evicts ids[2]
        newest = (await http.post("/v1/responses", json={**quick, "input": "x3"})).json()["id"]
        assert ids[1] in store and ids[2] not in store and newest in store
        follow_up = await http.post("/v1/responses", json={**quick, "input": "y", "previous_response_id": ids[2]})
        assert follow_up.status_code == 404
        made = await asyncio.gather(*[http.post("/v1/responses", json={**quick, "input": f"c{i}",
                                                                       "stream": i % 2 == 1}) for i in range(8)])
    assert all(response.status_code == 200 for response in made)
    assert len(store) == 2
