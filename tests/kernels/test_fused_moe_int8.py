"""W8A8 int8 experts (compressed-tensors' ``*-quantized.w8a8`` mixtures of experts) on the fused-MoE kernels' fp8 path
with int8 weights: each product's input quantized to int8 per token (`int8_quant`), the int8 tile products summed
exactly in int32 over all of K (the interpreter's int8 dot is numpy's int32 ``matmul``, exact too), scaled once by the
token's and the row's scales, against `reference.fused_moe` (compressed-tensors' forward:
`int8.int8_linear_fallback` per expert matrix), and bit for bit against those integer sums scaled in torch."""

from __future__ import annotations

import pytest
import torch

from asyncllm.kernels import reference
from asyncllm.kernels.fused_moe import fused_moe
from asyncllm.kernels.fused_moe_checks import INT8_MAX_K
from asyncllm.models.int8 import int8_scale, quantize_int8
from kernel_testing import DEVICE, DTYPES, assert_close, randn, requires_gpu
from test_fused_moe_kernel import E, FP8_TOL, H, I, _routing, _weights

INT8_TOL = FP8_TOL
"""As block-fp8's: float32, the same exact integer sums scaled in another order (the kernel's once per product
against the reference's dequantized float32 products); half types, a unit of the dtype where a product's rounding
moves."""
FLIP_TOL = (2e-2, 0.0)
"""A token with an activation within float32 noise of an int8 rounding midpoint (`_near_midpoint`): the kernel's
exact sums may round it the other way, one step (``max|act| / 127.5``) times a down weight (measured up to 1.4e-2
here)."""


def _near_midpoint(hidden: torch.Tensor, q13: torch.Tensor, q2: torch.Tensor, topk_weights: torch.Tensor,
                   topk_ids: torch.Tensor, int8: reference.Fp8Experts, activation: str) -> torch.Tensor:
    """``[T]``: whether one of a token's down-product inputs, quantized per token, lies within 1e-3 of a step of a
    rounding midpoint, clamped ones aside (read from the reference's LoRA hook, which sees each expert's activations).
    A row whose largest magnitude is negative is one: its ``-max / (max / 127.5)`` is -127.5 to an ulp. Only in
    float32: a half type's activations are the reference's to the bit (rounded to the dtype before they are
    quantized, by the same function) but where a product lands within float32 noise of the dtype's rounding midpoint,
    which the tests' inputs avoid."""
    near = torch.zeros(hidden.shape[0], dtype=torch.bool, device=hidden.device)
    if hidden.dtype != torch.float32:
        return near

    def spy(which: int, _expert: int, token_idx: torch.Tensor, x: torch.Tensor) -> int:
        if which == 1:
            v = x.float() / int8_scale(x.float().abs().amax(-1, keepdim=True))
            near[token_idx] |= (((v - v.floor() - 0.5).abs() < 1e-3) & (v < 127) & (v > -128)).any(-1)  # not clamped
        return 0
    reference.fused_moe(hidden, q13, q2, topk_weights, topk_ids, activation=activation, fp8=int8, lora=spy)
    return near


def _assert_close_up_to_flips(out: torch.Tensor, expected: torch.Tensor, near: torch.Tensor, dtype: torch.dtype
                              ) -> None:
    """`INT8_TOL` on every token but those `_near_midpoint` (`FLIP_TOL`), some tokens checked tightly."""
    assert not near.all(), "every token near a midpoint: nothing checked tightly"
    assert_close(out[~near], expected[~near], INT8_TOL[dtype])
    assert_close(out[near], expected[near], FLIP_TOL)


def _int8_experts(w13: torch.Tensor, w2: torch.Tensor, block: str) -> tuple[torch.Tensor, ...]:
    """(w13, w2) in int8 and their `Fp8Experts`: each row by its own scale (``block`` "row": compressed-tensors'
    channel experts, block ``(1, K)``) or each matrix (``"tensor"``: the gate's and the up's apart, block ``(I, K)``,
    the down's scale on each of its block rows), compressed-tensors' ``max / 127.5``."""
    inter, widest = w2.shape[2], max(w13.shape[2], w2.shape[2])
    bn = 1 if block == "row" else inter
    quantized = []
    for w, matrices in ((w13, w13.shape[1] // inter), (w2, 1)):
        cells = w.float().unflatten(1, (-1, 1) if block == "row" else (matrices, -1))
        scale = int8_scale(cells.abs().amax(dim=(2, 3), keepdim=True))
        block_rows = -(-w.shape[1] // bn)
        quantized.append((quantize_int8(cells, scale).flatten(1, 2),
                          scale.reshape(w.shape[0], -1, 1).expand(-1, block_rows, -1).contiguous()))
    (q13, s13), (q2, s2) = quantized
    return q13, q2, reference.Fp8Experts(s13, s2, (bn, widest))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("routing, block, activation", [
    ("expert_parallel", "row", "silu"),  # ids -1, E, E + 7 for other ranks' experts; H 40 and I 24: masked tails
    ("one_expert", "row", "relu2"),  # one expert's group over several row blocks; experts without a gate
    ("unused_expert", "tensor", "silu"),  # one scale per matrix: (I, K) blocks, the gate's and the up's apart
])
def test_int8_experts_match_reference(dtype: torch.dtype, routing: str, block: str, activation: str) -> None:
    hidden = randn(9, H, dtype=dtype, seed=0)
    w13, w2 = _weights(E, H, I, dtype, seed=1)
    w13 = w13 if activation == "silu" else w13[:, :I].contiguous()
    q13, q2, int8 = _int8_experts(w13, w2, block)
    assert q13.dtype == torch.int8 and int8.w13_scale.shape[2] == 1  # one scale per row (block row) and token
    topk_weights, topk_ids = _routing(routing, 9, seed=5)
    expected = reference.fused_moe(hidden, q13, q2, topk_weights, topk_ids, activation=activation, fp8=int8)
    plain = reference.fused_moe(hidden, w13, w2, topk_weights, topk_ids, activation=activation)
    assert_close(expected, plain, (0.1, 0.1))  # int8 is close to the float experts, not equal
    assert not torch.equal(expected, plain)
    out = fused_moe(hidden, q13, q2, topk_weights, topk_ids, activation=activation, fp8=int8)
    assert out.dtype == dtype
    near = _near_midpoint(hidden, q13, q2, topk_weights, topk_ids, int8, activation)
    _assert_close_up_to_flips(out, expected, near, dtype)


def test_int8_experts_over_several_k_steps() -> None:
    """H 300 and I 136: the gate/up product's K in three steps of 128 (the last 44 wide), the down's in two, their
    int32 sums scaled once; float32."""
    hidden = randn(7, 300, dtype=torch.float32, seed=2)
    w13, w2 = _weights(E, 300, 136, torch.float32, seed=3)
    q13, q2, int8 = _int8_experts(w13, w2, "row")
    topk_weights, topk_ids = _routing("expert_parallel", 7, seed=4)
    expected = reference.fused_moe(hidden, q13, q2, topk_weights, topk_ids, fp8=int8)
    near = _near_midpoint(hidden, q13, q2, topk_weights, topk_ids, int8, "silu")
    out = fused_moe(hidden, q13, q2, topk_weights, topk_ids, fp8=int8)
    _assert_close_up_to_flips(out, expected, near, torch.float32)


@pytest.mark.parametrize("hidden_size, inter", [
    (300, 24),  # the gate/up product's K in three int8 dots of 128 columns (the last 44 wide)
    (16, 16),  # one K step of 16 columns: upcast to float32 (int8 dots want 32), exact, then summed in int32
])
def test_int8_experts_sum_in_int32_and_scale_once(hidden_size: int, inter: int) -> None:
    """Bit for bit the exact integer products scaled once, ``(float(x_q @ W_q^T) * s_x) * s_W`` as the dense layers
    scale ``torch._int_mm``'s (a K step's sum scaled and added would round differently): float32, gateless (relu2),
    one expert a token with routing weight 1, so that nothing else rounds."""
    tokens = 4
    hidden = randn(tokens, hidden_size, dtype=torch.float32, seed=2)
    w13, w2 = _weights(E, hidden_size, inter, torch.float32, seed=3)
    q13, q2, int8 = _int8_experts(w13[:, :inter].contiguous(), w2, "row")
    topk_ids = (torch.arange(tokens, device=DEVICE) % E).reshape(tokens, 1)
    topk_weights = torch.ones(tokens, 1, device=DEVICE)
    out = fused_moe(hidden, q13, q2, topk_weights, topk_ids, activation="relu2", fp8=int8)

    experts = topk_ids[:, 0].cpu()

    def product(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:  # on the CPU: int64 einsum
        x_q, x_s = reference.quantize_int8_per_token(x.cpu())
        exact = torch.einsum("tk,tnk->tn", x_q.long(), q.cpu()[experts].long())
        assert exact.abs().max() < 2**24  # in float32, exactly
        return exact.float() * x_s * scales.cpu()[experts, :, 0]
    up = product(hidden, q13, int8.w13_scale)
    expected = product(torch.square(torch.relu(up)), q2, int8.w2_scale)
    assert torch.equal(out.cpu(), expected)


def test_int8_experts_take_one_input_scale_per_token() -> None:
    """An int8 block narrower than K (per-group activations) is refused by the kernel and the reference; w13 and w2
    int8 together."""
    hidden = randn(3, H, dtype=torch.float32, seed=0)
    w13, w2 = _weights(E, H, I, torch.float32, seed=1)
    q13, q2, int8 = _int8_experts(w13, w2, "row")
    narrow = int8._replace(block=(1, 16), w13_scale=int8.w13_scale.expand(-1, -1, 3).contiguous(),
                           w2_scale=int8.w2_scale.expand(-1, -1, 2).contiguous())
    topk_weights, topk_ids = _routing("one_expert", 3, seed=1)
    for moe in (fused_moe, reference.fused_moe):
        with pytest.raises(ValueError, match=r"int8 experts quantize each token's input whole"):
            moe(hidden, q13, q2, topk_weights, topk_ids, fp8=narrow)
    with pytest.raises(ValueError, match=r"w2 must be \[5, 40, 24\] of torch.int8"):
        fused_moe(hidden, q13, q2.view(torch.float8_e4m3fn), topk_weights, topk_ids, fp8=int8)


def test_int8_experts_refuse_a_k_whose_int32_sums_could_overflow() -> None:
    """``128 * 128 * K`` must fit in int32: K up to `INT8_MAX_K` (131071) is taken, one more refused."""
    assert 128 * 128 * INT8_MAX_K < 2**31 <= 128 * 128 * (INT8_MAX_K + 1)

    def moe(k: int) -> torch.Tensor:  # no tokens: checked, nothing run
        w13, w2 = (torch.zeros(shape, dtype=torch.int8, device=DEVICE) for shape in ((1, 1, k), (1, k, 1)))
        int8 = reference.Fp8Experts(torch.ones(1, 1, 1, device=DEVICE), torch.ones(1, k, 1, device=DEVICE), (1, k))
        return fused_moe(torch.zeros(0, k, device=DEVICE), w13, w2, torch.zeros(0, 1, device=DEVICE),
                         torch.zeros(0, 1, dtype=torch.int32, device=DEVICE), activation="relu2", fp8=int8)
    assert moe(INT8_MAX_K).shape == (0, INT8_MAX_K)
    with pytest.raises(ValueError, match=r"int8 experts sum each product in int32: K \(here 131072\) must be at "):
        moe(INT8_MAX_K + 1)


@requires_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 300])
def test_int8_experts_at_qwen3_moe_shapes(tokens: int) -> None:
    """Qwen3-30B-A3B-quantized.w8a8's experts (H 2048, I 768, top 8 of 128) in bfloat16: int8 tensor-core dots at
    decode and prefill block sizes, against the reference."""
    hidden = randn(tokens, 2048, dtype=torch.bfloat16, seed=0)
    w13, w2 = _weights(128, 2048, 768, torch.bfloat16, seed=1)
    q13, q2, int8 = _int8_experts(w13, w2, "row")
    gen = torch.Generator().manual_seed(2)
    topk_ids = torch.stack([torch.randperm(128, generator=gen)[:8] for _ in range(tokens)]).to(DEVICE)
    topk_weights = torch.softmax(torch.randn(tokens, 8, generator=gen), dim=-1).to(DEVICE)
    expected = reference.fused_moe(hidden, q13, q2, topk_weights, topk_ids, fp8=int8)
    near = _near_midpoint(hidden, q13, q2, topk_weights, topk_ids, int8, "silu")
    out = fused_moe(hidden, q13, q2, topk_weights, topk_ids, fp8=int8)
    _assert_close_up_to_flips(out, expected, near, torch.bfloat16)
