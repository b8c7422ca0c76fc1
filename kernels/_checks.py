"""Argument checks shared by the Triton launchers (internal).

A Triton kernel reads raw pointers: a wrong dtype, shape or stride gives
silently wrong numbers rather than an error, so every launcher checks its
inputs here first and raises `ValueError` naming the argument.
"""

from __future__ import annotations

import torch

__all__ = [
    "FLOAT_DTYPES", "FP8_DTYPES", "check", "check_float", "check_kv_cache", "check_last_dim_contiguous",
    "check_same_device", "check_token_vector",
]

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
"""The activation dtypes every kernel supports."""
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
"""The fp8 KV-cache element types (kv_cache_dtype='fp8' / 'fp8_e4m3', 'fp8_e5m2')."""


def check(ok: bool, message: str) -> None:
    """`ValueError(message)` unless ``ok``."""
    if not ok:
        raise ValueError(message)


def check_float(name: str, tensor: torch.Tensor, ndim: int) -> None:
    """``tensor`` is float32/float16/bfloat16 with ``ndim`` dims."""
    check(tensor.dtype in FLOAT_DTYPES, f"{name} must be float32, float16 or bfloat16, got {tensor.dtype}")
    check(tensor.dim() == ndim, f"{name} must have {ndim} dims, got shape {tuple(tensor.shape)}")


def check_kv_cache(name: str, tensor: torch.Tensor, ndim: int) -> None:
    """A KV cache: an activation dtype or an fp8 type, with ``ndim`` dims."""
    check(tensor.dtype in FLOAT_DTYPES + FP8_DTYPES,
          f"{name} must be float32, float16, bfloat16, float8_e4m3fn or float8_e5m2, got {tensor.dtype}")
    check(tensor.dim() == ndim, f"{name} must have {ndim} dims, got shape {tuple(tensor.shape)}")


def check_last_dim_contiguous(name: str, tensor: torch.Tensor) -> None:
    """The kernels index the last dim with unit stride."""
    check(tensor.stride(-1) == 1 or tensor.shape[-1] == 1, f"{name} must be contiguous in its last dim")


def check_same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    check(len(set(devices.values())) == 1, f"tensors on different devices: {devices}")


def check_token_vector(name: str, tensor: torch.Tensor, num_tokens: int) -> None:
    """An integer ``[T]`` (a token's slot or position) of unit stride: a kernel reads token t's at ``ptr + t``."""
    if tensor.shape != (num_tokens,) or tensor.is_floating_point():  # messages built only on failure (every layer)
        raise ValueError(f"{name} must be an integer [T] with T={num_tokens}: {tensor.dtype}, {tuple(tensor.shape)}")
    if tensor.stride(0) != 1 and num_tokens > 1:
        raise ValueError(f"{name} must be contiguous (stride 1): {tensor.stride()}")
