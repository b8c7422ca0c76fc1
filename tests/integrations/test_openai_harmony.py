"""gpt-oss's harmony replies through the OpenAI server (``openai_gptoss`` and ``openai`` parsers), over a stub engine
that answers every chat request with one harmony reply in small pieces (the tiny model writes no harmony, and a
grammar cannot force one here: with this reasoning parser a grammar waits for the final channel)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from asgi_helpers import asgi_client, sse_events

from asyncllm.errors import ConfigError
from asyncllm.outputs import StreamDelta

session_loop = pytest.mark.asyncio(loop_scope="session")

REPLY = ("<|channel|>analysis<|message|>Weather in Paris, then add.<|end|>"
         "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
         '<|message|>{"city": "Paris", "days": [1, 2.50]}<|call|>'
         "<|start|>assistant to=functions.add<|channel|>commentary json<|message|>{\"a\": 1}<|call|>")
TOOLS = [{"type": "function", "function": {"name": n}} for n in ("get_weather", "add")]
BODY = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": TOOLS}


class _Stream:
    collector = None

    def __init__(self, text: str) -> None:
        self._pieces = [text[i:i + 3] for i in range(0, len(text), 3)]

    def __aiter__(self) -> _Stream:
        return self

    async def __anext__(self) -> StreamDelta:
        if not self._pieces:
            raise StopAsyncIteration
        text = self._pieces.pop(0)
        return StreamDelta(0, text, [0], None if self._pieces else "stop")

    async def aclose(self) -> None:
        pass


class _HarmonyEngine:
    """Answers every chat request with `REPLY`; keeps the sampling parameters it was given."""

    config = SimpleNamespace(model="gpt-oss-stub", generation_config="auto", override_generation_config=None)
    model_name = "gpt-oss-stub"
    started = True

    def __init__(self, reply: str = REPLY) -> None:
        self.params: list = []
        self.reply = reply

    async def start(self) -> None:
        pass

    def default_sampling_fields(self) -> dict:
        return {}

    def chat(self, messages, params, **options) -> _Stream:
        self.params.append(params)
        return _Stream(self.reply)


def _app(engine, **parsers):
    from asyncllm.integrations.openai_server import create_app

    return create_app(engine, manage_engine=False, **parsers)


@session_loop
async def test_reasoning_and_calls_whole_and_streamed() -> None:
    engine = _HarmonyEngine()
    app = _app(engine, reasoning_parser="openai_gptoss", tool_call_parser="openai")
    async with asgi_client(app) as client:
        whole = (await client.post("/v1/chat/completions", json=BODY)).json()["choices"][0]
        streamed = await client.post("/v1/chat/completions", json={**BODY, "stream": True})
    assert all(not params.skip_special_tokens for params in engine.params)  # the markers are special tokens
    message = whole["message"]
    assert message["reasoning"] == "Weather in Paris, then add." and message["content"] is None
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == [
        ("get_weather", '{"city": "Paris", "days": [1, 2.5]}'), ("add", '{"a": 1}')]
    assert whole["finish_reason"] == "tool_calls"
    chunks = [c for event in sse_events(streamed.text) for c in event["choices"]]
    items = [item for c in chunks for item in c["delta"].get("tool_calls", ())]
    for index, call in enumerate(message["tool_calls"]):
        pieces = [item["function"]["arguments"] for item in items if item["index"] == index]
        assert len(pieces) > 3 and "".join(pieces) == call["function"]["arguments"]  # in pieces, joined exactly
    assert "".join(c["delta"].get("reasoning", "") for c in chunks) == message["reasoning"]
    assert not any(c["delta"].get("content") for c in chunks) and chunks[-1]["finish_reason"] == "tool_calls"


@session_loop
async def test_responses_api_items() -> None:
    app = _app(_HarmonyEngine(), reasoning_parser="openai_gptoss", tool_call_parser="openai")
    async with asgi_client(app) as client:
        body = (await client.post("/v1/responses", json={"input": "Weather in Paris?", "tools": [
            {"type": "function", "name": "get_weather"}, {"type": "function", "name": "add"}]})).json()
    kinds = [item["type"] for item in body["output"]]
    assert kinds == ["reasoning", "function_call", "function_call"], body
    assert body["output"][0]["content"][0]["text"] == "Weather in Paris, then add."
    assert json.loads(body["output"][1]["arguments"]) == {"city": "Paris", "days": [1, 2.5]}


@session_loop
async def test_responses_api_items_streamed_and_stored_as_answered(monkeypatch) -> None:
    """One item per harmony message, the same streamed or not, and kept as served (vLLM's layout)."""
    from asyncllm import envs

    monkeypatch.setenv(envs.ENABLE_RESPONSES_API_STORE.name, "1")
    reply = ("<|channel|>analysis<|message|>think A<|end|><|start|>assistant<|channel|>commentary<|message|>Let me "
             "check.<|end|><|start|>assistant<|channel|>analysis<|message|>think B<|end|>"
             "<|start|>assistant<|channel|>final<|message|>Done.<|return|>")
    app = _app(_HarmonyEngine(reply), reasoning_parser="openai_gptoss")
    async with asgi_client(app) as client:
        whole = (await client.post("/v1/responses", json={"input": "hi"})).json()
        streamed = await client.post("/v1/responses", json={"input": "hi", "stream": True})
        last = json.loads(streamed.text.rstrip().rsplit("data: ", 1)[1])["response"]
        stored = [(await client.get(f"/v1/responses/{body['id']}")).json() for body in (whole, last)]

    def items(body: dict) -> list[tuple[str, str]]:
        return [(item["type"], item["content"][0]["text"]) for item in body["output"]]

    assert items(whole) == items(last) == [("reasoning", "think A"), ("message", "Let me check."),
                                           ("reasoning", "think B"), ("message", "Done.")]
    assert stored == [whole, last]


@session_loop
async def test_without_tools_calls_stay_content_and_refusals() -> None:
    engine = _HarmonyEngine()
    app = _app(engine, reasoning_parser="openai_gptoss")
    async with asgi_client(app) as client:
        plain = (await client.post("/v1/chat/completions", json={"messages": BODY["messages"]})).json()["choices"][0]
        beams = await client.post("/v1/chat/completions", json={**BODY, "tools": None, "use_beam_search": True})
        forced = [await client.post("/v1/chat/completions", json={**BODY, "tool_choice": choice})
                  for choice in ("required", {"type": "function", "function": {"name": "add"}})]
        await client.post("/v1/chat/completions", json={**BODY, "tools": None,
                                                        "response_format": {"type": "json_object"}})
    assert plain["message"]["content"] == REPLY[REPLY.index("<|start|>"):] and plain["finish_reason"] == "stop"
    assert plain["message"]["reasoning"] == "Weather in Paris, then add."
    assert not engine.params[0].skip_special_tokens
    assert beams.status_code == 400 and beams.json()["error"]["param"] == "use_beam_search"
    for response in forced:  # a grammar after the final channel's start cannot make a call message
        assert response.status_code == 400 and response.json()["error"]["param"] == "tool_choice", response.text
    structured = engine.params[1].structured  # the final channel's header, tokens allowed between (vLLM's)
    assert len(engine.params) == 2 and (structured.start_after, structured.start_after_suffix) == (
        "<|channel|>final", "<|message|>")
    with pytest.raises(ConfigError, match="openai_gptoss"):
        _app(engine, tool_call_parser="openai")  # without it, the analysis would be content, markers and all


def test_serve_refuses_the_tool_parser_without_its_reasoning_parser(capsys) -> None:
    from asyncllm.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--enable-auto-tool-choice", "--tool-call-parser", "openai", "--reasoning-parser", "qwen3"])
    assert exit_info.value.code == 2 and "'openai_gptoss' with this tool-call parser" in capsys.readouterr().err
