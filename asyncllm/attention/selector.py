"""Pick the attention backend a model's layers run with: the one place that chooses.

``attention_backend`` (an `EngineConfig` field) names it; None picks the
default for the device: ``triton`` on CUDA (when the triton package is there,
as it is with every CUDA build of torch on Linux), ``torch_sdpa`` elsewhere.
The backend also carries the model's non-attention ops (`ModelOps`), so this
choice covers every kernel the model runs.
"""

from __future__ import annotations

from typing import Protocol

import torch

from asyncllm import envs
from asyncllm.attention.availability import ATTENTION_BACKENDS, backend_name, check_backend_available, package_installed
from asyncllm.attention.metadata import AttentionMetadata, RotaryInputs
from asyncllm.attention.torch_sdpa import TorchSDPABackend
from asyncllm.errors import ConfigError
from asyncllm.models.ops import ModelOps

__all__ = ["AttentionBackend", "get_attention_backend", "default_backend_name"]


class AttentionBackend(Protocol):
    """What an attention layer asks of its backend (one instance shared by all layers)."""

    name: str
    ops: ModelOps
    """The norms and activation the model's other layers run with this backend."""

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        rotary: RotaryInputs | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
        attention_chunk_size: int | None = None,
        alibi_slopes: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Rotate q/k by ``rotary`` (if given), write key/value ``[T, Hkv, D]`` at the step's slots,
        attend query ``[T, Hq, D]`` (scores capped to ``softcap * tanh(s / softcap)`` when ``softcap``; each
        head's softmax joined by its logit in ``sinks [Hq]`` when given, gpt-oss's attention sinks; each score
        biased by ``alibi_slopes[h] * (key_pos - query_pos)`` when ``alibi_slopes [Hq]`` (float32) is given,
        BLOOM's and MPT's ALiBi positions)."""
        ...


def default_backend_name(device: torch.device) -> str:
    """triton on CUDA when the package is there, else torch_sdpa."""
    return "triton" if device.type == "cuda" and package_installed("triton") else "torch_sdpa"


def get_attention_backend(
    name: str | None, device: torch.device, dtype: torch.dtype | None = None
) -> AttentionBackend:
    """The backend called ``name`` for a model on ``device`` (None picks `default_backend_name`).

    `ConfigError` when it cannot run here: a missing package, triton on a CPU
    without ``TRITON_INTERPRET=1``, or bfloat16 under the interpreter (which
    mis-rounds it). flashinfer / flash_attn are `NotBuiltError` once installed.
    """
    name = default_backend_name(device) if name is None else backend_name(name)  # vLLM's names too
    if name not in ATTENTION_BACKENDS:
        raise ConfigError("attention_backend", name, f"one of {', '.join(map(repr, ATTENTION_BACKENDS))}")
    check_backend_available(name)
    if name == "triton":
        _check_triton_runs_on(device, dtype)
        from asyncllm.attention.triton import TritonBackend

        return TritonBackend()
    return TorchSDPABackend()


def _check_triton_runs_on(device: torch.device, dtype: torch.dtype | None) -> None:
    if device.type == "cuda":
        return
    if not envs.TRITON_INTERPRET.get():
        raise ConfigError(
            "attention_backend", "triton",
            f"a CUDA device: the Triton kernels do not compile for {device.type}; use 'torch_sdpa' there "
            "(or set TRITON_INTERPRET=1 to run them in Triton's slow interpreter, for tests)",
        )
    if dtype == torch.bfloat16:
        raise ConfigError(
            "attention_backend", "triton",
            "float32 or float16 under TRITON_INTERPRET=1: Triton's interpreter mis-rounds bfloat16 "
            "(use dtype='float32' or 'float16', or a GPU)",
        )
