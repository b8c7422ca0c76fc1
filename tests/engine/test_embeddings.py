"""Embeddings (`AsyncEngine.embed`): the last prompt token's final hidden state, as transformers' base model
computes it, whatever the batch (generations alongside), chunking or prefix-cache hits; PoolingParams' options;
typed errors; a prompt may fill max_model_len (it generates nothing, as vLLM's), one more token is refused in vLLM's
words with code context_length_exceeded."""

from __future__ import annotations

import asyncio
import functools

import pytest

from asyncllm import AsyncEngine, InvalidRequestError, PoolingParams, SamplingParams
from engine_helpers import random_prompts
from hf_reference import hf_greedy

TOLERANCE = 1e-5


@functools.lru_cache(maxsize=None)
def _hf_base(path: str):
    import torch
    from transformers import AutoModel

    return AutoModel.from_pretrained(path, dtype=torch.float32).eval()


def _reference(path: str, prompt: list[int], normalize: bool = True, dimensions: int | None = None) -> list[float]:
    """transformers' last hidden state of the prompt's last token, truncated and normalized as asked."""
    import torch

    with torch.no_grad():
        hidden = _hf_base(path)(torch.tensor([prompt])).last_hidden_state[0, -1, :dimensions]
    return (torch.nn.functional.normalize(hidden, dim=0) if normalize else hidden).tolist()


def _close(got: list[float], want: list[float]) -> bool:
    return len(got) == len(want) and max(abs(a - b) for a, b in zip(got, want)) < TOLERANCE


async def test_embeddings_equal_transformers_in_mixed_chunked_batches(tiny_llama: str) -> None:
    prompts = random_prompts(6, seed=21, stem_len=40, max_len=70)  # every other one shares a 40-token stem
    greedy = SamplingParams(temperature=0.0, max_tokens=10)
    long = [3 + (37 * i) % 490 for i in range(81)]
    async with AsyncEngine(tiny_llama, max_model_len=80, max_num_batched_tokens=24, disable_log_stats=True,
                           hf_overrides={"is_matryoshka": True},  # `dimensions` allowed, as vLLM's
                           max_worker_restarts=0) as engine:  # a worker's failure ends the engine: the test fails
        embedded, generated = await asyncio.gather(
            asyncio.gather(*(engine.embed(p) for p in prompts)),
            asyncio.gather(*(engine.generate(p, greedy) for p in prompts)),
        )
        again = await engine.embed(prompts[1])  # its blocks are cached now: a prefix hit
        raw = await engine.embed(prompts[0], PoolingParams(normalize=False))
        short = await engine.embed(prompts[0], PoolingParams(dimensions=16))
        text = await engine.embed("hello there")
        full = await engine.embed(long[:80])  # 5 whole blocks: async scheduling must not decode after its prefill
        cut = await engine.embed(long, truncate_prompt_tokens=-1)  # the last max_model_len tokens
        with pytest.raises(InvalidRequestError) as over:
            await engine.embed(long)
        with pytest.raises(InvalidRequestError, match="dimensions") as info:
            await engine.embed(prompts[0], PoolingParams(dimensions=65))
        assert info.value.field == "dimensions"
        with pytest.raises(InvalidRequestError, match="positive int"):
            await engine.embed(prompts[0], PoolingParams(dimensions=0))
        with pytest.raises(InvalidRequestError, match="pooling_params"):
            await engine.embed(prompts[0], {"normalize": True})
    for prompt, out, gen in zip(prompts, embedded, generated):
        assert out.prompt_token_ids == prompt and _close(out.embedding, _reference(tiny_llama, prompt))
        assert gen.token_ids == hf_greedy(tiny_llama, prompt, 10)
    assert again.num_cached_tokens >= 32 and _close(again.embedding, _reference(tiny_llama, prompts[1]))
    assert _close(raw.embedding, _reference(tiny_llama, prompts[0], normalize=False))
    assert _close(short.embedding, _reference(tiny_llama, prompts[0], dimensions=16))
    assert _close(text.embedding, _reference(tiny_llama, text.prompt_token_ids))
    assert abs(sum(x * x for x in text.embedding) - 1.0) < 1e-5
    assert text.outputs.embedding is text.embedding  # vLLM's EmbeddingRequestOutput.outputs.embedding
    assert _close(full.embedding, _reference(tiny_llama, long[:80]))
    assert cut.prompt_token_ids == long[1:] and _close(cut.embedding, _reference(tiny_llama, long[1:]))
    assert (over.value.field, over.value.code) == ("prompt", "context_length_exceeded")
    assert over.value.message == ("This model's maximum context length is 80 tokens. However, you requested 81 tokens "
                                  "in the input for embedding generation. Please reduce the length of the input.")
