"""The decoders that run a stage themselves (Gemma 4, Gemma 3n, Zamba2) through the engine over two pipeline
stages: greedy tokens equal transformers' (chunked prefill, a prefix-cache hit, micro-batches); Gemma 4 with
images (the tower on the first stage, the image rows attending both ways in the sliding layers of both stages). A
split that parts a KV-sharing layer from its cache's layer is refused before anything is spawned. The stages bit
for bit against the unsplit model: tests/unit/test_pipeline_parallel_own_stages.py."""

from __future__ import annotations

import asyncio

import pytest
from engine_helpers import assert_greedy_with_prefix_hit_equals_transformers, token_prompts
from hf_reference import hf_greedy

from asyncllm import AsyncEngine, ConfigError, SamplingParams
from asyncllm.tiny import tiny_checkpoint

_TYPES = ["sliding_attention", "full_attention"]
STAGED = {  # (checkpoint, ASYNCLLM_PP_LAYER_PARTITION: None for vLLM's split)
    "gemma4": (dict(num_hidden_layers=6, layer_types=_TYPES * 3), "2,4"),  # 4, 5 share 2's and 3's caches
    "gemma3n": (dict(num_kv_shared_layers=1), "1,3"),  # 3 shares 1's cache
    "zamba2": ({}, None),  # 3 + 2: block 0 invoked on both stages
}
ENGINE = dict(pipeline_parallel_size=2, max_num_batched_tokens=16, block_size=4, max_model_len=96)


@pytest.mark.parametrize("arch", sorted(STAGED))
async def test_two_stages_equal_transformers_with_a_prefix_hit(arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    overrides, partition = STAGED[arch]
    if partition is not None:
        monkeypatch.setenv("ASYNCLLM_PP_LAYER_PARTITION", partition)
    path = tiny_checkpoint(arch, **overrides)
    extra = dict(mamba_block_size=8) if arch == "zamba2" else {}
    prompts, greedy = token_prompts(4, seed=2), SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    async with AsyncEngine(path, disable_log_stats=True, max_num_seqs=4, **ENGINE, **extra) as engine:
        await assert_greedy_with_prefix_hit_equals_transformers(engine, path, seed=len(arch))
        outs = await asyncio.gather(*(engine.generate(p, greedy) for p in prompts))  # four at once: micro-batches
    assert [o.token_ids for o in outs] == [hf_greedy(path, p, 8, eos_token_id=None) for p in prompts]


async def test_gemma4_images_run_in_stages(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The image-text checkpoint with a decoder whose layer 3 shares layer 1's cache, split 1 + 3: the first stage
    encodes the images and makes the per-layer inputs (the image rows take the pad token's), the second attends
    over them; a text prompt beside."""
    from gemma4_mm_utils import IMAGE, hf_gemma4_greedy, make_tiny_gemma4_mm
    from mm_utils import make_image

    monkeypatch.setenv("ASYNCLLM_PP_LAYER_PARTITION", "1,3")
    path = make_tiny_gemma4_mm(tmp_path / "gemma4", num_kv_shared_layers=1)
    images = [make_image(40, 28, seed=1), make_image(20, 52, seed=2)]
    text = f"look at {IMAGE} and then at {IMAGE} what are they"
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    async with AsyncEngine(path, pipeline_parallel_size=2, disable_log_stats=True, block_size=4,
                           max_num_batched_tokens=80, max_num_seqs=4) as engine:
        outs = await asyncio.gather(engine.generate({"prompt": text, "images": images}, greedy),
                                    engine.generate("only words here", greedy))
    assert outs[0].outputs[0].token_ids == hf_gemma4_greedy(path, text, images, 8)[1]
    assert outs[1].outputs[0].token_ids == hf_gemma4_greedy(path, "only words here", [], 8)[1]


async def test_the_default_split_of_the_tiny_gemma4_is_refused_before_anything_starts() -> None:
    """4 layers, the last two sharing the first two's caches: no split keeps them together."""
    with pytest.raises(ConfigError, match="ASYNCLLM_PP_LAYER_PARTITION") as info:
        async with AsyncEngine(tiny_checkpoint("gemma4"), pipeline_parallel_size=2, disable_log_stats=True):
            pass
    assert "layer 2 reads layer 0's" in str(info.value)
