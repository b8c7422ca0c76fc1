"""Phi-3 through the whole engine: greedy output equals transformers', token for token.

One engine on the tiny Phi-3 (asyncllm.tiny "phi3": rotary on 12 of 16 head dims, LongRoPE pretrained on 64
positions) with an 8-token sliding window, served with max_model_len unset: 64, the original length (vLLM's default
for LongRoPE, so its short factors, as transformers uses for every sequence that fits there), with 16-token
chunked prefill and a prefix-cache hit.
Logits per position, the long factors, and the fused weights' tensor-parallel split:
tests/unit/test_phi3_models.py.
"""

from __future__ import annotations

import asyncio
import random

import pytest
import pytest_asyncio

from asyncllm import AsyncEngine, SamplingParams
from asyncllm.tiny import tiny_checkpoint
from hf_reference import hf_greedy

pytestmark = pytest.mark.asyncio(loop_scope="module")

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def path() -> str:
    return tiny_checkpoint("phi3", sliding_window=8)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(path: str):
    async with AsyncEngine(path, max_num_batched_tokens=16, disable_log_stats=True) as engine:
        yield engine


async def test_phi3_greedy_equals_transformers(engine: AsyncEngine, path: str) -> None:
    assert engine.config.max_model_len == 64  # not max_position_embeddings (2048: the long factors)
    rng = random.Random(3)
    prompts = [[rng.randrange(6, 512) for _ in range(n)] for n in (37, 21, 12)]
    outs = await asyncio.gather(*(engine.generate(p, GREEDY) for p in prompts))
    again = await engine.generate(prompts[0] + [7, 8], GREEDY)  # its first 32 tokens' blocks are cached
    assert engine.stats().prefix_cache_hits > 0
    for prompt, out in zip([*prompts, prompts[0] + [7, 8]], [*outs, again]):
        assert out.token_ids == hf_greedy(path, prompt, MAX_TOKENS, eos_token_id=None), f"{len(prompt)} tokens"
