"""Mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE, GLM-4.5, Llama 4, Phi-3.5-MoE, DeepSeek-V2 / V3):
greedy output equals transformers', token for token, alone, chunked, preempted, and split
over two ranks by intermediate dim or by expert; LoRA adapters on their experts and attention equal PEFT's.
DeepSeek's latent cache swapped out and back, and its absorbed expansions after weight updates."""

from __future__ import annotations

import asyncio

import pytest
import torch

from asyncllm import AsyncEngine, SamplingParams
from asyncllm.errors import ConfigError
from asyncllm.tiny import tiny_checkpoint
from engine_helpers import greedy_equals_transformers, token_prompts
from hf_reference import hf_greedy

MAX_TOKENS = 16
MOE_ARCHS = ("glm4_moe", "llama4", "phimoe")
"""One engine start each, for routings of different kinds (grouped sigmoid with a correction bias, Llama 4's
sigmoid top-1 with a shared expert, Phi-3.5-MoE's sparsemixer; softmax top-k: Qwen3-MoE's below, Mixtral's the
same `SparseMoeBlock`). The other families' layers equal
transformers' in process (tests/unit/test_granite_olmo2_models.py, test_deepseek.py, test_llama4.py), and the
engine path they take is these ones'; Qwen2-MoE / Qwen3-MoE run through the engine below (chunked, preempted, on
two ranks)."""


def _prompts(count: int, seed: int) -> list[list[int]]:
    return token_prompts(count, seed)


async def _greedy_matches_hf(path: str, prompts: list[list[int]], **engine_kwargs: object) -> AsyncEngine:
    return await greedy_equals_transformers(path, prompts, MAX_TOKENS, **engine_kwargs)


@pytest.mark.parametrize("arch", MOE_ARCHS)
async def test_moe_greedy_equals_transformers(arch: str) -> None:
    await _greedy_matches_hf(tiny_checkpoint(arch), _prompts(8, seed=0))


async def test_moe_parity_chunked_and_preempted() -> None:
    """Dense and MoE layers mixed (Qwen3-MoE's mlp_only_layers), small chunks, recompute preemption."""
    path = tiny_checkpoint("qwen3_moe", mlp_only_layers=[1])
    engine = await _greedy_matches_hf(path, _prompts(8, seed=1), max_num_batched_tokens=16,
                                      num_gpu_blocks_override=10, max_model_len=96)
    assert engine.stats().num_preemptions_total > 0


@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3"])
async def test_deepseek_parity_chunked_preempted_and_from_the_prefix_cache(arch: str) -> None:
    """Latent attention expanded into the cache, dense then routed layers: small chunks, recompute preemption,
    then the same prompts again from the prefix cache."""
    path, prompts = tiny_checkpoint(arch), _prompts(8, seed=4)
    engine = await _greedy_matches_hf(path, prompts + prompts[:2], max_num_batched_tokens=16,
                                      num_gpu_blocks_override=12, max_model_len=96)
    assert engine.stats().num_preemptions_total > 0


async def test_deepseek_latent_cache_swapped_out_and_back_and_weight_updates_reach_the_absorbed_expansions() -> None:
    """Swap preemption copies the one-part latent cache out to the CPU and back: no token changes. Then, on the same
    engine: the latent cache's queries and outputs use ``kv_b_proj``'s matrices, absorbed and kept: an update of
    that projection alone (pushed from the host) or of the whole checkpoint (from disk) serves the new weights'
    tokens."""
    from hf_reference import hf_greedy_with, hf_state_dict

    a, b = tiny_checkpoint("deepseek_v3"), tiny_checkpoint("deepseek_v3", seed=1)
    prompts = _prompts(8, seed=6)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    async with AsyncEngine(a, disable_log_stats=True, max_num_batched_tokens=16, num_gpu_blocks_override=12,
                           max_model_len=96, preemption_mode="swap", swap_space=0.001) as engine:
        outs = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
        for prompt, out in zip(prompts, outs):
            assert out.token_ids == hf_greedy(a, prompt, MAX_TOKENS, eos_token_id=None), f"{len(prompt)} tokens"
        assert engine.stats().num_swapped_total > 0

        prompt = _prompts(1, seed=9)[0]
        name = "model.layers.1.self_attn.kv_b_proj.weight"
        bucket = [(name, hf_state_dict(b)[name])]
        await engine.update_weights_from_tensors(bucket)
        expected = hf_greedy_with(a, dict(bucket), prompt, MAX_TOKENS, eos_token_id=None)
        assert expected != hf_greedy(a, prompt, MAX_TOKENS, eos_token_id=None)
        assert (await engine.generate(prompt, params)).token_ids == expected
        await engine.update_weights(b)
        assert (await engine.generate(prompt, params)).token_ids == hf_greedy(b, prompt, MAX_TOKENS, eos_token_id=None)


@pytest.mark.parametrize("arch, expert_parallel", [("qwen2_moe", True), ("deepseek_v3", True)])  # split by rows: the
# LoRA test below (its base-model requests on Qwen3-MoE), test_gptq_experts_over_two_ranks
async def test_moe_tensor_and_expert_parallel(arch: str, expert_parallel: bool) -> None:
    await _greedy_matches_hf(tiny_checkpoint(arch), _prompts(5, seed=2), tensor_parallel_size=2,
                             enable_expert_parallel=expert_parallel)


async def test_expert_parallel_needs_experts(tiny_llama: str) -> None:
    with pytest.raises(ConfigError, match="enable_expert_parallel.*mixture-of-experts"):
        async with AsyncEngine(tiny_llama, enable_expert_parallel=True):
            pass


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["rows", "experts"])
async def test_lora_adapters_on_moe_experts_and_attention_equal_peft(expert_parallel: bool, tmp_path) -> None:
    """Two adapters batched with the base model on two ranks (the experts split by rows, or by experts): PEFT's
    ``target_parameters`` adapter of the stacked experts and the attention, and an experts-only one written per
    expert (vLLM's format, read as the same adapter): each request PEFT's tokens. An adapter naming the router is
    the request's error."""
    import json

    from safetensors.torch import save_file

    from asyncllm import InvalidRequestError, LoRARequest
    from lora_utils import make_expert_adapter, peft_greedy, per_expert_copy

    path = tiny_checkpoint("qwen3_moe")
    both = make_expert_adapter(path, str(tmp_path / "both"), seed=3, targets=["q_proj", "o_proj"])
    experts = make_expert_adapter(path, str(tmp_path / "experts"), seed=4, targets=[])
    per_expert = per_expert_copy(experts, str(tmp_path / "per_expert"), 64, 8, "mlp",
                                 ("gate_proj", "up_proj", "down_proj"))
    router = tmp_path / "router"
    router.mkdir()
    (router / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8, "peft_type": "LORA"}))
    save_file({"base_model.model.model.layers.0.mlp.gate.lora_A.weight": torch.zeros(4, 64),
               "base_model.model.model.layers.0.mlp.gate.lora_B.weight": torch.zeros(8, 4)},
              str(router / "adapter_model.safetensors"))
    prompts = _prompts(6, seed=9)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    loras = [None, LoRARequest("both", 1, both), LoRARequest("experts", 2, per_expert)]
    async with AsyncEngine(path, enable_lora=True, max_loras=2, tensor_parallel_size=2,
                           enable_expert_parallel=expert_parallel, disable_log_stats=True) as engine:
        outs = await asyncio.gather(*(engine.generate(p, params, lora_request=loras[i % 3])
                                      for i, p in enumerate(prompts)))
        with pytest.raises(InvalidRequestError, match="routers"):
            await engine.generate(prompts[0], params, lora_request=LoRARequest("router", 3, str(router)))
    references = [None, both, experts]
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        adapter = references[i % 3]
        expected = (peft_greedy(path, adapter, prompt, MAX_TOKENS, eos_token_id=None) if adapter
                    else hf_greedy(path, prompt, MAX_TOKENS, eos_token_id=None))
        assert out.token_ids == expected, i
    for i in (1, 2):  # each adapter mattered
        assert outs[i].token_ids != hf_greedy(path, prompts[i], MAX_TOKENS, eos_token_id=None)


async def test_a_step_without_adapters_after_an_expert_adapters_step(tmp_path) -> None:
    """An expert adapter's request, then a plain one, in turn: the plain steps take the experts' own kernel (the
    last adapter's step leaves nothing behind; a worker failure ends this engine); each request PEFT's / HF's tokens."""
    from asyncllm import LoRARequest
    from lora_utils import make_expert_adapter, peft_greedy

    path, prompt = tiny_checkpoint("qwen3_moe"), [7, 8, 9, 10, 11, 300]
    adapter = make_expert_adapter(path, str(tmp_path / "experts"), seed=3, targets=["q_proj"])
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    expected = [peft_greedy(path, adapter, prompt, 4, eos_token_id=None), hf_greedy(path, prompt, 4, eos_token_id=None)]
    assert expected[0] != expected[1]
    async with AsyncEngine(path, enable_lora=True, max_lora_rank=8, max_model_len=128, max_worker_restarts=0,
                           disable_log_stats=True) as engine:
        for lora in [LoRARequest("experts", 1, adapter), None] * 2:
            out = await engine.generate(prompt, params, lora_request=lora)
            assert out.token_ids == expected[lora is None]


@pytest.mark.parametrize("expert_parallel, desc_act", [(False, False), (True, False), (False, True)])
async def test_gptq_experts_over_two_ranks(tmp_path, expert_parallel: bool, desc_act: bool) -> None:
    """A GPTQ Qwen3-MoE over two ranks: each expert's staged gate and up split by columns and down by rows (or whole
    experts on their rank), dequantized at load: greedy tokens equal the dequantized reference's. Act-order
    (``desc_act``): each rank's down rows take their groups from its part of ``g_idx``, every group's scales kept."""
    from hf_reference import model_greedy
    from int4_reference import Int4Reference, write_int4_checkpoint

    src, path = tiny_checkpoint("qwen3_moe"), tmp_path / "gptq"
    reference = Int4Reference(src, write_int4_checkpoint(src, path, "gptq", 16, 4, desc_act))
    prompts = _prompts(3, seed=8)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    async with AsyncEngine(str(path), tensor_parallel_size=2, enable_expert_parallel=expert_parallel,
                           disable_log_stats=True) as engine:
        outs = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == model_greedy(reference.model, prompt, MAX_TOKENS, eos_token_id=None)
