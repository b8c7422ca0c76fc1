"""On a CUDA device (skipped without one): the whole engine's greedy tokens equal transformers'
for the tiny float32 checkpoints, on the triton backend (the GPU default) with CUDA graphs on
and off (``enforce_eager``), and on torch_sdpa (always eager).

Besides 12 prompts at once, rounds of 1, 3 and 17 requests whose max_tokens differ: the
decode batch shrinks as requests finish, so graphs are replayed padded (3 -> 4, 17 -> 24,
and every size in between) and at exact sizes. Live weight updates (docs/weight-updates.md) copy into the parameters the graphs
read, so the graphs stay exact after one.

The rounds hold near-ties: transformers' top two logits 8.3e-5 apart once for Qwen3, 5.1e-4 for Llama, where
float32 noise is about 1e-6 (the CPU engine against transformers there) but TF32 products (emulated) move them
by 1e-4 to 4e-3. So a divergence names transformers' lead at the first differing token and the settings that
turn TF32 on.
"""

from __future__ import annotations

import asyncio
import functools
import os
import random

import pytest
import torch
from hf_reference import greedy_divergence, hf_greedy

from asyncllm import AsyncEngine, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

MAX_TOKENS = 24
MODES = [
    pytest.param("triton", False, id="triton-graphs"),
    pytest.param("triton", True, id="triton-eager"),
    pytest.param("torch_sdpa", False, id="torch_sdpa"),  # graphs need triton: eager regardless
]


@functools.cache
def _expected(path: str, prompt: tuple[int, ...], max_tokens: int) -> list[int]:
    return hf_greedy(path, list(prompt), max_tokens)


def _tf32_settings() -> str:
    """What could turn this process's and the workers' float32 products into TF32 ones (their inputs cut to 10
    mantissa bits): the rounds hold near-ties that TF32 flips (docs/benchmarks.md, "The GPU tests fail")."""
    env = {name: os.environ.get(name) for name in ("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", "NVIDIA_TF32_OVERRIDE")}
    return f"float32 matmul precision {torch.get_float32_matmul_precision()!r}, {env}"


def _rounds() -> list[list[tuple[list[int], int]]]:
    """(prompt, max_tokens) per request: 12 at once, then rounds of 1, 3 and 17 finishing at different lengths."""
    rng = random.Random(0)

    def prompt() -> list[int]:
        return [rng.randrange(3, 500) for _ in range(rng.randint(3, 70))]

    rounds = [[(prompt(), MAX_TOKENS) for _ in range(12)]]
    for size in (1, 3, 17):
        rounds.append([(prompt(), rng.randint(2, MAX_TOKENS)) for _ in range(size)])
    return rounds


@pytest.mark.parametrize(("backend", "enforce_eager"), MODES)
@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen3"])
async def test_gpu_greedy_parity_fp32(request: pytest.FixtureRequest, fixture: str, backend: str,
                                      enforce_eager: bool) -> None:
    path = request.getfixturevalue(fixture)
    async with AsyncEngine(path, device="cuda", dtype="float32", attention_backend=backend,
                           enforce_eager=enforce_eager, max_num_seqs=32,  # graphs of 1, 2, 4, 8, 16, 24, 32
                           max_num_batched_tokens=64, num_gpu_blocks_override=1024,  # not 90% of the GPU
                           kv_cache_memory_bytes=1 << 28,  # no profile: test processes share the GPU
                           disable_log_stats=True) as engine:
        for requests in _rounds():
            outs = await asyncio.gather(*(
                engine.generate(p, SamplingParams(temperature=0.0, max_tokens=n)) for p, n in requests
            ))
            for (prompt, max_tokens), out in zip(requests, outs):
                expected = _expected(path, tuple(prompt), max_tokens)
                assert out.token_ids == expected, (f"{len(requests)} requests: a prompt of {len(prompt)} diverged at "
                                                   f"{greedy_divergence(path, prompt, expected, out.token_ids)}; "
                                                   f"{_tf32_settings()}")


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
async def test_gpu_weight_update_keeps_graphs_exact(tiny_llama: str, enforce_eager: bool) -> None:
    """`update_weights` copies into the parameters the captured decode graphs read: after it, graph replays give
    checkpoint B's tokens (a graph holding stale weights would still give A's)."""
    from asyncllm.tiny import tiny_checkpoint

    other = tiny_checkpoint("llama", seed=1)
    async with AsyncEngine(tiny_llama, device="cuda", dtype="float32", enforce_eager=enforce_eager, max_num_seqs=32,
                           max_num_batched_tokens=64, num_gpu_blocks_override=1024, kv_cache_memory_bytes=1 << 28,
                           disable_log_stats=True) as engine:
        for index, path in enumerate((tiny_llama, other, tiny_llama)):
            if index:
                assert await engine.update_weights(path) == index
            for requests in _rounds()[:2]:
                outs = await asyncio.gather(*(
                    engine.generate(p, SamplingParams(temperature=0.0, max_tokens=n)) for p, n in requests
                ))
                for (prompt, max_tokens), out in zip(requests, outs):
                    assert out.token_ids == _expected(path, tuple(prompt), max_tokens), f"weights of {path} diverged"


def _with_kv_scales(source: str, folder: "os.PathLike[str]", k_scale: float, v_scale: float) -> str:
    """A copy of the checkpoint ``source`` with calibrated fp8 KV-cache scales on every layer."""
    import json
    import shutil
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    shutil.copytree(source, folder)
    layers = json.loads((Path(folder) / "config.json").read_text())["num_hidden_layers"]
    [file] = Path(folder).glob("*.safetensors")
    tensors = load_file(file)
    for i in range(layers):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(k_scale)
        tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(v_scale)
    save_file(tensors, file)
    return str(folder)


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
async def test_gpu_weight_update_with_new_kv_scales_gives_a_fresh_engines_tokens(tiny_llama: str, tmp_path,
                                                                                 enforce_eager: bool) -> None:
    """fp8 KV cache: an update to a checkpoint whose calibrated k/v scales differ (the same weights) gives the
    tokens of an engine started on it. The scales are constants of the captured decode graphs, which the update
    captures again (workers/cuda_graphs.py `recapture_if_changed`); graphs replaying the old ones would attend
    over keys scaled by 16 and values by 8 against what the eager prefills wrote."""
    old = _with_kv_scales(tiny_llama, tmp_path / "old", 0.25, 0.25)
    new = _with_kv_scales(tiny_llama, tmp_path / "new", 4.0, 2.0)
    prompts = [prompt for prompt, _ in _rounds()[0][:4]]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    settings = dict(device="cuda", dtype="float32", kv_cache_dtype="fp8", enforce_eager=enforce_eager,
                    max_num_seqs=32, max_num_batched_tokens=64, num_gpu_blocks_override=1024,
                    kv_cache_memory_bytes=1 << 28, disable_log_stats=True)

    async def tokens(engine: AsyncEngine) -> list[list[int]]:  # one at a time: decode batches of one
        return [(await engine.generate(prompt, params)).token_ids for prompt in prompts]

    async with AsyncEngine(new, **settings) as engine:
        expected = await tokens(engine)
    async with AsyncEngine(old, **settings) as engine:
        await tokens(engine)  # the graphs replayed over the old scales first
        assert await engine.update_weights(new) == 1
        assert await tokens(engine) == expected
