"""The server's torch-free casts of pooled vectors (integrations/openai_embed_encoding.py) are torch's
``Tensor.to(dtype)`` of the float32 values bit for bit, as vLLM's ``tensor2binary``: every dtype over random float32
bit patterns (subnormals, infinities and the values past each format's range among them) and the boundaries, in both
byte orders; NaN stays NaN."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from asyncllm.integrations.openai_embed_encoding import vector_bytes

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32}
_TORCH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
EDGES = [0.0, -0.0, 1.0, -1.0, 448.0, 456.0, 464.0, 464.01, 479.99, 480.0, 1e4, 57344.0, 61439.0, 61440.0, 65535.0,
         65536.0, 3.4e38, float("inf"), -float("inf"), 2.0 ** -6, 2.0 ** -9, 2.0 ** -10, 2.0 ** -14, 2.0 ** -16,
         2.0 ** -17, 1.5 * 2.0 ** -17, 2.0 ** -24, 2.0 ** -25, 1e-30, 1e-45, 2.0 ** -133, 2.0 ** -126, 0.1, 1 / 3]


def _values() -> np.ndarray:
    rng = np.random.default_rng(7)
    patterns = rng.integers(0, 2 ** 32, size=200_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    edges = np.array(EDGES + [-x for x in EDGES], dtype=np.float32)
    ulps = np.concatenate([np.nextafter(edges, np.float32(np.inf)), np.nextafter(edges, np.float32(-np.inf))])
    normal = rng.standard_normal(20_000).astype(np.float32)
    return np.concatenate([patterns, edges, ulps, normal, normal * 1e-4, normal * 300])


def _torch_bits(values: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    cast = torch.from_numpy(values.copy()).to(dtype)
    return cast.view(_TORCH_INT[dtype.itemsize]).numpy().view(_UINT[dtype.itemsize])


@pytest.mark.parametrize("name", list(DTYPES))
def test_casts_are_torchs_bit_for_bit(name: str) -> None:
    values, dtype = _values(), DTYPES[name]
    width = dtype.itemsize
    want = _torch_bits(values, dtype)
    little = np.frombuffer(vector_bytes(values, name, "little"), dtype=np.dtype(_UINT[width]).newbyteorder("<"))
    big = np.frombuffer(vector_bytes(values, name, "big"), dtype=np.dtype(_UINT[width]).newbyteorder(">"))
    native = np.frombuffer(vector_bytes(values, name, "native"), dtype=_UINT[width])
    assert np.array_equal(little, big) and np.array_equal(little, native)
    kept = ~np.isnan(values)
    mismatched = np.flatnonzero((little != want) & kept)
    assert mismatched.size == 0, (values[mismatched[:5]], want[mismatched[:5]], little[mismatched[:5]])
    signed = {1: np.uint8, 2: np.int16, 4: np.int32}[width]  # the dtypes torch.from_numpy takes
    nans = torch.from_numpy(little[~kept].astype(_UINT[width]).view(signed)).view(dtype)
    assert nans.numel() > 0 and bool(torch.isnan(nans.float()).all())


def test_byte_orders_and_python_floats() -> None:
    """A list of Python floats is cast as float32 first (the engine's vectors are float32), "native" is the
    server's byte order, "big" the bytes of each value reversed."""
    floats = [0.1, -2.5, 1e-3, 3.0]
    assert vector_bytes(floats) == np.array(floats, dtype=np.float32).tobytes()
    assert vector_bytes(floats, "float16", "big") == np.array(floats, dtype=">f2").tobytes()
    native = vector_bytes(floats, "bfloat16", "native")
    assert native == vector_bytes(floats, "bfloat16", sys.byteorder)
    assert vector_bytes(floats, "fp8_e5m2", "big") == vector_bytes(floats, "fp8_e5m2", "little")
