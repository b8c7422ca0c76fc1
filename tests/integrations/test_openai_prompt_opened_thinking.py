"""glm45 with GLM-4.7's template, whose generation prompt ends with ``<think>``: the server reads the reply as
thinking until ``</think>`` (current vLLM's glm45), streamed and whole; the tiny model never writes the end tag, so
all of its reply is reasoning (the reply itself splits: tests/unit/test_reasoning_prompt_opened.py)."""

from __future__ import annotations

import pytest
from asgi_helpers import asgi_client as _client, sse_events as _events

pytestmark = pytest.mark.asyncio(loop_scope="session")

PLAIN = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}<|assistant|>"
OPENED = PLAIN + "<think>"  # as GLM-4.7's template ends a generation prompt


async def test_glm45_reads_a_reply_to_a_prompt_that_opened_the_thinking_as_reasoning(bundled_engine) -> None:
    from asyncllm.integrations.openai_server import create_app

    app = create_app(bundled_engine, manage_engine=False, reasoning_parser="glm45", trust_request_chat_template=True)
    body = {"messages": [{"role": "user", "content": "2+2?"}], "temperature": 0, "max_tokens": 4,
            "chat_template": OPENED}
    async with _client(app) as client:
        whole = (await client.post("/v1/chat/completions", json=body)).json()["choices"][0]["message"]
        streamed = await client.post("/v1/chat/completions", json={**body, "stream": True})
        plain = (await client.post("/v1/chat/completions", json={**body, "chat_template": PLAIN})).json()
    assert whole["reasoning"] and whole["content"] is None, whole
    deltas = [c["delta"] for event in _events(streamed.text) for c in event["choices"]]
    assert "".join(d.get("reasoning") or "" for d in deltas) == whole["reasoning"]
    assert not any(d.get("content") for d in deltas)
    assert "reasoning" not in plain["choices"][0]["message"]  # GLM-4.5's prompt: a reply without <think> is answer
