"""OpenAI's standard fields that the official client offers as typed arguments (openai_standard.py): accepted where
they ask for nothing a self-hosted server does, a 400 naming them where they ask for what is not built; one model's
card (``client.models.retrieve``); the Responses API's usage as openai's types declare it."""

from __future__ import annotations

import openai
import pytest
from openai.types.responses import ResponseUsage

pytestmark = pytest.mark.asyncio(loop_scope="session")

MODEL = "asyncllm-tiny"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
RESPONSE = {"model": MODEL, "input": "hi", "max_output_tokens": 4, "temperature": 0}
SERVICE = {"metadata": {"k": "v"}, "service_tier": "auto", "prompt_cache_key": "k", "safety_identifier": "u1"}


@pytest.fixture
def client(base_url) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)


async def test_no_op_fields_are_accepted_and_change_nothing(client) -> None:
    plain = await client.chat.completions.create(**CHAT)
    chat = await client.chat.completions.create(**CHAT, **SERVICE, store=False, modalities=["text"], verbosity="low")
    assert chat.choices[0].message.content == plain.choices[0].message.content
    chunks = [c async for c in await client.chat.completions.create(
        **CHAT, stream=True, stream_options={"include_usage": True, "include_obfuscation": False})]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == plain.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    plain_response = await client.responses.create(**RESPONSE)
    response = await client.responses.create(**RESPONSE, **SERVICE, store=False)
    assert response.output_text == plain_response.output_text and response.metadata == {"k": "v"}
    events = [e async for e in await client.responses.create(**RESPONSE, stream=True,
                                                             stream_options={"include_obfuscation": False})]
    assert events[-1].response.output_text == plain_response.output_text


@pytest.mark.parametrize("tier", ["flex", "scale", "priority"])
async def test_every_openai_service_tier_is_accepted(client, tier) -> None:
    """vLLM's Responses API takes OpenAI's five tiers and echoes the request's; its chat completions ignore the field
    (Codex sends ``priority``); until 2026-12-08 all but ``auto`` and ``default`` were a 400."""
    chat = await client.chat.completions.create(**CHAT, service_tier=tier)
    assert chat.choices[0].finish_reason in ("stop", "length") and chat.service_tier is None
    response = await client.responses.create(**RESPONSE, service_tier=tier)
    assert response.service_tier == tier


@pytest.mark.parametrize("route, fields, param", [
    ("chat", {"store": True}, "store"),
    ("chat", {"modalities": ["text", "audio"]}, "modalities"),
    ("chat", {"prediction": {"type": "content", "content": "abc"}}, "prediction"),
    ("chat", {"web_search_options": {}}, "web_search_options"),
    ("chat", {"service_tier": "fast"}, "service_tier"),
    ("chat", {"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ("chat", {"stream": True, "stream_options": {"include_obfuscation": True}}, "stream_options.include_obfuscation"),
    ("completions", {"stream": True, "stream_options": {"include_obfuscation": True}},
     "stream_options.include_obfuscation"),
    ("responses", {"stream": True, "stream_options": {"include_obfuscation": True}},
     "stream_options.include_obfuscation"),
    ("responses", {"stream_options": {"include_obfuscation": False}}, "stream_options"),  # only with stream
    ("responses", {"prompt": {"id": "pmpt_1"}}, "prompt"),  # its own name, not the chat prompt's ``input``
    ("responses", {"conversation": "conv_1"}, "conversation"),
    ("responses", {"service_tier": "fast"}, "service_tier"),
])
async def test_what_is_not_built_is_a_400_naming_it(client, route, fields, param) -> None:
    create = {"chat": lambda: client.chat.completions.create(**CHAT, **fields),
              "completions": lambda: client.completions.create(model=MODEL, prompt="x", max_tokens=2, **fields),
              "responses": lambda: client.responses.create(**RESPONSE, **fields)}[route]
    with pytest.raises(openai.BadRequestError) as bad:
        await create()
    assert bad.value.param == param and "unknown field" not in bad.value.message


async def test_an_unknown_field_is_still_refused(client) -> None:
    with pytest.raises(openai.BadRequestError, match="unknown field") as bad:
        await client.chat.completions.create(**CHAT, extra_body={"stoer": False})
    assert bad.value.param == "stoer"


async def test_models_retrieve_is_the_list_entry(client) -> None:
    listed = (await client.models.list()).data[0]
    card = await client.models.retrieve(MODEL)
    drop = {"permission"}  # a fresh permission id per listing, as vLLM's
    assert card.model_dump(exclude=drop) == listed.model_dump(exclude=drop) and card.id == MODEL
    with pytest.raises(openai.NotFoundError) as missing:
        await client.models.retrieve("org/nope")
    assert (missing.value.code, missing.value.param) == ("model_not_found", "model")
    assert "'org/nope'" in missing.value.message


async def test_responses_usage_is_openai_response_usage(client) -> None:
    raw = await client.responses.with_raw_response.create(**RESPONSE)
    usage = raw.http_response.json()["usage"]
    ResponseUsage.model_validate(usage)  # every required field, strictly (the client's parse does not check)
    assert usage["input_tokens_details"]["cache_write_tokens"] == 0
    assert set(usage["output_tokens_details"]) == {"reasoning_tokens"}
