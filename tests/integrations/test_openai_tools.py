"""Tool calling through the OpenAI server and `AsyncEngine.chat(tools=...)`, on the bundled model (hermes format)."""

from __future__ import annotations

import json

import pytest
from asgi_helpers import asgi_client as _client, sse_events as _events

from asyncllm import SamplingParams

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")
pytestmark = pytest.mark.asyncio(loop_scope="session")

CITY = {"type": "object", "properties": {"city": {"type": "string", "enum": ["paris", "rome", "oslo"]}},
        "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": CITY}},
         {"type": "function", "function": {"name": "add", "parameters": {
             "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
             "required": ["a"], "additionalProperties": False}}}]
DUMPED_TOOLS = [TOOLS[0], {"type": "function", "function": {"name": "add", "description": None,
                                                             "parameters": TOOLS[1]["function"]["parameters"]}}]
"""TOOLS as vLLM's server gives them to the template (``ChatCompletionToolsParam(**tool).model_dump()``)."""
HISTORY = [{"role": "system", "content": "You help."}, {"role": "user", "content": "Weather in Paris?"},
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "paris"}'}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
SAMPLED = {"temperature": 1.0, "seed": 11, "max_tokens": 120}
# what a hermes model writes: forced here with a regex, since the tiny model never chooses to call a tool
HERMES_CALL = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(paris|rome)"\}\}\n</tool_call>'


@pytest.fixture(scope="module")
def hermes_app(bundled_engine):
    from asyncllm.integrations.openai_server import create_app

    return create_app(bundled_engine, manage_engine=False, tool_call_parser="hermes")


def _rendered(tokenizer, messages=HISTORY, tools=TOOLS) -> list[int]:
    """vLLM's prompt: HISTORY as its conversation, rendered to text, tokenized without special tokens."""
    template = [dict(m) for m in messages]
    template[2] = {**template[2], "content": "", "tool_calls": [
        {**template[2]["tool_calls"][0], "function": {"name": "get_weather", "arguments": {"city": "paris"}}}]}
    text = tokenizer.apply_chat_template(template, tools=tools, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False).input_ids


async def test_tools_and_tool_history_reach_the_template(app, bundled_engine, bundled_tokenizer) -> None:
    """The server renders tools as vLLM's server does (dumped: "description": null here), the engine's chat as
    given (as vLLM's ``LLM.chat``); the bundled template writes whole tools with ``tojson``, so they differ."""
    expected, as_given = _rendered(bundled_tokenizer, tools=DUMPED_TOOLS), _rendered(bundled_tokenizer)
    assert "get_weather" in bundled_tokenizer.decode(expected) and "sunny" in bundled_tokenizer.decode(expected)
    assert expected != as_given
    async with _client(app) as client:
        tokenized = await client.post("/tokenize", json={"messages": HISTORY, "tools": TOOLS})
    assert tokenized.status_code == 200 and tokenized.json()["tokens"] == expected
    stream = bundled_engine.chat(HISTORY, SamplingParams(temperature=0, max_tokens=2), tools=TOOLS)
    async with stream:
        async for _ in stream:
            pass
    assert stream.collector.prompt_token_ids == as_given


async def test_tools_reach_the_template_as_vllm_dumps_them(app, bundled_tokenizer) -> None:
    """vLLM's model_dump: ``type`` defaulted and first, ``name``, ``description``, ``parameters`` (None kept) first in
    that order, then the client's other keys; a tool without ``type`` or with ``"parameters": null`` is served."""
    tools = [{"function": {"parameters": CITY, "strict": True, "name": "get_weather"}, "x-tag": 1},
             {"type": "function", "function": {"description": "The time", "name": "now", "parameters": None}}]
    dumped = [{"type": "function", "function": {"name": "get_weather", "description": None, "parameters": CITY,
                                                "strict": True}, "x-tag": 1},
              {"type": "function", "function": {"name": "now", "description": "The time", "parameters": None}}]
    expected = _rendered(bundled_tokenizer, tools=dumped)
    async with _client(app) as client:
        tokenized = await client.post("/tokenize", json={"messages": HISTORY, "tools": tools})
        chat = await client.post("/v1/chat/completions", json={"messages": HISTORY, "tools": tools,
                                                                "tool_choice": "none", "max_tokens": 1})
    assert tokenized.status_code == 200 and tokenized.json()["tokens"] == expected
    assert chat.status_code == 200 and chat.json()["usage"]["prompt_tokens"] == len(expected)


async def test_named_tool_choice_streamed_and_whole(app) -> None:
    body = {"messages": HISTORY, "tools": TOOLS, **SAMPLED,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    async with _client(app) as client:
        whole = await client.post("/v1/chat/completions", json=body)
        streamed = await client.post("/v1/chat/completions", json={**body, "stream": True})
    assert whole.status_code == 200, whole.text
    choice = whole.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "get_weather" and call["id"].startswith("call_")
    jsonschema.validate(json.loads(call["function"]["arguments"]), CITY)
    items = [item for event in _events(streamed.text) for c in event["choices"]
             for item in c["delta"].get("tool_calls", ())]
    assert items[0]["function"]["name"] == "get_weather" and all(item["index"] == 0 for item in items)
    assert "".join(item["function"]["arguments"] for item in items) == call["function"]["arguments"]  # same seed


async def test_required_tool_choice(app) -> None:
    body = {"messages": HISTORY, "tools": TOOLS, **SAMPLED, "n": 2, "tool_choice": "required",
            "parallel_tool_calls": False}
    async with _client(app) as client:
        response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    for choice in response.json()["choices"]:
        assert choice["finish_reason"] == "tool_calls", choice
        (call,) = choice["message"]["tool_calls"]
        schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call["function"]["name"])
        jsonschema.validate(json.loads(call["function"]["arguments"]), schema)


async def test_auto_reads_the_models_calls(hermes_app) -> None:
    body = {"messages": HISTORY, "tools": TOOLS, **SAMPLED, "structured_outputs": {"regex": HERMES_CALL}}
    async with _client(hermes_app) as client:
        whole = await client.post("/v1/chat/completions", json=body)
        streamed = await client.post("/v1/chat/completions", json={**body, "stream": True})
        text = await client.post("/v1/chat/completions", json={**body, "structured_outputs": {"regex": "It is sunny"}})
    choice = whole.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None, choice
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"])["city"] in ("paris", "rome")
    chunks = [c for event in _events(streamed.text) for c in event["choices"]]
    items = [item for c in chunks for item in c["delta"].get("tool_calls", ())]
    assert items[0]["function"] == {"name": "get_weather", "arguments": ""} and items[0]["id"].startswith("call_")
    assert len(items) > 2 and all(item["index"] == 0 and "id" not in item for item in items[1:])  # arguments in pieces
    assert "".join(item["function"]["arguments"] for item in items) == call["function"]["arguments"]  # same seed
    assert not any(c["delta"].get("content") for c in chunks)  # the call's text is not content
    assert chunks[-1]["finish_reason"] == "tool_calls"
    plain = text.json()["choices"][0]
    assert plain["message"] == {"role": "assistant", "content": "It is sunny"} and plain["finish_reason"] == "stop"


async def test_tool_requests_the_server_cannot_take(app, hermes_app) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    cases = [(app, {"tools": TOOLS}, "enable-auto-tool-choice"),  # auto by default: this server has no parser
             (hermes_app, {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "nope"),
             (hermes_app, {"tool_choice": "required"}, "needs tools"),
             (hermes_app, {"tools": TOOLS, "tool_choice": named, "response_format": {"type": "json_object"}}, "response_format"),
             (hermes_app, {"tools": [{"type": "function", "function": {}}]}, "name"),
             (hermes_app, {"tools": [{"type": "custom", "function": {"name": "f"}}]}, "item 0"),
             (hermes_app, {"tools": [{"function": {"name": "f", "description": 5}}]}, "description"),
             (app, {"tools": [{"type": "function", "function": {"name": "f", "parameters": {  # the engine's grammar
                 "type": "object", "properties": {"a": {"type": "nonsense"}}}}}], "tool_choice": "required"}, "nonsense")]
    for server, extra, match in cases:
        async with _client(server) as client:
            response = await client.post("/v1/chat/completions", json={"messages": HISTORY, "max_tokens": 2, **extra})
        assert response.status_code == 400, (extra, response.text)
        error = response.json()["error"]
        assert match in error["message"] and error["param"] in ("tools", "tool_choice"), error


async def test_reasoning_parser_wiring(bundled_engine, app) -> None:
    """Replies go to `reasoning` until </think> (the tiny model never writes it: all reasoning), and a grammar
    waits for the thinking to end (so here it never starts; without a reasoning parser it does at once)."""
    from asyncllm.integrations.openai_server import create_app

    r1 = create_app(bundled_engine, manage_engine=False, reasoning_parser="deepseek_r1")
    body = {"messages": HISTORY[:2], "temperature": 0, "max_tokens": 12}
    structured = {**body, "response_format": {"type": "json_object"}}
    async with _client(r1) as client:
        whole = (await client.post("/v1/chat/completions", json=body)).json()["choices"][0]
        streamed = await client.post("/v1/chat/completions", json={**body, "stream": True})
        thinking = (await client.post("/v1/chat/completions", json=structured)).json()["choices"][0]
    async with _client(app) as client:
        plain = (await client.post("/v1/chat/completions", json=body)).json()["choices"][0]
        constrained = (await client.post("/v1/chat/completions", json=structured)).json()["choices"][0]
    assert whole["message"]["reasoning"] == plain["message"]["content"] and whole["message"]["content"] is None
    deltas = [c["delta"] for event in _events(streamed.text) for c in event["choices"]]
    assert "".join(d.get("reasoning", "") for d in deltas) == plain["message"]["content"]
    assert not any(d.get("content") for d in deltas)
    assert thinking["message"]["reasoning"] == plain["message"]["content"]  # free text: the grammar waits
    assert constrained["message"]["content"].lstrip().startswith("{") and not plain["message"]["content"].startswith("{")


NO_THINKING = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}<|assistant|>"
               "{{ '<think>\\n\\n</think>\\n\\n' }}")  # as Qwen3's template writes it with enable_thinking false


async def test_qwen3_with_enable_thinking_false_reads_the_reply_as_answer(bundled_engine) -> None:
    """vLLM's qwen3 parser reads ``chat_template_kwargs.enable_thinking`` false as thinking off (an Instruct template
    writes no think block): the reply is content and a constraint applies at once (not when the prompt's end opens
    ``<think>`` anyway: tests/unit/test_reasoning.py)."""
    from asyncllm.integrations.openai_server import create_app

    app = create_app(bundled_engine, manage_engine=False, reasoning_parser="qwen3", trust_request_chat_template=True)
    plain = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}<|assistant|>"
    body = {"messages": HISTORY[:2], "temperature": 0, "max_tokens": 6, "chat_template": plain,
            "chat_template_kwargs": {"enable_thinking": False}}
    async with _client(app) as client:
        off = (await client.post("/v1/chat/completions", json=body)).json()["choices"][0]["message"]
        on = (await client.post("/v1/chat/completions", json={**body, "chat_template_kwargs": {}})).json()
        forced = (await client.post("/v1/chat/completions", json={
            **body, "max_tokens": 30, "structured_outputs": {"regex": "The answer is 4\\."}})).json()
    assert off["content"] and "reasoning" not in off, off
    assert on["choices"][0]["message"]["reasoning"] == off["content"]  # thinking on: the same text is reasoning
    assert forced["choices"][0]["message"] == {"role": "assistant", "content": "The answer is 4."}, forced


async def test_a_prompt_that_ended_the_thinking_gets_all_answer(bundled_engine) -> None:
    """As vLLM (``is_reasoning_end(prompt_token_ids)``): after the prompt's empty think block the reply is content,
    or a named choice's call, streamed and whole (the grammar applies at once: the same rule, start_after.py)."""
    from asyncllm.integrations.openai_server import create_app

    r1 = create_app(bundled_engine, manage_engine=False, reasoning_parser="deepseek_r1",
                    trust_request_chat_template=True)
    body = {"messages": HISTORY[:2], "temperature": 0, "max_tokens": 30, "chat_template": NO_THINKING}
    forced = {**body, "structured_outputs": {"regex": "The answer is 4\\."}}
    named = {**body, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    async with _client(r1) as client:
        whole = (await client.post("/v1/chat/completions", json=forced)).json()["choices"][0]
        streamed = await client.post("/v1/chat/completions", json={**forced, "stream": True})
        call = (await client.post("/v1/chat/completions", json=named)).json()["choices"][0]
        beam = (await client.post("/v1/chat/completions", json={**body, "use_beam_search": True, "n": 2,
                                                                 "max_tokens": 4})).json()["choices"]
    assert all(c["message"]["content"] and "reasoning" not in c["message"] for c in beam), beam  # beam search too
    assert whole["message"] == {"role": "assistant", "content": "The answer is 4."}, whole
    deltas = [c["delta"] for event in _events(streamed.text) for c in event["choices"]]
    assert "".join(d.get("content") or "" for d in deltas) == "The answer is 4."
    assert not any("reasoning" in d for d in deltas)
    assert "reasoning" not in call["message"] and call["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["message"]["tool_calls"][0]["function"]["arguments"]), CITY)
