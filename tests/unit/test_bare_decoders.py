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
            "afmoe", "gpt2", "gpt_bigcode", "bloom")
"""The tiny checkpoint of each family in `HEADLESS_BASES`."""
TOLERANCES = {"zamba2": 1e-4}
"""Zamba2's as its causal LM's (tests/unit/test_zamba2.py: transformers' own float32 error there reaches 1e-4)."""


def test_every_bare_decoder_is_transformers_own_over_a_served_causal_lm() -> None:
    import transformers

    from asyncllm.models.registry import get_model_class

    assert len(HEADLESS_BASES) == len(FAMILIES) == 83
    for arch, base in HEADLESS_BASES.items():
        assert hasattr(transformers, arch), arch
        assert base in TEXT_ARCHITECTURES and arch in EMBEDDING_ARCHITECTURES and base_architecture(arch) == base
        cls = get_model_class(SimpleNamespace(architectures=[arch]))
        assert not cls.has_lm_head and issubclass(cls, get_model_class(SimpleNamespace(architectures=[base]))), arch


@pytest.mark.parametrize("family", FAMILIES)
def test_bare_decoder_embeddings_equal_transformers(family: str, tmp_path) -> None:
    from transformers import AutoModel

    source = tiny_checkpoint(family)
    model = AutoModel.from_pretrained(source, dtype=torch.float32).eval()
    model.save_pretrained(tmp_path)
    for name in os.listdir(source):
        if "token" in name:
            shutil.copy(os.path.join(source, name), tmp_path)
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
