"""Per-token embeddings (`AsyncEngine.encode(..., pooling_task="token_embed")`, vLLM's ALL pooling): one row per
prompt token, each transformers' final hidden state at that position (normalized by default, ``normalize`` and
``dimensions`` as for `embed`), gathered across chunked-prefill chunks, never read from the prefix cache; bad
combinations refused by name."""

from __future__ import annotations

import asyncio
import re

import pytest
import torch

from asyncllm import AsyncEngine, InvalidRequestError, PoolingParams, SamplingParams
from hf_reference import hf_last_hidden_states

TOLERANCE = 1e-5


def _reference(path: str, prompt: list[int], normalize: bool = True, dimensions: int | None = None) -> torch.Tensor:
    rows = torch.tensor(hf_last_hidden_states(path, prompt))[:, :dimensions]
    return torch.nn.functional.normalize(rows, dim=-1) if normalize else rows


def _close(got: list[list[float]], want: torch.Tensor) -> bool:
    return torch.tensor(got).shape == want.shape and (torch.tensor(got) - want).abs().max().item() < TOLERANCE


async def test_token_embeddings_equal_transformers_across_chunks_without_prefix_hits(tiny_llama: str) -> None:
    prompts = [[3 + (37 * i) % 490 for i in range(60)], [7 + (53 * i) % 480 for i in range(45)],
               [11 + (29 * i) % 470 for i in range(23)]]  # each longer than one 16-token chunk
    cached = prompts[1][:40]  # its first blocks, cached by the generation below
    async with AsyncEngine(tiny_llama, max_model_len=80, max_num_batched_tokens=16, disable_log_stats=True,
                           hf_overrides={"is_matryoshka": True}, max_worker_restarts=0) as engine:
        assert await engine.get_supported_tasks() == ("generate", "embed", "token_embed")  # vLLM's names
        await engine.generate(cached, SamplingParams(temperature=0.0, max_tokens=2))
        encoded, embedded = await asyncio.gather(
            asyncio.gather(*(engine.encode(p, pooling_task="token_embed") for p in prompts)),
            asyncio.gather(*(engine.embed(p) for p in prompts)))
        raw = await engine.encode(prompts[0], PoolingParams(normalize=False, dimensions=16), pooling_task="token_embed")
        hit = await engine.embed(prompts[1])  # a LAST embedding does read the cache: the hit was there to take
        pooled = await engine.encode(prompts[2], pooling_task="embed")
        with pytest.raises(InvalidRequestError, match="embedding generation") as over:
            await engine.encode(list(range(3, 84)), pooling_task="token_embed")
    for prompt, out, emb in zip(prompts, encoded, embedded):
        assert out.prompt_token_ids == prompt and len(out.data) == len(prompt) > 16  # more than one chunk
        assert _close(out.data, _reference(tiny_llama, prompt)), prompt
        assert out.num_cached_tokens == 0 and out.outputs.data is out.data  # vLLM's PoolingRequestOutput spelling
        assert max(abs(a - b) for a, b in zip(out.data[-1], emb.embedding)) < TOLERANCE  # the last row is embed's
    assert hit.num_cached_tokens >= 32
    assert _close(raw.data, _reference(tiny_llama, prompts[0], normalize=False, dimensions=16))
    assert _close([pooled.data], _reference(tiny_llama, prompts[2])[-1:])
    assert (over.value.field, over.value.code) == ("prompt", "context_length_exceeded")


async def test_bad_encode_requests_are_refused_by_name(tiny_llama: str) -> None:
    async with AsyncEngine(tiny_llama, max_model_len=64, disable_log_stats=True) as engine:
        ids = [5, 6, 7]
        refusals = [({}, "pooling_task", "required"),
                    ({"pooling_task": "token_classify"}, "model", "no classification head"),
                    ({"pooling_params": PoolingParams(use_activation=False), "pooling_task": "token_embed"},
                     "use_activation", "for task 'token_classify' only"),
                    ({"pooling_task": "classify"}, "pooling_task", "classify()"),
                    ({"pooling_task": "reward"}, "pooling_task", "must be one of"),
                    ({"pooling_params": {"normalize": True}, "pooling_task": "token_embed"}, "pooling_params",
                     "asyncllm.PoolingParams"),
                    ({"pooling_params": PoolingParams(dimensions=8), "pooling_task": "token_embed"}, "dimensions",
                     "matryoshka")]
        for kwargs, field, words in refusals:
            with pytest.raises(InvalidRequestError, match=re.escape(words)) as info:
                await engine.encode(ids, **kwargs)
            assert info.value.field == field
        with pytest.raises(InvalidRequestError, match=re.escape("encode(")) as info:
            await engine.embed(ids, PoolingParams(task="token_embed"))
            assert info.value.field == field


def test_all_pooling_is_the_per_token_tasks_only() -> None:
    PoolingParams(task="token_embed", pooling_type="ALL").validate()
    PoolingParams(task="token_classify", pooling_type="ALL", use_activation=False).validate()
    with pytest.raises(InvalidRequestError) as info:
        PoolingParams(task="embed", pooling_type="ALL").validate()
    assert info.value.field == "pooling_type"
