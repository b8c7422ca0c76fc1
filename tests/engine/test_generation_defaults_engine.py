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


async def test_the_servers_default_max_tokens_is_cut_to_the_room_left(tiny_llama: str, tmp_path) -> None:
    """vLLM's server (``get_max_tokens``): a request without max_tokens runs with the least of the room the prompt
    leaves and the generation config's max_new_tokens, and its metrics record that, not the file's 200."""
    import httpx

    from asyncllm.integrations.openai_server import create_app

    model = str(tmp_path / "model")
    shutil.copytree(tiny_llama, model)
    with open(f"{model}/generation_config.json") as f:
        config = json.load(f)
    with open(f"{model}/generation_config.json", "w") as f:
        json.dump({**config, "max_new_tokens": 200}, f)
    async with AsyncEngine(model, max_model_len=32, disable_log_stats=True) as engine:
        app = create_app(engine, model_name="m", manage_engine=False)
        body = {"model": "m", "prompt": list(range(10, 20)), "max_tokens": None, "ignore_eos": True}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            out = (await client.post("/v1/completions", json=body)).json()
            short = (await client.post("/v1/completions", json={**body, "prompt": list(range(10, 12)),
                                                                 "max_tokens": None})).json()
            reply = (await client.post("/v1/responses", json={"model": "m", "input": "hi", "temperature": 0})).json()
        labels = {"model_name": engine._observer.stats.model_name, "engine": "0"}
        recorded = [engine.metrics_registry.get_sample_value(f"asyncllm:request_params_max_tokens_{part}", labels)
                    for part in ("count", "sum")]
    assert (out["usage"]["completion_tokens"], out["choices"][0]["finish_reason"]) == (22, "length")
    assert short["usage"]["completion_tokens"] == 30
    assert recorded[1] - 32 + reply["usage"]["input_tokens"] == 22 + 30  # the room left each time (200 uncut)
    assert recorded[0] == 3 and reply["max_output_tokens"] == 32 - reply["usage"]["input_tokens"]  # echoed cut
