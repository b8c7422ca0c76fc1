"""The whole engine serving a pre-quantized block-wise fp8 checkpoint on the CPU (written here from the tiny
Llama: 16x16 weight blocks, so that its 16-row KV heads split over two ranks on whole blocks).

The reference is transformers' float32 model with the dequantized weights and per-token-group fake-quantized
activations (tests/fp8_checkpoint_reference.py, written apart from asyncllm's code): the engine computes the
same function, so its prompt logprobs stay within float32 rounding of it and its greedy tokens are the same.
At tensor_parallel_size=2 each rank holds whole blocks and its input columns are whole activation groups, so
two ranks compute the function of one, up to the order of float32 sums.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from engine_helpers import random_prompts
from fp8_checkpoint_reference import Fp8Reference, write_fp8_checkpoint
from hf_reference import assert_greedy_until_a_near_tie

from asyncllm import AsyncEngine, SamplingParams

BLOCK = (16, 16)
MAX_TOKENS = 10
PROMPTS = random_prompts(4, seed=11, max_len=40)
# |prompt logprob difference| over the prompts' positions, (max, mean) allowed. Measured on the CPU (2026-11-23):
# engine vs reference 2.4e-4 / 2.5e-6, two ranks vs one 1.0e-3 / 1.2e-5: float32 rounding, plus where a float32
# difference (the order of a sum) flipped one activation's fp8 rounding (docs/quantization.md has seen up to 0.03)
VS_REFERENCE = (0.05, 1e-4)
TP2_VS_TP1 = (0.05, 1e-4)
NEAR_TIE = 0.05
"""A greedy token may differ from the reference's only where the reference's top two logprobs are this close."""
_outputs: dict[int, tuple[list, list]] = {}
"""Engine outputs per tensor_parallel_size (one engine run each, shared by the tests)."""


@pytest.fixture(scope="module")
def fp8_checkpoint(tiny_llama: str, tmp_path_factory) -> tuple[str, Fp8Reference]:
    path = tmp_path_factory.mktemp("fp8") / "tiny-llama-fp8"
    tensors = write_fp8_checkpoint(tiny_llama, path, BLOCK)
    return str(path), Fp8Reference(tiny_llama, tensors, BLOCK)


async def _engine_outputs(path: str, tp: int) -> tuple[list, list]:
    if tp not in _outputs:
        scoring = SamplingParams(prompt_logprobs=0, max_tokens=1, temperature=0.0)
        greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        async with AsyncEngine(path, tensor_parallel_size=tp, disable_log_stats=True) as engine:
            scored = await asyncio.gather(*(engine.generate(p, scoring) for p in PROMPTS))
            generated = await asyncio.gather(*(engine.generate(p, greedy) for p in PROMPTS))
        _outputs[tp] = ([_prompt_logprobs(p, out) for p, out in zip(PROMPTS, scored)],
                        [out.token_ids for out in generated])
    return _outputs[tp]


def _prompt_logprobs(prompt: list[int], out) -> torch.Tensor:
    return torch.tensor([out.prompt_logprobs[i][prompt[i]].logprob for i in range(1, len(prompt))], dtype=torch.float64)


def _reference_logprobs(reference: Fp8Reference, prompt: list[int]) -> torch.Tensor:
    logprobs = torch.log_softmax(reference.logits(prompt).double(), -1)
    return logprobs[torch.arange(len(prompt) - 1), prompt[1:]]


async def test_prompt_logprobs_and_greedy_tokens_equal_the_reference(fp8_checkpoint) -> None:
    path, reference = fp8_checkpoint
    logprobs, tokens = await _engine_outputs(path, 1)
    errors = torch.cat([(got - _reference_logprobs(reference, p)).abs() for p, got in zip(PROMPTS, logprobs)])
    print(f"engine vs reference: max {float(errors.max()):.2g}, mean {float(errors.mean()):.2g}")
    assert float(errors.max()) < VS_REFERENCE[0] and float(errors.mean()) < VS_REFERENCE[1], errors
    for prompt, got in zip(PROMPTS, tokens):
        _check_greedy(reference, prompt, got)


def _check_greedy(reference: Fp8Reference, prompt: list[int], got: list[int]) -> None:
    """Equal to the reference's greedy tokens, or different first at one of its near-ties."""
    assert len(got) == MAX_TOKENS, got  # ignore_eos: every request runs to max_tokens
    assert_greedy_until_a_near_tie(reference.logits, prompt, reference.greedy(prompt, MAX_TOKENS), got, NEAR_TIE)


async def test_two_ranks_equal_one(fp8_checkpoint) -> None:
    path, _ = fp8_checkpoint
    logprobs_1, tokens_1 = await _engine_outputs(path, 1)
    logprobs_2, tokens_2 = await _engine_outputs(path, 2)
    assert tokens_2 == tokens_1
    errors = torch.cat([(a - b).abs() for a, b in zip(logprobs_1, logprobs_2)])
    print(f"two ranks vs one: max {float(errors.max()):.2g}, mean {float(errors.mean()):.2g}")
    assert float(errors.max()) < TP2_VS_TP1[0] and float(errors.mean()) < TP2_VS_TP1[1], errors


STATIC_INPUT_SCALES = {"q_proj": 2 / 448, "k_proj": 4 / 448, "v_proj": 3 / 448, "o_proj": 4 / 448,
                       "gate_proj": 3 / 448, "up_proj": 3 / 448, "down_proj": 16 / 448}
"""AutoFP8-style static activation scales for the tiny Qwen3-MoE (its experts' inputs reach 3.5 to 4.2, their
activations 12 to 16: some saturate)."""


@pytest.mark.parametrize("fields, block, input_scales", [
    ({}, BLOCK, None), ({"tensor_parallel_size": 2}, BLOCK, None),
    ({"tensor_parallel_size": 2, "enable_expert_parallel": True}, BLOCK, None),
    ({"tensor_parallel_size": 2}, None, STATIC_INPUT_SCALES),
], ids=["one-rank", "intermediate-split", "expert-parallel", "per-tensor-static-split"])
async def test_fp8_experts_serve_the_reference_on_one_and_two_ranks(tmp_path_factory, fields, block,
                                                                    input_scales) -> None:
    """Qwen3-MoE with block-fp8 experts: two ranks split each expert's intermediate rows on whole blocks (their
    scales with them), or hold half the experts each; per-tensor fp8 experts with static activation scales (AutoFP8's)
    split over two ranks; greedy tokens equal the reference's (or differ at a near-tie)."""
    from asyncllm.tiny import tiny_checkpoint

    src = tiny_checkpoint("qwen3_moe")
    path = tmp_path_factory.mktemp("fp8_moe") / "qwen3-moe-fp8"
    tensors = write_fp8_checkpoint(src, path, block, ("lm_head",), input_scales=input_scales)
    reference = Fp8Reference(src, tensors, block)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    async with AsyncEngine(str(path), disable_log_stats=True, max_num_batched_tokens=24, **fields) as engine:
        outs = await asyncio.gather(*(engine.generate(p, greedy) for p in PROMPTS[:3]))
    for prompt, out in zip(PROMPTS[:3], outs):
        _check_greedy(reference, prompt, out.token_ids)
