"""Gemma 4 through the whole engine (asyncllm/models/gemma4.py, docs/gemma.md#gemma-4): greedy output equals
transformers', token for token, for the tiny E2B-style model (KV-sharing layers, per-layer inputs, sliding and global
layers with KV caches of different shapes) and the tiny 26B-A4B-style one (experts beside the dense MLP): chunked,
from the prefix cache, preempted by recompute and by swapping, over two tensor-parallel ranks (and by expert), and
drafted by itself (speculative decoding); LoRA adapters equal PEFT's. Pipeline stages:
tests/engine/test_pipeline_parallel_own_stages_engine.py."""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio
from engine_helpers import assert_greedy_with_prefix_hit_equals_transformers, greedy_equals_transformers, token_prompts
from hf_reference import hf_greedy

from asyncllm import AsyncEngine
from asyncllm.tiny import tiny_checkpoint

MAX_TOKENS = 12
ARCHS = ("gemma4", "gemma4_moe")


def _prompts(count: int, seed: int) -> list[list[int]]:
    return token_prompts(count, seed)


async def _greedy_matches_hf(path: str, prompts: list[list[int]], **engine_kwargs: object) -> AsyncEngine:
    return await greedy_equals_transformers(path, prompts, MAX_TOKENS, **engine_kwargs)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served(request: pytest.FixtureRequest):
    """One engine per checkpoint (16-token chunks, two adapter slots) shared by the prefix-hit and LoRA tests:
    (engine, checkpoint)."""
    path = tiny_checkpoint(request.param)
    async with AsyncEngine(path, max_num_batched_tokens=16, enable_lora=True, max_loras=2, max_lora_rank=8,
                           disable_log_stats=True) as engine:
        yield engine, path


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize("served", ["gemma4"], indirect=True)  # its KV-sharing layers; the MoE model's engine path:
# the TP cases
async def test_gemma4_greedy_equals_transformers_with_a_prefix_hit(served) -> None:
    engine, path = served
    await assert_greedy_with_prefix_hit_equals_transformers(engine, path, seed=6)


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
async def test_gemma4_preempted_changes_no_token(preemption_mode: str) -> None:
    """10 blocks for 8 requests: victims recomputed, or their caches of both shapes swapped out and back."""
    engine = await _greedy_matches_hf(tiny_checkpoint("gemma4"), _prompts(8, seed=3), max_num_batched_tokens=16,
                                      num_gpu_blocks_override=10, max_model_len=96, preemption_mode=preemption_mode,
                                      swap_space=0.001)
    stats = engine.stats()
    assert stats.num_preemptions_total > 0
    assert (stats.num_swapped_total > 0) == (preemption_mode == "swap")


@pytest.mark.parametrize("arch, expert_parallel", [("gemma4_moe", False), ("gemma4_moe", True)])  # its layers: the dense
# model's with experts beside the MLP
async def test_gemma4_tensor_parallel(arch: str, expert_parallel: bool) -> None:
    """Two ranks: query heads split, the global layers' single KV head replicated, per-layer inputs whole on each;
    the experts split by intermediate dim or by expert."""
    await _greedy_matches_hf(tiny_checkpoint(arch), _prompts(4, seed=5), tensor_parallel_size=2,
                             enable_expert_parallel=expert_parallel)


async def test_gemma4_drafted_by_itself_accepts_every_draft() -> None:
    """The tiny Gemma 4 as its own draft model: the draft's caches of two shapes (and its KV-sharing layers) keep
    step with the target's, so every greedy draft is accepted, and the tokens are transformers'."""
    path = tiny_checkpoint("gemma4")
    engine = await _greedy_matches_hf(path, _prompts(4, seed=7), max_num_batched_tokens=24,
                                      speculative_config={"model": path, "num_speculative_tokens": 3})
    stats = engine.stats()
    assert stats.spec_decode_num_draft_tokens > 0
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize("served", ARCHS, indirect=True)
async def test_lora_adapters_on_gemma4_equal_peft(served, tmp_path) -> None:
    """PEFT adapters on every projection the layers have: the sliding layers' q/k/v, the global layers' q/k (their
    values are the adapted keys), the KV-sharing layers' q alone, o, and the (double-wide) MLPs; two adapters and the
    base model batched together: greedy tokens and the prompts' log-probabilities equal PEFT's and transformers'
    (the tiny Gemmas' greedy tokens repeat, so the log-probabilities show the adapters' effect)."""
    import torch
    from lora_utils import make_adapter, peft_greedy, peft_logits

    from asyncllm import LoRARequest, SamplingParams
    from hf_reference import hf_logits

    engine, path = served
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    adapters = [make_adapter(path, str(tmp_path / f"a{i}"), seed=i, targets=targets) for i in (1, 2)]
    requests = [None, LoRARequest("one", 1, adapters[0]), LoRARequest("two", 2, adapters[1])]
    prompts = token_prompts(3, seed=11)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, prompt_logprobs=1)
    outs = await asyncio.gather(*(engine.generate(p, params, lora_request=r) for p, r in zip(prompts, requests)))
    assert outs[0].token_ids == hf_greedy(path, prompts[0], MAX_TOKENS, eos_token_id=None)
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        adapter = adapters[i - 1] if i else None
        logits = peft_logits(path, adapter, prompt) if adapter else hf_logits(path, prompt)
        expected = torch.log_softmax(logits.float(), -1)[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
        got = torch.tensor([entry[token].logprob for entry, token in zip(out.prompt_logprobs[1:], prompt[1:])])
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
        if adapter:
            assert out.token_ids == peft_greedy(path, adapter, prompt, MAX_TOKENS, eos_token_id=None)
            base = torch.log_softmax(hf_logits(path, prompt).float(), -1)[torch.arange(len(prompt) - 1),
                                                                          torch.tensor(prompt[1:])]
            assert (base - expected).abs().max() > 1e-2  # the adapter matters
