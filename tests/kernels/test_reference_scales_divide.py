"""The quantizers' torch references divide ``max|x|`` by a tensor, not a Python number: CUDA torch computes
``tensor / number`` as ``tensor * (1 / number)`` (ATen's ``div_true_kernel_cuda``: "may lose one bit of precision"),
so on the GPU a number's quotient is an ulp off for some values while the Triton quantizers divide (``div_rn``) as
the CPU does. The H200 run of 2026-11-30 failed 7 int8 tests on that ulp (the reference's per-token scale, and with it
a rounding of its int8 values, apart from `kernels/int8_quant.py`'s); emulated here on the CPU, those failures
reproduce to the digit. This runs the references under that emulation: their scales are the CPU's."""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from asyncllm.kernels import reference
from asyncllm.models.int8 import int8_scale
from kernel_testing import randn

_DIVISIONS = {torch.Tensor.__truediv__, torch.Tensor.div, torch.div, torch.true_divide, torch.Tensor.true_divide}


class _CudaScalarDivision(TorchFunctionMode):
    """``float32 tensor / Python number`` as CUDA torch computes it: times the float32 reciprocal."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _DIVISIONS and isinstance(args[1], (int, float)) and not kwargs and args[0].dtype == torch.float32:
            return args[0] * (torch.tensor(1.0) / torch.tensor(float(args[1])))
        return func(*args, **kwargs)


def test_the_emulated_division_is_an_ulp_off_for_some_values() -> None:
    amax = randn(4096, dtype=torch.float32, seed=0).abs().cpu()
    with _CudaScalarDivision():
        emulated = amax / 127.5, amax / reference.FP8_E4M3_MAX
    for got, divisor in zip(emulated, (127.5, reference.FP8_E4M3_MAX), strict=True):
        apart = got != amax / divisor
        assert 0.05 < apart.float().mean() < 0.95  # measured: a third to a half of random magnitudes
        assert torch.equal(got[apart].view(torch.int32).sub(
            (amax / divisor)[apart].view(torch.int32)).abs(), torch.ones(int(apart.sum()), dtype=torch.int32))


def test_the_int8_and_fp8_scales_are_the_cpus_under_cuda_division() -> None:
    x = randn(64, 96, dtype=torch.float32, seed=1).cpu()
    expected = int8_scale(x.abs().amax(-1, keepdim=True)), reference.quantize_int8_per_token(x)
    fp8_expected = reference.per_token_group_quant_fp8(x, 32)
    with _CudaScalarDivision():
        got = int8_scale(x.abs().amax(-1, keepdim=True)), reference.quantize_int8_per_token(x)
        fp8_got = reference.per_token_group_quant_fp8(x, 32)
    assert torch.equal(got[0], expected[0]) and all(map(torch.equal, got[1], expected[1]))
    assert torch.equal(fp8_got[1], fp8_expected[1]) and torch.equal(fp8_got[0].view(torch.uint8),
                                                                    fp8_expected[0].view(torch.uint8))
