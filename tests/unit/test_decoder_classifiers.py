"""Every decoder family's ``*ForSequenceClassification`` (transformers' classifier over the family's decoder, a
``score`` head on the last token): registered over its causal LM, and its float32 logits through the real loader
and the model runner equal transformers' for three prompts in one step (Llama's with LoRA:
tests/unit/test_classifier.py; in the engine: tests/engine/test_family_classifiers.py)."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import numpy as np
import pytest

from asyncllm.config import EngineConfig
from asyncllm.engine.runner import resolve_runner
from asyncllm.models.architectures import (CLASSIFICATION_ARCHITECTURES, DECODER_CLASSIFIER_BASES, TEXT_ARCHITECTURES,
                                           base_architecture, has_experts)
from asyncllm.tiny import tiny_checkpoint
from classifier_utils import hf_classifier_logits, pooling_step, tiny_classifier

PROMPTS = {"a": [5, 9, 14, 3, 77, 21], "b": [30, 4, 4, 17], "c": [88, 12, 25, 6, 7, 9, 10, 11, 40]}
TOLERANCES = {"zamba2": 2e-4}
"""float32 logits against transformers': 1e-5; Zamba2's as its causal LM's (tests/unit/test_zamba2.py: transformers'
own float32 error there reaches 1e-4)."""
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "gemma", "gemma2", "gemma3",
            "phi3", "olmo", "olmo2", "olmo3", "smollm3", "exaone4", "glm", "glm4", "seed_oss", "arcee", "ministral",
            "ministral3", "starcoder2", "hunyuan_v1_dense", "hunyuan_v1_moe", "gpt_oss", "deepseek_v2", "deepseek_v3",
            "qwen3_5", "qwen3_next", "jamba", "mistral4", "helium", "phi", "phimoe", "stablelm", "nemotron", "gpt_neox",
            "gpt2", "gpt_bigcode", "opt", "gptj", "falcon", "minicpm3", "zamba2", "bloom", "mpt", "minimax")
"""The tiny checkpoint of each family in `DECODER_CLASSIFIER_BASES` (Gemma 3's and Qwen3.5's text classifiers,
GPT-2's ``LMHeadModel`` among them)."""


def test_every_family_classifier_is_transformers_own_over_a_served_causal_lm() -> None:
    import transformers

    from asyncllm.models.classifier import SequenceClassification
    from asyncllm.models.registry import get_model_class

    assert len(DECODER_CLASSIFIER_BASES) == len(FAMILIES) == 48
    for arch, base in DECODER_CLASSIFIER_BASES.items():
        assert hasattr(transformers, arch), arch
        assert base in TEXT_ARCHITECTURES and arch in CLASSIFICATION_ARCHITECTURES and base_architecture(arch) == base
        cls = get_model_class(SimpleNamespace(architectures=[arch]))
        assert issubclass(cls, SequenceClassification) and issubclass(cls, get_model_class(
            SimpleNamespace(architectures=[base]))), arch
    assert has_experts(SimpleNamespace(), "Qwen3MoeForSequenceClassification")  # its decoder's experts
    assert not has_experts(SimpleNamespace(), "Gemma2ForSequenceClassification")


def test_a_classifiers_prequantized_checkpoint_is_refused_as_its_causal_lms() -> None:
    """gpt-oss stores its experts fused: a pre-quantized (GPTQ) checkpoint of its classifier is refused as the
    causal LM's is, naming the classifier."""
    from asyncllm import NotBuiltError
    from asyncllm.models.int4_config import _refuse_architecture

    for arch in ("GptOssForCausalLM", "GptOssForSequenceClassification"):
        with pytest.raises(NotBuiltError, match="experts are stored fused") as info:
            _refuse_architecture(SimpleNamespace(architectures=[arch]), "m", "gptq", ())
        assert arch in str(info.value)


@pytest.mark.parametrize("family", FAMILIES)
def test_family_classifier_logits_equal_transformers(family: str, tmp_path) -> None:
    path = tiny_classifier(tiny_checkpoint(family), str(tmp_path), num_labels=3, seed=1)
    arch = json.loads((tmp_path / "config.json").read_text())["architectures"][0]
    assert DECODER_CLASSIFIER_BASES[arch] == json.loads(
        open(os.path.join(tiny_checkpoint(family), "config.json")).read())["architectures"][0]
    config = EngineConfig.create(path)
    assert resolve_runner(config, arch)["runner"] == "pooling"
    rows, runner = pooling_step(path, "classify", PROMPTS)
    for rid, prompt in PROMPTS.items():
        got, want = rows[rid], np.array(hf_classifier_logits(path, prompt))
        assert got.shape == (3,) and np.abs(got - want).max() < TOLERANCES.get(family, 1e-5), (family, got, want)
    assert runner.model.lm_head is None
