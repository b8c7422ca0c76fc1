"""OpenAI's Responses API (`POST /v1/responses`) through the official `openai` client, on the bundled model."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from asgi_helpers import asgi_client as _client

from asyncllm import SamplingParams
from asyncllm.integrations.responses_api import input_messages

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")
pytestmark = pytest.mark.asyncio(loop_scope="session")

MODEL = "asyncllm-tiny"
CITY = {"type": "object", "properties": {"city": {"type": "string", "enum": ["paris", "rome"]}},
        "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": CITY}]
CONVERSATION = [
    {"role": "system", "content": "You help."},  # developer reaches the template as developer (the tiny one refuses it)
    {"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
    {"type": "reasoning", "id": "rs_1", "summary": []},
    {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "paris"}'},
    {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
]


@pytest.fixture
def client(app) -> openai.AsyncOpenAI:
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test/v1")
    return openai.AsyncOpenAI(api_key="unused", base_url="http://test/v1", http_client=http)


async def test_text_response_whole_and_streamed(client, bundled_engine) -> None:
    whole = await client.responses.create(model=MODEL, instructions="Be brief.", input="def add(a, b):",
                                          max_output_tokens=10, temperature=0)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def add(a, b):"}]
    deltas = [d async for d in bundled_engine.chat(messages, SamplingParams(temperature=0, max_tokens=10))]
    expected = "".join(d.text for d in deltas)
    assert whole.output_text == expected
    assert whole.status == ("incomplete" if deltas[-1].finish_reason == "length" else "completed")
    assert whole.usage.output_tokens == sum(len(d.token_ids) for d in deltas)
    events = [event async for event in await client.responses.create(
        model=MODEL, instructions="Be brief.", input="def add(a, b):", max_output_tokens=10, temperature=0, stream=True)]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type in ("response.completed", "response.incomplete")
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == expected
    assert events[-1].response.output_text == expected and events[-1].response.usage.total_tokens == whole.usage.total_tokens


async def test_function_calls_and_their_history(client, app, bundled_tokenizer) -> None:
    named = await client.responses.create(model=MODEL, input=CONVERSATION, tools=TOOLS, max_output_tokens=60,
                                          tool_choice={"type": "function", "name": "get_weather"}, temperature=0)
    (call,) = named.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), CITY)
    # the history reached the template: the prompt is the chat rendering of the converted messages with the tools
    chat_tools = [{"type": "function", "function": {k: v for k, v in TOOLS[0].items() if k != "type"}}]
    async with _client(app) as http:
        rendered = (await http.post("/tokenize", json={"messages": input_messages(CONVERSATION, None),
                                                       "tools": chat_tools})).json()
    assert named.usage.input_tokens == rendered["count"]
    assert "sunny" in bundled_tokenizer.decode(rendered["tokens"]) and "You help." in bundled_tokenizer.decode(rendered["tokens"])
    streamed = [e async for e in await client.responses.create(
        model=MODEL, input="weather?", tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
        max_output_tokens=60, temperature=0, stream=True)]
    done = [e.item for e in streamed if e.type == "response.output_item.done"]
    assert [item.type for item in done] == ["function_call"] and streamed[-1].response.output[0].name == "get_weather"


async def test_json_schema_text_format(client) -> None:
    response = await client.responses.create(
        model=MODEL, input="A city:", max_output_tokens=40, temperature=1.0,
        text={"format": {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}, "verbosity": "low"})
    jsonschema.validate(json.loads(response.output_text), CITY)
    assert response.text.verbosity == "low"  # accepted and echoed, not read (as vLLM's)


async def test_what_is_not_built_is_refused_by_name(app) -> None:
    cases = [({"background": True}, "background"),
             # vLLM's include values are accepted (reasoning.encrypted_content: Codex's), but the logprobs not built
             ({"include": ["message.output_text.logprobs"]}, "include"), ({"include": ["usage"]}, "include"),
             ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
             ({"reasoning": {"summary": "long"}}, "reasoning.summary"),
             ({"tools": [{"name": "f"}]}, "tools"),  # a tool without a type
             ({"input": [{"type": "image_generation_call"}]}, "input"),
             ({"unknown_field": 1}, "unknown_field"),
             # the chat request's errors name the Responses API's fields (RESPONSES_FIELDS)
             ({"max_output_tokens": 0}, "max_output_tokens"), ({"max_output_tokens": 10**6}, "max_output_tokens"),
             ({"input": []}, "input"), ({"input": [{"type": "message", "content": "x"}]}, "input"),
             ({"input": "hello " * 600}, "input_tokens"),  # over the context: vLLM's param
             ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
             ({"text": {"format": "json_object"}}, "text.format"),
             ({"text": {"format": {"type": "json_schema", "name": "c", "schema": CITY, "strict_mode": True}}},
              "text.format.strict_mode"),
             # function_call items need call_id, name and arguments as strings, their outputs call_id (vLLM's models)
             ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input"),
             ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}]}, "input"),
             ({"input": [{"type": "function_call_output", "output": "x"}]}, "input"),
             ({"input": [{"type": "message", "role": "user", "content": [  # messages[0]... is the client's input
                 {"type": "input_image", "image_url": "file:///etc/hostname"}]}]}, "input")]
    async with _client(app) as http:
        for extra, param in cases:
            response = await http.post("/v1/responses", json={"model": MODEL, "input": "x", **extra})
            assert (response.status_code, response.json()["error"]["param"]) == (400, param), response.text


async def test_reasoning_tokens_and_events(bundled_engine) -> None:
    """With a reasoning parser, usage counts the reply's tokens within its thinking (the bundled model's short reply
    never closes it: all of it) and a streamed reasoning item has vLLM's reasoning_part events around its text."""
    from asyncllm.integrations.openai_server import create_app

    body = {"model": MODEL, "input": "What is 2+2?", "max_output_tokens": 6, "temperature": 0}
    async with _client(create_app(bundled_engine, manage_engine=False, reasoning_parser="deepseek_r1")) as http:
        whole = (await http.post("/v1/responses", json=body)).json()
        streamed = await http.post("/v1/responses", json={**body, "stream": True})
    assert [item["type"] for item in whole["output"]] == ["reasoning"]
    assert whole["usage"]["output_tokens_details"] == {"reasoning_tokens": whole["usage"]["output_tokens"]} != {
        "reasoning_tokens": 0}
    events = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: ")]
    kinds = [e["type"] for e in events if "reasoning" in e["type"] or "output_item" in e["type"]]
    assert kinds[:2] == ["response.output_item.added", "response.reasoning_part.added"]
    assert kinds[-3:] == ["response.reasoning_text.done", "response.reasoning_part.done", "response.output_item.done"]
    assert events[-1]["response"]["usage"] == whole["usage"]


async def test_hunyuan_reasoning_tokens_are_those_of_its_thought(bundled_engine, bundled_tokenizer) -> None:
    """Hunyuan-A13B's thought is opened by ``<think>\\n`` (its start tag), not by its end tag without the "/": the
    Responses API's reasoning_tokens are the thought's (vLLM's hunyuan_a13b parser counts none)."""
    from asyncllm.integrations.openai_responses import Choices
    from asyncllm.integrations.openai_server import create_app
    from asyncllm.outputs import StreamDelta

    server = create_app(bundled_engine, manage_engine=False, reasoning_parser="hunyuan_a13b").state.openai_server
    pieces = ["<think>\n", "Two and two.\n", "</think>\n<answer>\n", "4\n</answer>"]
    ids = [bundled_tokenizer.encode(piece, add_special_tokens=False) for piece in pieces]
    choices = Choices(1, 1, None, chat=True, reasoning=server.reasoning, reasoning_end=server.reasoning_end(),
                      counts_reasoning=True)
    choices.add(0, StreamDelta(0, "".join(pieces), sum(ids, []), "stop"))
    assert choices.usage(reasoning_tokens=True)["completion_tokens_details"] == {"reasoning_tokens": len(ids[1])}
