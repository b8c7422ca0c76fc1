"""The hybrids with per-request states through the engine (Qwen3.5 dense and MoE: Gated DeltaNet + gated full
attention; Granite 4.0 and Nemotron-H / Nemotron 3: Mamba2 + attention; Falcon-H1: both in each layer; Jamba:
Mamba (v1) + attention; LFM2: short convolutions + attention; MiniMax: lightning attention + attention; Qwen3-Next
runs through the engine with its MTP layer, tests/engine/test_eagle_engine.py; Bamba's and LFM2-MoE's layers are
those of Granite 4.0 and LFM2 with their logits checked in process, tests/unit/test_mamba2.py, test_lfm2.py):
greedy tokens equal transformers' with 16-token chunks, two seats (rows reused by later requests), recompute
preemption, async scheduling and states saved in two slots for prefix caching (slots replaced); prefix-cache hits
resume from saved states (points in prompts and in decodes, shared prefixes, a conversation's next turn); n-gram
drafts verified and rolled back; swap preemption and hybrid draft models refused."""

from __future__ import annotations

import asyncio
import random

import pytest
from hf_reference import hf_greedy

from asyncllm import AsyncEngine, NotBuiltError, SamplingParams
from asyncllm.tiny import tiny_checkpoint

MAX_TOKENS = 12


def _prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(6, 512) for _ in range(rng.randint(3, 50))] for _ in range(count)]


@pytest.mark.parametrize("arch", ["qwen3_5", "granitemoehybrid", "lfm2", "nemotron_h", "falcon_h1", "jamba",
                                  "kimi_linear"])
# Qwen3.5-MoE: Qwen3.5's layers with experts (in process: tests/unit/test_gated_deltanet.py), through the engine in
# test_lora_engine.py and test_qwen_vl_engine.py
async def test_greedy_equals_transformers_chunked_preempted_and_on_reused_rows(arch: str) -> None:
    path, prompts = tiny_checkpoint(arch), _prompts(6, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    async with AsyncEngine(path, disable_log_stats=True, max_num_batched_tokens=16, max_num_seqs=2,
                           num_gpu_blocks_override=16, block_size=4, max_model_len=64, mamba_block_size=8,
                           mamba_checkpoint_slots=2) as engine:  # states saved every 8 tokens, in 2 slots
        outs = await asyncio.gather(*(engine.generate(p, params) for p in prompts + prompts[:1]))
        stats = engine.stats()
    for prompt, out in zip(prompts + prompts[:1], outs):
        assert out.token_ids == hf_greedy(path, prompt, MAX_TOKENS, eos_token_id=None), f"{len(prompt)} tokens"
    assert stats.num_preemptions_total > 0


@pytest.mark.parametrize("arch, tp", [("granitemoehybrid", 1), ("lfm2", 1), ("qwen3_5", 2), ("kimi_linear", 1)])
async def test_prefix_cache_hits_resume_from_saved_states(arch: str, tp: int) -> None:
    """Prompts sharing a 37-token prefix, then a conversation's next turn (prompt + answer + more): each hit starts
    at the last saved point (every 8 tokens) before its end, from the states saved there, mid-chunk or at a decode;
    tokens equal transformers'. """
    path = tiny_checkpoint(arch)
    rng = random.Random(7)
    shared = [rng.randrange(6, 512) for _ in range(37)]
    prompts = [shared + [rng.randrange(6, 512) for _ in range(rng.randint(1, 9))] for _ in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    async with AsyncEngine(path, disable_log_stats=True, max_num_batched_tokens=24, max_num_seqs=2, block_size=4,
                           max_model_len=96, mamba_block_size=8, mamba_checkpoint_slots=16,
                           tensor_parallel_size=tp) as engine:  # over two ranks each saves and loads its own
        outs = [await engine.generate(p, params) for p in prompts]
        turn = prompts[0] + outs[0].token_ids + [rng.randrange(6, 512) for _ in range(5)]
        outs.append(await engine.generate(turn, params))
        prompts.append(turn)
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(path, prompt, MAX_TOKENS, eos_token_id=None), f"{len(prompt)} tokens"
    computed = len(prompts[0]) + MAX_TOKENS - 1  # the first request's last token is never computed
    assert [o.num_cached_tokens for o in outs] == [0, 32, 32, computed // 8 * 8]


async def test_minimax_preempted_chunked_and_from_saved_states() -> None:
    """MiniMax's lightning attention in one engine: 16-token chunks, two seats (rows reused), recompute preemption,
    then a prompt sharing 37 tokens with an earlier one hits 32 from the states saved there; greedy tokens equal
    transformers'."""
    path, rng = tiny_checkpoint("minimax"), random.Random(7)
    shared = [rng.randrange(6, 512) for _ in range(37)]
    prompts = _prompts(4, seed=5) + [shared + [rng.randrange(6, 512) for _ in range(5)]]
    later = shared + [rng.randrange(6, 512) for _ in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    async with AsyncEngine(path, disable_log_stats=True, max_num_batched_tokens=16, max_num_seqs=2,
                           num_gpu_blocks_override=16, block_size=4, max_model_len=64, mamba_block_size=8,
                           mamba_checkpoint_slots=16) as engine:
        outs = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
        stats = engine.stats()
        outs.append(await engine.generate(later, params))
    for prompt, out in zip(prompts + [later], outs):
        assert out.token_ids == hf_greedy(path, prompt, MAX_TOKENS, eos_token_id=None), f"{len(prompt)} tokens"
    assert stats.num_preemptions_total > 0 and outs[-1].num_cached_tokens == 32


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


async def test_drafts_keep_tokens_equal_to_transformers() -> None:
    """n-gram drafts on Granite 4.0's Mamba2 layers (its outputs repeat themselves: some drafts are accepted, some
    not, some requests get fewer than three): each verification keeps the states after every draft and rolls back
    to the accepted ones (chunked prompts, two seats, states saved for prefix caching). Qwen3.5's Gated DeltaNet:
    tests/unit/test_hybrid_drafts.py, and Qwen3-Next's MTP through the engine: tests/engine/test_eagle_engine.py."""
    path = tiny_checkpoint("granitemoehybrid")
    prompts = [[5, 6, 7, 8, 9] * 6, list(range(10, 30)) * 2] + _prompts(3, seed=8)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)  # long enough to repeat itself
    async with AsyncEngine(path, disable_log_stats=True, speculative_config=NGRAM, max_num_batched_tokens=16,
                           max_num_seqs=2, block_size=4, max_model_len=96, mamba_block_size=8,
                           mamba_checkpoint_slots=4) as engine:
        outs = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
        stats = engine.stats()
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(path, prompt, 40, eos_token_id=None), f"{len(prompt)} tokens"
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens


@pytest.mark.parametrize("fields", [{"preemption_mode": "swap"},
                                    {"speculative_config": {"model": "qwen3_5", "num_speculative_tokens": 2}}])
async def test_swap_preemption_and_hybrid_draft_models_are_refused(fields: dict) -> None:
    spec = fields.get("speculative_config")
    if spec:
        fields = {"speculative_config": {**spec, "model": tiny_checkpoint(spec["model"])}}
    with pytest.raises(NotBuiltError, match="recurrent states"):
        async with AsyncEngine(tiny_checkpoint("qwen3_5"), disable_log_stats=True, **fields):
            pass


@pytest.mark.parametrize("arch, fields", [("qwen3_5", {}), ("nemotron_h", {"enable_expert_parallel": True})])
async def test_two_tensor_parallel_ranks_equal_transformers(arch: str, fields: dict) -> None:
    """The full-attention layers split by heads, the linear ones computed whole on each rank (their states too);
    Nemotron 3's experts four to a rank, its shared MLP split."""
    path, prompts = tiny_checkpoint(arch), _prompts(3, seed=6)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    async with AsyncEngine(path, disable_log_stats=True, tensor_parallel_size=2, max_num_batched_tokens=16,
                           **fields) as engine:
        outs = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
    assert [o.token_ids for o in outs] == [hf_greedy(path, p, MAX_TOKENS, eos_token_id=None) for p in prompts]
