"""A streamed completion of a prompt list: the response starts once every prompt is accepted, so prompts queued
past max_num_seqs hold up no other prompt's chunks (integrations/streams.py `accepted_streams`)."""

from __future__ import annotations

import pytest

from asyncllm import SamplingParams
from asyncllm.integrations.openai_server import create_app
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


async def test_streamed_prompt_list_counts_its_cached_tokens(bundled_engine) -> None:
    """A streamed completion of several prompts (the path that starts streaming once each prompt is accepted, before
    its first token) reports the prompts' prefix-cache hits in the usage chunk, as the whole response does
    (vLLM's --enable-prompt-tokens-details): they are known only from each prompt's first token on."""
    app = create_app(bundled_engine, manage_engine=False, enable_prompt_tokens_details=True)
    prompts = [f"class Review{i}:\n    def method(self, value):\n        return value + {i}\n" * 2 for i in range(2)]
    body = {"prompt": prompts, "max_tokens": 2, "temperature": 0, "ignore_eos": True, "cache_salt": "review-usage"}
    async with asgi_client(app) as client:
        await client.post("/v1/completions", json=body)  # fills the prefix cache
        whole = (await client.post("/v1/completions", json=body)).json()["usage"]
        streamed = await client.post("/v1/completions", json={**body, "stream": True,
                                                              "stream_options": {"include_usage": True}})
    usage = sse_events(streamed.text)[-1]["usage"]
    assert whole["prompt_tokens_details"]["cached_tokens"] >= 32
    assert usage == whole


@pytest.mark.parametrize("constraint,field", [({"structured_outputs": {"regex": "(("}}, "structured_outputs"),
                                              ({"response_format": {"type": "json_schema", "json_schema": {
                                                  "name": "x", "schema": {"$ref": "#/nope"}}}}, "response_format")])
async def test_streamed_prompt_list_names_the_clients_constraint_field(app, constraint, field) -> None:
    """A malformed constraint found when the engine compiles it names the field the client wrote, streamed over a
    prompt list too (whose stream begins once the prompts are accepted, before the compile's error: an error event),
    never the engine's ``structured``."""
    body = {"prompt": ["hi", "yo"], "max_tokens": 2, "stream": True, **constraint}
    async with asgi_client(app) as client:
        single = await client.post("/v1/completions", json={**body, "prompt": "hi"})
        listed = await client.post("/v1/completions", json=body)
    assert single.status_code == 400 and single.json()["error"]["param"] == field
    error = listed.json() if listed.status_code == 400 else sse_events(listed.text)[-1]
    assert error["error"]["param"] == field, error
    assert error["error"]["message"] == single.json()["error"]["message"]
