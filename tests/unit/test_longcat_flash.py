"""Meituan LongCat-Flash (``LongcatFlashForCausalLM``; asyncllm/models/longcat_flash.py) against transformers' forward
over a paged KV cache: two decoder layers of two latent attention blocks each (interleaved rope, the MLA LoRA scales),
two dense MLPs and the shortcut MoE (softmax over 6 routed and 2 identity experts, the top 3 by score plus a random
correction bias, times ``routed_scaling_factor``). Every position's float32 logits equal transformers' within 1e-4 in
chunked prefills beside decodes, from stacked experts too and over two tensor-parallel ranks; each attention block
keeps its own cache layer; settings transformers does not run, LoRA and pipeline stages are refused."""

from __future__ import annotations

import pytest
import torch
from model_utils import PagedRun, assert_paged_logits_match_checkpoint, assert_tp2_logits_match_checkpoint

from asyncllm.config import EngineConfig
from asyncllm.errors import NotBuiltError
from asyncllm.models.loader import load_hf_config, load_model
from asyncllm.models.longcat_flash import LongcatFlashForCausalLM
from asyncllm.models.registry import kv_cache_spec
from asyncllm.tiny import tiny_checkpoint

SEQ_LENS = [12, 20, 11]
SCHEDULE = [[5, 9, 0], [4, 9, 4], [1, 1, 5], [1, 1, 1], [1, 0, 1]]
"""Prefill chunks beside decodes, then decode-only steps."""


def _load(path: str, hf_config: object = None) -> LongcatFlashForCausalLM:
    model = load_model(EngineConfig.create(path), hf_config or load_hf_config(path), torch.device("cpu"),
                       torch.float32)
    assert type(model) is LongcatFlashForCausalLM
    return model


YARN = {"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 4.0, "original_max_position_embeddings": 512,
        "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0}


@pytest.mark.parametrize("overrides", [{}, {"rope_parameters": YARN, "attention_bias": True, "zero_expert_num": 0}],
                         ids=["flash", "yarn-biased-no-identity-experts"])
def test_logits_match_transformers(overrides: dict) -> None:
    """The tiny LongCat-Flash, and one under YaRN (its softmax mscale), attention biases and no identity expert."""
    path = tiny_checkpoint("longcat_flash", **overrides)
    assert_paged_logits_match_checkpoint(_load(path), path, SEQ_LENS, SCHEDULE, seed=len(overrides))


def test_each_attention_block_has_its_own_latent_cache_layer() -> None:
    """Four cache layers for two decoder layers (one 40-wide latent head each, keys alone); after a run every one
    holds rows, and no two blocks wrote the same rows."""
    path = tiny_checkpoint("longcat_flash")
    spec = kv_cache_spec(load_hf_config(path), 1)
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.kv_parts) == (4, 1, 8 + 32, 1)
    model = _load(path)
    assert len(model.model.layers) == 2
    run = PagedRun(model, [list(range(6, 20))], block_size=4)
    run.new_kv_caches_for(spec, torch.float32)
    run.run([[14]])
    caches = run.kv_caches
    assert all(cache.abs().sum() > 0 for cache in caches)
    assert all(not torch.equal(caches[i], caches[j]) for i in range(4) for j in range(i))


def test_identity_experts_are_chosen_and_add_the_input() -> None:
    """The tiny router picks identity experts (ids 6, 7) for some tokens; for those, the MoE output is the routed
    experts' plus the input times the identity weights."""
    model = _load(tiny_checkpoint("longcat_flash"))
    moe = model.model.layers[0].mlp
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    weights, ids = moe.router(x)
    identity = ids >= 6
    assert identity.any() and not identity.all()
    routed = moe.experts(x, weights.masked_fill(identity, 0.0), ids.masked_fill(identity, -1))
    torch.testing.assert_close(moe(x), routed + x * (weights * identity).sum(-1, keepdim=True))


def test_refreshing_derived_weights_reaches_both_attention_blocks() -> None:
    """A weight update copied in place into each block's ``kv_b_proj`` reaches its absorbed expansions once the model
    refreshes them (what the worker asks after an update), in both blocks of every layer."""
    model = _load(tiny_checkpoint("longcat_flash"))
    blocks = [attn for layer in model.model.layers for attn in layer.self_attn]
    before = [attn.expansions()[0].clone() for attn in blocks]
    for attn in blocks:
        attn.kv_b_proj.weight.data.mul_(2.0)
    model.refresh_derived_weights()
    for attn, old in zip(blocks, before, strict=True):
        torch.testing.assert_close(attn.absorbed[0], 2.0 * old)


def test_stacked_experts_load_as_the_per_expert_ones(tmp_path) -> None:
    """transformers 5 holds the experts stacked: ``gate_up_proj`` over all 8 ids (the identity ids' rows unused),
    ``down_proj`` over the 6 routed ones; a checkpoint saved that way gives transformers' logits too."""
    import shutil

    from safetensors.torch import load_file, save_file

    src = tiny_checkpoint("longcat_flash")
    stacked = tmp_path / "stacked"
    shutil.copytree(src, stacked)
    tensors = load_file(stacked / "model.safetensors")
    for layer in range(2):
        prefix = f"model.layers.{layer}.mlp.experts"
        stacked_ids = sum(f"{prefix}.{e}.gate_proj.weight" in tensors for e in range(8))  # 8 (the identity ids'
        # rows too) as transformers < 5.25 saves them, 6 (the routed ones) from 5.25
        tensors[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([tensors.pop(f"{prefix}.{e}.gate_proj.weight"),
                                                                    tensors.pop(f"{prefix}.{e}.up_proj.weight")])
                                                         for e in range(stacked_ids)])
        tensors[f"{prefix}.down_proj"] = torch.stack([tensors.pop(f"{prefix}.{e}.down_proj.weight") for e in range(6)])
    tensors["model.mtp.layers.0.eh_proj.weight"] = torch.zeros(64, 128)  # a multi-token-prediction weight: unread
    save_file(tensors, stacked / "model.safetensors", metadata={"format": "pt"})
    assert_paged_logits_match_checkpoint(_load(str(stacked)), src, SEQ_LENS, SCHEDULE, seed=3)


@pytest.mark.parametrize(("field", "value"), [("router_bias", True), ("zero_expert_type", "const"),
                                              ("mla_scale_q_lora", False), ("head_dim", 16), ("hidden_act", "gelu")])
def test_settings_transformers_does_not_run_are_refused(field: str, value: object) -> None:
    path = tiny_checkpoint("longcat_flash")
    hf_config = load_hf_config(path)
    setattr(hf_config, field, value)
    with pytest.raises(NotBuiltError) as info:
        _load(path, hf_config)
    assert info.value.field == field


def test_lora_and_pipeline_stages_are_refused_naming_the_family() -> None:
    from asyncllm.engine.prepare import prepare
    from asyncllm.pipeline_parallel import check_pipeline_model

    path = tiny_checkpoint("longcat_flash")
    with pytest.raises(NotBuiltError, match="LoRA adapters for LongcatFlashForCausalLM") as info:
        prepare(EngineConfig.create(path, enable_lora=True))
    assert info.value.field == "enable_lora"
    with pytest.raises(NotBuiltError, match="pipeline parallelism for LongcatFlashForCausalLM") as info:
        check_pipeline_model(EngineConfig.create(path, pipeline_parallel_size=2), "LongcatFlashForCausalLM",
                             load_hf_config(path))
    assert info.value.field == "pipeline_parallel_size"


@pytest.mark.slow
def test_tp2_logits_match_transformers(tmp_path) -> None:
    """Two gloo ranks, each holding half the heads of both attention blocks, half of both dense MLPs' rows and of
    every expert's; the identity experts whole on each: every rank's logits equal transformers'."""
    assert_tp2_logits_match_checkpoint(tiny_checkpoint("longcat_flash"), tmp_path, SEQ_LENS, SCHEDULE, seed=2)


def test_a_tensor_parallel_size_that_does_not_split_the_dense_mlps_is_refused_up_front() -> None:
    """The two dense MLPs beside each layer's experts are split over the ranks too: checked on the host, naming
    ffn_hidden_size, before any model is built."""
    from asyncllm.errors import ConfigError
    from asyncllm.models.registry import check_tensor_parallel

    hf_config = load_hf_config(tiny_checkpoint("longcat_flash"))
    check_tensor_parallel(hf_config, 2)
    hf_config.ffn_hidden_size = 66  # splits over 2 ranks, not 4 (the heads and experts do)
    with pytest.raises(ConfigError, match=r"ffn_hidden_size=66"):
        check_tensor_parallel(hf_config, 4)
