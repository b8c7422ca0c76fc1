"""The decode memory-bandwidth roofline: the fastest decode the device's memory allows.

A decode step reads every weight once (the embedding table only through the
LM head when the two are tied: otherwise just the batch's rows) and the KV
cache of every running request. With the device's copy bandwidth measured by
a large device-to-device copy (bytes read + bytes written, over time), the
roofline is ``batch * bandwidth / (weight_bytes + batch * context * kv_bytes_per_token)``
output tokens/s. It ignores compute, prefill and the host, so the fraction of
it an engine reaches says how close to memory-bound its decode is.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

__all__ = ["Roofline", "measure_copy_bandwidth", "model_bytes", "decode_roofline"]


@dataclass(frozen=True)
class Roofline:
    copy_bandwidth_gb_s: float
    """Measured device copy bandwidth, GB/s (1e9 bytes), read + write counted."""
    weight_bytes_per_step: int
    kv_bytes_per_token: int
    decode_batch: int
    mean_context: float
    """Mean tokens of context each decoding request reads."""
    output_tokens_per_s: float
    """The roofline: decode output tokens/s at this batch and context."""

    def fraction(self, measured_tokens_per_s: float) -> float:
        return measured_tokens_per_s / self.output_tokens_per_s if self.output_tokens_per_s else 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_copy_bandwidth(device: torch.device, nbytes: int | None = None, iters: int = 10) -> float:
    """Bytes/s of a large ``dst.copy_(src)`` on ``device``, counting the read and the write."""
    nbytes = nbytes or (1 << 30 if device.type == "cuda" else 1 << 27)
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    for _ in range(2):
        dst.copy_(src)
    _sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        dst.copy_(src)
    _sync(device)
    elapsed = time.perf_counter() - start
    del src, dst
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return 2 * nbytes * iters / elapsed


def model_bytes(path: str, dtype: torch.dtype) -> tuple[int, int]:
    """(weight bytes one decode step reads, KV-cache bytes per token) for the checkpoint's config.

    Counted from the config with the family's flags (biases, q/k norms) as
    asyncllm's Llama-style decoder lays its parameters out.
    """
    from asyncllm.models.layers import head_dim_of
    from asyncllm.models.loader import load_hf_config
    from asyncllm.models.registry import get_model_class, kv_cache_spec

    cfg = load_hf_config(path)
    flags = get_model_class(cfg).decoder_flags(cfg)  # type: ignore[attr-defined]
    hidden, inter, head_dim = cfg.hidden_size, cfg.intermediate_size, head_dim_of(cfg)
    q_size, kv_size = cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim
    layer = hidden * (q_size + 2 * kv_size) + q_size * hidden + 3 * hidden * inter + 2 * hidden
    layer += (q_size + 2 * kv_size) * flags.qkv_bias + hidden * flags.o_bias + (2 * inter + hidden) * flags.mlp_bias
    layer += 2 * head_dim * flags.qk_norm
    # the LM head reads the whole vocabulary matrix; a separate embedding table only the batch's rows
    params = cfg.num_hidden_layers * layer + hidden + cfg.vocab_size * hidden
    itemsize = torch.empty((), dtype=dtype).element_size()
    return int(params * itemsize), kv_cache_spec(cfg, 1).bytes_per_block(1, dtype)


def decode_roofline(
    path: str, dtype: torch.dtype, bandwidth: float, decode_batch: int, mean_context: float
) -> Roofline:
    weight_bytes, kv_per_token = model_bytes(path, dtype)
    batch = max(1, decode_batch)
    step_bytes = weight_bytes + batch * mean_context * kv_per_token
    return Roofline(
        copy_bandwidth_gb_s=bandwidth / 1e9,
        weight_bytes_per_step=weight_bytes,
        kv_bytes_per_token=kv_per_token,
        decode_batch=batch,
        mean_context=mean_context,
        output_tokens_per_s=batch * bandwidth / step_bytes,
    )
