"""On a CUDA device (skipped without one): sleep mode (docs/sleep-mode.md) frees GPU memory and takes it back,
and the decode graphs captured again at wake-up over the new weight and KV addresses give transformers' tokens
(graphs still replaying the freed addresses would give garbage or fault); and weights pushed from CUDA tensors
(`update_weights_from_tensors`) land in place under the graphs captured at start.

The free memory is read in this process (`torch.cuda.mem_get_info` is device-wide); the KV cache is sized to
~4 GiB so that what a sleep frees is far above the noise of other allocations.
"""

from __future__ import annotations

import pytest
import torch

from asyncllm import AsyncEngine, SamplingParams
from hf_reference import hf_greedy

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PROMPTS = [[5, 6, 7, 8], list(range(3, 40))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24)
_GIB = 2**30


def _free() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


async def _tokens(engine: AsyncEngine) -> list[list[int]]:
    return [(await engine.generate(prompt, GREEDY)).token_ids for prompt in PROMPTS]


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
async def test_gpu_sleep_frees_memory_and_wakes_up_exact(tiny_llama: str, enforce_eager: bool) -> None:
    from asyncllm.tiny import tiny_checkpoint

    other = tiny_checkpoint("llama", seed=1)
    expected = [hf_greedy(tiny_llama, prompt, GREEDY.max_tokens) for prompt in PROMPTS]
    blocks = 4 * _GIB // (2 * 2 * 16 * 2 * 16 * 4)  # tiny llama, fp32: 2 layers x K,V x 16 tokens x 2 heads x 16
    async with AsyncEngine(tiny_llama, device="cuda", dtype="float32", enforce_eager=enforce_eager, max_num_seqs=32,
                           max_num_batched_tokens=64, num_gpu_blocks_override=blocks, enable_sleep_mode=True,
                           kv_cache_memory_bytes=1 << 28,  # no profile: test processes share the GPU
                           disable_log_stats=True) as engine:
        assert await _tokens(engine) == expected
        awake = _free()
        await engine.sleep(level=1)
        freed = _free() - awake
        assert freed > 1 * _GIB, f"sleep(1) freed {freed / _GIB:.2f} GiB"
        await engine.wake_up()
        assert _free() < awake + _GIB / 4  # taken back
        assert await _tokens(engine) == expected  # graphs recaptured over the new addresses
        await engine.sleep(level=2)
        await engine.wake_up(tags=["weights"])
        await engine.update_weights(other)
        await engine.wake_up(tags=["kv_cache"])
        assert await _tokens(engine) == [hf_greedy(other, prompt, GREEDY.max_tokens) for prompt in PROMPTS]


async def test_gpu_tensors_pushed_in_place_keep_the_decode_graphs_exact(tiny_llama: str) -> None:
    """`update_weights_from_tensors` with CUDA tensors (the host copies them into shared memory, each rank into
    its parameters in place): the decode graphs captured at start replay over the same addresses, now holding
    the pushed weights, so the tokens are the new checkpoint's."""
    from asyncllm.tiny import tiny_checkpoint
    from hf_reference import hf_state_dict

    other = tiny_checkpoint("llama", seed=1)
    async with AsyncEngine(tiny_llama, device="cuda", dtype="float32", max_num_seqs=8, max_num_batched_tokens=64,
                           kv_cache_memory_bytes=1 << 28, disable_log_stats=True) as engine:
        assert await _tokens(engine) == [hf_greedy(tiny_llama, prompt, GREEDY.max_tokens) for prompt in PROMPTS]
        pushed = {name: tensor.cuda() for name, tensor in hf_state_dict(other).items()}
        assert await engine.update_weights_from_tensors(pushed) == 1
        assert await _tokens(engine) == [hf_greedy(other, prompt, GREEDY.max_tokens) for prompt in PROMPTS]
