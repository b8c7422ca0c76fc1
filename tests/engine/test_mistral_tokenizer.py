"""A checkpoint that ships only Mistral's tekken.json: mistral_common tokenizes its prompts and chats, greedy equals
transformers', and what mistral_common cannot do is refused by name (asyncllm/mistral_tokenizer.py)."""

from __future__ import annotations

import re

import pytest
import pytest_asyncio

from asyncllm import AsyncEngine, InvalidRequestError, SamplingParams, StructuredOutputs
from asgi_helpers import asgi_client
from hf_reference import hf_greedy
from mistral_utils import tekken_checkpoint

pytestmark = pytest.mark.asyncio(loop_scope="module")

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Beautiful is better"},
        {"role": "assistant", "content": "than ugly"}, {"role": "user", "content": "Explicit?"}]
TOOL_CHAT = [{"role": "user", "content": "Weather in Paris?"},
             {"role": "assistant", "content": None, "tool_calls": [{"id": "abcdefghi", "type": "function", "function": {
                 "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
             {"role": "tool", "tool_call_id": "abcdefghi", "content": "22C"},
             {"role": "user", "content": [{"type": "text", "text": "And"}, {"type": "text", "text": "tomorrow?"}]}]


@pytest.fixture(scope="module")
def tekken_model(tiny_llama: str, tmp_path_factory) -> str:
    return tekken_checkpoint(tiny_llama, str(tmp_path_factory.mktemp("tekken")))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tekken_model: str):
    async with AsyncEngine(tekken_model, disable_log_stats=True, max_model_len=512) as engine:
        yield engine


def mistral_common_chat(path: str, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """The chat's ids as mistral_common itself encodes them (not through transformers)."""
    from mistral_common.protocol.instruct.request import ChatCompletionRequest
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

    tokenizer = MistralTokenizer.from_file(f"{path}/tekken.json")
    return tokenizer.encode_chat_completion(ChatCompletionRequest.from_openai(messages, tools)).tokens


def tekken_ids(path: str, text: str) -> list[int]:
    """``text`` as mistral_common's tekkenizer encodes a prompt: BOS, then its tokens."""
    from mistral_common.tokens.tokenizers.tekken import Tekkenizer

    return Tekkenizer.from_file(f"{path}/tekken.json").encode(text, bos=True, eos=False)


async def test_auto_loads_mistral_common_and_greedy_equals_transformers(engine: AsyncEngine, tekken_model: str) -> None:
    from asyncllm.mistral_tokenizer import is_mistral

    tokenizer = await engine.get_tokenizer()
    assert is_mistral(tokenizer) and engine.eos_token_ids == [2]
    prompt = "Beautiful is better than ugly."
    out = await engine.generate(prompt, GREEDY)
    assert out.prompt_token_ids == tekken_ids(tekken_model, prompt)
    assert out.token_ids == hf_greedy(tekken_model, out.prompt_token_ids, 12)
    assert out.text == tokenizer.decode(out.token_ids, skip_special_tokens=True)
    deltas = [d async for d in engine.stream(prompt, GREEDY)]
    assert "".join(d.text for d in deltas) == out.text


async def test_control_token_text_in_a_prompt_stays_text(engine: AsyncEngine, tekken_model: str) -> None:
    """mistral_common never reads "[INST]" written in a prompt as the control token (transformers' conversion of
    tekken.json, which ``auto`` would otherwise load, does, and has no BOS)."""
    out = await engine.generate("[INST] hi [/INST]", SamplingParams(max_tokens=1))
    assert out.prompt_token_ids == tekken_ids(tekken_model, "[INST] hi [/INST]")
    assert 3 not in out.prompt_token_ids and 4 not in out.prompt_token_ids


async def test_chat_is_encoded_by_mistral_common(engine: AsyncEngine, tekken_model: str) -> None:
    [last] = [d async for d in engine.chat(CHAT, GREEDY, tools=TOOLS)][-1:]
    expected = mistral_common_chat(tekken_model, CHAT, TOOLS)
    assert expected[:2] == [1, 17] and 5 in expected  # BOS, [SYSTEM_PROMPT], [AVAILABLE_TOOLS]
    out = await engine.generate(expected, GREEDY)
    assert last.finish_reason == "length" and out.token_ids == hf_greedy(tekken_model, expected, 12)
    chat = [d async for d in engine.chat(CHAT, GREEDY, tools=TOOLS)]
    assert [t for d in chat for t in d.token_ids] == out.token_ids
    prefix = [{"role": "user", "content": "Explicit?"}, {"role": "assistant", "content": "Better than"}]
    continued = [d async for d in engine.chat(prefix, SamplingParams(max_tokens=1),
                                              chat_template_kwargs={"continue_final_message": True})]
    assert continued[-1].finish_reason == "length"


@pytest.mark.parametrize("messages, options, field", [
    (CHAT, {"chat_template": "{{ messages }}"}, "chat_template"),
    (CHAT, {"chat_template_kwargs": {"enable_thinking": True}}, "chat_template_kwargs"),
    (CHAT, {"add_special_tokens": True}, "add_special_tokens"),
    ([{"role": "assistant", "content": "first"}], {}, "messages"),
], ids=["jinja-template", "template-variable", "special-tokens-twice", "assistant-first"])
async def test_what_mistral_common_does_not_take_is_refused(engine: AsyncEngine, messages, options, field) -> None:
    with pytest.raises(InvalidRequestError) as raised:
        _ = [d async for d in engine.chat(messages, SamplingParams(max_tokens=2), **options)]
    assert raised.value.field == field
    out = await engine.generate("still serving", SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(out.token_ids) == 3


async def test_structured_output_and_stop_strings_read_tekken_bytes(engine: AsyncEngine) -> None:
    regex = StructuredOutputs(regex=r"(yes|no), [a-z]{3,8}\.")
    out = await engine.generate("Is it?", SamplingParams(temperature=0.0, max_tokens=20, structured=regex))
    assert re.fullmatch(r"(yes|no), [a-z]{3,8}\.", out.text), out.text
    choice = StructuredOutputs(choice=["Beautiful is better", "Explicit"])
    out = await engine.generate("Which?", SamplingParams(temperature=0.0, max_tokens=20, structured=choice))
    assert out.text in ("Beautiful is better", "Explicit") and out.finish_reason == "stop"
    free = await engine.generate("Now", SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    stop = free.text[5:8]
    stopped = await engine.generate("Now", SamplingParams(temperature=0.0, max_tokens=30, stop=[stop]))
    assert stopped.text == free.text[:free.text.index(stop)] and stopped.finish_reason == "stop"


async def test_the_server_serves_chat_and_tokenize(engine: AsyncEngine, tekken_model: str) -> None:
    from asyncllm.integrations.openai_server import create_app

    async with asgi_client(create_app(engine, manage_engine=False)) as client:
        chat = await client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 4, "temperature": 0.0})
        tokenize = await client.post("/tokenize", json={"messages": CHAT})
        tools = await client.post("/tokenize", json={"messages": TOOL_CHAT, "tools": TOOLS})
        detokenize = await client.post("/detokenize", json={"tokens": tekken_ids(tekken_model, "Beautiful")})
    assert chat.status_code == 200 and chat.json()["usage"]["prompt_tokens"] == len(
        mistral_common_chat(tekken_model, CHAT))
    assert tokenize.json()["tokens"] == mistral_common_chat(tekken_model, CHAT)
    expected = mistral_common_chat(tekken_model, TOOL_CHAT, TOOLS)  # a tool call, its result, two text parts
    assert 9 in expected and 7 in expected and tools.json()["tokens"] == expected
    assert detokenize.json()["prompt"] == "<s>Beautiful"


async def test_reasoning_effort_is_served_without_its_enable_thinking(engine: AsyncEngine) -> None:
    """``reasoning_effort`` sets the template's ``enable_thinking`` (vLLM's ``build_chat_params``), which
    mistral_common never reads: dropped, as vLLM's Mistral tokenizer drops it, and so is the effort itself below
    tokenizer v15 (this checkpoint's v13; mistral_common refused it, a 400), chat and Responses API alike; a
    request's own ``enable_thinking`` that says otherwise is still refused."""
    from asyncllm.integrations.openai_server import create_app

    body = {"messages": CHAT, "max_tokens": 2, "temperature": 0.0, "return_token_ids": True}
    async with asgi_client(create_app(engine, manage_engine=False)) as client:
        plain = (await client.post("/v1/chat/completions", json=body)).json()
        efforts = [await client.post("/v1/chat/completions", json={**body, "reasoning_effort": effort})
                   for effort in ("none", "high")]
        response = await client.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2,
                                                             "reasoning": {"effort": "low"}})
        own = await client.post("/v1/chat/completions", json={**body, "reasoning_effort": "high",
                                                               "chat_template_kwargs": {"enable_thinking": False}})
    assert [r.status_code for r in efforts] == [200, 200], efforts[0].text
    assert all(r.json()["prompt_token_ids"] == plain["prompt_token_ids"] for r in efforts)  # v13: the effort dropped
    assert response.status_code == 200, response.text
    assert own.status_code == 400 and own.json()["error"]["param"] == "chat_template_kwargs"
    from types import SimpleNamespace

    from asyncllm.mistral_tokenizer import _without_effort_kwargs

    v15 = SimpleNamespace(tokenizer=SimpleNamespace(instruct_tokenizer=SimpleNamespace(
        tokenizer=SimpleNamespace(version="v15"))))
    assert _without_effort_kwargs(v15, {"reasoning_effort": "none", "enable_thinking": False}) == {
        "reasoning_effort": "none"}  # from v15 on, mistral_common reads the effort (as vLLM passes it)


async def test_a_detokenizer_that_cannot_be_made_fails_its_request_alone(engine: AsyncEngine, monkeypatch) -> None:
    """A tokenizer that cannot stream a request's options (a Mistral one lacked added tokens) fails that request,
    not the processor thread every request shares."""
    from asyncllm.engine import processor_requests

    real = processor_requests.new_detokenizer

    def refusing(tokenizer, token_ids, params, **kwargs):
        if params.stop == ["BOOM"]:
            raise NotImplementedError("no such stream")
        return real(tokenizer, token_ids, params, **kwargs)

    monkeypatch.setattr(processor_requests, "new_detokenizer", refusing)
    with pytest.raises(InvalidRequestError, match="no such stream") as raised:
        await engine.generate("hi", SamplingParams(max_tokens=2, stop=["BOOM"]))
    assert raised.value.field == "request"
    out = await engine.generate("hi", SamplingParams(max_tokens=2, ignore_eos=True, skip_special_tokens=False,
                                                     spaces_between_special_tokens=False))
    assert len(out.token_ids) == 2
