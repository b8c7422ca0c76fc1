"""GPTQ act-order (``desc_act``) integer experts kept packed: the fused-MoE kernels' integer path with each matrix's
``g_idx`` (``G_IDX``: a row's scale and zero point gathered at group ``g_idx[e, k]``, any order) against
`reference.fused_moe`, and the reference against the float path on weights dequantized here by gathering."""

from __future__ import annotations

import pytest
import torch

from asyncllm.kernels import reference
from asyncllm.kernels.fused_moe import fused_moe
from int4_reference import act_order_g_idx
from kernel_testing import DEVICE, DTYPES, assert_close, randn
from test_fused_moe_kernel import MOE_TOL, E, _routing

H, I = 40, 24  # odd sizes (multiples of the 8 values an int32 packs at 4 bits): masked tails in both products


def _act_order_matrix(rows: int, cols: int, bits: int, g_idx: torch.Tensor, groups: int, gen: torch.Generator
                      ) -> tuple[torch.Tensor, ...]:
    """``[E, rows, cols]`` experts packed along their inputs (int32 ``[E, rows, cols / p]``), scales and zero points
    ``[E, rows, groups]`` (float32) and the dense weights ``W[n, k] = (q - zero[n, g_idx[k]]) * scale[n, g_idx[k]]``
    gathered here, float32."""
    pack = 32 // bits
    q = torch.randint(0, 1 << bits, (E, rows, cols), generator=gen, dtype=torch.int32)
    words = torch.zeros(E, rows, cols // pack, dtype=torch.int32)
    for i in range(pack):
        words |= q[..., i::pack] << (bits * i)
    scales = (torch.rand(E, rows, groups, generator=gen) * 2 + 0.5) / (1 << bits) / cols**0.5
    zeros = torch.randint(0, 1 << bits, (E, rows, groups), generator=gen).float()
    index = g_idx.long()[:, None, :].expand(E, rows, cols)
    dense = (q.float() - zeros.gather(2, index)) * scales.gather(2, index)
    return words, scales, zeros, dense


def _act_order_experts(bits: int, group: int, seed: int) -> tuple[torch.Tensor, ...]:
    """(w13, w2, `reference.IntExperts` with g_idx, dense w13, dense w2): w13's inputs (H) in shuffled groups; w2 as
    rank 1 of 2 holds a down matrix split by its input rows, its part of the whole matrix's shuffled g_idx and every
    one of the whole matrix's groups' scales (more groups than its own I rows span)."""
    gen = torch.Generator().manual_seed(seed)
    g13 = torch.stack([act_order_g_idx(H, group, gen) for _ in range(E)]).to(torch.int32)
    g2 = torch.stack([act_order_g_idx(2 * I, group, gen)[I:] for _ in range(E)]).to(torch.int32)
    w13, s13, z13, dense13 = _act_order_matrix(2 * I, H, bits, g13, -(-H // group), gen)
    w2, s2, z2, dense2 = _act_order_matrix(H, I, bits, g2, -(-2 * I // group), gen)
    ints = reference.IntExperts(*(t.to(DEVICE) for t in (s13, z13, s2, z2)), bits, group, g13.to(DEVICE),
                                g2.to(DEVICE))
    return w13.to(DEVICE), w2.to(DEVICE), ints, dense13, dense2


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits, group", [(4, 16), (8, 8)])
def test_act_order_int_experts_match_reference(dtype: torch.dtype, bits: int, group: int) -> None:
    """Shuffled groups on both matrices (a K step of 16 inputs: inside one group of 16 were the groups in order),
    the down matrix's scales holding twice the groups its rows span: the kernel equals the reference, which equals
    the float path on the gathered dense weights."""
    hidden = randn(9, H, dtype=dtype, seed=1)
    w13, w2, ints, dense13, dense2 = _act_order_experts(bits, group, seed=bits + group)
    topk_weights, topk_ids = _routing("expert_parallel", 9, seed=5)
    expected = reference.fused_moe(hidden, w13, w2, topk_weights, topk_ids, int_experts=ints)
    plain = reference.fused_moe(hidden, dense13.to(dtype).to(DEVICE), dense2.to(dtype).to(DEVICE), topk_weights,
                                topk_ids)
    assert_close(expected, plain, MOE_TOL[dtype])
    assert expected.abs().max() > 0.01
    in_order = ints._replace(w13_g_idx=torch.arange(H, device=DEVICE).div(group, rounding_mode="floor")
                             .to(torch.int32).expand(E, H).contiguous())
    assert not torch.allclose(reference.fused_moe(hidden, w13, w2, topk_weights, topk_ids, int_experts=in_order)
                              .float(), expected.float(), atol=0.05)  # the shuffled groups matter
    out = fused_moe(hidden, w13, w2, topk_weights, topk_ids, int_experts=ints)
    assert_close(out, expected, MOE_TOL[dtype])


def test_act_order_g_idx_is_checked() -> None:
    hidden = randn(3, H, dtype=torch.float32, seed=0)
    w13, w2, ints, _, _ = _act_order_experts(4, 16, seed=0)
    topk_weights, topk_ids = _routing("one_expert", 3, seed=1)
    with pytest.raises(ValueError, match="w2_g_idx must be int32"):
        fused_moe(hidden, w13, w2, topk_weights, topk_ids, int_experts=ints._replace(w2_g_idx=ints.w2_g_idx.long()))
    with pytest.raises(ValueError, match=r"w13_g_idx must be int32 \[5, 40\]"):
        fused_moe(hidden, w13, w2, topk_weights, topk_ids, int_experts=ints._replace(w13_g_idx=ints.w2_g_idx))
    with pytest.raises(ValueError, match="w2_scales must be"):  # without g_idx, the scales span I / group groups
        fused_moe(hidden, w13, w2, topk_weights, topk_ids, int_experts=ints._replace(w2_g_idx=None))
