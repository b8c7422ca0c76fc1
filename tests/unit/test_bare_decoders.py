"""Every decoder family's bare-decoder checkpoint (what transformers' ``AutoModel`` saves: ``GPT2Model``,
``Gemma2Model``, ``Qwen3_5TextModel``, ...; the registry's `HEADLESS_BASES`) loads as its causal LM without an LM
head, and its last-token embedding through the real loader and the model runner equals transformers'
``last_hidden_state`` (normalized) within 1e-5. Through the engine: tests/engine/test_embedding_models.py."""

from __future__ import annotations

import json
import os
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from asyncllm.models.architectures import EMBEDDING_ARCHITECTURES, HEADLESS_BASES, TEXT_ARCHITECTURES, base_architecture
from asyncllm.tiny import tiny_checkpoint
from classifier_utils import pooling_step

PROMPTS = {"a": [5, 9, 14, 3, 77, 21], "b": [30, 4, 4, 17]}
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "gemma2", "phi3", "granite",
            "olmo2", "olmo3", "smollm3", "exaone4", "glm", "glm4", "ernie4_5", "seed_oss", "arcee", "cohere",
            "cohere2", "ministral", "ministral3", "granitemoe", "olmoe", "starcoder2", "hunyuan_v1_dense", "gpt_oss",
            "deepseek_v2", "deepseek_v3", "glm4_moe", "qwen3_5", "qwen3_5_moe", "qwen3_next", "minimax_m2",
            "granitemoehybrid", "lfm2", "lfm2_moe", "nemotron_h", "bamba", "ernie4_5_moe", "hunyuan_v1_moe", "dots1",
            "llama4", "glm4_moe_lite", "falcon_h1", "apertus", "jamba", "mistral4", "solar_open", "gemma", "gemma4",
            "exaone_moe", "helium", "vaultgemma", "granitemoeshared", "flex_olmo", "phi", "stablelm", "nemotron",
            "gpt_neox", "opt", "gptj", "falcon", "olmo", "jais2", "cwm", "youtu", "gemma3n", "phimoe", "minicpm3",
            "dbrx", "longcat_flash", "zamba2", "kimi_linear", "mpt", "deepseek_v32", "glm_moe_dsa", "minimax",
            "afmoe", "gpt2", "gpt_bigcode", "bloom", "gemma3")
"""The tiny checkpoint of each family in `HEADLESS_BASES`."""
TOLERANCES = {"zamba2": 1e-4}
"""Zamba2's as its causal LM's (tests/unit/test_zamba2.py: transformers' own float32 error there reaches 1e-4)."""


def test_every_bare_decoder_is_transformers_own_over_a_served_causal_lm() -> None:
    import transformers

    from asyncllm.models.registry import get_model_class

    assert len(HEADLESS_BASES) == len(FAMILIES) == 84
    for arch, base in HEADLESS_BASES.items():
        assert hasattr(transformers, arch), arch
        assert base in TEXT_ARCHITECTURES and arch in EMBEDDING_ARCHITECTURES and base_architecture(arch) == base
        cls = get_model_class(SimpleNamespace(architectures=[arch]))
        assert not cls.has_lm_head and issubclass(cls, get_model_class(SimpleNamespace(architectures=[base]))), arch


def _save_bare(source: str, folder) -> torch.nn.Module:
    """`source`'s decoder as ``AutoModel`` saves it (with the tokenizer's files) in `folder`; the model."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(source, dtype=torch.float32).eval()
    model.save_pretrained(folder)
    for name in os.listdir(source):
        if "token" in name:
            shutil.copy(os.path.join(source, name), folder)
    return model


@pytest.mark.parametrize("family", FAMILIES)
def test_bare_decoder_embeddings_equal_transformers(family: str, tmp_path) -> None:
    source = tiny_checkpoint(family)
    model = _save_bare(source, tmp_path)
    arch = json.loads((tmp_path / "config.json").read_text())["architectures"][0]
    assert HEADLESS_BASES[arch] == json.loads(open(os.path.join(source, "config.json")).read())["architectures"][0]
    rows, _ = pooling_step(str(tmp_path), "embed", PROMPTS)
    for rid, prompt in PROMPTS.items():
        with torch.no_grad():
            hidden = model(torch.tensor([prompt])).last_hidden_state[0, -1]
        got = rows[rid]
        want = torch.nn.functional.normalize(hidden, dim=0).numpy()
        error = np.abs(got / np.linalg.norm(got) - want).max()
        assert error < TOLERANCES.get(family, 1e-5), (family, error)


def test_a_gemma3_text_model_is_embeddinggemma_by_its_config_else_gemma3s_causal_decoder(tmp_path) -> None:
    """``Gemma3TextModel`` with ``use_bidirectional_attention``: EmbeddingGemma (an encoder: whole prompts, no KV
    cache, CLS by default); without it: Gemma 3's causal decoder as every bare decoder (its KV cache, LAST pooling)."""
    from transformers import Gemma3TextConfig

    from asyncllm.engine.pooling_model import pooling_model_of
    from asyncllm.models.architectures import serves_as_encoder
    from asyncllm.models.embedding_gemma import EmbeddingGemmaModel
    from asyncllm.models.registry import get_model_class, kv_cache_spec

    causal = Gemma3TextConfig(num_hidden_layers=2, architectures=["Gemma3TextModel"])
    bidirectional = Gemma3TextConfig(num_hidden_layers=2, architectures=["Gemma3TextModel"],
                                     use_bidirectional_attention=True)
    cls = get_model_class(causal)
    assert not serves_as_encoder("Gemma3TextModel", causal) and serves_as_encoder("Gemma3TextModel", bidirectional)
    assert not cls.has_lm_head and not getattr(cls, "is_encoder", False) and not issubclass(cls, EmbeddingGemmaModel)
    assert issubclass(cls, get_model_class(SimpleNamespace(architectures=["Gemma3ForCausalLM"])))
    assert get_model_class(bidirectional) is EmbeddingGemmaModel and EmbeddingGemmaModel.is_encoder
    assert kv_cache_spec(causal, 1).num_layers == 2 and kv_cache_spec(bidirectional, 1).num_layers == 1
    assert pooling_model_of("Gemma3TextModel", causal, str(tmp_path)).pooling_type == "LAST"
    assert pooling_model_of("Gemma3TextModel", bidirectional, str(tmp_path)).pooling_type == "CLS"


def test_the_host_serves_a_causal_gemma3_text_model_as_a_bare_decoder_and_embeddinggemma_as_an_encoder(
        tmp_path) -> None:
    """Scheduling (whole prompts without chunking or prefix caching: the encoder's), pooling, LoRA and
    ``convert="reward"`` follow the config's attention, not the shared architecture name."""
    from asyncllm.config import EngineConfig
    from asyncllm.engine.prepare import prepare
    from asyncllm.errors import ConfigError, NotBuiltError
    from encoder_utils import make_tiny_encoder

    causal = str(tmp_path / "causal")
    _save_bare(tiny_checkpoint("gemma3"), causal)
    bidirectional = make_tiny_encoder(tmp_path / "embeddinggemma", "embeddinggemma")
    served = prepare(EngineConfig.create(causal, enable_lora=True))
    assert served.config.enable_prefix_caching and served.lora is not None and served.pooling_model.pooling_type == "LAST"
    assert prepare(EngineConfig.create(causal, convert="reward")).config.convert == "reward"
    encoder = prepare(EngineConfig.create(bidirectional))
    assert not encoder.config.enable_prefix_caching and not encoder.config.enable_chunked_prefill
    assert encoder.pooling_model.pooling_type == "CLS"
    with pytest.raises(NotBuiltError, match="LoRA adapters for Gemma3TextModel"):
        prepare(EngineConfig.create(bidirectional, enable_lora=True))
    with pytest.raises(ConfigError, match="pools with its own head or pooler"):
        prepare(EngineConfig.create(bidirectional, convert="reward"))
