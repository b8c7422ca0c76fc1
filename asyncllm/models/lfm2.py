"""Liquid LFM2 (``Lfm2ForCausalLM``: LFM2-350M / 700M / 1.2B / 2.6B): a hybrid of gated short convolutions and
attention layers (``layer_types``: "conv" / "full_attention"), on the hybrid stack of asyncllm/models/hybrid.py.

- A conv layer projects each token to ``B, C, x`` (``in_proj``), convolves ``B * x`` causally over the last
  ``conv_L_cache`` (3) tokens (depthwise, no activation; its last two inputs are the request's state, by worker
  row: asyncllm/models/row_states.py) and outputs ``out_proj(C * conv)``.
- An attention layer is Llama's with Qwen3's per-head q/k RMSNorms (``q_layernorm`` / ``k_layernorm``).
- Pre-norm layers (``operator_norm``, ``ffn_norm``), a SwiGLU MLP (``feed_forward.w1`` / ``w3`` / ``w2``, its width
  adjusted as transformers does by ``block_auto_adjust_ff_dim``), the final norm ``embedding_norm``. Checkpoint
  names map to Llama's at load (`llama_name`).
- LFM2-MoE (``Lfm2MoeForCausalLM``: LFM2-8B-A1B, LFM2-24B-A2B): the same layers, dense SwiGLU MLPs in the first
  ``num_dense_layers`` and experts after them: a router in the model's dtype, sigmoid scores, the top k chosen with
  the float32 ``expert_bias`` added (``use_expert_bias``) but weighted by the scores alone, renormalized
  (``norm_topk_prob``, plus 1e-6) and scaled by ``routed_scaling_factor``, all rounded to the model's dtype as
  transformers does; the experts (``experts.N.w1`` / ``w3`` / ``w2``) run in the fused-MoE op.
"""

from __future__ import annotations

import copy
from typing import Any, Iterable

import torch
from torch import nn

from asyncllm.attention.metadata import AttentionMetadata
from asyncllm.models.hybrid import HybridBuild, HybridLayer, HybridModel, StateLayersMixin, renamed
from asyncllm.models.layers import LoadedWeight, RMSNorm, TensorParallel, new_param
from asyncllm.models.family_config import lfm2_intermediate_size
from asyncllm.models.linear import ColumnParallelLinear
from asyncllm.models.llama import DecoderBuild, DecoderFlags, LlamaAttention, LlamaForCausalLM, LlamaMLP
from asyncllm.models.moe import FusedMoE, MoECausalLM, MoESpec
from asyncllm.models.phi3 import check_phi3
from asyncllm.models.row_states import DepthwiseConv, RowStates, StateRows, causal_conv, conv_step

__all__ = ["Lfm2ForCausalLM", "Lfm2MoeForCausalLM", "llama_name", "lfm2_intermediate_size"]

_NAMES = ((".operator_norm.", ".input_layernorm."), (".ffn_norm.", ".post_attention_layernorm."),
          (".feed_forward.w1.", ".mlp.gate_proj."), (".feed_forward.w3.", ".mlp.up_proj."),
          (".feed_forward.w2.", ".mlp.down_proj."), (".self_attn.out_proj.", ".self_attn.o_proj."),
          (".q_layernorm.", ".q_norm."), (".k_layernorm.", ".k_norm."), ("model.embedding_norm.", "model.norm."))


def llama_name(name: str) -> str:
    """An LFM2 checkpoint name as the Llama-style modules here name it."""
    return renamed(name, _NAMES)


class ShortConv(nn.Module):
    """The gated short convolution; every tensor-parallel rank computes it whole."""

    def __init__(self, cfg: Any, dtype: torch.dtype, rows: StateRows) -> None:
        super().__init__()
        hidden, bias, whole = cfg.hidden_size, bool(cfg.conv_bias), TensorParallel()
        self.in_proj = ColumnParallelLinear(hidden, 3 * hidden, bias, whole, dtype)
        self.conv = DepthwiseConv(hidden, cfg.conv_L_cache, bias, dtype)
        self.out_proj = ColumnParallelLinear(hidden, hidden, bias, whole, dtype)
        self.states = RowStates(rows, {"conv": ((hidden, cfg.conv_L_cache - 1), dtype)})

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: Any,
                metadata: AttentionMetadata) -> torch.Tensor:
        step = self.states.begin(metadata, hidden.device)
        b, c, x = self.in_proj(hidden).chunk(3, dim=-1)
        gated = b * x
        out = torch.zeros_like(gated)
        if step.decode_only:
            n = len(step.rows)
            out[:n] = conv_step(gated[:n], self.states["conv"], step.rows, self.conv, silu=False)
            self.states.save_decoded(step)
        else:
            for rows, index in self.states.positions(step):  # decodes and drafted requests
                out[index] = conv_step(gated[index], self.states["conv"], rows, self.conv, silu=False)
            for row, span in self.states.spans(step):
                out[span] = causal_conv(gated[span], self.states["conv"][row], self.conv, silu=False)
        return self.out_proj(c * out)


class Lfm2Layer(HybridLayer):
    state_name = "conv"

    def __init__(self, b: HybridBuild, layer_idx: int) -> None:
        cfg = b.hf_config
        norm = lambda: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, b.dtype, b.attn_backend.ops)  # noqa: E731
        super().__init__(b, layer_idx, norm,
                         lambda: ShortConv(cfg, b.dtype, b.state_rows), lambda: LlamaAttention(b, layer_idx))


class Lfm2Model(HybridModel):
    layer_cls = Lfm2Layer


class Lfm2ForCausalLM(StateLayersMixin, LlamaForCausalLM):
    """LFM2: conv and attention layers (Llama's, with per-head q/k norms), SwiGLU MLPs."""

    model_cls = Lfm2Model

    @classmethod
    def decoder_flags(cls, hf_config: Any) -> DecoderFlags:
        return DecoderFlags(qk_norm=True)

    def __init__(self, hf_config: Any, **kwargs: Any) -> None:
        check_phi3(hf_config, "LFM2")
        config = copy.copy(hf_config)  # Llama's names for LFM2's fields
        config.rms_norm_eps = hf_config.norm_eps
        config.intermediate_size = lfm2_intermediate_size(hf_config)
        config.hidden_act = "silu"
        super().__init__(config, **kwargs)

    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        return super().load_weights((llama_name(name), w) for name, w in weights)


_MOE_NAMES = ((".feed_forward.gate.weight", ".mlp.gate_weight"), (".feed_forward.expert_bias", ".mlp.expert_bias"),
              (".feed_forward.experts.", ".mlp.experts."))


class Lfm2MoeBlock(nn.Module):
    """LFM2-MoE's experts: sigmoid scores in the model's dtype, chosen with the expert bias, weighted without it."""

    def __init__(self, spec: MoESpec, b: DecoderBuild) -> None:
        super().__init__()
        cfg = b.hf_config
        self.spec, self.scaling = spec, float(cfg.routed_scaling_factor)
        self.gate_weight = new_param(spec.num_experts, cfg.hidden_size, dtype=b.dtype)
        self.expert_bias = new_param(spec.num_experts, dtype=torch.float32) if cfg.use_expert_bias else None
        self.experts = FusedMoE(spec, cfg.hidden_size, b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = torch.nn.functional.linear(x, self.gate_weight).sigmoid()
        choice = scores if self.expert_bias is None else scores + self.expert_bias
        ids = choice.topk(self.spec.top_k, dim=-1)[1]
        weights = scores.gather(1, ids)
        if self.spec.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-6)
        return self.experts(x, (weights * self.scaling).float(), ids)


class Lfm2MoeForCausalLM(MoECausalLM, Lfm2ForCausalLM):
    """LFM2 with experts after the first ``num_dense_layers`` layers."""

    expert_parts = {"w1": "gate", "w3": "up", "w2": "down"}

    @classmethod
    def moe_spec(cls, hf_config: Any, layer_idx: int) -> MoESpec | None:
        if layer_idx < hf_config.num_dense_layers:
            return None
        return MoESpec(hf_config.num_experts, hf_config.num_experts_per_tok, hf_config.moe_intermediate_size,
                       renormalize=bool(hf_config.norm_topk_prob), weights_in_model_dtype=True)

    @classmethod
    def make_mlp(cls, b: DecoderBuild, layer_idx: int) -> nn.Module:
        spec = cls.moe_spec(b.hf_config, layer_idx)
        return LlamaMLP(b) if spec is None else Lfm2MoeBlock(spec, b)

    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        return super().load_weights((renamed(name, _MOE_NAMES), w) for name, w in weights)

