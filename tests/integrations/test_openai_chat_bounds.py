"""The OpenAI server's own chat renders (``/tokenize``, ``/v1/embeddings``, beam search) take the engine's chat bounds
before the template renders (asyncllm/engine/chat_bounds.py, via integrations/openai_tokenize.py `chat_tokens`):
100,000 messages held the worker thread, and the GIL, for seconds, where a chat completion refused them unrendered."""

from __future__ import annotations

import pytest

from asyncllm.engine.chat_bounds import CUT_CHAT_MESSAGES
from asgi_helpers import asgi_client

pytestmark = pytest.mark.asyncio(loop_scope="session")

MESSAGE = {"role": "user", "content": "a"}


def _refused_unrendered(response, count: int) -> None:
    """A 400 on ``input_tokens`` (vLLM's param for a prompt past the context, every route's) told by its count (a render's error would count tokens: 3 or more a message)."""
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == "input_tokens", error
    assert f"{count} messages" in error["message"] and error["code"] == "context_length_exceeded", error


@pytest.mark.parametrize("route", ["embeddings", "beam_search"])
async def test_more_messages_than_max_model_len_are_refused_unrendered(app, bundled_engine, route) -> None:
    await bundled_engine.start()
    count = bundled_engine.config.max_model_len + 1
    body = {"messages": [MESSAGE] * count}
    async with asgi_client(app) as client:
        if route == "embeddings":
            response = await client.post("/v1/embeddings", json=body)
        else:
            response = await client.post("/v1/chat/completions", json={**body, "use_beam_search": True, "n": 2,
                                                                       "max_tokens": 2})
    _refused_unrendered(response, count)
    if route == "embeddings":
        assert "embedding generation" in response.json()["error"]["message"]  # the pooling operation, as the engine's


async def test_tokenize_counts_past_max_model_len_up_to_the_render_bound(app, bundled_engine) -> None:
    """/tokenize answers a chat's count past max_model_len (vLLM's), so only the render bound applies to it."""
    await bundled_engine.start()
    max_model_len = bundled_engine.config.max_model_len
    async with asgi_client(app) as client:
        counted = await client.post("/tokenize", json={"messages": [MESSAGE] * (max_model_len + 1)})
        refused = await client.post("/tokenize", json={"messages": [MESSAGE] * (CUT_CHAT_MESSAGES * max_model_len + 1)})
    assert counted.status_code == 200 and counted.json()["count"] > max_model_len
    _refused_unrendered(refused, CUT_CHAT_MESSAGES * max_model_len + 1)
