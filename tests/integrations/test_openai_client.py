"""The official `openai` client against the server on a real socket (uvicorn on 127.0.0.1, random port)."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from asyncllm import SamplingParams

pytestmark = pytest.mark.asyncio(loop_scope="session")

MODEL = "asyncllm-tiny"


@pytest.fixture
def client(base_url) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)


async def test_completion(client, bundled_engine, bundled_tokenizer) -> None:
    prompt = "import sys\n"
    expected = await bundled_engine.generate(prompt, SamplingParams(temperature=0, max_tokens=10))
    out = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0)
    assert out.choices[0].text == expected.text
    assert out.choices[0].finish_reason == expected.finish_reason
    assert out.usage.prompt_tokens == len(bundled_tokenizer(prompt).input_ids)
    assert out.usage.completion_tokens == len(expected.token_ids)
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


async def test_completion_stream_with_usage(client) -> None:
    whole = await client.completions.create(model=MODEL, prompt="def f(x):", max_tokens=12, temperature=0)
    chunks = [c async for c in await client.completions.create(
        model=MODEL, prompt="def f(x):", max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True})]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


async def test_chat(client, bundled_engine, bundled_tokenizer) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "print it"}]
    deltas = [d async for d in bundled_engine.chat(messages, SamplingParams(temperature=0, max_tokens=9))]
    out = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=9, temperature=0)
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == "".join(d.text for d in deltas)
    prompt_ids = bundled_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                       return_dict=False)
    assert out.usage.prompt_tokens == len(prompt_ids)
    assert out.usage.completion_tokens == sum(len(d.token_ids) for d in deltas)


async def test_chat_stream_with_usage(client) -> None:
    messages = [{"role": "user", "content": "hi"}]
    whole = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=9, temperature=0)
    stream = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=9, temperature=0,
                                                  stream=True, stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[-1].usage == whole.usage
    assert all(c.usage is None for c in chunks[:-1])


async def test_n_and_seed(client) -> None:
    request = dict(model=MODEL, prompt="x = ", max_tokens=8, n=3, seed=7, temperature=1.0, logprobs=0)
    first = await client.completions.create(**request)
    again = await client.completions.create(**request)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]  # seeded: reproducible
    assert len({c.text for c in first.choices}) > 1  # each sample has its own seed
    assert first.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in first.choices)
    chat = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                                max_tokens=4, n=2, temperature=0)
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.choices[0].message.content == chat.choices[1].message.content


async def test_stop(client) -> None:
    text = (await client.completions.create(model=MODEL, prompt="def add(a, b):", max_tokens=16,
                                            temperature=0)).choices[0].text
    stop = text[4:6]
    out = await client.completions.create(model=MODEL, prompt="def add(a, b):", max_tokens=16, temperature=0,
                                          stop=[stop])
    assert out.choices[0].text == text[: text.index(stop)] and out.choices[0].finish_reason == "stop"


async def test_logprobs(client) -> None:
    out = await client.completions.create(model=MODEL, prompt="return ", max_tokens=5, temperature=0, logprobs=2)
    logprobs = out.choices[0].logprobs
    assert "".join(logprobs.tokens) == out.choices[0].text
    assert all(len(top) == 2 and max(top.values()) == lp for top, lp in zip(logprobs.top_logprobs, logprobs.token_logprobs))
    chat = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                                max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert "".join(t.token for t in content) == chat.choices[0].message.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob == t.logprob for t in content)


async def test_errors_are_typed_for_the_client(client) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        await client.completions.create(model=MODEL, prompt="x", max_tokens=0)
    assert bad.value.status_code == 400 and "max_tokens" in bad.value.message
    with pytest.raises(openai.NotFoundError):
        await client.completions.create(model="gpt-4", prompt="x")
    models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL]


async def test_client_disconnect_aborts(base_url, bundled_engine) -> None:
    """Leaving a stream (or a plain request) early frees the request in the engine."""
    request = {"model": MODEL, "prompt": "def f():", "max_tokens": 400, "ignore_eos": True, "temperature": 0}
    aborted_before = bundled_engine.stats().request_success_total.get("abort", 0)
    async with httpx.AsyncClient(base_url=base_url) as http:
        async with http.stream("POST", "/v1/completions", json={**request, "stream": True}) as response:
            async for _ in response.aiter_bytes():
                break  # one chunk, then hang up
        await _wait_idle(bundled_engine)
        task = asyncio.ensure_future(http.post("/v1/completions", json=request))
        for _ in range(1000):
            if bundled_engine.stats().num_requests_running or task.done():
                break
            await asyncio.sleep(0.01)
        assert not task.done(), task.result().text  # still generating: 400 tokens take far longer
        task.cancel()  # closes the connection mid-request
        await _wait_idle(bundled_engine)
    assert bundled_engine.stats().request_success_total.get("abort", 0) == aborted_before + 2  # not "length"


async def _wait_idle(engine, timeout: float = 10.0) -> None:
    for _ in range(int(timeout / 0.02)):
        stats = engine.stats()
        if stats.num_requests_running == 0 and stats.num_requests_waiting == 0:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"the engine still runs requests: {engine.stats()}")
