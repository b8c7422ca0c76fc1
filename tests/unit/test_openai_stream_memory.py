"""A streamed OpenAI response keeps no per-token lists: each chunk is built from its delta alone (`Choices.streaming`),
and the chunks are those a non-streaming `Choices` builds."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
from starlette.requests import Request

from asyncllm.integrations.openai_protocol import CompletionRequest, decode_request
from asyncllm.integrations.openai_responses import Choices
from asyncllm.integrations.openai_streaming import respond, response_events
from asyncllm.outputs import Logprob, StreamDelta
from test_echo_n_streaming import _Stream

PROMPT = [7, 8]
PROMPT_LOGPROBS = [None, {8: Logprob(-0.5, 1, "b")}]


def _deltas(count: int) -> list[StreamDelta]:
    out = []
    for i in range(count):
        token = 100 + i
        entry = {token: Logprob(-0.25, 2, f"t{i}"), 5: Logprob(-0.1, 1, "x"), 6: Logprob(-3.0, 3, "y")}
        out.append(StreamDelta(0, f"t{i}", [token], "length" if i == count - 1 else None, None, [entry],
                               prompt_logprobs=PROMPT_LOGPROBS if i == 0 else None))
    return out


def _kept(choices: Choices) -> list[int]:
    """How many texts, token ids, logprob entries and output ids the request's choices keep."""
    return [sum(len(getattr(c, name)) for c in choices._choices)
            for name in ("text", "token_ids", "logprobs", "output_token_ids")]


@pytest.mark.parametrize("chat", [False, True])
def test_streamed_chunks_are_the_whole_bodys_without_keeping_them(chat: bool) -> None:
    whole, streamed = (Choices(1, 1, 2, chat=chat, return_token_ids=True) for _ in range(2))
    streamed.streaming = True
    if not chat:  # completions' echo: the prompt's logprobs first, the offsets of the generated text after it
        whole.prompt_logprobs[0] = streamed.prompt_logprobs[0] = PROMPT_LOGPROBS
        assert whole.echo(0, "ab", PROMPT) == streamed.echo(0, "ab", PROMPT)
    for delta in _deltas(50):
        assert msgspec.json.encode(whole.add(0, delta)) == msgspec.json.encode(streamed.add(0, delta))
    assert whole.usage() == streamed.usage()
    assert _kept(streamed) == [0, 0, 0, 0]
    assert _kept(whole) == [50 + (not chat), 50 + 2 * (not chat), 50 + 2 * (not chat), 50]


def test_reasoning_tokens_are_still_counted_streaming() -> None:
    """The Responses API's usage counts the generated ids within the thinking: those are kept."""
    choices = Choices(1, 1, None, chat=True, counts_reasoning=True, reasoning_end=SimpleNamespace())
    choices.streaming = True
    for delta in _deltas(5):
        choices.add(0, delta)
    assert _kept(choices) == [0, 0, 0, 5]


def _stream(deltas: list[StreamDelta]) -> _Stream:
    stream = _Stream(deltas)
    stream.collector = SimpleNamespace(prompt_token_ids=PROMPT, num_cached_tokens=0)
    return stream


def _request() -> Request:
    async def receive() -> dict[str, Any]:
        await asyncio.Event().wait()  # the client never leaves
        return {}

    return Request({"type": "http", "method": "POST", "path": "/", "headers": []}, receive)


def test_the_sse_paths_stream() -> None:
    """Completions (chat the same, `respond`) and the Responses API's events keep nothing per token."""
    req = decode_request(b'{"model": "m", "prompt": "ab", "stream": true, "logprobs": 2}', CompletionRequest)

    async def completions() -> tuple[Choices, list[bytes]]:
        choices = Choices(1, 1, 2, chat=False)
        response = await respond(_request(), req, "m", [_stream(_deltas(20))], choices, "cmpl", "text_completion")
        return choices, [chunk async for chunk in response.body_iterator]

    choices, chunks = asyncio.run(completions())
    assert sum(b'"logprobs":{"tokens"' in chunk for chunk in chunks) == 20 and chunks[-1] == b"data: [DONE]\n\n"
    assert _kept(choices) == [0, 0, 0, 0]

    events = SimpleNamespace(start=lambda: [], feed=lambda parts: [], finish=lambda reason, usage: [b"end"])

    async def responses() -> tuple[Choices, list[bytes]]:
        stream = _stream(_deltas(20))
        choices = Choices(1, 1, None, chat=True, message_starts=True)
        firsts = [await stream.__anext__()]
        return choices, [event async for event in response_events(_request(), events, [stream], firsts, choices)]

    choices, sent = asyncio.run(responses())
    assert sent == [b"end"] and _kept(choices) == [0, 0, 0, 0]
