"""A streamed completion of a prompt list: the response starts once every prompt is accepted, so prompts queued
past max_num_seqs hold up no other prompt's chunks (integrations/streams.py `accepted_streams`)."""

from __future__ import annotations

import pytest

from asyncllm import SamplingParams
from asgi_helpers import asgi_client, sse_events

pytestmark = pytest.mark.asyncio(loop_scope="session")

GREEDY = {"model": "asyncllm-tiny", "temperature": 0, "max_tokens": 6}


async def test_a_streamed_prompt_list_longer_than_max_num_seqs_starts_before_the_queued_prompts_run(
        app, bundled_engine) -> None:
    """vLLM streams a prompt list's tokens as they come: the prompts past max_num_seqs (16 here), queued until a
    running one finishes, hold up nobody's chunks (the response starts once every prompt was accepted), and a
    rejected prompt of the list is still a 400 before the stream."""
    prompts = [f"x = {i}" for i in range(bundled_engine.config.max_num_seqs + 1)]
    request = {**GREEDY, "prompt": prompts, "max_tokens": 4, "ignore_eos": True, "stream": True}
    async with asgi_client(app) as client:
        streamed = await client.post("/v1/completions", json=request)
        too_long = await client.post("/v1/completions", json={**request, "prompt": [
            "a", "b " * bundled_engine.config.max_model_len]})
    events = sse_events(streamed.text)
    last = len(prompts) - 1
    first_of_last = next(i for i, e in enumerate(events) if e["choices"][0]["index"] == last)
    assert any(e["choices"][0]["finish_reason"] for e in events[:first_of_last])  # one finished before it started
    whole = {i: "".join(e["choices"][0]["text"] for e in events if e["choices"][0]["index"] == i) for i in range(last + 1)}
    for i in (0, last):
        expected = await bundled_engine.generate(prompts[i], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        assert whole[i] == expected.text
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "input_tokens"
