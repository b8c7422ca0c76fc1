"""Decoder classifiers of other families through the engine (the registry's `DECODER_CLASSIFIER_BASES`): a
``Gemma2ForSequenceClassification`` (Skywork-Reward-Gemma-2's architecture) and a hybrid's,
``JambaForSequenceClassification`` (Mamba layers' states: a hybrid's config), classify chunked prompts, one after a
prefix-cache hit where the model keeps them, equal to transformers' logits; generation and embeddings are refused
by name. Every family's logits in the runner: tests/unit/test_decoder_classifiers.py."""

from __future__ import annotations

import asyncio

import pytest

from asyncllm import AsyncEngine, InvalidRequestError
from asyncllm.tiny import tiny_checkpoint
from classifier_utils import hf_classifier_logits, tiny_classifier
from engine_helpers import random_prompts


@pytest.mark.parametrize("family", ["gemma2", "jamba"])
async def test_a_family_classifier_classifies_chunked_prompts_as_transformers(family: str, tmp_path) -> None:
    path = tiny_classifier(tiny_checkpoint(family), str(tmp_path / family), num_labels=2, seed=4)
    prompts = random_prompts(4, seed=11, stem_len=20, max_len=50)
    async with AsyncEngine(path, max_num_batched_tokens=16, disable_log_stats=True) as engine:
        assert engine.config.runner == "pooling"
        outs = await asyncio.gather(*(engine.classify(prompt) for prompt in prompts))
        again = await engine.classify(prompts[1])  # its 20-token stem is in the cache (Gemma 2's; Jamba: off)
        with pytest.raises(InvalidRequestError) as refused:
            await engine.generate(prompts[0])
        assert refused.value.field in ("prompt", "model")
        with pytest.raises(InvalidRequestError):
            await engine.embed(prompts[0])
    assert (again.num_cached_tokens >= 16) == (family == "gemma2")
    for prompt, out in zip([*prompts, prompts[1]], [*outs, again]):
        want = hf_classifier_logits(path, prompt)
        assert out.num_classes == 2 and max(abs(g - w) for g, w in zip(out.logits, want)) < 1e-5, (out.logits, want)
    assert len({round(out.logits[0], 4) for out in outs}) == len(outs)
