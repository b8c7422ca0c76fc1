"""The Responses API's request checks and stamps: vLLM's extra fields, ``metadata``'s bounds, the ``error`` event,
``created_at`` taken at arrival, a 400 worded with the client's field."""

from __future__ import annotations

import json
import types

import pytest
from asgi_helpers import asgi_client
from openai.types.responses import ResponseErrorEvent

import asyncllm.integrations.responses_api as responses_api
from asyncllm import SamplingParams
from asyncllm.errors import EngineDeadError, InvalidRequestError
from asyncllm.integrations.errors import error_body, renamed_fields
from asyncllm.integrations.openai_server import OpenAIServer
from asyncllm.integrations.responses_api import ResponseEvents, ResponsesRequest, chat_request, check_request

BASE = {"model": "asyncllm-tiny", "input": "hi", "temperature": 0, "max_output_tokens": 2}


def test_vllm_sampling_fields_reach_the_chat() -> None:
    passed = {"stop": ["\n"], "logit_bias": {"5": 1.0}, "ignore_eos": True, "skip_special_tokens": False,
              "include_stop_str_in_output": True, "structured_outputs": {"regex": "a+"}}
    chat = chat_request(ResponsesRequest(input="hi", top_logprobs=0, prompt_cache_key="k", **passed))
    assert {name: getattr(chat, name) for name in passed} == passed


@pytest.mark.parametrize("field, value", [("top_logprobs", 2), ("max_tool_calls", 4), ("request_id", "abc"),
                                          ("prompt", {"id": "pmpt_1"}), ("conversation", "conv_1")])
def test_fields_not_built_are_refused_by_name(field, value) -> None:
    with pytest.raises(InvalidRequestError, match="not built") as caught:
        check_request(ResponsesRequest(input="hi", **{field: value}))
    assert caught.value.field == field


@pytest.mark.parametrize("metadata", [{f"k{i}": "v" for i in range(17)}, {"k" * 65: "v"}, {"k": "v" * 513}])
def test_metadata_past_openai_bounds_is_refused(metadata) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        check_request(ResponsesRequest(input="hi", metadata=metadata))
    assert caught.value.field == "metadata"
    at_bounds = {f"{i:02d}" + "k" * 62: "v" * 512 for i in range(16)}
    check_request(ResponsesRequest(input="hi", metadata=at_bounds))


def test_error_event_is_openai_response_error_event() -> None:
    events = ResponseEvents(ResponsesRequest(input="hi"), "m")
    events.start()
    raw = events.error(error_body(EngineDeadError("the engine core died"))[1]["error"])
    assert raw.startswith(b"event: error\n")
    payload = json.loads(raw.split(b"data: ", 1)[1])
    event = ResponseErrorEvent.model_validate(payload)
    assert (event.type, event.code, event.message, event.sequence_number) == ("error", "engine_dead",
                                                                             "the engine core died", 2)


@pytest.mark.parametrize("finish_reason, status, details", [
    ("abort", "cancelled", None), ("length", "incomplete", {"reason": "max_output_tokens"}),
    ("stop", "completed", None)])
def test_finish_reason_sets_the_status_whole_and_streamed(finish_reason, status, details) -> None:
    """An abort in the engine is vLLM's "cancelled" (its stream ends with response.completed, as vLLM's: OpenAI has
    no event of a cancelled response); the body kept (`on_finish`) is the one sent."""
    req, usage = ResponsesRequest(input="hi"), {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}
    whole = responses_api.response_body(req, "m", [{"content": "par"}], finish_reason, usage)
    kept: list[dict] = []
    events = ResponseEvents(req, "m", on_finish=kept.append)
    events.start()
    events.feed([{"content": "par"}])
    last = json.loads(events.finish(finish_reason, usage)[-1].split(b"data: ", 1)[1])
    assert (whole["status"], whole["incomplete_details"]) == (status, details)
    assert (last["response"]["status"], last["response"]["incomplete_details"]) == (status, details)
    assert last["type"] == ("response.incomplete" if status == "incomplete" else "response.completed")
    assert kept == [last["response"]] and whole["output"][0]["content"][0]["text"] == "par"


def test_renamed_max_tokens_message_names_the_client_field() -> None:
    message = "'max_tokens' or 'max_completion_tokens' is too large: 9."
    with pytest.raises(InvalidRequestError) as caught, renamed_fields(responses_api.RESPONSES_FIELDS):
        raise InvalidRequestError("max_tokens", message)
    assert (caught.value.field, caught.value.message) == ("max_output_tokens", "'max_output_tokens' is too large: 9.")
    with pytest.raises(InvalidRequestError) as caught, renamed_fields({"max_tokens": "max_completion_tokens"}):
        raise InvalidRequestError("max_tokens", message)
    assert caught.value.message == message  # it already names the client's field


@pytest.mark.asyncio(loop_scope="session")
@pytest.mark.parametrize("stream", [False, True])
async def test_created_at_is_the_request_arrival(app, monkeypatch, stream) -> None:
    clock = [1000]
    monkeypatch.setattr(responses_api, "time", types.SimpleNamespace(time=lambda: clock[0]))
    start_chat = OpenAIServer._start_chat

    def started(*args, **kwargs):
        clock[0] = 2000  # generation begins after the request arrived
        return start_chat(*args, **kwargs)

    monkeypatch.setattr(OpenAIServer, "_start_chat", started)
    async with asgi_client(app) as http:
        reply = await http.post("/v1/responses", json={**BASE, "stream": stream})
    assert reply.status_code == 200
    if stream:
        bodies = [json.loads(line[6:])["response"] for line in reply.text.split("\n") if '"response"' in line]
        assert {b["created_at"] for b in bodies} == {1000} and len({b["id"] for b in bodies}) == 1
    else:
        assert reply.json()["created_at"] == 1000


@pytest.mark.asyncio(loop_scope="session")
async def test_too_large_max_output_tokens_is_worded_with_it(app) -> None:
    async with asgi_client(app) as http:
        reply = await http.post("/v1/responses", json={**BASE, "max_output_tokens": 600})
    error = reply.json()["error"]
    assert (reply.status_code, error["param"]) == (400, "max_output_tokens")
    assert error["message"].startswith("'max_output_tokens' is too large: 600.")


@pytest.mark.asyncio(loop_scope="session")
async def test_stream_null_is_a_whole_response(app) -> None:
    """OpenAI's and vLLM's ``stream`` is ``bool | None``: null (a client that sends every field) is not streamed."""
    async with asgi_client(app) as http:
        reply = await http.post("/v1/responses", json={**BASE, "stream": None})
    assert reply.status_code == 200, reply.text
    assert reply.json()["object"] == "response"


def test_text_echo_has_its_format_with_verbosity_alone() -> None:
    """``text: {"verbosity": ...}`` without a format echoes OpenAI's default format (text) beside it."""
    usage = {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}
    body = responses_api.response_body(ResponsesRequest(input="hi", text={"verbosity": "low"}), "m", [], "stop", usage)
    assert body["text"] == {"format": {"type": "text"}, "verbosity": "low"}
    fmt = {"type": "json_object"}
    body = responses_api.response_body(ResponsesRequest(input="hi", text={"format": fmt}), "m", [], "stop", usage)
    assert body["text"] == {"format": fmt}
    body = responses_api.response_body(ResponsesRequest(input="hi", text={"format": None}), "m", [], "stop", usage)
    assert body["text"] == {"format": {"type": "text"}}


@pytest.mark.parametrize("verbosity", ["bogus", "LOW", 3, ["low"]])
def test_text_verbosity_other_than_openai_values_is_refused(verbosity) -> None:
    # OpenAI's ResponseTextConfig (and so vLLM's request model): low, medium, high or null; until 2026-12-08 any value
    # was accepted and echoed in the response's text
    with pytest.raises(InvalidRequestError) as caught:
        check_request(ResponsesRequest(input="hi", text={"verbosity": verbosity}))
    assert caught.value.field == "text.verbosity"
    for ok in ("low", "medium", "high", None):
        check_request(ResponsesRequest(input="hi", text={"verbosity": ok}))


@pytest.mark.parametrize("choice", ["bogus", {"type": "function"}, {"type": "function", "name": 5},
                                    {"type": "function", "function": {"name": "f"}}, {"type": "bogus"},
                                    {"type": "custom"}, {"type": "mcp"}, {"type": "allowed_tools", "mode": "x",
                                                                          "tools": []}])
@pytest.mark.parametrize("tools", [None, [{"type": "function", "name": "f", "parameters": {}}]])
def test_bad_tool_choice_is_worded_with_the_responses_shape(choice, tools) -> None:
    # until 2026-12-08 chat's check answered: "'bogus' needs tools", or named chat's {'function': {'name'}} shape
    with pytest.raises(InvalidRequestError, match=r"\{'type': 'function', 'name': \.\.\.\}") as caught:
        chat_request(ResponsesRequest(input="hi", tools=tools, tool_choice=choice))
    assert caught.value.field == "tool_choice"


@pytest.mark.parametrize("tools", [None, []])
def test_named_tool_choice_without_tools_names_the_responses_choice(tools) -> None:
    # until 2026-12-08 the 400 showed chat's shape: "{'type': 'function', 'function': {'name': 'f'}} needs tools"
    with pytest.raises(InvalidRequestError, match="names 'f', but the request has no tools") as caught:
        chat_request(ResponsesRequest(input="hi", tools=tools, tool_choice={"type": "function", "name": "f"}))
    assert caught.value.field == "tool_choice"


@pytest.mark.parametrize("tools", [None, [], [{"type": "web_search"}]])
def test_required_without_function_tools_says_so(tools) -> None:
    # until 2026-12-08: "'required' needs tools", though the request may have sent tools (of other types)
    with pytest.raises(InvalidRequestError, match="'required' needs function tools") as caught:
        chat_request(ResponsesRequest(input="hi", tools=tools, tool_choice="required"))
    assert caught.value.field == "tool_choice"
    assert ("are not run by this server" in caught.value.message) == bool(tools)


def _bodies(reply) -> list[dict]:
    """The response bodies a reply carries: the whole one, or each of a stream's (created ... completed)."""
    if reply.headers["content-type"].startswith("application/json"):
        return [reply.json()]
    return [json.loads(line[6:])["response"] for line in reply.text.split("\n") if '"response"' in line]


@pytest.mark.asyncio(loop_scope="session")
@pytest.mark.parametrize("stream", [False, True])
async def test_sampling_fields_echo_the_values_used(app, bundled_engine, monkeypatch, stream) -> None:
    """``temperature``, ``top_p`` and ``max_output_tokens`` echo what sampled the reply (vLLM's ``sampling_params``'
    values; OpenAI's 1.0 and 1.0 for unset ones), the model's generation-config defaults included; until 2026-12-08
    unset ones were null."""
    fields = ("temperature", "top_p", "max_output_tokens")
    async with asgi_client(app) as http:
        reply = await http.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2, "stream": stream})
        assert {tuple(b[f] for f in fields) for b in _bodies(reply)} == {(1.0, 1.0, 2)}
        sent = {"input": "hi", "temperature": 0, "top_p": 0.5, "max_output_tokens": 1, "stream": stream}
        reply = await http.post("/v1/responses", json=sent)
        assert {tuple(b[f] for f in fields) for b in _bodies(reply)} == {(0.0, 0.5, 1)}
        monkeypatch.setattr(bundled_engine, "default_sampling_fields",
                            lambda: {"temperature": 0.5, "top_p": 0.9, "max_tokens": 2})
        reply = await http.post("/v1/responses", json={"input": "hi", "stream": stream})
        assert {tuple(b[f] for f in fields) for b in _bodies(reply)} == {(0.5, 0.9, 2)}


def test_unset_max_output_tokens_without_a_default_is_null() -> None:
    """No max_output_tokens and no default: the reply may run to the context's end, and the echo is null, as
    OpenAI's (vLLM's echoes max_model_len - the prompt's tokens)."""
    usage = {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}
    body = responses_api.response_body(ResponsesRequest(input="hi"), "m", [], "stop", usage,
                                       params=SamplingParams(temperature=0.7, max_tokens=None))
    assert (body["temperature"], body["top_p"], body["max_output_tokens"]) == (0.7, 1.0, None)


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}
TOOL = {"type": "function", "name": "f", "parameters": {"type": "object"}}


@pytest.mark.asyncio(loop_scope="session")
@pytest.mark.parametrize("extra, param", [
    ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({"text": {"format": "json_object"}}, "text.format"),
    ({"text": {"format": {"type": "json_schema", "schema": SCHEMA}}}, "text.format.name"),
    ({"text": {"format": {"type": "json_schema", "name": 5, "schema": SCHEMA}}}, "text.format.name"),
    ({"text": {"format": {"type": "json_schema", "name": "a"}}}, "text.format.schema"),
    ({"text": {"format": {"type": "json_schema", "name": "a", "schema": "{}"}}}, "text.format.schema"),
    ({"text": {"format": {"type": "json_schema", "name": "a", "schema": {"type": "bogus"}}}}, "text.format"),
    ({"text": {"format": {"type": "json_object"}}, "structured_outputs": {"regex": "a"}}, "structured_outputs"),
    ({"text": {"format": {"type": "json_object"}}, "tools": [TOOL], "tool_choice": "required"}, "tool_choice"),
])
async def test_output_format_errors_name_text_format(app, extra, param) -> None:
    """A 400 about the output format names the Responses API's ``text.format`` (its key where one is wrong); until
    2026-12-08 they named chat's ``response_format`` and its ``json_schema`` object ("structured_outputs: set
    response_format or structured_outputs, not both"), with ``text`` as the param."""
    async with asgi_client(app) as http:
        reply = await http.post("/v1/responses", json={**BASE, **extra})
    error = reply.json()["error"]
    assert (reply.status_code, error["param"]) == (400, param), error
    assert "response_format" not in error["message"] and "json_schema must" not in error["message"], error
    assert "text.format" in error["message"], error


def test_request_fields_openai_echoes_are_echoed() -> None:
    """OpenAI's response (and vLLM's) carries the request's ``user``, ``safety_identifier``, ``prompt_cache_key``
    and the ``background``, ``max_tool_calls`` and ``top_logprobs`` it ran with; until 2026-12-08 they were left out
    (the SDK's ``response.user`` read None)."""
    usage = {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}
    req = ResponsesRequest(input="hi", user="u", safety_identifier="s", prompt_cache_key="k")
    body = responses_api.response_body(req, "m", [], "stop", usage)
    echoed = ("user", "safety_identifier", "prompt_cache_key", "background", "max_tool_calls", "top_logprobs")
    assert {name: body.get(name, "absent") for name in echoed} == {
        "user": "u", "safety_identifier": "s", "prompt_cache_key": "k", "background": False, "max_tool_calls": None,
        "top_logprobs": 0}
