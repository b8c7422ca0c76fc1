"""A request without SamplingParams runs with the model's generation_config.json defaults (as vLLM)."""

from __future__ import annotations

import json
import shutil

import pytest

from asyncllm import AsyncEngine, AsyncLLMError, SamplingParams
from hf_reference import hf_greedy


async def test_requests_without_params_use_the_models_generation_config(tiny_llama: str, tmp_path) -> None:
    model = str(tmp_path / "model")
    shutil.copytree(tiny_llama, model)
    with open(f"{model}/generation_config.json") as f:
        config = json.load(f)
    with open(f"{model}/generation_config.json", "w") as f:
        json.dump({**config, "max_new_tokens": 5, "repetition_penalty": 1.3, "top_k": 7}, f)
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]
    engine = AsyncEngine(model, override_generation_config={"temperature": 0.0}, disable_log_stats=True)
    with pytest.raises(AsyncLLMError, match="start"):
        engine.default_sampling_params()
    async with engine:
        defaults = engine.default_sampling_params()
        assert (defaults.max_tokens, defaults.repetition_penalty, defaults.top_k, defaults.temperature) == (
            5, 1.3, 7, 0.0)
        out = await engine.generate(prompt)
        streamed = [t async for d in engine.stream(prompt) for t in d.token_ids]
        explicit = await engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=8))  # exactly these
        served, served_explicit = await _served(engine, prompt)
        three = await engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=3))
    want = hf_greedy(model, prompt, 5, repetition_penalty=1.3)
    assert out.token_ids == streamed == want and len(want) == 5
    assert explicit.token_ids == hf_greedy(model, prompt, 8, repetition_penalty=1.0)  # not the file's
    assert served == out.text  # the server's unset fields take the same defaults
    assert served_explicit == three.text and three.token_ids == hf_greedy(model, prompt, 3, repetition_penalty=1.0)


async def _served(engine: AsyncEngine, prompt: list[int]) -> tuple[str, str]:
    """Completions through the OpenAI server: fields unset, then set (temperature, max_tokens, penalty)."""
    import httpx

    from asyncllm.integrations.openai_server import create_app

    app = create_app(engine, model_name="m", manage_engine=False)
    body = {"model": "m", "prompt": prompt}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        unset = (await client.post("/v1/completions", json={**body, "max_tokens": None})).json()
        explicit = (await client.post("/v1/completions", json={**body, "max_tokens": 3, "temperature": 0,
                                                               "repetition_penalty": 1.0})).json()
    return unset["choices"][0]["text"], explicit["choices"][0]["text"]
