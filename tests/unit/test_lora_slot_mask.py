"""The step's adapter mask selects each token's own slot: another adapter's fp16 overflow never reaches a token
(asyncllm/models/lora.py `slot_masked`). Whole models' adapters: tests/unit/test_lora_models.py."""

from __future__ import annotations

import torch

from asyncllm.models.layers import TensorParallel
from asyncllm.models.linear import ColumnParallelLinear
from asyncllm.models.lora import LoRAContext, LoRALayer


def test_another_slots_overflow_never_reaches_a_token() -> None:
    """fp16: slot 1's product overflows (inf) on every token; the token of slot 0 and the base model's get exactly
    their own sums, never NaN (a mask multiply would make inf * 0 = NaN of them)."""
    gen = torch.Generator().manual_seed(7)
    layer = ColumnParallelLinear(16, 8, False, TensorParallel(), torch.float16)
    layer.weight.data.copy_(torch.randn(8, 16, generator=gen).half())
    context = LoRAContext()
    lora = LoRALayer(layer, [None], num_slots=2, max_rank=4, context=context)
    lora_a, lora_b = torch.randn(4, 16, generator=gen).half(), torch.randn(8, 4, generator=gen).half()
    lora.set(0, None, lora_a, lora_b, scaling=0.5)
    lora.set(1, None, torch.full((4, 16), 3e4).half(), torch.ones(8, 4).half(), scaling=1.0)
    x = torch.rand(2, 16, generator=gen).half() + 0.5
    assert torch.isinf(torch.nn.functional.linear(x, lora.a[4:])).all()  # slot 1 overflows on both tokens
    base = torch.nn.functional.linear(x, layer.weight)
    context.set_step(torch.tensor([[1.0, 0.0], [0.0, 0.0]], dtype=torch.float16))
    out = lora(x, base)
    assert torch.isfinite(out).all()
    expected = base[0] + torch.nn.functional.linear(torch.nn.functional.linear(x[0], lora_a), lora_b * 0.5)
    torch.testing.assert_close(out[0], expected, atol=1e-2, rtol=1e-2)
    assert torch.equal(out[1], base[1])
