"""LFM2 (asyncllm/models/lfm2.py): the gated short convolution's states carried across chunks by worker row, the
attention layer's per-head q/k norms, the adjusted MLP width: float32 logits equal transformers' within 1e-4 over a
paged run (a 72-token request in 40- and 30-token chunks beside decodes); LFM2-MoE's dense first layer and experts
(sigmoid scores, chosen with the expert bias, weighted without it) likewise."""

from __future__ import annotations

import torch
from model_utils import assert_paged_logits_match_checkpoint

from asyncllm.config import EngineConfig
from asyncllm.models.lfm2 import Lfm2ForCausalLM, Lfm2MoeForCausalLM, llama_name
from asyncllm.models.loader import load_hf_config, load_model
from asyncllm.models.registry import kv_cache_spec
from asyncllm.tiny import tiny_checkpoint


def test_lfm2_logits_match_transformers() -> None:
    path = tiny_checkpoint("lfm2")
    model = load_model(EngineConfig.create(path), load_hf_config(path), torch.device("cpu"), torch.float32)
    assert type(model) is Lfm2ForCausalLM
    assert kv_cache_spec(load_hf_config(path), 1).num_layers == 1  # the attention layer only
    assert model.model.layers[0].mlp.down_proj.weight.shape == (64, 96)  # 128 -> two thirds -> a multiple of 32
    assert_paged_logits_match_checkpoint(model, path, [12, 72, 11],
                                         [[5, 40, 0], [4, 30, 4], [1, 1, 5], [1, 1, 1], [1, 0, 1]], seed=4)


def test_checkpoint_names() -> None:
    assert llama_name("model.layers.3.feed_forward.w3.weight") == "model.layers.3.mlp.up_proj.weight"
    assert llama_name("model.layers.0.conv.out_proj.weight") == "model.layers.0.conv.out_proj.weight"
    assert llama_name("model.layers.1.self_attn.out_proj.weight") == "model.layers.1.self_attn.o_proj.weight"
    assert llama_name("model.embedding_norm.weight") == "model.norm.weight"


def test_lfm2_moe_logits_match_transformers() -> None:
    path = tiny_checkpoint("lfm2_moe")
    model = load_model(EngineConfig.create(path), load_hf_config(path), torch.device("cpu"), torch.float32)
    assert type(model) is Lfm2MoeForCausalLM
    assert model.model.layers[0].mlp.down_proj.weight.shape == (64, 128)  # dense: intermediate_size as it is
    moe = model.model.layers[1].mlp
    assert moe.experts.w13_weight.shape == (6, 48, 64) and moe.expert_bias.abs().sum() > 0
    assert_paged_logits_match_checkpoint(model, path, [12, 72, 11],
                                         [[5, 40, 0], [4, 30, 4], [1, 1, 5], [1, 1, 1], [1, 0, 1]], seed=4)


def test_lfm2_moe_expert_bias_chooses_but_does_not_weight() -> None:
    path = tiny_checkpoint("lfm2_moe")
    model = load_model(EngineConfig.create(path), load_hf_config(path), torch.device("cpu"), torch.float32)
    moe = model.model.layers[1].mlp
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(2))
    before = moe(x)
    moe.expert_bias.data *= 100  # a larger bias chooses other experts: the output changes
    assert not torch.allclose(moe(x), before, atol=1e-4)
