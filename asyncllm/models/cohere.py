"""Cohere Command R (c4ai-command-r-v01, -08-2024, Aya-23 / Aya-Expanse: ``CohereForCausalLM``) and Command R7B /
Command A (``Cohere2ForCausalLM``).

Llama's projections and gated SiLU MLP (asyncllm/models/llama.py) in Cohere's block:

- one LayerNorm (mean-centred, no bias, weight multiplied in float32: `CohereLayerNorm`) feeds both the
  attention and the MLP, whose outputs join the residual stream together: ``x + attn(ln(x)) + mlp(ln(x))``,
  summed in that order, as transformers does;
- the rotary turns interleaved pairs: the q and k rows are reordered at load, as GLM's
  (`InterleavedRotaryLoading`);
- the logits are multiplied by ``logit_scale``;
- Cohere2: three sliding-window layers to each full one (``layer_types``); only the sliding ones rotate (the
  full ones use no positions: `with_rope_only_in`).

``use_qk_norm`` (Command R+): each q and k head LayerNorm-ed (Cohere's, with a weight per head, `HeadLayerNorm`)
before the rotary; its weights' columns reordered at load as the q/k rows are, each rank holding its heads'.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from asyncllm.attention.metadata import AttentionMetadata
from asyncllm.attention.selector import AttentionBackend
from asyncllm.models.glm4 import InterleavedRotaryLoading, interleaved_to_half
from asyncllm.models.layers import (
    LoadedWeight, RMSNorm, TensorParallel, copy_weight, head_dim_of, new_param, weight_narrow,
)
from asyncllm.models.llama import (
    DecoderBuild,
    DecoderFlags,
    LlamaAttention,
    LlamaForCausalLM,
    LlamaModel,
    with_rope_only_in,
)

__all__ = ["Cohere2ForCausalLM", "CohereForCausalLM", "CohereLayerNorm", "HeadLayerNorm", "HeadNormAttention"]


class CohereLayerNorm(RMSNorm):
    """transformers' ``CohereLayerNorm``: ``w * (x - mean) * rsqrt(var + eps)`` in float32, rounded once; ``forward(x,
    residual)`` adds the residual first and returns both, as `RMSNorm`."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            x = x + residual
        x32 = x.float()
        centred = x32 - x32.mean(-1, keepdim=True)
        normed = centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + self.eps)
        out = (self.weight.float() * normed).to(x.dtype)
        return out if residual is None else (out, x)


class HeadLayerNorm(nn.Module):
    """`CohereLayerNorm` over each head of ``[T, heads, head_dim]``, a weight per head (``[heads, head_dim]``):
    this rank's ``heads`` from head ``start`` of the checkpoint's."""

    def __init__(self, heads: int, start: int, head_dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.start, self.eps = start, eps
        self.weight = new_param(heads, head_dim, dtype=dtype, loader=self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded: LoadedWeight) -> None:
        copy_weight(param.data, weight_narrow(loaded, 0, self.start, param.shape[0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        centred = x32 - x32.mean(-1, keepdim=True)
        normed = centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * normed).to(x.dtype)


class HeadNormAttention(LlamaAttention):
    """Llama's attention with a `HeadLayerNorm` per q and k head, before the rotary, when the config's
    ``norm_flag`` is set (Command R+'s ``use_qk_norm``; StableLM's ``qk_layernorm``, stablelm.py); the norms are
    attributes ``norm_names`` (their checkpoint names)."""

    norm_flag = "use_qk_norm"
    norm_names = ("q_norm", "k_norm")

    def __init__(self, b: DecoderBuild, layer_idx: int) -> None:
        super().__init__(b, layer_idx)
        cfg, qkv = b.hf_config, self.qkv_proj
        self.head_norms = bool(getattr(cfg, self.norm_flag, False))
        if self.head_norms:
            head_dim, eps = head_dim_of(cfg), cfg.layer_norm_eps
            q_name, k_name = self.norm_names
            setattr(self, q_name, HeadLayerNorm(qkv.num_heads, b.tp.rank * qkv.num_heads, head_dim, eps, b.dtype))
            setattr(self, k_name, HeadLayerNorm(qkv.num_kv_heads, qkv.kv_head_start, head_dim, eps, b.dtype))

    def norm_qk(self, query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.head_norms:
            return query, key
        q_name, k_name = self.norm_names
        return getattr(self, q_name)(query), getattr(self, k_name)(key)


class CohereDecoderLayer(nn.Module):
    def __init__(self, b: DecoderBuild, layer_idx: int) -> None:
        super().__init__()
        cfg = b.hf_config
        self.input_layernorm = CohereLayerNorm(cfg.hidden_size, cfg.layer_norm_eps, b.dtype)
        self.self_attn = HeadNormAttention(b, layer_idx)
        self.mlp = b.make_mlp(b, layer_idx)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: torch.Tensor, metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(the MLP's output, the stream plus the attention's): the next norm adds them, so the stream is
        transformers' ``(x + attn) + mlp`` to the bit (the last addition commutes). `LlamaModel.forward` runs
        these layers, so pipeline stages and EAGLE-3's layer inputs work as for Llama."""
        stream = hidden if residual is None else hidden + residual
        normed = self.input_layernorm(stream)
        return self.mlp(normed), stream + self.self_attn(positions, normed, kv_cache, metadata)


class CohereModel(LlamaModel):
    layer_cls = CohereDecoderLayer
    norm_cls = CohereLayerNorm


class CohereForCausalLM(InterleavedRotaryLoading, LlamaForCausalLM):
    """Cohere's block and LayerNorm, its interleaved rotary reordered at load, logits times ``logit_scale``."""

    model_cls = CohereModel

    @classmethod
    def decoder_flags(cls, hf_config: Any) -> DecoderFlags:
        bias = bool(getattr(hf_config, "attention_bias", False))
        return DecoderFlags(qkv_bias=bias, o_bias=bias)

    def __init__(self, hf_config: Any, **kwargs: Any) -> None:
        hf_config = copy.copy(hf_config)
        hf_config.rms_norm_eps = hf_config.layer_norm_eps  # the final norm's eps, as LlamaModel builds it
        super().__init__(hf_config, **kwargs)
        self.reorder_rotary_rows(hf_config)
        self.logit_scale = float(getattr(hf_config, "logit_scale", None) or 1.0)

    def _half_split(self, name: str, weight: LoadedWeight) -> LoadedWeight:
        """The q/k rows reordered (`InterleavedRotaryLoading`), and the q/k norms' columns the same way."""
        if ".q_norm." not in name and ".k_norm." not in name:
            return super()._half_split(name, weight)
        tensor = weight if isinstance(weight, torch.Tensor) else weight[:]
        return interleaved_to_half(tensor.reshape(-1), self.head_dim, self.rotary_dim).reshape(tensor.shape)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """transformers' ``lm_head(hidden) * logit_scale`` (in the model dtype), then float32."""
        return (self.lm_head(hidden) * self.logit_scale).float()


class Cohere2ForCausalLM(CohereForCausalLM):
    """Command R7B / A: Cohere's layers; sliding layers rotate, full ones use no positions."""

    @classmethod
    def decoder_build(cls, hf_config: Any, dtype: torch.dtype, tp: TensorParallel, attn_backend: AttentionBackend,
                      max_position: int, expert_parallel: bool) -> DecoderBuild:
        build = super().decoder_build(hf_config, dtype, tp, attn_backend, max_position, expert_parallel)
        return with_rope_only_in(build, [kind == "sliding_attention" for kind in hf_config.layer_types], max_position)
