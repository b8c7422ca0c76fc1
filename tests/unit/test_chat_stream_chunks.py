"""A streamed chat delta's chunk choices (`chat_stream_choices`): one dict per OpenAI delta, built without copies."""

from __future__ import annotations

import itertools

import msgspec

from asyncllm.integrations.openai_responses import Choices, chat_stream_choices
from asyncllm.integrations.openai_tools import ToolMode
from asyncllm.outputs import StreamDelta


def _choices(**kwargs) -> Choices:
    choices = Choices(1, 1, None, chat=True, **kwargs)
    choices.streaming = True
    return choices


def _stream(choices: Choices, delta: StreamDelta, logprobs=None) -> bytes:
    index, _ = choices.add(0, delta)
    return b"".join(msgspec.json.encode(choice) + b"\n" for choice in chat_stream_choices(choices, index, delta, logprobs))


def test_a_tokens_chunk_is_its_content_and_the_last_carries_the_finish() -> None:
    choices = _choices()
    assert _stream(choices, StreamDelta(0, "Hi", [7], None)) == (
        b'{"index":0,"delta":{"content":"Hi"},"logprobs":null,"finish_reason":null,"stop_reason":null}\n')
    assert _stream(choices, StreamDelta(0, "", [8], None)) == b""  # no text yet, nothing to send
    assert _stream(choices, StreamDelta(0, "", [2], "stop", stop_reason=2), {"content": []}) == (
        b'{"index":0,"delta":{},"logprobs":{"content":[]},"finish_reason":"stop","stop_reason":2}\n')


def test_token_ids_go_on_a_chunk_even_without_text() -> None:
    choices = _choices(return_token_ids=True)
    assert _stream(choices, StreamDelta(0, "", [8], None)) == (
        b'{"index":0,"delta":{},"logprobs":null,"finish_reason":null,"stop_reason":null,"token_ids":[8]}\n')
    assert _stream(choices, StreamDelta(0, "", [], None)) == b""


def test_several_deltas_put_logprobs_and_token_ids_on_the_first_and_the_finish_on_the_last() -> None:
    ids = itertools.count()
    choices = _choices(tool_mode=ToolMode("required", new_call_id=lambda: f"call{next(ids)}"), return_token_ids=True)
    assert _stream(choices, StreamDelta(0, '[{"name": "a", "parameters": {}}, ', [5], None)) == (
        b'{"index":0,"delta":{},"logprobs":null,"finish_reason":null,"stop_reason":null,"token_ids":[5]}\n')
    lines = _stream(choices, StreamDelta(0, '{"name": "b", "parameters": {"x": 1}}]', [6], "stop"),
                    {"content": []}).splitlines()
    assert [msgspec.json.decode(line) for line in lines] == [
        {"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "call1", "type": "function",
                                               "function": {"name": "a", "arguments": "{}"}}]},
         "logprobs": {"content": []}, "finish_reason": None, "stop_reason": None, "token_ids": [6]},
        {"index": 0, "delta": {"tool_calls": [{"index": 1, "id": "call2", "type": "function",
                                               "function": {"name": "b", "arguments": '{"x": 1}'}}]},
         "logprobs": None, "finish_reason": "tool_calls", "stop_reason": None}]
    assert all(line.startswith(b'{"index":0,"delta":') for line in lines)  # the fields in OpenAI's order
