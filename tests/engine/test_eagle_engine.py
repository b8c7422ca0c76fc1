"""EAGLE heads through the engine: the drafts change how many steps a request takes, never its tokens.

Three engines started together: a random EAGLE-3 head on the tiny Llama over two tensor-parallel ranks (its
drafts almost all rejected) under chunked prefill, prefix-cache hits and preemption; and an EAGLE-1 head that
computes its target exactly (a target whose next token depends on its last token only), whose every greedy draft
must be accepted, which catches a draft read from the wrong token, hidden state or position; and the tiny
DeepSeek-V3 and the hybrid Qwen3-Next with a multi-token-prediction layer drafting for themselves
(``method="mtp"``; Qwen3-Next's linear layers rolled back to each step's accepted drafts, its prefix-cache hits
resuming from saved states).
"""

from __future__ import annotations

import asyncio
import functools

import pytest
import pytest_asyncio

from asyncllm import AsyncEngine, SamplingParams
from asyncllm.tiny import tiny_checkpoint
from eagle_utils import add_mtp_layer, add_qwen_mtp_layer, make_eagle_head, make_exact_pair
from engine_helpers import random_prompts
from hf_reference import hf_greedy

MAX_TOKENS = 16


@functools.lru_cache(maxsize=None)
def _reference(path: str, prompt: tuple[int, ...]) -> list[int]:
    return hf_greedy(path, list(prompt), MAX_TOKENS, eos_token_id=None)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engines(tiny_llama: str, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("eagle")
    head3 = make_eagle_head(str(root / "eagle3"), tiny_llama, "eagle3")
    exact_target, exact_head = make_exact_pair(tiny_llama, str(root / "exact"))
    eagle3 = AsyncEngine(tiny_llama, disable_log_stats=True, max_num_batched_tokens=24, num_gpu_blocks_override=8,
                         max_model_len=128, tensor_parallel_size=2,
                         speculative_config={"method": "eagle3", "model": head3, "num_speculative_tokens": 3})
    exact = AsyncEngine(exact_target, disable_log_stats=True,
                        speculative_config={"method": "eagle", "model": exact_head, "num_speculative_tokens": 3})
    deepseek = add_mtp_layer(tiny_checkpoint("deepseek_v3"), str(root / "deepseek"))
    mtp = AsyncEngine(deepseek, disable_log_stats=True, max_num_batched_tokens=32,
                      speculative_config={"method": "deepseek_mtp", "num_speculative_tokens": 2})
    qwen = add_qwen_mtp_layer(tiny_checkpoint("qwen3_next"), str(root / "qwen3_next"))
    qwen_mtp = AsyncEngine(qwen, disable_log_stats=True, max_num_batched_tokens=32, block_size=4, mamba_block_size=8,
                           speculative_config={"method": "qwen3_next_mtp", "num_speculative_tokens": 2})
    pair = {"eagle3": (eagle3, tiny_llama), "exact": (exact, exact_target), "mtp": (mtp, deepseek),
            "qwen_mtp": (qwen_mtp, qwen)}
    try:
        await asyncio.gather(*(engine.start() for engine, _ in pair.values()))
        yield pair
    finally:
        await asyncio.gather(*(engine.aclose() for engine, _ in pair.values()))


@pytest.mark.asyncio(loop_scope="module")
async def test_greedy_outputs_equal_transformers_and_an_exact_head_is_always_accepted(engines) -> None:
    prompts = random_prompts(8, seed=7, stem_len=20, max_len=60)
    prompts += prompts[1:3]  # again: prefix-cache hits on whole blocks
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for name, (engine, target) in engines.items():
        outs = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
        for prompt, out in zip(prompts, outs):
            assert out.token_ids == _reference(target, tuple(prompt)), f"{name}: {len(prompt)} tokens diverged"
        stats = engine.stats()
        assert stats.spec_decode_num_drafts > 0 and stats.prefix_cache_hits > 0
    assert engines["eagle3"][0].stats().num_preemptions_total > 0
    assert engines["exact"][0].stats().spec_decode_acceptance_rate == 1.0
