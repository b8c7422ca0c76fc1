"""Completions' `echo`: the prompt before the completion, with its logprobs (what evaluation harnesses ask for)."""

from __future__ import annotations

import json

import pytest
from asgi_helpers import asgi_client as _client
from test_openai_asgi import GREEDY

from asyncllm import InvalidRequestError, SamplingParams
from asyncllm.integrations.openai_responses import prompt_logprobs_body
from asyncllm.outputs import Logprob

pytestmark = pytest.mark.asyncio(loop_scope="session")

PROMPT = "def add(a, b):\n    return"


async def test_echo_with_max_tokens_zero_gives_the_prompt_logprobs(app, bundled_engine, bundled_tokenizer) -> None:
    expected = await bundled_engine.generate(PROMPT, SamplingParams(max_tokens=1, prompt_logprobs=2))
    prompt_ids = bundled_tokenizer(PROMPT).input_ids
    async with _client(app) as client:
        body = (await client.post("/v1/completions", json={"prompt": PROMPT, "echo": True, "max_tokens": 0,
                                                          "logprobs": 2})).json()
        refused = await client.post("/v1/completions", json={"prompt": PROMPT, "echo": True, "max_tokens": 0,
                                                             "min_tokens": 2})
    assert refused.status_code == 400 and "2 exceeds max_tokens=0" in refused.json()["error"]["message"]
    choice = body["choices"][0]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": len(prompt_ids), "completion_tokens": 0, "total_tokens": len(prompt_ids)}
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(prompt_ids) and logprobs["token_logprobs"][0] is None
    assert logprobs["top_logprobs"][0] is None and logprobs["text_offset"][0] == 0
    for i in range(1, len(prompt_ids)):
        entry = expected.prompt_logprobs[i]
        assert logprobs["token_logprobs"][i] == pytest.approx(entry[prompt_ids[i]].logprob)
        assert len(logprobs["top_logprobs"][i]) <= 3 and logprobs["tokens"][i] in logprobs["top_logprobs"][i]
        assert logprobs["text_offset"][i] == logprobs["text_offset"][i - 1] + len(logprobs["tokens"][i - 1])


async def test_echo_leaves_prompt_logprobs_as_many_as_asked(app) -> None:
    """echo with logprobs 3 asks the engine for 3 prompt logprobs a token; ``prompt_logprobs`` M below it still
    answers vLLM's shape: the prompt token and the M most likely (rank <= M), as without echo; the echoed
    ``logprobs`` keep their 3. -1 keeps every entry the engine gave."""
    body = {**GREEDY, "prompt": PROMPT, "max_tokens": 1}
    async with _client(app) as client:
        for asked in (0, 1):
            alone = (await client.post("/v1/completions", json={**body, "prompt_logprobs": asked})).json()
            echoed = (await client.post("/v1/completions", json={**body, "prompt_logprobs": asked, "echo": True,
                                                                 "logprobs": 3})).json()
            want, got = alone["choices"][0]["prompt_logprobs"], echoed["choices"][0]["prompt_logprobs"]
            assert got[0] is None and [{t: e["rank"] for t, e in entry.items()} for entry in got[1:]] == [
                {t: e["rank"] for t, e in entry.items()} for entry in want[1:]]
            assert all(len(entry) <= asked + 1 for entry in got[1:])
            assert max(len(top) for top in echoed["choices"][0]["logprobs"]["top_logprobs"][1:]) >= 3
    entries = [None, {9: Logprob(-5.0, 40), 1: Logprob(-1.0, 1), 2: Logprob(-2.0, 2)}]  # the prompt token first
    assert [list(prompt_logprobs_body(entries, n)[1]) for n in (0, 1, -1)] == [["9"], ["9", "1"], ["9", "1", "2"]]


async def test_echo_only_prompt_may_fill_the_context(app) -> None:
    """lm-eval's perplexity windows are max_model_len tokens: echo with max_tokens 0 scores one (vLLM's server counts
    its max_tokens as 0; the one sampled token ends it); a token more, or max_tokens 1, is still refused."""
    max_model_len = app.state.openai_server.engine.config.max_model_len
    full = {"prompt": [5, 6, 7] * (max_model_len // 3) + [5] * (max_model_len % 3), "echo": True, "max_tokens": 0,
            "logprobs": 0, "temperature": 0}
    async with _client(app) as client:
        scored = await client.post("/v1/completions", json=full)
        shorter = await client.post("/v1/completions", json={**full, "prompt": full["prompt"][:-1]})
        refused = [await client.post("/v1/completions", json={**full, **extra})
                   for extra in ({"prompt": full["prompt"] + [5]}, {"max_tokens": 1})]
    assert scored.status_code == 200, scored.text
    choice, usage = scored.json()["choices"][0], scored.json()["usage"]
    assert choice["finish_reason"] == "length" and len(choice["logprobs"]["tokens"]) == max_model_len
    assert usage == {"prompt_tokens": max_model_len, "completion_tokens": 0, "total_tokens": max_model_len}
    assert choice["logprobs"]["token_logprobs"][:-1] == pytest.approx(
        shorter.json()["choices"][0]["logprobs"]["token_logprobs"], abs=1e-4)  # causal: the same up to the last
    assert [(r.status_code, r.json()["error"]["code"]) for r in refused] == [(400, "context_length_exceeded")] * 2
    engine = app.state.openai_server.engine
    for params, field in ((None, "echo_only"), (SamplingParams(max_tokens=5), "echo_only"), ({}, "params")):
        with pytest.raises(InvalidRequestError) as info:  # the engine's option names itself, not the prompt
            engine.stream(full["prompt"], params, echo_only=True)
        assert info.value.field == field


async def test_echo_then_generated_tokens_streamed_or_not(app) -> None:
    body = {**GREEDY, "prompt": PROMPT, "logprobs": 1}
    async with _client(app) as client:
        plain = (await client.post("/v1/completions", json=body)).json()["choices"][0]
        echoed = (await client.post("/v1/completions", json={**body, "echo": True})).json()["choices"][0]
        streamed = await client.post("/v1/completions", json={**body, "echo": True, "stream": True})
        tokens = await client.post("/v1/completions", json={**GREEDY, "prompt": [5, 6, 7], "echo": True})
        two = await client.post("/v1/completions", json={**GREEDY, "prompt": PROMPT, "echo": True, "n": 2,
                                                         "temperature": 1.0})
    assert echoed["text"] == PROMPT + plain["text"]
    generated = len(plain["logprobs"]["tokens"])
    assert echoed["logprobs"]["token_logprobs"][-generated:] == plain["logprobs"]["token_logprobs"]
    assert echoed["logprobs"]["tokens"][-generated:] == plain["logprobs"]["tokens"]
    chunks = [json.loads(line[6:]) for line in streamed.text.split("\n\n") if line.startswith("data: {")]
    assert chunks[0]["choices"][0]["text"] == PROMPT
    assert "".join(c["choices"][0]["text"] for c in chunks) == echoed["text"]
    assert tokens.json()["choices"][0]["text"].startswith(app.state.openai_server.engine.tokenizer.decode([5, 6, 7]))
    assert all(c["text"].startswith(PROMPT) for c in two.json()["choices"])


async def test_echo_with_logprobs_and_n_puts_the_prompt_logprobs_on_every_choice(app, bundled_tokenizer) -> None:
    """vLLM's: each choice's logprobs are the prompt's then its own, streamed or not (sample 0 computes them)."""
    body = {"prompt": PROMPT, "logprobs": 1, "echo": True, "n": 2, "temperature": 1.0, "max_tokens": 3, "seed": 1}
    num_prompt = len(bundled_tokenizer(PROMPT).input_ids)
    async with _client(app) as client:
        whole = await client.post("/v1/completions", json=body)
        streamed = await client.post("/v1/completions", json={**body, "stream": True})
    assert whole.status_code == 200, whole.text
    choices = [c["logprobs"] for c in whole.json()["choices"]]
    chunks = [json.loads(line[6:]) for line in streamed.text.split("\n\n") if line.startswith("data: {")]
    firsts = {}
    for chunk in chunks:
        firsts.setdefault(chunk["choices"][0]["index"], chunk["choices"][0]["logprobs"])
    prompt_lps = choices[0]["token_logprobs"][:num_prompt]
    assert prompt_lps[0] is None and None not in prompt_lps[1:]
    for logprobs in [*choices, *(firsts[i] for i in (0, 1))]:
        assert logprobs["token_logprobs"][:num_prompt] == pytest.approx(prompt_lps, abs=1e-5)
    assert all(len(logprobs["tokens"]) == num_prompt + 3 for logprobs in choices)


async def test_return_tokens_as_token_ids_names_every_logprob_token_by_id(bundled_engine, bundled_tokenizer) -> None:
    """vLLM's --return-tokens-as-token-ids: completions' and chat's logprobs name tokens ``token_id:N`` (an echoed
    prompt's too), the ids the engine generated."""
    from asyncllm.integrations.openai_server import create_app

    app = create_app(bundled_engine, manage_engine=False, return_tokens_as_token_ids=True)
    expected = await bundled_engine.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=4))
    async with _client(app) as client:
        done = (await client.post("/v1/completions", json={**GREEDY, "prompt": PROMPT, "max_tokens": 4, "logprobs": 2,
                                                           "echo": True})).json()["choices"][0]["logprobs"]
        chat = (await client.post("/v1/chat/completions", json={
            **GREEDY, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "logprobs": True,
            "top_logprobs": 2})).json()["choices"][0]["logprobs"]["content"]
    prompt_ids = bundled_tokenizer(PROMPT).input_ids
    assert done["tokens"] == [f"token_id:{t}" for t in prompt_ids + expected.token_ids]
    assert all(key.startswith("token_id:") for top in done["top_logprobs"][1:] for key in top)
    assert all(entry["token"].startswith("token_id:") and entry["bytes"] == list(entry["token"].encode())
               and all(t["token"].startswith("token_id:") for t in entry["top_logprobs"]) for entry in chat)


async def test_a_requests_return_tokens_as_token_ids_overrides_the_servers(bundled_engine, bundled_tokenizer) -> None:
    """vLLM's request field: true on a server without the flag names tokens by id (an echoed prompt's too), false
    on a server with it names them by text."""
    from asyncllm.integrations.openai_server import create_app

    body = {**GREEDY, "prompt": PROMPT, "max_tokens": 3, "logprobs": 1, "echo": True}
    async with _client(create_app(bundled_engine, manage_engine=False)) as client:
        by_id = (await client.post("/v1/completions", json={**body, "return_tokens_as_token_ids": True})).json()
        chat = (await client.post("/v1/chat/completions", json={
            **GREEDY, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "logprobs": True,
            "return_tokens_as_token_ids": True})).json()["choices"][0]["logprobs"]["content"]
    async with _client(create_app(bundled_engine, manage_engine=False, return_tokens_as_token_ids=True)) as client:
        by_text = (await client.post("/v1/completions", json={**body, "return_tokens_as_token_ids": False})).json()
    prompt_ids = bundled_tokenizer(PROMPT).input_ids
    tokens = by_id["choices"][0]["logprobs"]["tokens"]
    assert tokens[:len(prompt_ids)] == [f"token_id:{t}" for t in prompt_ids] and len(tokens) == len(prompt_ids) + 3
    assert all(entry["token"].startswith("token_id:") for entry in chat)
    assert not any(t.startswith("token_id:") for t in by_text["choices"][0]["logprobs"]["tokens"])
