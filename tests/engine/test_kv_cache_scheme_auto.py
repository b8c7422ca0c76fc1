"""``kv_cache_dtype="auto"`` over a checkpoint that declares an fp8 KV cache (llm-compressor's compressed-tensors
``quantization_config.kv_cache_scheme``): the cache is fp8 with the checkpoint's calibrated ``k_scale`` / ``v_scale``,
as vLLM's (its ``Attention`` sets ``cache_dtype = "fp8"`` for such a checkpoint); until 2026-12-08 asyncllm kept a
cache of the model dtype and dropped the scales (the same tokens, a quarter of the blocks in float32). The resolution
itself (ModelOpt's ``kv_cache_quant_algo``, an explicit value winning): tests/unit/test_fp8_kv_cache.py."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch
from compressed_tensors_reference import FP8_DYNAMIC, write_ct_checkpoint
from engine_helpers import random_prompts
from safetensors.torch import load_file, save_file

from asyncllm import AsyncEngine, SamplingParams

KV_CACHE_SCHEME = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
"""What llm-compressor writes for ``kv_cache_scheme`` (its FP8 KV-cache recipe)."""
PROMPTS = random_prompts(3, seed=5, max_len=24)


@pytest.fixture(scope="module")
def kv_scheme_checkpoint(tiny_llama: str, tmp_path_factory) -> str:
    """The tiny Llama as FP8_DYNAMIC with an fp8 ``kv_cache_scheme`` and each layer's ``k_scale`` / ``v_scale``."""
    path = write_ct_checkpoint(tiny_llama, tmp_path_factory.mktemp("ct") / "tiny-llama-fp8-kv",
                               {"group_0": FP8_DYNAMIC})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["kv_cache_scheme"] = KV_CACHE_SCHEME
    (path / "config.json").write_text(json.dumps(config))
    shard = next(Path(path).glob("*.safetensors"))
    weights = load_file(str(shard))
    for layer in range(config["num_hidden_layers"]):
        weights[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor(0.05 * (layer + 1))
        weights[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor(0.02 * (layer + 1))
    save_file(weights, str(shard), metadata={"format": "pt"})
    return str(path)


async def _serve(path: str, **fields) -> tuple[str, int, list[list[int]]]:
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    async with AsyncEngine(path, dtype="float32", max_model_len=64, disable_log_stats=True, **fields) as engine:
        outs = await asyncio.gather(*(engine.generate(list(p), greedy) for p in PROMPTS))
        return engine.config.cache_config.kv_cache_dtype, engine.stats().num_gpu_blocks, [o.token_ids for o in outs]


async def test_auto_is_the_checkpoints_fp8_cache(kv_scheme_checkpoint: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``auto`` serves the cache ``fp8`` serves (the config says fp8, the same blocks in the budget: a quarter of a
    float32 cache's bytes each, the profile step sized with the fp8 dtype), with the checkpoint's scales: the same
    greedy tokens as the explicit ``kv_cache_dtype="fp8"``."""
    monkeypatch.setenv("ASYNCLLM_CPU_KVCACHE_SPACE_GB", "0.001")
    auto_dtype, auto_blocks, auto_tokens = await _serve(kv_scheme_checkpoint)
    fp8_dtype, fp8_blocks, fp8_tokens = await _serve(kv_scheme_checkpoint, kv_cache_dtype="fp8")
    assert (auto_dtype, fp8_dtype) == ("fp8", "fp8")
    assert auto_blocks == fp8_blocks > 0
    assert auto_tokens == fp8_tokens


def test_the_bench_roofline_counts_the_resolved_cache(kv_scheme_checkpoint: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """`asyncllm bench`'s roofline reads the KV cache in the dtype the engine serves: under ``auto`` the fp8 cache the
    checkpoint declares, as ``--kv-cache-dtype fp8`` (until 2026-12-08 it counted float32 KV bytes, 4 a value)."""
    from types import SimpleNamespace

    from asyncllm.bench import common

    monkeypatch.setattr(common, "measure_copy_bandwidth", lambda device: 1e12)

    def line(kv_cache_dtype: str):
        args = SimpleNamespace(attention_backend=None, tensor_parallel_size=1, enable_expert_parallel=False,
                               kv_cache_dtype=kv_cache_dtype, quantization=None)
        ctx = SimpleNamespace(device=torch.device("cpu"), args=args, model=SimpleNamespace(path=kv_scheme_checkpoint),
                              dtype=torch.float32)
        return common.roofline(ctx, 8, 512.0)

    assert line("auto") == line("fp8")
