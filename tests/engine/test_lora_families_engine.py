"""LoRA adapters through the engine on DBRX (its fused ``Wqkv`` and ``out_proj``), Kimi-Linear (its KDA layers' and
latent attention's projections, dense MLP, shared experts and experts) and Zamba2 (its shared blocks' projections,
per invocation): two adapters batched with the base model over two tensor-parallel ranks, each request PEFT's greedy
tokens; adapters on what these models cannot adapt are the request's error, by name. Their logits in process:
tests/unit/test_lora_models.py, the host's refusals: tests/unit/test_lora_families.py."""

from __future__ import annotations

import asyncio

import pytest

from asyncllm import AsyncEngine, InvalidRequestError, LoRARequest, SamplingParams
from asyncllm.tiny import tiny_checkpoint
from engine_helpers import token_prompts
from hf_reference import hf_greedy
from lora_utils import EXPERTS, make_adapter, peft_greedy

MAX_TOKENS = 12
PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
KIMI = (r".*\.(self_attn\.(q_proj|k_proj|v_proj|o_proj|forget_gate\.f_[ab]_proj|b_proj|g_[ab]_proj|"
        r"kv_a_proj_with_mqa|kv_b_proj)|mlp\.(shared_experts\.)?(gate|up|down)_proj)")
"""Every projection of Kimi-Linear's KDA and latent-attention layers, its dense MLP and its shared experts."""
ZAMBA2 = r".*shared_transformer\.(self_attn\.[qkvo]_proj|feed_forward\.(gate_up|down)_proj)"
"""Zamba2's shared blocks' projections, per hybrid layer (each invocation its own adapter, as PEFT builds them)."""


async def _batched_adapters_equal_peft(path: str, adapters: list[str], refused: dict[str, str],
                                       **engine_kwargs: object) -> None:
    """Each adapter of `adapters` and the base model on two prompts each, all at once, over two ranks: PEFT's
    tokens (transformers' for the base model), every adapter changing them; each adapter of `refused` (folder ->
    the error's pattern) the request's `InvalidRequestError`."""
    prompts = token_prompts(2 * (len(adapters) + 1), seed=5, max_len=40)
    loras = [None, *(LoRARequest(f"a{i}", i, folder) for i, folder in enumerate(adapters, start=1))]
    async with AsyncEngine(path, enable_lora=True, max_loras=2, tensor_parallel_size=2, max_num_batched_tokens=32,
                           max_model_len=96, disable_log_stats=True, **engine_kwargs) as engine:
        outs = await asyncio.gather(*(engine.generate(p, PARAMS, lora_request=loras[i % len(loras)])
                                      for i, p in enumerate(prompts)))
        for i, (folder, match) in enumerate(refused.items(), start=len(loras)):
            with pytest.raises(InvalidRequestError, match=match):
                await engine.generate(prompts[0], PARAMS, lora_request=LoRARequest(f"r{i}", i, folder))
        assert (await engine.generate(prompts[1], PARAMS, lora_request=loras[1])).token_ids == outs[1].token_ids
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        lora = loras[i % len(loras)]
        base = hf_greedy(path, prompt, MAX_TOKENS, eos_token_id=None)
        if lora is None:
            assert out.token_ids == base, i
        else:
            assert out.token_ids == peft_greedy(path, lora.lora_path, prompt, MAX_TOKENS, eos_token_id=None), i
            assert out.token_ids != base, i  # the adapter mattered


async def test_dbrx_fused_qkv_adapters_over_two_ranks(tmp_path) -> None:
    """``Wqkv``'s one A and q/k/v-stacked B split per part over the ranks, ``out_proj`` by columns of A; an adapter
    of the router or of the experts' fused ``w1`` (which PEFT cannot run on DBRX) is refused by name."""
    path = tiny_checkpoint("dbrx")
    both = make_adapter(path, str(tmp_path / "both"), seed=1, rank=8, alpha=16, targets=["Wqkv", "out_proj"])
    qkv = make_adapter(path, str(tmp_path / "qkv"), seed=2, rank=4, alpha=8, targets=["Wqkv"], use_rslora=True)
    router = make_adapter(path, str(tmp_path / "router"), seed=3, rank=4, targets=["layer"])
    experts = make_adapter(path, str(tmp_path / "experts"), seed=4, rank=4, targets=["out_proj"],
                           target_parameters=["ffn.experts.mlp.w1"])
    await _batched_adapters_equal_peft(path, [both, qkv], {router: "ffn.router.layer.*routers",
                                                           experts: r"ffn\.experts\.mlp\.w1"})


async def test_kimi_linear_adapters_over_two_ranks(tmp_path) -> None:
    """KDA layers' projections whole on each rank, latent attention's by heads (``kv_b_proj``'s through the absorbed
    expansions), experts split by rows; an adapter of DeepSeek-V3's low-rank query (Kimi's is full-rank) is
    refused by name."""
    path = tiny_checkpoint("kimi_linear")
    every = make_adapter(path, str(tmp_path / "every"), seed=5, rank=4, alpha=8, targets=KIMI,
                         target_parameters=EXPERTS)
    kda = make_adapter(path, str(tmp_path / "kda"), seed=6, rank=8, alpha=8,
                       targets=r".*layers\.[02]\.self_attn\.(q_proj|v_proj|forget_gate\.f_b_proj|g_a_proj|b_proj)")
    dense_name = make_adapter(tiny_checkpoint("deepseek_v3"), str(tmp_path / "v3"), seed=7, rank=4,
                              targets=r".*layers\.1\.self_attn\.q_b_proj")
    await _batched_adapters_equal_peft(path, [every, kda], {dense_name: "has no q_b_proj"},
                                       mamba_block_size=8, block_size=4)


async def test_zamba2_shared_block_adapters_over_two_ranks(tmp_path) -> None:
    """Each invocation of a shared block with its own adapter (block 0 at layers 1 and 4), the attention split by
    heads and the MLP by intermediate size; an adapter of a Mamba2 layer's ``in_proj`` is refused by name."""
    path = tiny_checkpoint("zamba2")
    every = make_adapter(path, str(tmp_path / "every"), seed=8, rank=4, alpha=8, targets=ZAMBA2)
    one = make_adapter(path, str(tmp_path / "one"), seed=9, rank=8, alpha=8,
                       targets=r".*layers\.4\.shared_transformer\.(self_attn\.[qv]_proj|feed_forward\.gate_up_proj)")
    mamba = make_adapter(path, str(tmp_path / "mamba"), seed=10, rank=4, targets=["in_proj"])
    await _batched_adapters_equal_peft(path, [every, one], {mamba: r"mamba\.in_proj"}, mamba_block_size=8,
                                       block_size=4)
