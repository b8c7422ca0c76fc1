"""The whole engine with quantization="fp8" (online fp8 weights, per-token fp8 activations) on the CPU.

Two references:
- transformers' float32 model with fake-quantized weights and activations as docs/quantization.md
  describes them (tests/fp8_reference.py, written apart from asyncllm's code): the engine computes the
  same function, so its prompt logprobs stay within float32 rounding of it (plus the odd fp8 rounding
  flip) and its greedy tokens are the same, token for token, until a near-tie of the reference;
- transformers' plain float32 model: the prompt logprobs stay within a measured distance of it.
Tensor parallelism (2 gloo ranks) quantizes each rank's shard with its own scales: the reference
emulates those, and the engine's tokens still equal it. The measured numbers are in docs/quantization.md.
"""

from __future__ import annotations

import asyncio
import functools
import json
import shutil

import pytest
import torch

from asyncllm import AsyncEngine, SamplingParams
from asyncllm.bundled import bundled_model_path
from asyncllm.errors import NotBuiltError
from engine_helpers import CODE_PROMPTS, random_prompts
from fp8_reference import fp8_hf_greedy, fp8_hf_logits
from hf_reference import hf_logits

PROMPTS = CODE_PROMPTS
MAX_TOKENS = 16
# |engine prompt logprob - reference| over the prompts' 132 positions, (max, mean) allowed. Measured on the CPU
# (2026-11-23): vs transformers float32 0.30 / 0.036 (the unquantized engine: 2.3e-6 / 4.7e-7); vs the fp8
# fake-quant reference 5.5e-5 / 1.2e-6.
VS_FLOAT32 = (0.6, 0.07)
VS_REFERENCE = (0.05, 1e-3)
NEAR_TIE = 0.05
"""A greedy token may differ from the fp8 reference's only where the reference's top two logprobs are this close
(one fp8 rounding that flips on a float32 rounding difference moves a logprob by up to ~0.03)."""


@functools.lru_cache(maxsize=None)
def _prompts() -> tuple[tuple[int, ...], ...]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(bundled_model_path())
    return tuple(tuple(tokenizer(text)["input_ids"]) for text in PROMPTS)


def _errors(path: str, prompt: list[int], scored, logits_fn) -> torch.Tensor:
    expected = torch.log_softmax(logits_fn(path, prompt).double(), -1)
    got = torch.tensor([scored.prompt_logprobs[i][prompt[i]].logprob for i in range(1, len(prompt))])
    return (got.double() - expected[torch.arange(len(prompt) - 1), prompt[1:]]).abs()


def _check_greedy(path: str, prompt: list[int], got: list[int], tp_size: int = 1, adapter: str | None = None) -> None:
    """Equal to the fp8 reference's greedy tokens, or different first at one of its near-ties."""
    reference = fp8_hf_greedy(path, prompt, len(got), tp_size, adapter)
    first_diff = next((i for i, (a, b) in enumerate(zip(reference, got)) if a != b), None)
    if first_diff is None:
        return
    logits = fp8_hf_logits(path, prompt + reference[:first_diff], tp_size, adapter)[-1]
    top2 = torch.log_softmax(logits.double(), -1).topk(2).values
    margin = float(top2[0] - top2[1])
    assert margin < NEAR_TIE, (first_diff, margin, reference, got)


async def test_fp8_logprobs_and_greedy_tokens_match_the_fake_quant_reference() -> None:
    path = bundled_model_path()
    prompts = [list(p) for p in _prompts()]
    scoring = SamplingParams(prompt_logprobs=0, max_tokens=1, temperature=0.0)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    async with AsyncEngine(path, quantization="fp8", disable_log_stats=True) as engine:
        scored = await asyncio.gather(*(engine.generate(p, scoring) for p in prompts))
        generated = await asyncio.gather(*(engine.generate(p, greedy) for p in prompts))
    vs_float32 = torch.cat([_errors(path, p, out, hf_logits) for p, out in zip(prompts, scored)])
    vs_reference = torch.cat([_errors(path, p, out, fp8_hf_logits) for p, out in zip(prompts, scored)])
    assert 0.05 < float(vs_float32.max()) < VS_FLOAT32[0], vs_float32.max()  # it does round: far above 2.3e-6
    assert float(vs_float32.mean()) < VS_FLOAT32[1], vs_float32.mean()
    assert float(vs_reference.max()) < VS_REFERENCE[0], vs_reference.max()
    assert float(vs_reference.mean()) < VS_REFERENCE[1], vs_reference.mean()
    for prompt, out in zip(prompts, generated):
        assert len(out.token_ids) == MAX_TOKENS
        _check_greedy(path, prompt, out.token_ids)


async def test_fp8_tensor_parallel_quantizes_each_rank_shard(tiny_llama: str) -> None:
    prompts = random_prompts(6, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, prompt_logprobs=0)
    async with AsyncEngine(tiny_llama, quantization="fp8", tensor_parallel_size=2, disable_log_stats=True,
                           max_num_batched_tokens=48) as engine:
        outs = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
    errors = torch.cat([_errors(tiny_llama, p, out, functools.partial(fp8_hf_logits, tp_size=2))
                        for p, out in zip(prompts, outs)])
    assert float(errors.max()) < VS_REFERENCE[0] and float(errors.mean()) < VS_REFERENCE[1], errors
    # the single-rank emulation is another function: the engine's ranks really used their own scales
    single = torch.cat([_errors(tiny_llama, p, out, fp8_hf_logits) for p, out in zip(prompts, outs)])
    assert float(single.max()) > 10 * float(errors.max())
    for prompt, out in zip(prompts, outs):
        _check_greedy(tiny_llama, prompt, out.token_ids, tp_size=2)


async def test_lora_adapters_on_fp8_layers(tiny_llama: str, tmp_path) -> None:
    """The adapter's product (from the unquantized input, in float32) adds to the fp8 projections' outputs: the
    same tokens as PEFT over the fp8 reference's base layers, with and without the adapter in one batch."""
    from asyncllm.lora import LoRARequest
    from lora_utils import make_adapter

    adapter = make_adapter(tiny_llama, str(tmp_path / "adapter"), seed=1)
    prompts = random_prompts(4, seed=6)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    lora = LoRARequest("a", 1, adapter)
    async with AsyncEngine(tiny_llama, quantization="fp8", enable_lora=True, disable_log_stats=True) as engine:
        outs = await asyncio.gather(*(engine.generate(p, params, lora_request=lora if i % 2 else None)
                                      for i, p in enumerate(prompts)))
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        _check_greedy(tiny_llama, prompt, out.token_ids, adapter=adapter if i % 2 else None)
    assert any(out.token_ids != fp8_hf_greedy(tiny_llama, p, 10) for p, out in list(zip(prompts, outs))[1::2])


async def test_fp8_with_dummy_weights_then_real_ones_by_update_and_by_a_push_after_sleep(tiny_llama: str) -> None:
    """An fp8 engine on dummy weights generates; update_weights then requantizes the checkpoint's float weights
    layer by layer (the fake-quant reference's tokens), and so does a state_dict pushed after a level-2 sleep."""
    from hf_reference import hf_state_dict

    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = random_prompts(3, seed=8)
    async with AsyncEngine(tiny_llama, quantization="fp8", load_format="dummy", enable_sleep_mode=True,
                           disable_log_stats=True) as engine:
        out = await engine.generate([5, 6, 7, 8], params)
        assert len(out.token_ids) == 8
        assert await engine.update_weights(tiny_llama) == 1
        for prompt, out in zip(prompts, await asyncio.gather(*(engine.generate(p, params) for p in prompts))):
            _check_greedy(tiny_llama, prompt, out.token_ids)
        await engine.sleep(level=2)
        await engine.wake_up(tags=["weights"])
        assert await engine.update_weights_from_tensors(hf_state_dict(tiny_llama)) == 2
        await engine.wake_up(tags=["kv_cache"])
        for prompt, out in zip(prompts, await asyncio.gather(*(engine.generate(p, params) for p in prompts))):
            _check_greedy(tiny_llama, prompt, out.token_ids)


async def test_a_pre_quantized_checkpoint_fails_the_start(tiny_llama: str, tmp_path) -> None:
    path = tmp_path / "bnb"
    shutil.copytree(tiny_llama, path)
    config_json = json.loads((path / "config.json").read_text())
    config_json["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (path / "config.json").write_text(json.dumps(config_json))
    engine = AsyncEngine(str(path), disable_log_stats=True)
    with pytest.raises(NotBuiltError, match="pre-quantized 'bitsandbytes' checkpoint"):
        await engine.start()
    await engine.aclose()


# ------------------------------------------------------------------ CUDA (skipped without a device)


@pytest.mark.parametrize("enforce_eager", [False, True])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
async def test_gpu_fp8_float32_matches_the_fake_quant_reference(enforce_eager: bool) -> None:
    """float32 on the GPU: torch._scaled_mm (capability >= 8.9) with the scales after a float32 product, inside
    CUDA graphs or eager; the same function as the CPU's, so the same reference and bounds hold."""
    path = bundled_model_path()
    prompts = [list(p) for p in _prompts()]
    scoring = SamplingParams(prompt_logprobs=0, max_tokens=1, temperature=0.0)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    async with AsyncEngine(path, quantization="fp8", device="cuda", dtype="float32", enforce_eager=enforce_eager,
                           num_gpu_blocks_override=512, disable_log_stats=True) as engine:
        scored = await asyncio.gather(*(engine.generate(p, scoring) for p in prompts))
        generated = await asyncio.gather(*(engine.generate(p, greedy) for p in prompts))
    vs_reference = torch.cat([_errors(path, p, out, fp8_hf_logits) for p, out in zip(prompts, scored)])
    assert float(vs_reference.max()) < VS_REFERENCE[0] and float(vs_reference.mean()) < VS_REFERENCE[1]
    for prompt, out in zip(prompts, generated):
        _check_greedy(path, prompt, out.token_ids)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
async def test_gpu_fp8_weights_leave_more_room_for_the_kv_cache(tiny_llama: str, tmp_path) -> None:
    """A Llama of ~0.5 B parameters with dummy bfloat16 weights: fp8 frees ~0.49 GB that the KV-cache
    profile (gpu_memory_utilization) hands to blocks."""
    path = tmp_path / "llama-0.5b"
    shutil.copytree(tiny_llama, path)
    config_json = json.loads((path / "config.json").read_text())
    shape = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=8, num_attention_heads=16,
                 num_key_value_heads=4, head_dim=128)
    (path / "config.json").write_text(json.dumps({**config_json, **shape}))
    for name in ("model.safetensors", "model.safetensors.index.json"):
        (path / name).unlink(missing_ok=True)
    blocks = {}
    for quantization in (None, "fp8"):
        async with AsyncEngine(str(path), load_format="dummy", quantization=quantization, device="cuda",
                               dtype="bfloat16", gpu_memory_utilization=0.5, max_model_len=512, max_num_seqs=8,
                               max_num_batched_tokens=512, enforce_eager=True, disable_log_stats=True) as engine:
            out = await engine.generate([5, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
            assert len(out.token_ids) == 4
            blocks[quantization] = engine.stats().num_gpu_blocks
    linear_elements = 8 * (2048 * (2048 + 2 * 512) + 2048 * 2048 + 2 * 8192 * 2048 + 8192 * 2048)
    block_bytes = 8 * 2 * 16 * 4 * 128 * 2  # layers x K,V x tokens x KV heads x head_dim x bfloat16
    expected = linear_elements // block_bytes  # one byte saved per weight element
    assert blocks["fp8"] - blocks[None] > 0.8 * expected, (blocks, expected)
