"""Prompts given as embeddings on the families whose first layer takes more than the embedding table's rows:
transformers' ``get_input_embeddings()(ids)`` of a prompt gives that prompt's greedy tokens where the forward
scales them (Granite's ``embedding_multiplier``, Granite 4's, Falcon-H1's: workers/prompt_embeds.py scales the
rows by the model's ``scale_prompt_embeds``) and where the embedding module does (MiniCPM3, Gemma 4: rows that
come scaled are not scaled again); the models with per-layer inputs looked up by token id (Gemma 3n, Gemma 4 with
``hidden_size_per_layer_input``) refuse ``enable_prompt_embeds`` by name."""

from __future__ import annotations

import asyncio
import random

import pytest

from asyncllm import AsyncEngine, SamplingParams
from asyncllm.config import EngineConfig
from asyncllm.engine.prepare import prepare
from asyncllm.errors import NotBuiltError
from asyncllm.tiny import tiny_checkpoint
from hf_reference import hf_input_embeddings

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(length)] for length in (5, 19, 33)]


@pytest.mark.parametrize("arch, overrides", [
    ("granite", {}), ("granitemoehybrid", {}), ("falcon_h1", {}), ("minicpm3", {}),
    ("gemma4", {"hidden_size_per_layer_input": 0}),
], ids=["granite", "granitemoehybrid", "falcon_h1", "minicpm3", "gemma4-no-per-layer-inputs"])
async def test_a_prompts_input_embeddings_give_its_tokens(arch: str, overrides: dict) -> None:
    """Token and embedding prompts in the same chunked steps (16 tokens): each embedding prompt's tokens are its
    token prompt's (tiny Granite's multiplier is 12, Falcon-H1's 2: unscaled rows give other tokens)."""
    path = tiny_checkpoint(arch, **overrides)
    prompts = _prompts(seed=1)
    embedded = [{"prompt_embeds": hf_input_embeddings(path, ids)} for ids in prompts]
    async with AsyncEngine(path, enable_prompt_embeds=True, max_num_batched_tokens=16, max_model_len=128,
                           disable_log_stats=True) as engine:
        outs = await asyncio.gather(*(engine.generate(prompt, GREEDY) for prompt in [*prompts, *embedded]))
    tokens = [out.token_ids for out in outs]
    assert tokens[3:] == tokens[:3]


@pytest.mark.parametrize("arch, name", [("gemma4", "Gemma4ForCausalLM"), ("gemma3n", "Gemma3nForCausalLM")])
async def test_per_layer_input_models_refuse_the_option_by_name(arch: str, name: str) -> None:
    """Their per-layer inputs come from a second table by token id: an embedding prompt has only placeholder ids."""
    path = tiny_checkpoint(arch)
    words = f"prompts given as embeddings with {name} \\(its per-layer inputs are looked up by token id\\)"
    with pytest.raises(NotBuiltError, match=words) as info:
        prepare(EngineConfig.create(path, enable_prompt_embeds=True))
    assert info.value.field == "enable_prompt_embeds"
    with pytest.raises(NotBuiltError, match=words):
        async with AsyncEngine(path, enable_prompt_embeds=True, disable_log_stats=True):
            pass
    assert prepare(EngineConfig.create(path)).embeds_width is None
