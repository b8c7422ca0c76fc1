"""AllenAI OLMo 2 (OLMo-2-1124-7B / 13B, OLMo-2-0325-32B, OLMo-2-0425-1B and their SFT / DPO / Instruct
checkpoints): ``Olmo2ForCausalLM``; and OLMo 3 (Olmo-3-7B / 32B, Think and Instruct): ``Olmo3ForCausalLM``.

The Llama decoder's projections, rotary, MLP and weight loading (asyncllm/models/llama.py, llama_weights.py) with OLMo 2's
differences, in transformers' order of operations:

- no norm before attention or the MLP: each sublayer's output is normed (``post_attention_layernorm``,
  ``post_feedforward_layernorm``) and then added to the residual stream;
- ``q_norm`` / ``k_norm``: one RMSNorm over the whole q (``num_heads * head_dim``) and the whole k projection,
  not per head as Qwen3's. The backend's fused per-head q/k norm (`RotaryInputs` with norm weights) would be
  wrong here and is never handed these norms: they run before the backend (`Olmo2Attention.norm_qk`). Under
  tensor parallelism a rank holds some of the heads, so the mean square is summed over the ranks with one
  ``all_reduce`` of a ``[T, 1]`` float32 per norm (`WholeProjectionRMSNorm`; vLLM all-gathers q and k instead,
  norms the whole and keeps its slice: the same numbers, more traffic);
- every RMSNorm multiplies its weight in float32 and rounds once (`Olmo2RMSNorm`; Llama's rounds before the
  weight), so these norms run in torch on every backend rather than in the fused residual-add kernels.

OLMo 3 is OLMo 2 with three sliding-window layers to each full one (``layer_types``) and a rope per layer type
(``rope_parameters["sliding_attention"]`` / ``["full_attention"]``: the long-context checkpoints scale only the
full layers' with YaRN).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from asyncllm.attention.metadata import AttentionMetadata
from asyncllm.attention.selector import AttentionBackend
from asyncllm.models.layers import (
    LoadedWeight, RMSNorm, TensorParallel, copy_weight, head_dim_of, new_param, weight_narrow,
)
from asyncllm.models.llama import DecoderBuild, LlamaAttention, LlamaForCausalLM, LlamaModel

__all__ = ["Olmo2ForCausalLM", "Olmo2RMSNorm", "Olmo3ForCausalLM", "WholeProjectionRMSNorm", "olmo2_rms_norm"]


def olmo2_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, variance: torch.Tensor | None = None,
                   weight_after_rounding: bool = False) -> torch.Tensor:
    """transformers' ``Olmo2RMSNorm``: ``(w * x32 * rsqrt(mean(x32^2) + eps)).to(x.dtype)``, the weight
    multiplied in float32 (``weight_after_rounding``: Llama's order, ``w * (...).to(x.dtype)``, OLMoE's).
    ``variance`` (``[..., 1]`` float32): the mean square when it spans more than x."""
    x32 = x.to(torch.float32)
    if variance is None:
        variance = x32.pow(2).mean(-1, keepdim=True)
    if weight_after_rounding:
        return weight * (x32 * torch.rsqrt(variance + eps)).to(x.dtype)
    return (weight * (x32 * torch.rsqrt(variance + eps))).to(x.dtype)


class Olmo2RMSNorm(RMSNorm):
    """`olmo2_rms_norm`; ``forward(x, residual)`` adds the residual first, as `RMSNorm` (the final norm)."""

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return olmo2_rms_norm(x, self.weight, self.eps)
        x = x + residual
        return olmo2_rms_norm(x, self.weight, self.eps), x


class WholeProjectionRMSNorm(nn.Module):
    """OLMo 2's ``q_norm`` / ``k_norm``: one `olmo2_rms_norm` over all ``total_heads`` heads of a projection, of
    which this rank holds ``num_heads`` from head ``head_start`` (its slice of the weight)."""

    def __init__(self, total_heads: int, num_heads: int, head_start: int, head_dim: int, eps: float,
                 dtype: torch.dtype, tp: TensorParallel) -> None:
        super().__init__()
        self.tp, self.eps, self.width = tp, eps, total_heads * head_dim
        self.start, self.rows = head_start * head_dim, num_heads * head_dim
        self.weight_after_rounding = False
        """Llama's rounding order (OLMoE's norms) instead of OLMo 2's."""
        self.replicas = tp.size * num_heads // total_heads
        """Ranks holding each head: more than 1 for k when there are fewer KV heads than ranks."""
        self.weight = new_param(self.rows, dtype=dtype, loader=self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded: LoadedWeight) -> None:
        copy_weight(param.data, weight_narrow(loaded, 0, self.start, self.rows))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, heads, head_dim]`` -> the same shape, normed over every rank's heads together."""
        flat = x.reshape(x.shape[0], -1)
        variance = None  # alone: `olmo2_rms_norm`'s own mean, the very reduction transformers runs
        if self.tp.size > 1:
            sum_sq = flat.to(torch.float32).pow(2).sum(-1, keepdim=True)
            variance = self.tp.all_reduce(sum_sq) / (self.replicas * self.width)
        return olmo2_rms_norm(flat, self.weight, self.eps, variance, self.weight_after_rounding).view_as(x)


class Olmo2Attention(LlamaAttention):
    """Llama's attention with q and k normed over the whole projection before the backend rotates them."""

    def __init__(self, b: DecoderBuild, layer_idx: int) -> None:
        super().__init__(b, layer_idx)  # b.flags.qk_norm is False: the backend's per-head norm stays off
        cfg, qkv = b.hf_config, self.qkv_proj
        head_dim, eps = head_dim_of(cfg), cfg.rms_norm_eps
        self.q_norm = WholeProjectionRMSNorm(cfg.num_attention_heads, qkv.num_heads, b.tp.rank * qkv.num_heads,
                                             head_dim, eps, b.dtype, b.tp)
        self.k_norm = WholeProjectionRMSNorm(cfg.num_key_value_heads, qkv.num_kv_heads, qkv.kv_head_start,
                                             head_dim, eps, b.dtype, b.tp)

    def norm_qk(self, query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q_norm(query), self.k_norm(key)


class Olmo2DecoderLayer(nn.Module):
    attention_cls: type[LlamaAttention] = Olmo2Attention
    norm_cls: type[RMSNorm] = Olmo2RMSNorm
    """What a family may swap (EXAONE 4: per-head q/k norms, Llama's norms), same constructor arguments."""

    def __init__(self, b: DecoderBuild, layer_idx: int) -> None:
        super().__init__()
        cfg = b.hf_config
        self.self_attn = self.attention_cls(b, layer_idx)
        self.post_attention_layernorm = self.norm_cls(cfg.hidden_size, cfg.rms_norm_eps, b.dtype)
        self.mlp = b.make_mlp(b, layer_idx)
        self.post_feedforward_layernorm = self.norm_cls(cfg.hidden_size, cfg.rms_norm_eps, b.dtype)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's output, the residual stream before it), as `LlamaDecoderLayer`; with no norm
        before the sublayers, the previous layer's output joins the stream here."""
        if residual is not None:
            hidden = hidden + residual
        hidden = hidden + self.post_attention_layernorm(self.self_attn(positions, hidden, kv_cache, metadata))
        return self.post_feedforward_layernorm(self.mlp(hidden)), hidden


class Olmo2Model(LlamaModel):
    layer_cls = Olmo2DecoderLayer
    norm_cls = Olmo2RMSNorm


class Olmo2ForCausalLM(LlamaForCausalLM):
    """OLMo 2's causal LM: post-sublayer norms and whole-projection q/k norms on Llama's layers."""

    model_cls = Olmo2Model


class Olmo3ForCausalLM(Olmo2ForCausalLM):
    """OLMo 2's layers; sliding or full attention per ``layer_types``, each with its layer type's rope."""

    @classmethod
    def decoder_build(cls, hf_config: Any, dtype: torch.dtype, tp: TensorParallel, attn_backend: AttentionBackend,
                      max_position: int, expert_parallel: bool) -> DecoderBuild:
        from asyncllm.models.gemma import rotary_by_layer_type

        ropes = rotary_by_layer_type(hf_config, max_position)
        return DecoderBuild(hf_config, cls.decoder_flags(hf_config), dtype, tp, attn_backend, ropes["full_attention"],
                            cls.make_mlp, expert_parallel,
                            layer_rotary=tuple(ropes[kind] for kind in hf_config.layer_types))
