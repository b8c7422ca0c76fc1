"""The whole engine with an fp8 KV cache (kv_cache_dtype='fp8' / 'fp8_e5m2', scale 1.0) on the CPU.

The bundled model (a small trained Llama, float32) with each fp8 cache: four times the blocks of a
float32 cache in the same CPU KV budget, prompt logprobs within a stated distance of transformers'
float32 log-softmax, greedy tokens equal to transformers' (which the float32 engine matches exactly,
tests/engine/test_parity.py) until a near-tie, where a rounding error may rightly flip the argmax. Swap
preemption moves fp8 blocks out and back in exactly: outputs equal to the same engine's without
preemption. The measured errors are in docs/fp8-kv-cache.md.
"""

from __future__ import annotations

import asyncio
import functools

import pytest
import torch

from asyncllm import AsyncEngine, SamplingParams
from asyncllm.bundled import bundled_model_path
from engine_helpers import CODE_PROMPTS, random_prompts
from hf_reference import assert_greedy_until_a_near_tie, hf_greedy, hf_logits

PROMPTS = CODE_PROMPTS
MAX_TOKENS = 16
FP32_BLOCK_BYTES = 4 * 2 * 16 * 1 * 64 * 4
"""The bundled model's float32 KV block: 4 layers x K,V x 16 tokens x 1 KV head x 64 dims x 4 bytes."""
# |engine prompt logprob - transformers' float32 log-softmax| over the prompts' 132 positions: (max, mean) allowed.
# Measured on the CPU (2026-11-23): float32 cache 2.3e-6 / 4.7e-7; fp8 (e4m3) 0.17 / 0.020; fp8_e5m2 0.35 / 0.038.
LOGPROB_TOL = {"fp8": (0.35, 0.04), "fp8_e5m2": (0.7, 0.08)}
NEAR_TIE = 0.5
"""A greedy token may differ from float32's only where float32's top two logprobs are this close."""


@functools.lru_cache(maxsize=None)
def _prompts() -> tuple[tuple[int, ...], ...]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(bundled_model_path())
    return tuple(tuple(tokenizer(text)["input_ids"]) for text in PROMPTS)


def _logprob_errors(prompt: list[int], scored) -> torch.Tensor:
    expected = torch.log_softmax(hf_logits(bundled_model_path(), prompt).double(), -1)
    got = torch.tensor([scored.prompt_logprobs[i][prompt[i]].logprob for i in range(1, len(prompt))])
    return (got.double() - expected[torch.arange(len(prompt) - 1), prompt[1:]]).abs()


async def test_fp8_e5m2_cache_blocks_logprobs_and_greedy_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """The block count in a 64 MiB budget, then the logprobs and tokens; fp8 (e4m3): the swap test's engine below
    (the same code, another dtype)."""
    monkeypatch.setenv("ASYNCLLM_CPU_KVCACHE_SPACE_GB", "0.0625")
    async with AsyncEngine(bundled_model_path(), kv_cache_dtype="fp8_e5m2", disable_log_stats=True) as engine:
        await _assert_logprobs_and_greedy_tokens(engine, "fp8_e5m2")
        num_blocks = engine.stats().num_gpu_blocks
    fp32_blocks = 2**26 // FP32_BLOCK_BYTES  # 2048 blocks in 64 MiB
    assert num_blocks == 4 * fp32_blocks == 8192


async def _assert_logprobs_and_greedy_tokens(engine: AsyncEngine, kv_cache_dtype: str) -> None:
    """The prompts' logprobs within LOGPROB_TOL of transformers' float32 ones; greedy tokens equal until a near-tie."""
    assert engine.config.cache_config.kv_cache_dtype == kv_cache_dtype
    prompts = [list(p) for p in _prompts()]
    scoring = SamplingParams(prompt_logprobs=0, max_tokens=1, temperature=0.0)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    scored = await asyncio.gather(*(engine.generate(p, scoring) for p in prompts))
    generated = await asyncio.gather(*(engine.generate(p, greedy) for p in prompts))
    errors = torch.cat([_logprob_errors(p, out) for p, out in zip(prompts, scored)])
    max_tol, mean_tol = LOGPROB_TOL[kv_cache_dtype]
    assert 1e-3 < float(errors.max()) < max_tol, errors.max()  # far above a float32 cache's 2.3e-6: it rounds
    assert float(errors.mean()) < mean_tol, errors.mean()
    path = bundled_model_path()
    for prompt, out in zip(prompts, generated):
        assert len(out.token_ids) == MAX_TOKENS
        assert_greedy_until_a_near_tie(functools.partial(hf_logits, path), prompt,
                                       hf_greedy(path, prompt, MAX_TOKENS), out.token_ids, NEAR_TIE)


async def test_swap_preemption_with_an_fp8_cache_changes_no_token() -> None:
    """10 blocks for 8 requests of up to 94 tokens: victims are swapped out to the CPU and back (as bytes). The
    engine without preemption also checks fp8 (e4m3)'s logprobs and greedy tokens."""
    prompts = random_prompts(8, seed=3, stem_len=32)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)

    async def run(check_logprobs: bool = False, **fields) -> tuple[list[list[int]], object]:
        async with AsyncEngine(bundled_model_path(), kv_cache_dtype="fp8", disable_log_stats=True, max_model_len=128,
                               **fields) as engine:
            outs = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
            if check_logprobs:  # fp8 (e4m3)'s logprobs and tokens, on this engine
                await _assert_logprobs_and_greedy_tokens(engine, "fp8")
            return [o.token_ids for o in outs], engine.stats()

    free, _ = await run(check_logprobs=True, num_gpu_blocks_override=256)
    swapped, stats = await run(num_gpu_blocks_override=10, preemption_mode="swap", swap_space=0.001)
    assert stats.num_swapped_total > 0
    assert swapped == free
