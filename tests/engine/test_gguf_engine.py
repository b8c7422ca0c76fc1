"""The whole engine serving a GGUF file (the tiny Llama written as Q8_0 by tests/gguf_reference.py, the tokenizer
from the original folder as vLLM's docs advise), against transformers' model loaded from the same file; and a
Llama 3.1-style rope-scaled one (F32, rope_freqs.weight) against transformers' model of the original checkpoint;
and a quantized Gemma 2, Gemma 3 (text) and Phi-3 file against transformers' model of the same file."""

from __future__ import annotations

import asyncio

import pytest
from engine_helpers import random_prompts
from gguf import GGMLQuantizationType
from gguf_reference import LLAMA3_ROPE, with_rope_parameters, write_gguf
from hf_reference import hf_greedy

from asyncllm import AsyncEngine, SamplingParams

MAX_TOKENS = 10
FAMILIES = {  # arch -> (overrides giving the values transformers' GGUF reader assumes, stored type of 2-D weights)
    "gemma2": ({"query_pre_attn_scalar": 256, "attn_logit_softcapping": 50.0}, GGMLQuantizationType.Q8_0),
    "gemma3": ({"query_pre_attn_scalar": 256}, GGMLQuantizationType.Q4_0),
    "phi3": ({"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}, GGMLQuantizationType.Q8_0),
}
PROMPTS = random_prompts(4, seed=21, max_len=40)


@pytest.fixture(scope="module")
def gguf_llama(tiny_llama: str, tmp_path_factory) -> str:
    return write_gguf(tiny_llama, str(tmp_path_factory.mktemp("gguf") / "tiny-llama.Q8_0.gguf"))


async def test_greedy_tokens_equal_transformers_from_the_same_file(gguf_llama: str, tiny_llama: str) -> None:
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    async with AsyncEngine(gguf_llama, tokenizer=tiny_llama, quantization="gguf", disable_log_stats=True) as engine:
        outputs = await asyncio.gather(*(engine.generate(p, greedy) for p in PROMPTS))
    assert [out.token_ids for out in outputs] == [hf_greedy(gguf_llama, p, MAX_TOKENS) for p in PROMPTS]


async def test_llama3_rope_file_equals_the_original_checkpoint(tiny_llama: str, tmp_path) -> None:
    """The rope_freqs reach the workers (in the config JSON) and every position past 32 is rotated as in HF."""
    original = with_rope_parameters(tiny_llama, LLAMA3_ROPE, str(tmp_path / "llama3"))
    path = write_gguf(original, str(tmp_path / "llama3.gguf"), qtype=GGMLQuantizationType.F32)
    prompts = random_prompts(3, seed=0, max_len=60)  # 57, 33, 39 tokens
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    async with AsyncEngine(path, tokenizer=tiny_llama, disable_log_stats=True) as engine:
        outputs = await asyncio.gather(*(engine.generate(p, greedy) for p in prompts))
    assert [out.token_ids for out in outputs] == [hf_greedy(original, p, MAX_TOKENS) for p in prompts]


@pytest.mark.parametrize("arch", list(FAMILIES))
async def test_gemma_and_phi3_greedy_tokens_equal_transformers(arch: str, tmp_path) -> None:
    """Prompts past the sliding window (8): Gemma's sliding layers and softcapping, Phi-3's fused projections."""
    from asyncllm.tiny import tiny_checkpoint

    overrides, qtype = FAMILIES[arch]
    folder = tiny_checkpoint(arch, **overrides)
    path = write_gguf(folder, str(tmp_path / f"tiny-{arch}.{qtype.name}.gguf"), arch, qtype)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    async with AsyncEngine(path, tokenizer=folder, disable_log_stats=True) as engine:
        outputs = await asyncio.gather(*(engine.generate(p, greedy) for p in PROMPTS))
    assert [out.token_ids for out in outputs] == [hf_greedy(path, p, MAX_TOKENS) for p in PROMPTS]
