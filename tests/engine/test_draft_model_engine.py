"""Speculative decoding with a draft model, end to end: the drafts change how many steps a request takes, never
its tokens.

Two engines share the tests (module-scoped): the tiny Llama on two tensor-parallel ranks drafted by itself whole
on each rank (``draft_tensor_parallel_size=1``; every greedy draft must then be accepted, which catches a draft KV
cache or position out of step with the target) under chunked prefill, prefix-cache hits and swap preemption; and drafted by a different tiny Llama with the same vocabulary (most
drafts rejected) under recompute preemption. Greedy outputs equal transformers', seeded sampled outputs are
the same in both engines (the sampler seeds by position, so they are the tokens without drafts).
"""

from __future__ import annotations

import asyncio
import functools
import json
import shutil
from pathlib import Path

import pytest
import pytest_asyncio

from asyncllm import AsyncEngine, ConfigError, SamplingParams
from engine_helpers import random_prompts
from hf_reference import hf_greedy

MAX_TOKENS = 20
PREEMPTING = {"num_gpu_blocks_override": 8, "max_model_len": 128}


@functools.lru_cache(maxsize=None)
def _reference(path: str, prompt: tuple[int, ...]) -> list[int]:
    return hf_greedy(path, list(prompt), MAX_TOKENS)


def _perturbed_copy(src: str, dst: Path, scale: float) -> str:
    """The checkpoint with noise added to every weight: another model with the same vocabulary (scale 0.01 against
    weights of std 0.2: about 40% of its greedy drafts are the target's tokens)."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    generator = torch.Generator().manual_seed(1)
    for file in dst.glob("*.safetensors"):
        tensors = load_file(file)
        noisy = {name: t + scale * torch.randn(t.shape, generator=generator).to(t.dtype) for name, t in tensors.items()}
        save_file(noisy, file, metadata={"format": "pt"})
    return str(dst)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engines(tiny_llama: str, tmp_path_factory: pytest.TempPathFactory):
    other_llama = _perturbed_copy(tiny_llama, tmp_path_factory.mktemp("draft") / "other", 0.01)
    same = {"model": tiny_llama, "num_speculative_tokens": 3, "draft_tensor_parallel_size": 1}
    other = {"method": "draft_model", "model": other_llama, "num_speculative_tokens": 2}
    pair = (AsyncEngine(tiny_llama, disable_log_stats=True, speculative_config=same, max_num_batched_tokens=24,
                        preemption_mode="swap", swap_space=0.001, tensor_parallel_size=2, **PREEMPTING),
            AsyncEngine(tiny_llama, disable_log_stats=True, speculative_config=other, **PREEMPTING))
    try:
        await asyncio.gather(*(engine.start() for engine in pair))  # the two starts overlap
        yield pair
    finally:
        await asyncio.gather(*(engine.aclose() for engine in pair))


def _prompts() -> list[list[int]]:
    prompts = random_prompts(8, seed=5, stem_len=20, max_len=60)  # every other one shares a 20-token stem
    return prompts + prompts[1:3]  # again: prefix-cache hits on whole blocks


@pytest.mark.asyncio(loop_scope="module")
async def test_greedy_outputs_equal_transformers_and_a_self_draft_is_always_accepted(engines, tiny_llama) -> None:
    prompts = _prompts()
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    rates = []
    for engine in engines:
        outs = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
        for prompt, out in zip(prompts, outs):
            assert out.token_ids == _reference(tiny_llama, tuple(prompt)), f"prompt of {len(prompt)} tokens diverged"
        stats = engine.stats()
        assert stats.num_preemptions_total > 0 and stats.prefix_cache_hits > 0
        assert stats.spec_decode_num_drafts > 0 and sum(stats.spec_decode_accepted_per_pos) == \
            stats.spec_decode_num_accepted_tokens
        rates.append(stats.spec_decode_acceptance_rate)
    assert rates[0] == 1.0, "the target drafted by itself: every greedy draft is its own next token"
    assert 0.0 < rates[1] < 1.0, "another model's drafts: some accepted, some rejected (outputs still transformers')"


@pytest.mark.asyncio(loop_scope="module")
async def test_seeded_sampling_gives_the_same_tokens_whatever_the_draft(engines) -> None:
    prompts = _prompts()[:6]
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=i, max_tokens=MAX_TOKENS, ignore_eos=True)
              for i in range(len(prompts))]
    outs = [await asyncio.gather(*(e.generate(p, sp) for p, sp in zip(prompts, params))) for e in engines]
    assert [o.token_ids for o in outs[0]] == [o.token_ids for o in outs[1]]
    assert engines[0].stats().spec_decode_acceptance_rate < 1.0  # sampled tokens reject some greedy drafts


async def test_a_draft_with_another_vocabulary_is_refused_at_start(tiny_llama, tmp_path) -> None:
    draft = shutil.copytree(tiny_llama, tmp_path / "draft")
    config = json.loads((draft / "config.json").read_text())
    target_vocab, config["vocab_size"] = config["vocab_size"], config["vocab_size"] + 64
    (draft / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="speculative_config") as info:
        async with AsyncEngine(tiny_llama, speculative_config={"model": str(draft), "num_speculative_tokens": 2}):
            pass
    assert f"vocab_size={target_vocab + 64}" in str(info.value) and f"the target {target_vocab}" in str(info.value)


async def test_a_draft_with_a_shorter_position_table_drafts_below_it_and_runs_past_it() -> None:
    """A GPT-2 draft whose learned positions end at 64 under a target of max_model_len 128: requests past 64
    tokens get no drafts and their tokens equal transformers' (the draft's forward indexed past its table: the
    worker failed and the engine died)."""
    from asyncllm.tiny import tiny_checkpoint

    target, draft = tiny_checkpoint("llama"), tiny_checkpoint("gpt2", max_position_embeddings=64)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = [[(7 * i) % 500 + 3 for i in range(n)] for n in (30, 50, 90)]
    async with AsyncEngine(target, disable_log_stats=True, max_model_len=128,
                           speculative_config={"model": draft, "num_speculative_tokens": 3}) as engine:
        assert engine.config.speculative_config["max_model_len"] == 64
        outs = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
        assert [o.token_ids for o in outs] == [_reference(target, tuple(p)) for p in prompts]
        assert engine.stats().spec_decode_num_drafts > 0
