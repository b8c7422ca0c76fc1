"""GPTQ act-order (``desc_act``) mixtures of experts kept packed (the GPU's layout, through the torch reference of the
fused-MoE kernel's integer path): each matrix's ``g_idx`` goes with its packed experts, one for gate and up."""

from __future__ import annotations

import logging

import pytest
import torch
from int4_reference import write_int4_checkpoint
from test_int4_checkpoint import int4_moe_model, paged_logits, staged_int4_moe_model

from asyncllm.models.int4_experts import finish_int4_experts
from asyncllm.models.layers import TensorParallel
from asyncllm.models.moe import FusedMoE
from asyncllm.tiny import tiny_checkpoint


@pytest.mark.parametrize("arch, tp_rank, tp_size, group", [("mixtral", 0, 1, 16), ("qwen3_moe", 1, 2, 16),
                                                            ("qwen3_moe", 1, 2, -1)])
def test_act_order_moe_experts_kept_packed(tmp_path, monkeypatch, arch: str, tp_rank: int, tp_size: int,
                                           group: int) -> None:
    """Act-order experts kept packed with each matrix's ``g_idx`` (gate and up sharing theirs; rank 1 of 2: its down
    rows' part of ``g_idx`` and every group's scales, the whole input's one with ``group_size: -1``) compute as the
    experts dequantized at load: one rank's logits, and each expert layer's partial sum on rank 1 of 2 (its
    all-reduce left out)."""
    src, path = tiny_checkpoint(arch), tmp_path / "gptq"
    write_int4_checkpoint(src, path, "gptq", group, 4, True)
    packed, plain = (int4_moe_model(path, keep, tp_rank, tp_size) for keep in (True, False))
    layers = [(a, b) for a, b in zip(packed.modules(), plain.modules()) if isinstance(a, FusedMoE)]
    assert layers
    for moe, _ in layers:
        num_experts, inter = moe.w13_scales.shape[0], moe.intermediate
        assert moe.w13_weight.dtype == torch.int32 and moe.w13_g_idx.shape == (num_experts, moe.hidden_size)
        groups = 1 if group == -1 else tp_size * inter // group
        assert moe.w2_g_idx.shape == (num_experts, inter) and moe.w2_scales.shape[2] == groups
    if tp_size == 1:
        for a, b in zip(paged_logits(packed, path), paged_logits(plain, path)):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
        return
    monkeypatch.setattr(TensorParallel, "all_reduce", lambda self, x: x)
    gen = torch.Generator().manual_seed(0)
    for a, b in layers:
        x = torch.randn(7, a.hidden_size, generator=gen)
        weights = torch.rand(7, 2, generator=gen).softmax(-1)
        ids = torch.rand(7, a.num_experts, generator=gen).topk(2).indices  # two distinct experts a token
        out = a(x, weights, ids)
        assert float(out.abs().max()) > 0.01
        torch.testing.assert_close(out, b(x, weights, ids), atol=1e-5, rtol=0)


def test_act_order_experts_whose_gate_and_up_g_idx_differ_are_dequantized(tmp_path, caplog) -> None:
    """The kernel reads one ``g_idx`` per expert for gate and up: a checkpoint whose differ is dequantized, logged."""
    src, path = tiny_checkpoint("qwen3_moe"), tmp_path / "gptq"
    write_int4_checkpoint(src, path, "gptq", 16, 4, True)
    model, cfg = staged_int4_moe_model(path)
    moe = next(m for m in model.modules() if isinstance(m, FusedMoE))
    moe.up_g_idx.data[1] = moe.up_g_idx.data[1].flip(0)  # expert 1's up matrix: its groups in another order
    with caplog.at_level(logging.INFO, logger="asyncllm.models.int4_experts"):
        finish_int4_experts(model, cfg, keep_packed=True)
    assert "gate and up g_idx differ" in caplog.text
    assert moe.w13_weight.dtype == torch.float32 and not hasattr(moe, "w13_g_idx")
