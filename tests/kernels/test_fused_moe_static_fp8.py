"""Per-tensor fp8 experts with static activation scales (AutoFP8's ``activation_scheme: "static"`` mixtures of
experts): each product's input quantized with its one scale, ``fp8(clamp(x / s, -448, 448))`` for every token
(`block_fp8.static_quant_fp8`, tested bit for bit against `reference.static_quant_fp8` in test_block_fp8_kernel.py),
on the fused-MoE kernels' fp8 path, against `reference.fused_moe`."""

from __future__ import annotations

import pytest
import torch

from asyncllm.kernels import reference
from asyncllm.kernels.fused_moe import fused_moe
from kernel_testing import DEVICE, DTYPES, assert_close, randn
from test_fused_moe_kernel import E, FP8_TOL, H, I, _fp8_experts, _routing, _weights

STATIC = (2.0 / 448, 0.5 / 448)
"""(gate/up input scale, down input scale): hidden (about N(0, 1), up to ~3) saturates past 2, the activations
(up to ~1) past 0.5: the clamp is exercised in both products."""


def _static_experts(dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """(hidden, q13, q2, topk_weights, topk_ids, Fp8Experts with the `STATIC` scales): per-tensor experts' block."""
    hidden = randn(9, H, dtype=dtype, seed=0)
    w13, w2 = _weights(E, H, I, dtype, seed=1)
    q13, q2, fp8 = _fp8_experts(w13, w2, (I, H))  # one scale per matrix half (gate, up) and per down
    scales = [torch.tensor(s, device=DEVICE) for s in STATIC]
    return (hidden, q13, q2, *_routing("expert_parallel", 9, seed=5), fp8._replace(w13_input_scale=scales[0],
                                                                                    w2_input_scale=scales[1]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_static_input_scales_match_the_reference(dtype: torch.dtype) -> None:
    hidden, q13, q2, topk_weights, topk_ids, fp8 = _static_experts(dtype)
    expected = reference.fused_moe(hidden, q13, q2, topk_weights, topk_ids, fp8=fp8)
    dynamic = reference.fused_moe(hidden, q13, q2, topk_weights, topk_ids, fp8=fp8._replace(w13_input_scale=None,
                                                                                          w2_input_scale=None))
    assert (expected - dynamic).abs().max() > 0.05  # the static scales (saturating) compute another function
    assert_close(fused_moe(hidden, q13, q2, topk_weights, topk_ids, fp8=fp8), expected, FP8_TOL[dtype])


def test_static_scales_need_a_whole_row_block() -> None:
    hidden, q13, q2, topk_weights, topk_ids, fp8 = _static_experts(torch.float32)
    with pytest.raises(ValueError, match=r"w13_input_scale \(a static activation scale\) must be one float32 value"):
        fused_moe(hidden, q13, q2, topk_weights, topk_ids, fp8=fp8._replace(block=(16, 16), w13_scale=torch.ones(
            E, 3, 3, device=DEVICE), w2_scale=torch.ones(E, 3, 2, device=DEVICE)))
