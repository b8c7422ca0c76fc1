"""A causal LM served as a cross-encoder by ``hf_overrides`` (vLLM's ``classifier_from_token``, Qwen3-Reranker's
form): the score head is the LM head's row of "yes" less the row of "no", so classify's logit is transformers'
logit difference at the prompt's last token and score is its sigmoid (docs/pooling.md)."""

from __future__ import annotations

import asyncio

import pytest
from transformers import AutoTokenizer

from asyncllm import AsyncEngine, ConfigError
from asyncllm.tiny import tiny_checkpoint
from engine_helpers import random_prompts
from hf_reference import hf_logits


def _overrides(tokens: list[str], **more: object) -> dict:
    return {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": tokens, **more}


@pytest.mark.parametrize("form", [{"is_original_qwen3_reranker": True}, {"method": "from_2_way_softmax"}])
async def test_qwen3_reranker_form_scores_the_yes_no_logit_difference(form: dict) -> None:
    """Qwen3-Reranker's flag, or vLLM's ``method`` (mxbai-rerank-v2's form)."""
    path = tiny_checkpoint("qwen3")
    tokenizer = AutoTokenizer.from_pretrained(path)
    no, yes = tokenizer.convert_ids_to_tokens([40, 41])  # stand-ins for "no" and "yes"
    overrides = _overrides([no, yes], **form)
    prompts = random_prompts(3, seed=31, max_len=40)
    async with AsyncEngine(path, hf_overrides=overrides, max_num_batched_tokens=16, disable_log_stats=True) as engine:
        outs = await asyncio.gather(*(engine.classify(p) for p in prompts))
        [scored] = await engine.score("is it paged?", ["paged attention"])
    for prompt, out in zip(prompts, outs):
        logits = hf_logits(path, prompt)[-1]
        assert out.logits == pytest.approx([float(logits[41] - logits[40])], abs=1e-4)
        assert out.probs == pytest.approx([1 / (1 + pow(2.718281828459045, -out.logits[0]))], abs=1e-6)
    pair = list(tokenizer("is it paged?", "paged attention").input_ids)
    logits = hf_logits(path, pair)[-1]
    assert scored.prompt_token_ids == pair
    assert scored.score == pytest.approx(1 / (1 + pow(2.718281828459045, -float(logits[41] - logits[40]))), abs=1e-4)


async def test_bge_reranker_gemma_form_scores_the_yes_logit() -> None:
    """bge-reranker-v2-gemma's form in vLLM's docs: a Gemma causal LM (tied embeddings) as
    ``GemmaForSequenceClassification`` with ``method="no_post_processing"``: the logit is "Yes"'s LM-head logit."""
    path = tiny_checkpoint("gemma")
    [yes] = AutoTokenizer.from_pretrained(path).convert_ids_to_tokens([41])
    overrides = {"architectures": ["GemmaForSequenceClassification"], "classifier_from_token": [yes],
                 "method": "no_post_processing"}
    prompts = random_prompts(2, seed=5, max_len=30)
    async with AsyncEngine(path, hf_overrides=overrides, disable_log_stats=True) as engine:
        outs = await asyncio.gather(*(engine.classify(p) for p in prompts))
    for prompt, out in zip(prompts, outs):
        assert out.logits == pytest.approx([float(hf_logits(path, prompt)[-1][41])], abs=1e-4)


@pytest.mark.parametrize("overrides, why", [
    (_overrides(["not-a-token-of-this-vocab"]), "unknown: 'not-a-token-of-this-vocab'"),
    (_overrides(["a", "b"], method="softmax"), "one of from_2_way_softmax, no_post_processing"),
    ({"classifier_from_token": ["a", "b"]}, "set 'architectures' too"),
])
async def test_bad_token_classifiers_fail_the_start_by_name(overrides: dict, why: str) -> None:
    with pytest.raises(ConfigError, match="hf_overrides") as info:
        async with AsyncEngine(tiny_checkpoint("qwen3"), hf_overrides=overrides):
            pass
    assert why in str(info.value)
