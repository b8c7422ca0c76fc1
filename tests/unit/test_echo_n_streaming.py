"""Streamed completions' echo with logprobs and n > 1: a sibling's delta may come before sample 0's, which carries
the prompt's logprobs every choice's echo starts with; they are waited for, and the deltas taken meanwhile replayed."""

from __future__ import annotations

import asyncio

from asyncllm.integrations.openai_responses import Choices
from asyncllm.integrations.openai_streaming import _hold_for_prompt_logprobs
from asyncllm.integrations.streams import merge_streams
from asyncllm.outputs import Logprob, StreamDelta


class _Stream:
    def __init__(self, deltas: list[StreamDelta]) -> None:
        self.deltas, self.closed, self.collector = list(deltas), False, None

    def __aiter__(self) -> "_Stream":
        return self

    async def __anext__(self) -> StreamDelta:
        await asyncio.sleep(0)
        if not self.deltas:
            raise StopAsyncIteration
        return self.deltas.pop(0)

    async def aclose(self) -> None:
        self.closed = True


def test_a_siblings_first_delta_waits_for_sample_0s_prompt_logprobs() -> None:
    prompt = [None, {7: Logprob(-1.0, 1)}]
    deltas = [StreamDelta(1, "a", [3]), StreamDelta(1, "b", [4]), StreamDelta(0, "c", [5], prompt_logprobs=prompt),
              StreamDelta(0, "d", [6], finish_reason="length")]
    stream = _Stream(deltas)

    async def run() -> tuple[list, list]:
        firsts = [await stream.__anext__()]
        choices = Choices(1, 2, 1, chat=False)
        held = await _hold_for_prompt_logprobs([stream], firsts, choices, asyncio.Event().wait)
        assert choices.prompt_logprobs == [prompt] and not stream.closed
        return held, [delta async for _, delta in merge_streams([stream], firsts, held=held)]

    held, merged = asyncio.run(run())
    assert [d.text for _, d in held] == ["b", "c"]
    assert [d.text for d in merged] == ["a", "b", "c", "d"]
