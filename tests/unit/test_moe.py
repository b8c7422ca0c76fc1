"""MoE layers without processes: routing equals transformers', each rank loads its shard of the
experts (by intermediate dim or, expert parallel, whole experts), and the ranks' partial sums add up."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from asyncllm.attention.selector import get_attention_backend
from asyncllm.errors import ConfigError
from asyncllm.kernels import reference
from asyncllm.models.checkpoint import load_hf_config
from asyncllm.models.layers import TensorParallel
from asyncllm.models.moe import FusedMoE, select_experts
from asyncllm.models.registry import check_tensor_parallel, get_model_class
from asyncllm.tiny import tiny_checkpoint


@pytest.mark.parametrize("router_cls, renormalize", [(Qwen3MoeTopKRouter, True), (Qwen3MoeTopKRouter, False),
                                                     (MixtralTopKRouter, True)])
def test_select_experts_equals_transformers_router(router_cls: type, renormalize: bool) -> None:
    config = type("Cfg", (), dict(num_experts_per_tok=3, num_experts=7, num_local_experts=7, hidden_size=16,
                                  norm_topk_prob=renormalize))()
    router = router_cls(config)
    torch.nn.init.normal_(router.weight, std=0.5, generator=torch.Generator().manual_seed(0))
    hidden = torch.randn(11, 16, generator=torch.Generator().manual_seed(1))
    _, hf_weights, hf_ids = router(hidden)
    weights, ids = select_experts(torch.nn.functional.linear(hidden, router.weight), 3, renormalize)
    assert torch.equal(ids, hf_ids)
    assert torch.equal(weights, hf_weights.float())


def _build(path: str, rank: int, tp_size: int, expert_parallel: bool) -> torch.nn.Module:
    hf_config = load_hf_config(path)
    model = get_model_class(hf_config)(
        hf_config, dtype=torch.float32, tp=TensorParallel(rank, tp_size), max_position=64, expert_parallel=expert_parallel,
        attn_backend=get_attention_backend("torch_sdpa", torch.device("cpu"), torch.float32))
    model.load_weights(load_file(f"{path}/model.safetensors").items())
    return model


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("expert_parallel", [False, True])
def test_ranks_partial_sums_equal_the_whole_layer(arch: str, expert_parallel: bool) -> None:
    path = tiny_checkpoint(arch)
    whole = _build(path, 0, 1, False).model.layers[0].mlp.experts
    ranks = [_build(path, rank, 2, expert_parallel).model.layers[0].mlp.experts for rank in range(2)]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(9, whole.w13_weight.shape[2], generator=gen)
    ids = torch.randint(0, whole.num_local_experts, (9, 2), generator=gen)
    weights = torch.rand(9, 2, generator=gen)
    expected = reference.fused_moe(x, whole.w13_weight, whole.w2_weight, weights, ids)
    parts = [reference.fused_moe(x, r.w13_weight, r.w2_weight, weights, r.local_ids(ids)) for r in ranks]
    torch.testing.assert_close(parts[0] + parts[1], expected, rtol=1e-5, atol=1e-5)
    assert all(torch.count_nonzero(part) for part in parts)  # both ranks contribute


def test_expert_parallel_rank_loads_only_its_experts() -> None:
    path = tiny_checkpoint("mixtral")  # 4 experts: rank 1 of 2 holds experts 2 and 3 whole
    model = _build(path, 1, 2, True)
    experts: FusedMoE = model.model.layers[0].mlp.experts
    state = load_file(f"{path}/model.safetensors")
    assert (experts.expert_start, experts.num_local_experts) == (2, 2)
    torch.testing.assert_close(experts.w13_weight[1, :experts.intermediate],
                               state["model.layers.0.block_sparse_moe.experts.3.w1.weight"], rtol=0, atol=0)
    torch.testing.assert_close(experts.w2_weight[0], state["model.layers.0.block_sparse_moe.experts.2.w2.weight"],
                               rtol=0, atol=0)
    names = model.checkpoint_weight_names()
    assert "model.layers.0.block_sparse_moe.experts.3.w3.weight" in names
    assert "model.layers.0.block_sparse_moe.experts.1.w3.weight" not in names
    assert "model.layers.0.block_sparse_moe.gate.weight" in names


def test_experts_that_do_not_split_are_a_config_error() -> None:
    config = load_hf_config(tiny_checkpoint("qwen2_moe"))  # 6 experts, intermediate 32, shared 96
    check_tensor_parallel(config, 2, expert_parallel=True)
    with pytest.raises(ConfigError, match=r"divides the model's num_experts=6 \(with enable_expert_parallel\)"):
        check_tensor_parallel(config, 4, expert_parallel=True)
    with pytest.raises(ConfigError, match=r"experts' intermediate_size=32 \(without enable_expert_parallel\)"):
        check_tensor_parallel(config, 64)


def test_layers_of_different_expert_counts_are_named_in_layer_order() -> None:
    """Every worker rank runs the check in `load_model`: the layers' distinct MoE shapes (Hunyuan's per-layer
    ``num_experts``) are listed in layer order, not in a set's, whose order follows `MoESpec`'s str field (its
    activation) and so each interpreter's hash seed."""
    config = SimpleNamespace(architectures=["HunYuanMoEV1ForCausalLM"], num_attention_heads=8, num_key_value_heads=8,
                             num_hidden_layers=6, intermediate_size=32, num_experts=[3, 5, 7, 9, 11, 13], moe_topk=1)
    listed = ", ".join(f"num_experts={n} (with enable_expert_parallel)" for n in (3, 5, 7, 9, 11, 13))
    with pytest.raises(ConfigError) as caught:
        check_tensor_parallel(config, 2, expert_parallel=True)
    assert str(caught.value) == f"tensor_parallel_size=2 is not allowed: a size that divides the model's {listed}"
