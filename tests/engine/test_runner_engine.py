"""A running engine under vLLM's ``runner`` (asyncllm/engine/runner.py): runner='pooling' on a causal LM embeds as
vLLM's as_embedding_model (the last token's state, normalized: transformers' base model's) and refuses generation,
the server's generation routes answering 400 as for a classifier; runner='generate' refuses embeddings; both say so in
`get_supported_tasks` and in the config. Resolution without an engine: tests/unit/test_runner_convert.py."""

from __future__ import annotations

import functools

import pytest

from asyncllm import AsyncEngine, InvalidRequestError, SamplingParams
from asyncllm.integrations.openai_server import create_app
from asgi_helpers import asgi_client

TOLERANCE = 1e-5


@functools.lru_cache(maxsize=None)
def _hf_last_state(path: str, prompt: tuple[int, ...]) -> list[float]:
    import torch
    from transformers import AutoModel

    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = model(torch.tensor([list(prompt)])).last_hidden_state[0, -1]
    return torch.nn.functional.normalize(hidden, dim=0).tolist()


async def test_runner_pooling_embeds_and_refuses_generation(tiny_llama: str) -> None:
    prompt = [5, 9, 14, 200, 31]
    async with AsyncEngine(tiny_llama, runner="pooling", max_model_len=64, disable_log_stats=True) as engine:
        assert (engine.config.runner, engine.config.convert) == ("pooling", "embed")
        assert await engine.get_supported_tasks() == ("embed", "token_embed")
        out = await engine.embed(prompt)
        want = _hf_last_state(tiny_llama, tuple(prompt))
        assert max(abs(a - b) for a, b in zip(out.embedding, want)) < TOLERANCE and len(out.embedding) == len(want)
        with pytest.raises(InvalidRequestError, match="runner='pooling'") as info:
            await engine.generate(prompt, SamplingParams(max_tokens=2))
        assert info.value.field == "prompt"
        async with asgi_client(create_app(engine, manage_engine=False)) as client:
            completion = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            chat = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
            embedded = await client.post("/v1/embeddings", json={"input": [prompt]})
        for response in (completion, chat):
            assert response.status_code == 400 and "runner='pooling'" in response.json()["error"]["message"]
        assert embedded.status_code == 200
        assert max(abs(a - b) for a, b in zip(embedded.json()["data"][0]["embedding"], want)) < TOLERANCE
        assert engine.stats().num_requests_running == 0


async def test_runner_generate_refuses_embeddings(tiny_llama: str) -> None:
    async with AsyncEngine(tiny_llama, runner="generate", max_model_len=64, disable_log_stats=True) as engine:
        assert (engine.config.runner, engine.config.convert) == ("generate", "none")
        assert await engine.get_supported_tasks() == ("generate",)
        out = await engine.generate([5, 9, 14], SamplingParams(max_tokens=2, temperature=0.0))
        assert len(out.outputs[0].token_ids) == 2
        with pytest.raises(InvalidRequestError, match="runner='generate'") as info:
            await engine.embed([5, 9, 14])
        assert info.value.field == "model"
        async with asgi_client(create_app(engine, manage_engine=False)) as client:
            embedded = await client.post("/v1/embeddings", json={"input": "hi"})
        assert embedded.status_code == 400 and "runner='generate'" in embedded.json()["error"]["message"]
