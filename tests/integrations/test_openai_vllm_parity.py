"""The server answers as vLLM's does where clients depend on it: history messages from the official client,
``stop_reason``, context-length errors, logprobs shapes, and vLLM's request fields."""

from __future__ import annotations

import json

import pytest

from asyncllm.errors import InvalidRequestError
from asyncllm.integrations.openai_messages import chat_messages
from asyncllm.engine.validation import MAX_REQUEST_ID_CHARS
from asyncllm.integrations.openai_protocol import (
    ChatCompletionRequest, CompletionRequest, ServerLimits, chat_echo, decode_request, template_kwargs,
)
from asyncllm.integrations.openai_sampling import chat_params, completion_params
from asyncllm.integrations.openai_http import CorsPolicy
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
        "type": "invalid_request_error", "param": "input_tokens", "code": "context_length_exceeded"}


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
            ("/v1/completions", {**GREEDY, "prompt": "x"}, False), ("/v1/chat/completions", CHAT, True),
            ("/tokenize", {"messages": CHAT["messages"]}, True))]
        defaults = [await client.post(path, json={**body, "add_special_tokens": value}) for path, body, value in (
            ("/v1/completions", {**GREEDY, "prompt": "x"}, True), ("/v1/chat/completions", CHAT, False),
            ("/tokenize", {"messages": CHAT["messages"]}, False))]
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
    assert [r.status_code for r in special] == [200, 200, 200]  # honoured: test_openai_add_special_tokens.py
    assert [r.status_code for r in defaults] == [200, 200, 200]


async def test_request_id_and_return_token_ids(app, bundled_tokenizer) -> None:
    async with asgi_client(app) as client:
        completion = (await client.post("/v1/completions", json={**GREEDY, "prompt": "import os", "request_id": "r1",
                                                                 "return_token_ids": True})).json()
        chat = (await client.post("/v1/chat/completions", json={**CHAT, "request_id": "r2",
                                                                "return_token_ids": True})).json()
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
    assert header["id"] == "chatcmpl-hdr"  # vLLM's rule: the header wins over the body
    assert [(r.status_code, r.json()["error"]["param"]) for r in refused] == [(400, "request_id")] * 3


async def test_include_reasoning_false_drops_it(bundled_engine) -> None:
    """As vLLM's: hidden reasoning takes the choices' logprobs and token_ids with it (they would show it), streamed
    and not, and a hidden reasoning token sends no chunk."""
    app = create_app(bundled_engine, manage_engine=False, reasoning_parser="deepseek_r1")
    body = {**CHAT, "max_tokens": 4}  # no </think> in 4 tokens: all of it is reasoning
    metadata = {"logprobs": True, "return_token_ids": True}
    async with asgi_client(app) as client:
        shown = (await client.post("/v1/chat/completions", json={**body, **metadata})).json()
        hidden = (await client.post("/v1/chat/completions",
                                    json={**body, **metadata, "include_reasoning": False})).json()
        stream, with_metadata = [sse_events((await client.post("/v1/chat/completions", json={
            **body, "include_reasoning": False, "stream": True, **extra})).text) for extra in ({}, metadata)]
        beams = [(await client.post("/v1/chat/completions", json={**body, "use_beam_search": True, **extra})).json()
                 for extra in ({}, {"include_reasoning": False})]
    choice = shown["choices"][0]
    assert choice["message"]["reasoning"] and len(choice["logprobs"]["content"]) == len(choice["token_ids"]) == 4
    choice = hidden["choices"][0]
    assert "reasoning" not in choice["message"] and hidden["usage"]["completion_tokens"] == 4
    assert (choice["logprobs"], choice["token_ids"]) == (None, None)
    assert len(hidden["prompt_token_ids"]) == hidden["usage"]["prompt_tokens"]  # the prompt's ids show no reasoning
    for events in (stream, with_metadata):  # no chunk per reasoning token
        assert [(e["choices"][0]["delta"], e["choices"][0]["finish_reason"]) for e in events] == [
            ({"role": "assistant", "content": ""}, None), ({}, "length")]
    assert [(e["choices"][0]["logprobs"], e["choices"][0].get("token_ids", "absent")) for e in with_metadata] == [
        (None, "absent"), (None, None)]
    assert beams[0]["choices"][0]["message"]["reasoning"]
    assert "reasoning" not in beams[1]["choices"][0]["message"], beams[1]


async def test_continuous_usage_stats_are_per_choice(app, bundled_tokenizer) -> None:
    """As vLLM's: a chunk's usage is its choice's prompt's tokens and that choice's completion tokens so far (n=2,
    two prompts of different lengths); the final chunk has the request's."""
    options = {"stream": True, "n": 2, "max_tokens": 3, "return_token_ids": True,
               "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    prompts = ["x", "def add(a, b):"]
    async with asgi_client(app) as client:
        completion = sse_events((await client.post("/v1/completions", json={**GREEDY, **options,
                                                                             "prompt": prompts})).text)
        chat = sse_events((await client.post("/v1/chat/completions", json={**GREEDY, **options, "messages": [
            {"role": "user", "content": "hi"}]})).text)
    prompt_tokens = [len(bundled_tokenizer(prompt).input_ids) for prompt in prompts]
    chat_prompt_tokens = chat[-1]["usage"]["prompt_tokens"]
    for events, prompt_of in ((completion, lambda i: prompt_tokens[i // 2]), (chat, lambda i: chat_prompt_tokens)):
        generated = [0] * (4 if events is completion else 2)
        for event in events[:-1]:
            [choice] = event["choices"]
            generated[choice["index"]] += len(choice.get("token_ids") or [])
            assert event["usage"] == {"prompt_tokens": prompt_of(choice["index"]),
                                      "completion_tokens": generated[choice["index"]],
                                      "total_tokens": prompt_of(choice["index"]) + generated[choice["index"]]}
        assert generated == [3] * len(generated) and events[-1]["choices"] == []
        prompts_total = sum(prompt_tokens) if events is completion else chat_prompt_tokens
        assert events[-1]["usage"]["completion_tokens"] == 3 * len(generated) and (
            events[-1]["usage"]["prompt_tokens"] == prompts_total)


async def test_return_token_ids_streamed_as_vllm(app, bundled_tokenizer) -> None:
    """Streamed, a completion choice's first chunk carries the prompt's ids, a chat's first chunk at its top; each
    chunk's choice the ids it adds, which join to the ids of the same request not streamed."""
    completion = {**GREEDY, "prompt": "import os", "return_token_ids": True}
    chat = {**CHAT, "return_token_ids": True}
    async with asgi_client(app) as client:
        plain = (await client.post("/v1/completions", json=completion)).json()["choices"][0]
        streams = [sse_events((await client.post("/v1/completions", json={**completion, "stream": True, **extra})).text)
                   for extra in ({}, {"echo": True})]
        only = sse_events((await client.post("/v1/completions", json={**completion, "stream": True, "echo": True,
                                                                       "max_tokens": 0})).text)
        echoed = (await client.post("/v1/completions", json={**completion, "echo": True, "logprobs": 0})).json()
        chat_plain = (await client.post("/v1/chat/completions", json=chat)).json()
        chat_stream = sse_events((await client.post("/v1/chat/completions", json={**chat, "stream": True})).text)
    for chunks in streams:
        choices = [chunk["choices"][0] for chunk in chunks]
        assert choices[0]["prompt_token_ids"] == bundled_tokenizer("import os").input_ids
        assert all("prompt_token_ids" not in choice for choice in choices[1:])
        assert sum((choice["token_ids"] for choice in choices), []) == plain["token_ids"]
    # vLLM's echo with return_token_ids: the prompt comes back as prompt_token_ids, neither as text nor in token_ids
    assert streams[1][0]["choices"][0]["text"] == "" and streams[1][0]["choices"][0]["token_ids"] == []
    assert "".join(chunk["choices"][0]["text"] for chunk in streams[1]) == plain["text"]
    echoed = echoed["choices"][0]
    assert (echoed["text"], echoed["token_ids"]) == (plain["text"], plain["token_ids"])
    assert echoed["prompt_token_ids"] == bundled_tokenizer("import os").input_ids
    assert len(echoed["logprobs"]["tokens"]) == len(echoed["prompt_token_ids"]) + len(plain["token_ids"])
    only_choices = [chunk["choices"][0] for chunk in only]  # echo alone: the generated token is dropped, as unstreamed
    assert "".join(c["text"] for c in only_choices) == ""
    assert sum((c["token_ids"] for c in only_choices), []) == []
    assert chat_stream[0]["prompt_token_ids"] == chat_plain["prompt_token_ids"]
    assert all("prompt_token_ids" not in chunk for chunk in chat_stream[1:])
    streamed_ids = sum((chunk["choices"][0].get("token_ids", []) for chunk in chat_stream), [])
    assert streamed_ids == chat_plain["choices"][0]["token_ids"] != []


async def test_request_id_headers(bundled_engine) -> None:
    """vLLM's --enable-request-id-headers: X-Request-Id on every response, the request's own or a fresh one."""
    body = {**GREEDY, "prompt": "x", "request_id": "body"}
    async with asgi_client(create_app(bundled_engine, manage_engine=False, enable_request_id_headers=True)) as client:
        sent = await client.post("/v1/completions", json=body, headers={"X-Request-Id": "abc"})
        streamed = await client.post("/v1/completions", json={**body, "stream": True}, headers={"X-Request-Id": "s"})
        refused = await client.post("/v1/completions", json={**body, "n": 0}, headers={"X-Request-Id": "e"})
        fresh = [(await client.post("/v1/completions", json=body)).headers["x-request-id"] for _ in range(2)]
    preflight = {"Origin": "https://ui.example", "Access-Control-Request-Method": "POST", "X-Request-Id": "p"}
    cors = create_app(bundled_engine, manage_engine=False, enable_request_id_headers=True, cors=CorsPolicy())
    async with asgi_client(cors) as client:  # vLLM's request-id middleware is outermost: preflights carry it
        answered = await client.options("/v1/completions", headers=preflight)
    async with asgi_client(create_app(bundled_engine, manage_engine=False)) as client:
        off = await client.post("/v1/completions", json=body, headers={"X-Request-Id": "abc"})
    assert (sent.headers["x-request-id"], sent.json()["id"]) == ("abc", "cmpl-abc")
    assert (streamed.headers["x-request-id"], refused.status_code, refused.headers["x-request-id"]) == ("s", 400, "e")
    assert fresh[0] != fresh[1] and all(len(value) == 32 for value in fresh)  # uuid4 hex, as vLLM's
    assert "x-request-id" not in off.headers
    assert (answered.status_code, answered.headers["x-request-id"]) == (200, "p")


async def test_spaces_between_special_tokens_reaches_the_sampling_params(app) -> None:
    field = "spaces_between_special_tokens"
    completion = decode_request(json.dumps({**GREEDY, "prompt": "x", field: False}).encode(), CompletionRequest)
    chat = decode_request(json.dumps({**CHAT, field: False}).encode(), ChatCompletionRequest)
    assert completion_params(completion, ServerLimits()).spaces_between_special_tokens is False
    assert chat_params(chat, ServerLimits()).spaces_between_special_tokens is False
    assert chat_params(decode_request(json.dumps(CHAT).encode(), ChatCompletionRequest),
                       ServerLimits()).spaces_between_special_tokens is True  # vLLM's default
    bodies = [("/v1/completions", {**GREEDY, "prompt": "x", field: True}),
              ("/v1/chat/completions", {**CHAT, field: False}),
              ("/v1/chat/completions", {**CHAT, "use_beam_search": True, field: False})]  # beam search: no effect
    async with asgi_client(app) as client:
        answered = [await client.post(path, json={**body, "max_tokens": 2}) for path, body in bodies]
        wrong = await client.post("/v1/chat/completions", json={**CHAT, field: "no"})
    assert [r.status_code for r in answered] == [200] * 3
    assert (wrong.status_code, wrong.json()["error"]["param"]) == (400, field)


async def test_minus_one_fields_as_vllm() -> None:
    """seed -1 is no seed; logprobs, prompt_logprobs, echo's and chat's top_logprobs -1 the whole vocabulary (the
    engine's max_logprobs then decides); chat's top_logprobs below -1 is an error naming it."""
    def completion(**fields):
        return completion_params(decode_request(json.dumps({**GREEDY, "prompt": "x", **fields}).encode(),
                                                CompletionRequest), ServerLimits())

    def chat(**fields):
        return chat_params(decode_request(json.dumps({**CHAT, **fields}).encode(), ChatCompletionRequest),
                           ServerLimits())

    params = completion(seed=-1, logprobs=-1, prompt_logprobs=-1)
    assert (params.seed, params.logprobs, params.prompt_logprobs) == (None, -1, -1)
    assert completion(seed=-7).seed == -7 and completion(echo=True, logprobs=-1).prompt_logprobs == -1
    assert chat(logprobs=True, top_logprobs=-1).logprobs == -1
    for fields in ({"logprobs": True, "top_logprobs": -2}, {"top_logprobs": -1}):
        with pytest.raises(InvalidRequestError) as info:
            chat(**fields)
        assert info.value.field == "top_logprobs"
    from asyncllm.integrations.openai_responses import _top
    from asyncllm.outputs import Logprob

    entry = {token: Logprob(-float(token)) for token in (3, 1, 2)}
    assert [t for t, _ in _top(entry, -1)] == [1, 2, 3] and [t for t, _ in _top(entry, 2)] == [1, 2]  # -1: all


async def test_chat_echo_puts_the_last_assistant_message_first(app) -> None:
    partial = {**GREEDY, "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure,"}],
               "add_generation_prompt": False, "continue_final_message": True}
    async with asgi_client(app) as client:
        plain = (await client.post("/v1/chat/completions", json=partial)).json()["choices"][0]["message"]
        echoed = (await client.post("/v1/chat/completions", json={**partial, "echo": True})).json()
        chunks = sse_events((await client.post("/v1/chat/completions", json={**partial, "echo": True,
                                                                            "stream": True})).text)
        user_last = (await client.post("/v1/chat/completions", json={**CHAT, "echo": True})).json()
        without = (await client.post("/v1/chat/completions", json=CHAT)).json()
        beam = await client.post("/v1/chat/completions", json={**CHAT, "echo": True, "use_beam_search": True})
    content = echoed["choices"][0]["message"]["content"]
    assert content == "Sure," + plain["content"] and plain["content"]
    assert [chunk["choices"][0]["delta"] for chunk in chunks[:2]] == [{"role": "assistant", "content": ""},
                                                                       {"content": "Sure,"}]
    assert "".join(chunk["choices"][0]["delta"].get("content", "") for chunk in chunks) == content
    assert user_last["choices"][0]["message"] == without["choices"][0]["message"]  # the last role is not the reply's
    assert (beam.status_code, beam.json()["error"]["param"]) == (400, "echo")
    parts = {**CHAT, "echo": True, "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}
    assert chat_echo(decode_request(json.dumps(parts).encode(), ChatCompletionRequest)) == "a\nb"
    assert chat_echo(decode_request(json.dumps({**parts, "echo": False}).encode(), ChatCompletionRequest)) == ""


async def test_chat_echo_reads_the_parts_the_prompt_reads(app) -> None:
    """vLLM echoes the last message as its parsed conversation has it: every part it reads as text (bare strings,
    ``input_text``, ``output_text``, ``refusal``, ``thinking``) joined by a newline, a text part whose text is null
    dropped. Those parts were left out of the echo, and a null text was a 500 (TypeError in the join)."""
    partial = {**GREEDY, "max_tokens": 2, "add_generation_prompt": False, "continue_final_message": True}
    last = [{"type": "text", "text": None}, "Sure", {"type": "input_text", "text": "let"},
            {"type": "output_text", "text": "me"}, {"type": "refusal", "refusal": "not"}]
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": last}]
    async with asgi_client(app) as client:
        plain = (await client.post("/v1/chat/completions", json={**partial, "messages": messages})).json()
        whole = await client.post("/v1/chat/completions", json={**partial, "messages": messages, "echo": True})
        streamed = await client.post("/v1/chat/completions", json={**partial, "messages": messages, "echo": True,
                                                                   "stream": True})
    assert whole.status_code == 200, whole.text
    reply = plain["choices"][0]["message"]["content"]
    assert whole.json()["choices"][0]["message"]["content"] == "Sure\nlet\nme\nnot" + reply
    chunks = sse_events(streamed.text)
    assert chunks[1]["choices"][0]["delta"] == {"content": "Sure\nlet\nme\nnot"}


async def test_reply_role_is_the_last_messages_without_a_generation_prompt(app) -> None:
    """vLLM's get_chat_request_role: with add_generation_prompt false the reply continues the last message's turn
    and takes its role, in the message and in the streamed role chunk (beam search's too)."""
    body = {**CHAT, "add_generation_prompt": False}
    async with asgi_client(app) as client:
        plain = (await client.post("/v1/chat/completions", json=body)).json()
        streams = [sse_events((await client.post("/v1/chat/completions", json={**body, "stream": True, **extra})).text)
                   for extra in ({}, {"use_beam_search": True})]
        prompted = (await client.post("/v1/chat/completions", json=CHAT)).json()
    assert plain["choices"][0]["message"]["role"] == "user"
    assert [chunks[0]["choices"][0]["delta"] for chunks in streams] == [{"role": "user", "content": ""}] * 2
    assert prompted["choices"][0]["message"]["role"] == "assistant"


async def test_response_role_names_replies_to_a_generation_prompt(bundled_engine) -> None:
    """vLLM's --response-role: the role of a reply to a generation prompt (here "user": the bundled template knows no
    other roles), in the message, the streamed role chunk and beam search's; chat echo compares the last message's
    role with it."""
    async with asgi_client(create_app(bundled_engine, manage_engine=False, response_role="user")) as client:
        plain = (await client.post("/v1/chat/completions", json=CHAT)).json()
        streams = [sse_events((await client.post("/v1/chat/completions", json={**CHAT, "stream": True, **extra})).text)
                   for extra in ({}, {"use_beam_search": True})]
        echo = (await client.post("/v1/chat/completions", json={**CHAT, "echo": True})).json()
    assert plain["choices"][0]["message"]["role"] == "user"
    assert [chunks[0]["choices"][0]["delta"] for chunks in streams] == [{"role": "user", "content": ""}] * 2
    assert echo["choices"][0]["message"]["content"].startswith("hi")
