"""Three small variations on the Llama decoder (asyncllm/models/llama.py), each only a flag or a part away:

- Baidu ERNIE 4.5 dense (ERNIE-4.5-0.3B, base and PT): ``Ernie4_5ForCausalLM``. Biases on every projection when
  ``use_bias``, and a rotary on interleaved pairs, run as half-split by reordering the q and k rows at load
  (`InterleavedRotaryLoading`, as GLM's);
- ByteDance Seed-OSS (Seed-OSS-36B, base and instruct): ``SeedOssForCausalLM``. q, k and v biases
  (``attention_bias``) and the output projection's own flag (``attention_out_bias``);
- Arcee AFM (AFM-4.5B): ``ArceeForCausalLM``. An MLP without a gate: ``down(relu(up(x)) ** 2)``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from asyncllm.errors import NotBuiltError
from asyncllm.models.glm4 import InterleavedRotaryLoading
from asyncllm.models.linear import ColumnParallelLinear, RowParallelLinear
from asyncllm.models.llama import DecoderBuild, DecoderFlags, LlamaForCausalLM

__all__ = ["ArceeForCausalLM", "Ernie4_5ForCausalLM", "SeedOssForCausalLM"]


class Ernie4_5ForCausalLM(InterleavedRotaryLoading, LlamaForCausalLM):
    """Llama's layers with ERNIE's biases; its interleaved rotary reordered at load."""

    @classmethod
    def decoder_flags(cls, hf_config: Any) -> DecoderFlags:
        bias = bool(getattr(hf_config, "use_bias", False))
        return DecoderFlags(qkv_bias=bias, o_bias=bias, mlp_bias=bias)

    def __init__(self, hf_config: Any, **kwargs: Any) -> None:
        super().__init__(hf_config, **kwargs)
        self.reorder_rotary_rows(hf_config)


class SeedOssForCausalLM(LlamaForCausalLM):
    """Llama's layers; the output projection's bias has its own flag."""

    @classmethod
    def decoder_flags(cls, hf_config: Any) -> DecoderFlags:
        return DecoderFlags(qkv_bias=bool(getattr(hf_config, "attention_bias", False)),
                            o_bias=bool(getattr(hf_config, "attention_out_bias", False)),
                            mlp_bias=bool(getattr(hf_config, "mlp_bias", False)))


class ArceeMLP(nn.Module):
    """``down(relu(up(x)) ** 2)``: ``up_proj`` column-parallel, ``down_proj`` row-parallel."""

    def __init__(self, b: DecoderBuild) -> None:
        super().__init__()
        cfg = b.hf_config
        if cfg.hidden_act != "relu2":
            raise NotBuiltError("model", cfg.hidden_act, "Arcee's MLP activation relu2")
        self.up_proj = ColumnParallelLinear(cfg.hidden_size, cfg.intermediate_size, b.flags.mlp_bias, b.tp, b.dtype)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, b.flags.mlp_bias, b.tp, b.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(torch.square(torch.relu(self.up_proj(x))))


class ArceeForCausalLM(LlamaForCausalLM):
    """Llama's layers with Arcee's gateless ReLU-squared MLP."""

    packed_modules: dict[str, list[tuple[str, object]]] = {
        "qkv_proj": [("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")],
    }

    @classmethod
    def make_mlp(cls, b: DecoderBuild, layer_idx: int) -> nn.Module:
        return ArceeMLP(b)
