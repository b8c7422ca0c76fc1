"""Pipeline parallelism on a real engine (CPU, gloo): a 3-layer Llama split 2 + 1 over two stages (one worker
each). Greedy tokens equal transformers' under chunked prefill, a prefix-cache hit and preemption (by swap: each
stage copies its own layers' blocks out and back); the KV cache's block count is the first stage's (2 layers:
the minimum over the ranks), not the whole model's; embeddings come from the last stage; update_weights loads
each stage's own tensors, and sleep mode's RL cycle runs over the stages; a killed stage worker is replaced and its requests recomputed token-exact; micro-batches (two steps of
disjoint requests in flight) keep every token. The stages' parts and their
logits against the unsplit model: tests/unit/test_pipeline_parallel.py."""

from __future__ import annotations

import asyncio
import os
import random
import signal

import pytest
import pytest_asyncio
import torch

from asyncllm import AsyncEngine, InvalidRequestError, SamplingParams
from asyncllm.models.registry import KVCacheSpec
from asyncllm.tiny import tiny_checkpoint
from engine_helpers import assert_greedy_with_prefix_hit_equals_transformers, wait_idle
from hf_reference import hf_embeds_greedy, hf_greedy, hf_last_hidden_state, hf_state_dict
from proc_utils import worker_pids

pytestmark = pytest.mark.asyncio(loop_scope="module")

KV_SPACE_GB = 0.000107
"""ASYNCLLM_CPU_KVCACHE_SPACE_GB: 14 blocks of a 2-layer stage (8,192 bytes each), so requests get preempted."""
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _blocks(num_layers: int) -> int:
    """KV blocks of `num_layers` layers of the tiny model (2 KV heads of 16, float32) in KV_SPACE_GB."""
    return int(KV_SPACE_GB * 2**30) // KVCacheSpec(num_layers, 2, 16).bytes_per_block(16, torch.float32)


@pytest.fixture(scope="module")
def path() -> str:
    return tiny_checkpoint("llama", num_layers=3)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(path: str):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ASYNCLLM_CPU_KVCACHE_SPACE_GB", str(KV_SPACE_GB))  # read by the workers the core starts
        engine = AsyncEngine(path, pipeline_parallel_size=2, max_num_batched_tokens=16, max_model_len=128,
                             preemption_mode="swap", swap_space=0.001,  # each stage swaps its own layers' blocks
                             worker_step_timeout_s=20.0, enable_sleep_mode=True, enable_prompt_embeds=True,
                             disable_log_stats=True)
        async with engine:
            yield engine


async def test_greedy_equals_transformers_chunked_with_prefix_hits_and_preemption(engine: AsyncEngine,
                                                                                   path: str) -> None:
    await assert_greedy_with_prefix_hit_equals_transformers(engine, path, seed=3)
    rng = random.Random(4)
    prompts = [[rng.randrange(6, 500) for _ in range(rng.randint(5, 60))] for _ in range(8)]
    outs = await asyncio.gather(*(engine.generate(p, GREEDY) for p in prompts))
    stats = engine.stats()
    assert stats.num_preemptions_total > 0
    assert (stats.num_gpu_blocks, _blocks(3)) == (_blocks(2), 9)  # stage 0's 2 layers, not the model's 3
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(path, prompt, 24, eos_token_id=None), f"{len(prompt)} tokens"


async def test_micro_batches_split_the_requests_over_the_stages_and_keep_every_token(engine: AsyncEngine,
                                                                                    path: str) -> None:
    """Four requests decode two by two (a step holds half the seats: the stages run two steps at once), stage 0
    taking each step's sampled ids after it has gone on (workers/pipeline.py), and every token stays exact."""
    prompts = [list(range(20 + 7 * i, 32 + 7 * i)) for i in range(4)]
    steps_before = engine.stats().num_steps_total
    outs = await asyncio.gather(*(engine.generate(p, GREEDY) for p in prompts))
    assert [out.token_ids for out in outs] == [hf_greedy(path, p, 24, eos_token_id=None) for p in prompts]
    assert engine.stats().num_steps_total - steps_before >= 4 * 24 // 2  # at most two requests a step


async def test_a_prompt_given_as_embeddings_is_written_by_the_first_stage(engine: AsyncEngine, path: str) -> None:
    """``{"prompt_embeds": rows}`` over two stages, chunked beside a token prompt: the first stage writes the rows,
    the second takes its hidden states; tokens equal transformers' ``generate(inputs_embeds=...)``."""
    rows = torch.randn(20, 64, generator=torch.Generator().manual_seed(3)) * 0.5
    prompt = list(range(30, 50))
    embedded, tokens = await asyncio.gather(engine.generate({"prompt_embeds": rows}, GREEDY),
                                            engine.generate(prompt, GREEDY))
    assert embedded.token_ids == hf_embeds_greedy(path, rows, 24)
    assert tokens.token_ids == hf_greedy(path, prompt, 24, eos_token_id=None)


async def test_embeddings_come_from_the_last_stage(engine: AsyncEngine, path: str) -> None:
    prompt = list(range(40, 75))
    out = await engine.embed(prompt)
    want = torch.nn.functional.normalize(torch.tensor(hf_last_hidden_state(path, prompt)), dim=0)
    torch.testing.assert_close(torch.tensor(out.embedding), want, atol=1e-5, rtol=0)


async def test_update_weights_loads_each_stage_its_own_layers(engine: AsyncEngine, path: str) -> None:
    """Each stage checks the new checkpoint against its own parts and copies only their tensors; all ranks agree
    before any copies. A checkpoint of other shapes is refused by the stages and changes nothing."""
    prompt = list(range(30, 58))
    other = tiny_checkpoint("llama", num_layers=3, seed=1)
    version = engine.stats().weights_version
    assert await engine.update_weights(other) == version + 1
    assert (await engine.generate(prompt, GREEDY)).token_ids == hf_greedy(other, prompt, 24, eos_token_id=None)
    with pytest.raises(InvalidRequestError, match="num_hidden_layers"):
        await engine.update_weights(tiny_checkpoint("llama", num_layers=2))
    assert await engine.update_weights(path) == version + 2  # the module's later tests serve the first weights
    assert (await engine.generate(prompt, GREEDY)).token_ids == hf_greedy(path, prompt, 24, eos_token_id=None)


async def test_sleep_level_2_then_an_update_then_the_kv_cache(engine: AsyncEngine, path: str) -> None:
    """The RL cycle over two stages: each stage discards and takes back its own parameters and KV cache; the new
    weights come from a trainer's state_dict (`update_weights_from_tensors`)."""
    prompt = list(range(12, 40))
    other = tiny_checkpoint("llama", num_layers=3, seed=1)
    await engine.sleep(level=1)
    await engine.wake_up()
    assert (await engine.generate(prompt, GREEDY)).token_ids == hf_greedy(path, prompt, 24, eos_token_id=None)
    await engine.sleep(level=2)
    await engine.wake_up(tags=["weights"])
    version = await engine.update_weights_from_tensors(hf_state_dict(other))  # each stage writes its own parts
    assert engine.stats().awaiting_weights is False  # every stage's weights written
    await engine.wake_up(tags=["kv_cache"])
    assert (await engine.generate(prompt, GREEDY)).token_ids == hf_greedy(other, prompt, 24, eos_token_id=None)
    assert await engine.update_weights(path) == version + 1  # the module's later tests serve the first weights


async def test_a_killed_stage_worker_is_replaced_and_streams_stay_exact(engine: AsyncEngine, path: str) -> None:
    prompts = [list(range(10 + i, 40 + 3 * i)) for i in range(3)]
    tokens: list[list[int]] = [[] for _ in prompts]

    async def consume(index: int) -> None:
        async for delta in engine.stream(prompts[index], GREEDY):
            tokens[index] += delta.token_ids

    tasks = [asyncio.create_task(consume(i)) for i in range(len(prompts))]
    while min(len(t) for t in tokens) < 3:
        await asyncio.sleep(0.005)
    workers = worker_pids(engine._core.pid)
    assert len(workers) == 2
    os.kill(workers[1], signal.SIGKILL)  # stage 1: the one that samples
    await asyncio.wait_for(asyncio.gather(*tasks), 120)
    assert tokens == [hf_greedy(path, p, 24, eos_token_id=None) for p in prompts]
    assert set(worker_pids(engine._core.pid)).isdisjoint(workers)  # every rank restarted
    await wait_idle(engine)


async def test_three_stages_run_three_micro_batches_token_exact(path: str) -> None:
    """One layer per stage: the middle stage also goes on before its steps' ids arrive; up to three steps of
    disjoint requests are in flight."""
    rng = random.Random(7)
    prompts = [[rng.randrange(6, 500) for _ in range(rng.randint(3, 40))] for _ in range(6)]
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    async with AsyncEngine(path, pipeline_parallel_size=3, max_num_batched_tokens=64, max_model_len=128,
                           disable_log_stats=True) as engine:
        outs = await asyncio.gather(*(engine.generate(p, greedy) for p in prompts))
        assert engine.stats().num_steps_total >= 6 * 16 // 2  # at most ceil(6 / 3) requests a step
    assert [out.token_ids for out in outs] == [hf_greedy(path, p, 16, eos_token_id=None) for p in prompts]


async def test_two_replicas_of_two_stages_each_serve_token_exact(path: str) -> None:
    """data_parallel_size=2 x pipeline_parallel_size=2: two engine cores, each over its own two stages; both
    replicas serve and every token equals transformers'."""
    rng = random.Random(5)
    prompts = [[rng.randrange(6, 500) for _ in range(rng.randint(3, 40))] for _ in range(6)]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    async with AsyncEngine(path, data_parallel_size=2, pipeline_parallel_size=2, max_num_batched_tokens=64,
                           max_model_len=128, disable_log_stats=True) as engine:
        outs = await asyncio.gather(*(engine.generate(p, greedy) for p in prompts))
        assert all(replica.prompt_tokens_total > 0 for replica in engine.stats().replicas)
    assert [out.token_ids for out in outs] == [hf_greedy(path, p, 8, eos_token_id=None) for p in prompts]


async def test_a_hybrid_runs_in_stages_with_saved_states_preemption_and_micro_batches() -> None:
    """Qwen3.5 (4 layers: Gated DeltaNet, attention, twice) over two stages, each holding one of each: a prompt
    sharing a 37-token prefix with an earlier one resumes from the states each stage saved at token 32; then five
    requests at once in 16 blocks, preempted (recomputed) and decoding in micro-batches, every stage's state rows
    following the same seats. Every token equals transformers'."""
    path = tiny_checkpoint("qwen3_5", num_layers=4)
    rng = random.Random(11)
    shared = [rng.randrange(6, 512) for _ in range(37)]
    prompts = [shared + [5, 9, 13], shared + [21, 7]]
    prompts += [[rng.randrange(6, 512) for _ in range(rng.randint(3, 40))] for _ in range(5)]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    async with AsyncEngine(path, pipeline_parallel_size=2, disable_log_stats=True, max_num_batched_tokens=16,
                           max_num_seqs=4, num_gpu_blocks_override=16, block_size=4, max_model_len=64,
                           mamba_block_size=8, mamba_checkpoint_slots=4) as engine:
        outs = [await engine.generate(p, greedy) for p in prompts[:2]]
        outs += await asyncio.gather(*(engine.generate(p, greedy) for p in prompts[2:]))
        assert engine.stats().num_preemptions_total > 0
    assert outs[1].num_cached_tokens == 32
    assert [out.token_ids for out in outs] == [hf_greedy(path, p, 12, eos_token_id=None) for p in prompts]


async def test_images_run_in_stages_on_qwen3_5_qwen3_vl_and_gemma3(tmp_path) -> None:
    """Image-text models over two stages, the first encoding the images: Qwen3.5 (4 layers: Gated DeltaNet and
    attention twice; its M-RoPE positions on every stage) with an image split across chunks beside a text prompt,
    Qwen3-VL (4 layers, its deepstack rows joining the first two, on the first stage), and Gemma 3 (its images'
    rows attending both ways on every stage) with two images. Tokens equal transformers'."""
    from gemma3_mm_utils import BOI, hf_gemma3_greedy, make_tiny_gemma3_mm
    from mm_utils import items_altered, make_image
    from qwen_vl_utils import IMAGE_PLACEHOLDER, hf_qwen_vl_greedy, make_tiny_qwen_vl

    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    qwen = make_tiny_qwen_vl(tmp_path / "qwen3_5", version="3.5", num_layers=4)
    image = make_image(120, 90, seed=1)
    text = f"Describe {IMAGE_PLACEHOLDER} please"
    async with AsyncEngine(qwen, pipeline_parallel_size=2, disable_log_stats=True, block_size=4, max_model_len=128,
                           num_gpu_blocks_override=64, max_num_batched_tokens=24, max_num_seqs=4) as engine:
        outs = await asyncio.gather(engine.generate({"prompt": text, "images": [image]}, greedy),
                                    engine.generate("a text prompt beside it", greedy))
    assert outs[0].outputs[0].token_ids == hf_qwen_vl_greedy(qwen, text, [image], 8)[1]
    assert outs[1].outputs[0].token_ids == hf_qwen_vl_greedy(qwen, "a text prompt beside it", [], 8)[1]
    qwen3_vl = make_tiny_qwen_vl(tmp_path / "qwen3_vl", version="3", num_layers=4)
    async with AsyncEngine(qwen3_vl, pipeline_parallel_size=2, disable_log_stats=True, block_size=4, max_model_len=128,
                           num_gpu_blocks_override=64, max_num_batched_tokens=24) as engine:
        out = await engine.generate({"prompt": text, "images": [image]}, greedy)
    assert out.outputs[0].token_ids == hf_qwen_vl_greedy(qwen3_vl, text, [image], 8)[1]
    gemma = make_tiny_gemma3_mm(tmp_path / "gemma3")
    images = [make_image(100, 60, seed=7), make_image(50, 112, seed=8)]
    text = f"look at this\n{BOI} and then at {BOI}\nwhat are they"
    async with AsyncEngine(gemma, pipeline_parallel_size=2, disable_log_stats=True, block_size=4, max_model_len=128,
                           num_gpu_blocks_override=64, max_num_batched_tokens=20, enable_prefix_caching=False) as engine:
        out = await engine.generate({"prompt": text, "images": images}, greedy)
        await engine.generate({"prompt": text, "images": images}, greedy)  # its images from the encoder cache
        stats = engine.stats()  # the first stage's lookups (the step outputs come from the last stage)
        laid_short = make_image(70, 70, seed=9)
        with items_altered(engine):  # the first stage alone can tell: its report fails the request
            with pytest.raises(InvalidRequestError, match=r"mm_items\[0\]: its data encodes to (\d+) rows, not its"):
                await engine.generate({"prompt": f"see {BOI} now", "images": [laid_short]}, greedy)
        assert len((await engine.generate({"prompt": text, "images": images}, greedy)).outputs[0].token_ids) == 8
    assert out.outputs[0].token_ids == hf_gemma3_greedy(gemma, text, images, 8)[1]
    assert (stats.mm_encoder_cache_queries, stats.mm_encoder_cache_hits) == (4, 2)
