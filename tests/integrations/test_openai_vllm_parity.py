"""The server answers as vLLM's does where clients depend on it: history messages from the official client,
``stop_reason``, context-length errors, logprobs shapes, and vLLM's request fields."""

from __future__ import annotations

import json

import pytest

from asyncllm.errors import InvalidRequestError
from asyncllm.integrations.openai_messages import chat_messages
from asyncllm.engine.validation import MAX_REQUEST_ID_CHARS
from asyncllm.integrations.openai_protocol import ChatCompletionRequest, ServerLimits, decode_request, template_kwargs
from asyncllm.integrations.openai_server import create_app
from asgi_helpers import asgi_client, sse_events

pytestmark = pytest.mark.asyncio(loop_scope="session")

MODEL = "asyncllm-tiny"
GREEDY = {"model": MODEL, "temperature": 0, "max_tokens": 6}
CHAT = {**GREEDY, "messages": [{"role": "user", "content": "hi"}]}
# what `resp.choices[0].message.model_dump()` of the official client holds, behind a reasoning parser
DUMPED = {"role": "assistant", "content": "x", "refusal": None, "annotations": None, "audio": None,
          "function_call": None, "tool_calls": None, "reasoning": "thought"}


async def test_history_messages_as_vllm_reads_them() -> None:
    messages = [{"role": "user", "content": "hi", "name": None}, DUMPED,
                {"role": "assistant", "content": "y", "reasoning_content": "r", "refusal": "no", "audio": {"id": "a"}}]
    assert chat_messages(messages) == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "x", "reasoning": "thought", "reasoning_content": "thought"},
        {"role": "assistant", "content": "y", "reasoning": "r", "reasoning_content": "r"}]
    for message in ({"role": "user", "content": "x", "foo": 1}, {"role": "user", "content": "x", "refusal": "no"},
                    {"role": "user", "content": "x", "reasoning": "r"}):
        with pytest.raises(InvalidRequestError, match=r"\['(foo|refusal|reasoning)'\]"):
            chat_messages([message])
    with pytest.raises(InvalidRequestError, match="item 0: reasoning_content must be a string, got dict") as error:
        chat_messages([{"role": "assistant", "content": "x", "reasoning_content": {"text": "r"}}])
    assert error.value.field == "messages"


async def test_reasoning_effort_goes_to_the_template() -> None:
    def kwargs(**fields):
        return template_kwargs(decode_request(json.dumps({**CHAT, **fields}).encode(), ChatCompletionRequest))

    assert kwargs(reasoning_effort="low")["reasoning_effort"] == "low"
    assert kwargs(reasoning_effort="low", chat_template_kwargs={"reasoning_effort": "high"})["reasoning_effort"] == "high"
    assert "reasoning_effort" not in kwargs()
    assert [kwargs(reasoning_effort=value)["reasoning_effort"] for value in ("minimal", "none", "max")] == [
        "minimal", "none", "max"]  # vLLM's values
    with pytest.raises(InvalidRequestError) as error:
        kwargs(reasoning_effort="extreme")
    assert error.value.field == "reasoning_effort"


async def test_history_reasoning_reaches_the_template(bundled_engine, bundled_tokenizer) -> None:
    app = create_app(bundled_engine, manage_engine=False, trust_request_chat_template=True)
    template = ("{% for m in messages %}{{ m.role }}:{{ m.reasoning_content or '' }}:{{ m.reasoning or '' }}|"
                "{% endfor %}")
    want = bundled_tokenizer("user::|assistant:thought:thought|", add_special_tokens=False).input_ids
    async with asgi_client(app) as client:
        tokens = await client.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}, DUMPED],
                                                      "chat_template": template})
        chat = await client.post("/v1/chat/completions",
                                 json={**CHAT, "messages": [*CHAT["messages"], DUMPED, {"role": "user", "content": "y"}]})
    assert tokens.json()["tokens"] == want
    assert chat.status_code == 200, chat.text


async def test_stop_reason(app) -> None:
    request = {**GREEDY, "prompt": "import os\n"}
    async with asgi_client(app) as client:
        plain = (await client.post("/v1/completions", json={**request, "return_token_ids": True})).json()
        stop_id = plain["choices"][0]["token_ids"][3]
        by_id = (await client.post("/v1/completions", json={**request, "stop_token_ids": [stop_id]})).json()
        streamed = sse_events((await client.post("/v1/completions", json={**request, "stop_token_ids": [stop_id],
                                                                           "stream": True})).text)
        chat_id = (await client.post("/v1/chat/completions", json={**CHAT, "return_token_ids": True})
                   ).json()["choices"][0]["token_ids"][2]
        chat = sse_events((await client.post("/v1/chat/completions", json={**CHAT, "stream": True,
                                                                            "stop_token_ids": [chat_id]})).text)
        word = plain["choices"][0]["text"].strip()[:2]
        by_text = (await client.post("/v1/completions", json={**request, "stop": [word]})).json()
    assert plain["choices"][0]["stop_reason"] is None  # ran to its length
    assert (by_id["choices"][0]["finish_reason"], by_id["choices"][0]["stop_reason"]) == ("stop", stop_id)
    assert [e["choices"][0]["stop_reason"] for e in streamed] == [None] * (len(streamed) - 1) + [stop_id]
    assert [(e["choices"][0]["finish_reason"], e["choices"][0]["stop_reason"]) for e in chat] == (
        [(None, None)] * (len(chat) - 1) + [("stop", chat_id)])
    assert (by_text["choices"][0]["finish_reason"], by_text["choices"][0]["stop_reason"]) == ("stop", word)


async def test_context_length_errors_as_vllm(app, bundled_engine, bundled_tokenizer) -> None:
    length = bundled_engine.config.max_model_len
    prompt = [5] * (length - 2)
    async with asgi_client(app) as client:
        fits = await client.post("/v1/completions", json={**GREEDY, "prompt": prompt, "max_tokens": 2})
        over = await client.post("/v1/completions", json={**GREEDY, "prompt": prompt, "max_tokens": 3})
        over_chat = await client.post("/v1/chat/completions", json={**CHAT, "max_completion_tokens": 10 * length})
        unset_chat = await client.post("/v1/chat/completions", json={  # runs to the room left: EOS at once here
            **CHAT, "max_tokens": None, "allowed_token_ids": [bundled_tokenizer.eos_token_id]})
        too_long = await client.post("/v1/completions", json={**GREEDY, "prompt": [5] * length})
        beams = [await client.post("/v1/completions", json={**GREEDY, "prompt": prompt, "max_tokens": max_tokens,
                                                              "use_beam_search": True}) for max_tokens in (2, 3)]
    assert fits.status_code == 200 and unset_chat.status_code == 200, (fits.text, unset_chat.text)
    assert over.json()["error"] == {
        "message": f"'max_tokens' or 'max_completion_tokens' is too large: 3. This model's maximum context length is "
                   f"{length} tokens and your request has {length - 2} input tokens (3 > {length} - {length - 2}).",
        "type": "invalid_request_error", "param": "max_tokens", "code": "context_length_exceeded"}
    assert beams[0].status_code == 200 and beams[1].json()["error"] == over.json()["error"]  # checked before the search
    assert (over_chat.status_code, over_chat.json()["error"]["code"]) == (400, "context_length_exceeded")
    assert too_long.status_code == 400 and too_long.json()["error"] == {
        "message": f"This model's maximum context length is {length} tokens. However, your request has {length} input "
                   "tokens. Please reduce the length of the input messages.",
        "type": "invalid_request_error", "param": "prompt", "code": "context_length_exceeded"}


async def test_body_limit_takes_a_photo(app) -> None:
    assert ServerLimits().max_body_bytes == 64 << 20
    async with asgi_client(app) as client:  # 2 MB: a data-URL photo's size; refused for its length, not its bytes
        response = await client.post("/v1/completions", json={**GREEDY, "prompt": "x" * (2 << 20)})
    assert (response.status_code, response.json()["error"]["code"]) == (400, "context_length_exceeded")


async def test_completion_top_logprobs_hold_the_sampled_token(app) -> None:
    sampled = {**GREEDY, "max_tokens": 12, "temperature": 2.0, "seed": 1}
    async with asgi_client(app) as client:
        zero, one = [(await client.post("/v1/completions", json={**sampled, "prompt": "def f(x):", "logprobs": n})
                      ).json()["choices"][0]["logprobs"] for n in (0, 1)]
        chat = (await client.post("/v1/chat/completions", json={**CHAT, **sampled, "logprobs": True,
                                                                 "top_logprobs": 1})).json()
    assert zero["top_logprobs"] == [{t: lp} for t, lp in zip(zero["tokens"], zero["token_logprobs"])]
    assert all(top[t] == lp and len(top) in (1, 2) for t, lp, top in
               zip(one["tokens"], one["token_logprobs"], one["top_logprobs"]))
    assert any(len(top) == 2 for top in one["top_logprobs"])  # temperature 2: some sampled token is not the top one
    assert all(len(entry["top_logprobs"]) == 1 for entry in chat["choices"][0]["logprobs"]["content"])


async def test_request_shape_checks(app) -> None:
    async with asgi_client(app) as client:
        empty_model = await client.post("/v1/chat/completions", json={**CHAT, "model": ""})
        options = await client.post("/v1/completions", json={**GREEDY, "prompt": "x",
                                                              "stream_options": {"include_usage": True}})
        empty_options = await client.post("/v1/completions", json={**GREEDY, "prompt": "x", "stream_options": {}})
        sequences = [await client.post("/v1/completions", json={**GREEDY, "prompt": ["x"] * 129, "n": 16, **beam})
                     for beam in ({}, {"use_beam_search": True})]  # 2,064 sequences
        special = [await client.post(path, json={**body, "add_special_tokens": value}) for path, body, value in (
            ("/v1/completions", {**GREEDY, "prompt": "x"}, False), ("/v1/chat/completions", CHAT, True))]
        defaults = [await client.post(path, json={**body, "add_special_tokens": value}) for path, body, value in (
            ("/v1/completions", {**GREEDY, "prompt": "x"}, True), ("/v1/chat/completions", CHAT, False))]
    assert empty_model.status_code == 200 and empty_model.json()["model"] == MODEL
    assert options.status_code == 400 and options.json()["error"]["param"] == "stream_options"
    assert "Stream options can only be defined when stream=True" in options.json()["error"]["message"]
    assert empty_options.status_code == 200, empty_options.text  # vLLM refuses only a non-empty one
    assert [(r.status_code, r.json()["error"]["param"]) for r in sequences] == [(400, "n")] * 2
    assert "129 prompts x 16 = 2064 sequences (at most 2048)" in sequences[0].json()["error"]["message"]
    ServerLimits().check_sequences(16, 128)  # max(max_prompts, max_n): each limit alone fits
    ServerLimits().check_sequences(2048, 1)
    with pytest.raises(InvalidRequestError):
        ServerLimits().check_sequences(17, 128)
    assert [(r.status_code, r.json()["error"]["param"]) for r in special] == [(400, "add_special_tokens")] * 2
    assert [r.status_code for r in defaults] == [200, 200]


async def test_request_id_and_return_token_ids(app, bundled_tokenizer) -> None:
    async with asgi_client(app) as client:
        completion = (await client.post("/v1/completions", json={**GREEDY, "prompt": "import os", "request_id": "r1",
                                                                 "return_token_ids": True})).json()
        chat = (await client.post("/v1/chat/completions", json={**CHAT, "request_id": "r2",
                                                                "return_token_ids": True})).json()
        streamed = await client.post("/v1/completions", json={**GREEDY, "prompt": "x", "stream": True,
                                                              "return_token_ids": True})
        header = (await client.post("/v1/chat/completions", json={**CHAT, "request_id": "body"},
                                    headers={"X-Request-Id": "hdr"})).json()
        refused = [await client.post("/v1/completions", json={**GREEDY, "prompt": "x", **body}, headers=headers)
                   for body, headers in (({"request_id": "r" * (MAX_REQUEST_ID_CHARS + 1)}, {}),
                                         ({"request_id": 7}, {}),
                                         ({}, {"X-Request-Id": "h" * (MAX_REQUEST_ID_CHARS + 1)}))]
    choice = completion["choices"][0]
    assert (completion["id"], chat["id"]) == ("cmpl-r1", "chatcmpl-r2")
    assert choice["prompt_token_ids"] == bundled_tokenizer("import os").input_ids
    assert bundled_tokenizer.decode(choice["token_ids"]) == choice["text"]
    assert len(choice["token_ids"]) == completion["usage"]["completion_tokens"]
    assert len(chat["prompt_token_ids"]) == chat["usage"]["prompt_tokens"]
    assert len(chat["choices"][0]["token_ids"]) == chat["usage"]["completion_tokens"]
    assert (streamed.status_code, streamed.json()["error"]["param"]) == (400, "return_token_ids")
    assert header["id"] == "chatcmpl-hdr"  # vLLM's rule: the header wins over the body
    assert [(r.status_code, r.json()["error"]["param"]) for r in refused] == [(400, "request_id")] * 3


async def test_include_reasoning_false_drops_it(bundled_engine) -> None:
    app = create_app(bundled_engine, manage_engine=False, reasoning_parser="deepseek_r1")
    body = {**CHAT, "max_tokens": 4}  # no </think> in 4 tokens: all of it is reasoning
    async with asgi_client(app) as client:
        shown = (await client.post("/v1/chat/completions", json=body)).json()["choices"][0]["message"]
        hidden = (await client.post("/v1/chat/completions", json={**body, "include_reasoning": False})).json()
        stream, with_logprobs = [sse_events((await client.post("/v1/chat/completions", json={
            **body, "include_reasoning": False, "stream": True, **extra})).text) for extra in ({}, {"logprobs": True})]
        beams = [(await client.post("/v1/chat/completions", json={**body, "use_beam_search": True, **extra})).json()
                 for extra in ({}, {"include_reasoning": False})]
    assert shown["reasoning"]
    assert "reasoning" not in hidden["choices"][0]["message"] and hidden["usage"]["completion_tokens"] == 4
    assert not any("reasoning" in e["choices"][0]["delta"] for e in stream + with_logprobs)
    assert [(e["choices"][0]["delta"], e["choices"][0]["finish_reason"]) for e in stream] == [
        ({"role": "assistant", "content": ""}, None), ({}, "length")]  # no empty chunk per reasoning token
    assert [e["choices"][0]["logprobs"] is not None for e in with_logprobs] == [False] + [True] * 4  # theirs kept
    assert beams[0]["choices"][0]["message"]["reasoning"]
    assert "reasoning" not in beams[1]["choices"][0]["message"], beams[1]
