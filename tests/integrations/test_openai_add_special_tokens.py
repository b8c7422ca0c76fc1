"""vLLM's ``add_special_tokens``: /v1/completions (default true), /v1/chat/completions and /tokenize's messages (default
false, the template writes them), beam search too, tokenize the prompt with the value sent, as the engine's generate /
chat option does."""

from __future__ import annotations

import pytest

from asgi_helpers import asgi_client
from asyncllm import SamplingParams
from asyncllm.errors import InvalidRequestError

pytestmark = pytest.mark.asyncio(loop_scope="session")
MODEL = "asyncllm-tiny"
GREEDY = {"model": MODEL, "temperature": 0, "max_tokens": 1, "return_token_ids": True}
MESSAGES = [{"role": "user", "content": "hi"}]


async def test_the_prompt_is_tokenized_with_the_requests_add_special_tokens(app, bundled_tokenizer) -> None:
    tokenizer = bundled_tokenizer
    rendered = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    want = {None: tokenizer("hi").input_ids, True: tokenizer("hi").input_ids,
            False: tokenizer("hi", add_special_tokens=False).input_ids}
    chat_want = {None: tokenizer(rendered, add_special_tokens=False).input_ids,
                 False: tokenizer(rendered, add_special_tokens=False).input_ids,
                 True: tokenizer(rendered).input_ids}
    assert want[True] != want[False] and chat_want[True] != chat_want[False]  # the tokenizer adds BOS
    async with asgi_client(app) as client:
        for value in (None, True, False):
            extra = {} if value is None else {"add_special_tokens": value}
            completion = await client.post("/v1/completions", json={**GREEDY, "prompt": "hi", **extra})
            assert completion.status_code == 200, completion.text
            assert completion.json()["choices"][0]["prompt_token_ids"] == want[value], completion.text
            beam = await client.post("/v1/completions", json={**GREEDY, "prompt": "hi", "use_beam_search": True,
                                                              "return_token_ids": None, **extra})
            assert beam.status_code == 200 and beam.json()["usage"]["prompt_tokens"] == len(want[value]), beam.text
            chat = await client.post("/v1/chat/completions", json={**GREEDY, "messages": MESSAGES, **extra})
            assert chat.json()["prompt_token_ids"] == chat_want[value], chat.text
            tokenized = await client.post("/tokenize", json={"messages": MESSAGES, **extra})  # as vLLM's
            assert tokenized.status_code == 200 and tokenized.json()["tokens"] == chat_want[value], tokenized.text
            beam_chat = await client.post("/v1/chat/completions", json={
                **GREEDY, "messages": MESSAGES, "use_beam_search": True, "return_token_ids": None, **extra})
            assert beam_chat.status_code == 200, beam_chat.text
            assert beam_chat.json()["usage"]["prompt_tokens"] == len(chat_want[value]), beam_chat.text


async def test_the_engine_option_adds_or_leaves_out_special_tokens(bundled_engine, bundled_tokenizer) -> None:
    params = SamplingParams(max_tokens=1)
    out = await bundled_engine.generate("hi", params, add_special_tokens=False)
    assert out.prompt_token_ids == bundled_tokenizer("hi", add_special_tokens=False).input_ids
    with pytest.raises(InvalidRequestError) as info:
        await bundled_engine.generate("hi", params, add_special_tokens="no")
    assert info.value.field == "add_special_tokens"
