"""TII Falcon-H1 (``FalconH1ForCausalLM``: Falcon-H1-0.5B / 1.5B / 1.5B-Deep / 3B / 7B / 34B, Falcon-H1R): in every
layer a Mamba2 mixer and Llama attention side by side on the same normed input, their outputs summed into the
residual stream, then a SwiGLU MLP (asyncllm/models/mamba2.py, asyncllm/models/hybrid.py).

Falcon-H1's muP multipliers are folded into the weights as they load, so the layers compute plain products:
``attention_in_multiplier`` into q, k and v (their input), ``key_multiplier`` into k (rows and bias),
``attention_out_multiplier`` into o, ``ssm_in_multiplier`` into the mixer's ``in_proj`` (its input) and
``ssm_multipliers`` into its row sections (z, x, B, C, dt; bias too), ``ssm_out_multiplier`` into its ``out_proj``,
``mlp_multipliers`` into the MLP's gate and down. ``embedding_multiplier`` scales the embeddings, a prompt's own
embedding rows too (as vLLM's; transformers' ``inputs_embeds`` path skips it, so its embeddings of a prompt's tokens
would not give that prompt's output), and ``lm_head_multiplier`` the logits at run time (the two may share a tied
matrix). The mixer's output is gated by ``silu(z)``, RMS-normed per group first or after when ``mamba_rms_norm`` is
set (``mamba_norm_before_gate``).
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from asyncllm.attention.metadata import AttentionMetadata
from asyncllm.models.granite import GraniteEmbedding, GraniteForCausalLM
from asyncllm.models.hybrid import HybridBuild, HybridModel, StateLayersMixin, renamed
from asyncllm.models.layers import LoadedWeight, RMSNorm
from asyncllm.models.llama import DecoderFlags, LlamaAttention, LlamaForCausalLM
from asyncllm.models.mamba2 import Mamba2Mixer, Mamba2Shape
from asyncllm.models.phi3 import check_phi3

__all__ = ["FalconH1ForCausalLM"]

_NAMES = ((".feed_forward.", ".mlp."), (".pre_ff_layernorm.", ".post_attention_layernorm."),
          ("model.final_layernorm.", "model.norm."))


def falcon_mamba(cfg: Any) -> Mamba2Shape:
    """Falcon-H1's names for a Mamba2 mixer's sizes (the inner width ``mamba_d_ssm``, else ``mamba_expand``)."""
    inner = cfg.mamba_d_ssm if cfg.mamba_d_ssm is not None else int(cfg.mamba_expand * cfg.hidden_size)
    head_dim = inner // cfg.mamba_n_heads if cfg.mamba_d_head in (None, "auto") else int(cfg.mamba_d_head)
    norm = ("norm_gate" if cfg.mamba_norm_before_gate else "gate_norm") if cfg.mamba_rms_norm else "gate"
    return Mamba2Shape(cfg.hidden_size, cfg.mamba_n_heads, head_dim, cfg.mamba_n_groups, cfg.mamba_d_state,
                       cfg.mamba_d_conv, bool(cfg.mamba_conv_bias), bool(cfg.mamba_proj_bias), cfg.rms_norm_eps,
                       tuple(cfg.time_step_limit or (0.0, float("inf"))), norm, bool(cfg.projectors_bias))


class FalconH1Layer(nn.Module):
    """A pre-norm, the mixer and the attention on its output (summed), a pre-norm, the MLP."""

    is_linear = False
    uses_kv_cache = True
    """Every layer attends (and keeps a mixer state too)."""

    def __init__(self, b: HybridBuild, layer_idx: int) -> None:
        super().__init__()
        cfg = b.hf_config
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, b.dtype, b.attn_backend.ops)
        self.mamba = Mamba2Mixer(falcon_mamba(cfg), b.dtype, b.state_rows, b.attn_backend.ops)
        self.self_attn = LlamaAttention(b, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, b.dtype, b.attn_backend.ops)
        self.mlp = b.make_mlp(b, layer_idx)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: torch.Tensor | None, metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = (self.input_layernorm(hidden), hidden) if residual is None else \
            self.input_layernorm(hidden, residual)
        mixed = self.mamba(positions, hidden, None, metadata) + self.self_attn(positions, hidden, kv_cache, metadata)
        hidden, residual = self.post_attention_layernorm(mixed, residual)
        return self.mlp(hidden), residual


class FalconH1Model(HybridModel):
    embedding_cls = GraniteEmbedding
    layer_cls = FalconH1Layer

    def __init__(self, b: HybridBuild) -> None:
        super().__init__(b)
        self.embed_tokens.multiplier = float(b.hf_config.embedding_multiplier)


class FalconH1ForCausalLM(StateLayersMixin, LlamaForCausalLM):
    """Falcon-H1: parallel Mamba2 and attention in every layer, muP multipliers folded into the weights."""

    model_cls = FalconH1Model
    scale_prompt_embeds = GraniteForCausalLM.scale_prompt_embeds

    @staticmethod
    def kv_cache_layers(hf_config: Any) -> int:
        return int(hf_config.num_hidden_layers)

    @classmethod
    def decoder_flags(cls, hf_config: Any) -> DecoderFlags:
        bias = bool(hf_config.attention_bias)
        return DecoderFlags(qkv_bias=bias, o_bias=bias, mlp_bias=bool(hf_config.mlp_bias))

    def __init__(self, hf_config: Any, **kwargs: Any) -> None:
        check_phi3(hf_config, "Falcon-H1")  # pre-quantized: its multipliers are folded into float weights
        super().__init__(hf_config, **kwargs)
        self.lm_head_multiplier = float(hf_config.lm_head_multiplier)
        self.scales = _weight_scales(hf_config)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head's logits times ``lm_head_multiplier`` in the model dtype, then float32 (transformers')."""
        return (self.lm_head(hidden) * self.lm_head_multiplier).float()

    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        return super().load_weights((renamed(name, _NAMES), self._scaled(renamed(name, _NAMES), w))
                                    for name, w in weights)

    def lora_b_scale(self, name: str) -> float:
        """The multiplier folded into a projection's weight (its adapter's product takes it too: an adapter of the
        attention or the MLP; the mixer's take none)."""
        module, _, kind = name.rpartition(".")
        scale = self.scales.get((module.rsplit(".", 1)[-1], kind), 1.0)
        return scale if isinstance(scale, float) else 1.0

    def _scaled(self, name: str, weight: LoadedWeight) -> LoadedWeight:
        """The checkpoint tensor with its multipliers folded in (see the module's docstring)."""
        module, _, kind = name.rpartition(".")
        scale = self.scales.get((module.rsplit(".", 1)[-1], kind))
        if scale is None:
            return weight
        tensor = weight if isinstance(weight, torch.Tensor) else weight[:]
        if not isinstance(scale, torch.Tensor):
            return (tensor.float() * scale).to(tensor.dtype)
        rows = scale.to(tensor.device).view(-1, *([1] * (tensor.dim() - 1)))  # meta: an update's shape check
        return (tensor.float() * rows).to(tensor.dtype)


def _weight_scales(cfg: Any) -> dict[tuple[str, str], Any]:
    """(module, weight or bias) -> the multiplier folded into it: a float, or per row (the mixer's in_proj)."""
    attn_in, key = float(cfg.attention_in_multiplier), float(cfg.key_multiplier)
    gate, down = (float(m) for m in (cfg.mlp_multipliers or (1.0, 1.0)))
    ssm_in = float(cfg.ssm_in_multiplier)
    rows = _in_proj_rows(cfg)
    return {
        ("q_proj", "weight"): attn_in, ("v_proj", "weight"): attn_in,
        ("k_proj", "weight"): attn_in * key, ("k_proj", "bias"): key,
        ("o_proj", "weight"): float(cfg.attention_out_multiplier), ("o_proj", "bias"): float(cfg.attention_out_multiplier),
        ("in_proj", "weight"): rows * ssm_in, ("in_proj", "bias"): rows,
        ("out_proj", "weight"): float(cfg.ssm_out_multiplier), ("out_proj", "bias"): float(cfg.ssm_out_multiplier),
        ("gate_proj", "weight"): gate, ("gate_proj", "bias"): gate,
        ("down_proj", "weight"): down, ("down_proj", "bias"): down,
    }


def _in_proj_rows(cfg: Any) -> torch.Tensor:
    """The mixer's ``in_proj`` row multipliers: z, x, B, C and dt sections by ``ssm_multipliers`` (muP)."""
    shape = falcon_mamba(cfg)
    inner, groups = shape.heads * shape.head_dim, shape.groups * shape.state
    sizes = [inner, inner, groups, groups, shape.heads]
    multipliers = cfg.ssm_multipliers or [1.0] * 5
    return torch.cat([torch.full((size,), float(m)) for size, m in zip(sizes, multipliers)])
