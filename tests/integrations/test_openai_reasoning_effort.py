"""``reasoning_effort`` turns a template's thinking on or off, as vLLM's ``build_chat_params`` (chat completions and the
Responses API, vLLM PR #43401, in v0.28): ``enable_thinking`` is ``reasoning_effort != "none"`` unless the request's
``chat_template_kwargs`` has that key, over ``--default-chat-template-kwargs``; the qwen3 parser reads it as thinking
off, so the reply is content."""

from __future__ import annotations

import pytest
from asgi_helpers import asgi_client, sse_events

from asyncllm.integrations.openai_protocol import ChatCompletionRequest, ChatTemplates, template_kwargs
from asyncllm.integrations.responses_api import ResponsesRequest, chat_request

MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]
QWEN3 = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
         "<|im_start|>assistant\n"
         "{% if enable_thinking is defined and enable_thinking is false %}"
         "{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}")
"""Qwen3's template, cut down: ``enable_thinking`` false writes an empty think block; else the reply thinks."""
PLAIN = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}<|assistant|>"
"""An Instruct template that writes no think block whatever ``enable_thinking`` says."""


def _kwargs(**fields) -> dict:
    return template_kwargs(ChatCompletionRequest(messages=MESSAGES, **fields))


def test_reasoning_effort_sets_enable_thinking_unless_the_request_does() -> None:
    assert _kwargs(reasoning_effort="none")["enable_thinking"] is False
    assert [_kwargs(reasoning_effort=e)["enable_thinking"] for e in ("minimal", "low", "high", "max")] == [True] * 4
    assert "enable_thinking" not in _kwargs()  # no effort: the template's own default
    assert _kwargs(reasoning_effort="none", chat_template_kwargs={"enable_thinking": True})["enable_thinking"] is True
    assert _kwargs(reasoning_effort="high", chat_template_kwargs={"enable_thinking": False})["enable_thinking"] is False
    defaults = ChatTemplates.create(default_kwargs={"enable_thinking": False})  # the request's over the server's
    assert defaults.kwargs(ChatCompletionRequest(messages=MESSAGES, reasoning_effort="low"))["enable_thinking"] is True
    assert defaults.kwargs(ChatCompletionRequest(messages=MESSAGES))["enable_thinking"] is False


def test_the_responses_api_reasoning_effort_too() -> None:
    none = chat_request(ResponsesRequest(input="hi", reasoning={"effort": "none"}))
    assert template_kwargs(none)["enable_thinking"] is False
    assert template_kwargs(chat_request(ResponsesRequest(input="hi", reasoning={"effort": "high"})))["enable_thinking"]
    assert "enable_thinking" not in template_kwargs(chat_request(ResponsesRequest(input="hi")))


@pytest.mark.asyncio(loop_scope="session")
async def test_reasoning_effort_none_is_an_answer_with_qwen3(bundled_engine) -> None:
    """Qwen3's ``reasoning_effort: "none"``: the prompt ends with an empty think block and the reply is content, whole
    and streamed, in the Responses API too; with an Instruct template (no think block) the qwen3 parser still reads
    the reply as content (thinking off), and a constraint applies from the first token."""
    from asyncllm.integrations.openai_server import create_app

    app = create_app(bundled_engine, manage_engine=False, reasoning_parser="qwen3", chat_template=QWEN3)
    plain = create_app(bundled_engine, manage_engine=False, reasoning_parser="qwen3", chat_template=PLAIN)
    body = {"messages": MESSAGES, "temperature": 0, "max_tokens": 6, "return_token_ids": True}
    async with asgi_client(app) as client:
        off = (await client.post("/v1/chat/completions", json={**body, "reasoning_effort": "none"})).json()
        on = (await client.post("/v1/chat/completions", json={**body, "reasoning_effort": "high"})).json()
        streamed = await client.post("/v1/chat/completions", json={**body, "reasoning_effort": "none", "stream": True})
        response = (await client.post("/v1/responses", json={
            "input": "What is 2 + 2?", "max_output_tokens": 6, "temperature": 0, "reasoning": {"effort": "none"}})).json()
    async with asgi_client(plain) as client:
        answer = (await client.post("/v1/chat/completions", json={**body, "reasoning_effort": "none"})).json()
        forced = (await client.post("/v1/chat/completions", json={
            **body, "reasoning_effort": "none", "max_tokens": 30,
            "structured_outputs": {"regex": "The answer is 4\\."}})).json()
    tokenizer = bundled_engine.tokenizer
    assert tokenizer.decode(off["prompt_token_ids"]).endswith("<think>\n\n</think>\n\n")
    assert not tokenizer.decode(on["prompt_token_ids"]).endswith("</think>\n\n")
    message = off["choices"][0]["message"]
    assert message["content"] and "reasoning" not in message, message
    assert on["choices"][0]["message"].get("reasoning") and on["choices"][0]["message"]["content"] is None
    deltas = [c["delta"] for event in sse_events(streamed.text) for c in event["choices"]]
    assert "".join(d.get("content") or "" for d in deltas) == message["content"]
    assert not any("reasoning" in d for d in deltas)
    assert [item["type"] for item in response["output"]] == ["message"], response["output"]
    assert answer["choices"][0]["message"]["content"] and "reasoning" not in answer["choices"][0]["message"]
    assert forced["choices"][0]["message"] == {"role": "assistant", "content": "The answer is 4."}, forced
