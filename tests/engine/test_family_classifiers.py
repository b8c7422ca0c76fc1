"""Decoder classifiers of other families through the engine (the registry's `DECODER_CLASSIFIER_BASES`): a
``Gemma2ForSequenceClassification`` (Skywork-Reward-Gemma-2's architecture) and a hybrid's,
``JambaForSequenceClassification`` (Mamba layers' states: a hybrid's config), classify chunked prompts, one after a
prefix-cache hit where the model keeps them, equal to transformers' logits; generation and embeddings are refused
by name; Gemma 2's over two tensor-parallel ranks with its causal LM's adapter equals PEFT's. Every family's logits
in the runner: tests/unit/test_decoder_classifiers.py."""

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


async def test_a_family_classifier_over_two_ranks_takes_its_causal_lms_adapter(tmp_path) -> None:
    """Gemma 2's classifier split over two tensor-parallel ranks, with and without an adapter trained on the Gemma 2
    causal LM: logits equal transformers' classifier (under PEFT with the adapter)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification

    from asyncllm.lora import LoRARequest
    from lora_utils import make_adapter

    source = tiny_checkpoint("gemma2")
    path = tiny_classifier(source, str(tmp_path / "classifier"), num_labels=2, seed=8)
    adapter = make_adapter(source, str(tmp_path / "adapter"), seed=9)
    prompts = random_prompts(2, seed=12, max_len=30)
    async with AsyncEngine(path, tensor_parallel_size=2, enable_lora=True, max_lora_rank=8,
                           disable_log_stats=True) as engine:
        plain = [await engine.classify(prompt) for prompt in prompts]
        adapted = [await engine.classify(prompt, lora_request=LoRARequest("a", 1, adapter)) for prompt in prompts]
    peft = PeftModel.from_pretrained(AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32),
                                     adapter).eval()
    for prompt, out, with_adapter in zip(prompts, plain, adapted):
        with torch.no_grad():
            want = peft(input_ids=torch.tensor([prompt])).logits[0].tolist()
        assert max(abs(g - w) for g, w in zip(with_adapter.logits, want)) < 1e-4, (with_adapter.logits, want)
        assert max(abs(g - w) for g, w in zip(out.logits, hf_classifier_logits(path, prompt))) < 1e-5
        assert max(abs(g - w) for g, w in zip(out.logits, with_adapter.logits)) > 0.05  # the adapter matters
