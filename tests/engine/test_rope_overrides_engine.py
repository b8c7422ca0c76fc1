"""hf_overrides' rope_theta and rope_scaling (vLLM's way to change RoPE) reach the rotary table: greedy output
equals transformers' with the same rope_parameters."""

from __future__ import annotations

from asyncllm import AsyncEngine, SamplingParams
from asyncllm.tiny import tiny_checkpoint
from hf_reference import model_greedy

PROMPT = list(range(10, 60))
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _hf_with_rope(path: str, rope_parameters: dict) -> list[int]:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    config.rope_parameters = rope_parameters
    model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch.float32).eval()
    return model_greedy(model, PROMPT, GREEDY.max_tokens)


async def test_rope_theta_and_linear_scaling_overrides_match_transformers() -> None:
    path = tiny_checkpoint("llama")
    overrides = {"rope_theta": 1e6, "rope_scaling": {"rope_type": "linear", "factor": 4.0}}
    async with AsyncEngine(path, disable_log_stats=True, max_num_seqs=2, max_model_len=128,
                           hf_overrides=overrides) as engine:
        got = (await engine.generate(PROMPT, GREEDY)).outputs[0].token_ids
    expected = _hf_with_rope(path, {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6})
    assert got == expected  # the model's own rope gives other tokens: the sabotage check of the folding fails here
