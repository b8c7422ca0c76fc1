"""n > 1 on a real engine: the samples share the prompt's KV blocks and give the tokens of separate requests.

The n core requests of one `generate` reach the core together; the first
computes the 600-token prompt, the others hit its 37 full blocks (in the same
step or the next) and compute only the last 8 tokens. The counters prove it,
and the tokens equal those of separate requests (greedy: also transformers').
"""

from __future__ import annotations

import random

import pytest
import pytest_asyncio
from hf_reference import hf_greedy

from asyncllm import AsyncEngine, SamplingParams
from asyncllm.sampling import sample_seed
from engine_helpers import wait_idle

pytestmark = pytest.mark.asyncio(loop_scope="module")

PROMPT_LEN, BLOCK, N = 600, 16, 4
SHARED = PROMPT_LEN // BLOCK * BLOCK  # 592 tokens in 37 full blocks


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tiny_llama: str):
    engine = AsyncEngine(tiny_llama, disable_log_stats=True, max_model_len=1024, max_num_batched_tokens=2048,
                         max_num_seqs=16, block_size=BLOCK)
    async with engine:
        yield engine


def _prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 500) for _ in range(PROMPT_LEN)]


async def _counters(engine: AsyncEngine) -> tuple[int, int, int]:
    await wait_idle(engine)
    s = engine.stats()
    return s.prompt_tokens_total, s.prefix_cache_queries, s.prefix_cache_hits


async def _check_the_prompt_was_computed_once(engine: AsyncEngine, before: tuple[int, int, int]) -> None:
    prompt_tokens, queries, hits = (a - b for a, b in zip(await _counters(engine), before))
    assert prompt_tokens == N * PROMPT_LEN  # the host counts the prompt once per sample, as vLLM's
    assert queries == N * PROMPT_LEN  # the core looked up each sample's prompt
    assert hits == (N - 1) * SHARED  # and found 37 blocks for all but the first
    assert queries - hits == PROMPT_LEN + (N - 1) * (PROMPT_LEN - SHARED)  # prompt tokens computed: 600 + 3 x 8


async def test_greedy_samples_share_the_prompt_and_match_separate_requests(engine: AsyncEngine,
                                                                          tiny_llama: str) -> None:
    prompt = _prompt(1)
    params = SamplingParams(n=N, temperature=0.0, max_tokens=12, ignore_eos=True)
    before = await _counters(engine)
    shared = await engine.generate(prompt, params)
    await _check_the_prompt_was_computed_once(engine, before)
    alone = await engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    expected = hf_greedy(tiny_llama, prompt, 12)
    assert alone.outputs[0].token_ids == expected
    assert [o.token_ids for o in shared.outputs] == [expected] * N


async def test_seeded_samples_share_the_prompt_and_match_separate_requests(engine: AsyncEngine) -> None:
    prompt = _prompt(2)
    params = SamplingParams(n=N, temperature=1.0, top_k=50, seed=1234, max_tokens=12, ignore_eos=True)
    before = await _counters(engine)
    shared = await engine.generate(prompt, params)
    await _check_the_prompt_was_computed_once(engine, before)
    separate = [
        await engine.generate(prompt, SamplingParams(temperature=1.0, top_k=50, seed=sample_seed(1234, i),
                                                     max_tokens=12, ignore_eos=True))
        for i in range(N)
    ]
    assert [o.token_ids for o in shared.outputs] == [r.outputs[0].token_ids for r in separate]
    assert len({tuple(o.token_ids) for o in shared.outputs}) > 1  # the samples differ: each has its own seed
