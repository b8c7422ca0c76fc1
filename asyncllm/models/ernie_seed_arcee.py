"""Three small variations on the Llama decoder (asyncllm/models/llama.py), each only a flag or a part away:

- Baidu ERNIE 4.5 dense (ERNIE-4.5-0.3B, base and PT): ``Ernie4_5ForCausalLM``. Biases on every projection when
  ``use_bias``, and a rotary on interleaved pairs, run as half-split by reordering the q and k rows at load
  (`InterleavedRotaryLoading`, as GLM's);
- ByteDance Seed-OSS (Seed-OSS-36B, base and instruct): ``SeedOssForCausalLM``. q, k and v biases
  (``attention_bias``) and the output projection's own flag (``attention_out_bias``);
- Arcee AFM (AFM-4.5B): ``ArceeForCausalLM``. An MLP without a gate: ``down(relu(up(x)) ** 2)``.

And ERNIE 4.5's mixture of experts (``Ernie4_5_MoeForCausalLM``): ERNIE 4.5's layers with `ErnieMoE` blocks.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from asyncllm.errors import NotBuiltError
from asyncllm.models.glm4 import InterleavedRotaryLoading
from asyncllm.models.layers import LoadedWeight, TensorParallel, new_param
from asyncllm.models.linear import ColumnParallelLinear, RowParallelLinear
from asyncllm.models.llama import DecoderBuild, DecoderFlags, LlamaForCausalLM, LlamaMLP
from asyncllm.models.moe import FusedMoE, MoECausalLM, MoESpec
from asyncllm.models.phi import renamed

__all__ = ["ArceeForCausalLM", "ArceeMLP", "Ernie4_5ForCausalLM", "Ernie4_5_MoeForCausalLM", "SeedOssForCausalLM"]


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

    def __init__(self, b: DecoderBuild, intermediate_size: int | None = None) -> None:
        super().__init__()
        cfg = b.hf_config
        if cfg.hidden_act != "relu2":
            raise NotBuiltError("model", cfg.hidden_act, "a squared-ReLU MLP's activation relu2")
        inter = intermediate_size or cfg.intermediate_size
        self.up_proj = ColumnParallelLinear(cfg.hidden_size, inter, b.flags.mlp_bias, b.tp, b.dtype)
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, b.flags.mlp_bias, b.tp, b.dtype)

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


class _Statics(nn.Module):
    """ERNIE's ``moe_statics``: the experts' score correction, ``[1, E]`` float32."""

    def __init__(self, num_experts: int) -> None:
        super().__init__()
        self.e_score_correction_bias = new_param(1, num_experts, dtype=torch.float32)


class ErnieMoE(nn.Module):
    """ERNIE 4.5's experts: a float32 router's softmax, the top k chosen by softmax plus the score correction,
    their softmax weights renormalized (the sum at least ``moe_norm_min``) and rounded to the model dtype; plus
    the shared experts every token runs."""

    def __init__(self, spec: MoESpec, b: DecoderBuild) -> None:
        super().__init__()
        cfg = b.hf_config
        self.top_k, self.norm_min = spec.top_k, float(cfg.moe_norm_min)
        self.gate = ColumnParallelLinear(cfg.hidden_size, spec.num_experts, False, TensorParallel(), torch.float32)
        self.moe_statics = _Statics(spec.num_experts)
        self.experts = FusedMoE(spec, cfg.hidden_size, b)
        self.shared_experts = LlamaMLP(b, spec.shared_expert_size) if spec.shared_expert_size else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.gate(x.float()), dim=-1)
        ids = (probs + self.moe_statics.e_score_correction_bias[0]).topk(self.top_k, dim=-1)[1]
        weights = probs.gather(1, ids)
        weights = (weights / weights.sum(dim=-1, keepdim=True).clamp(min=self.norm_min)).to(x.dtype).float()
        out = self.experts(x, weights, ids)
        return out if self.shared_experts is None else out + self.shared_experts(x)


class Ernie4_5_MoeForCausalLM(MoECausalLM, Ernie4_5ForCausalLM):
    """ERNIE 4.5 MoE (ERNIE-4.5-21B-A3B, 300B-A47B): ERNIE 4.5's layers, experts in the layers from
    ``moe_layer_start_index`` to ``moe_layer_end_index`` on the ``moe_layer_interval`` stride."""

    lora_experts = True

    @classmethod
    def moe_spec(cls, hf_config: Any, layer_idx: int) -> MoESpec | None:
        cfg = hf_config
        end = cfg.moe_layer_end_index if cfg.moe_layer_end_index >= 0 else cfg.num_hidden_layers - 1
        if (layer_idx + 1) % cfg.moe_layer_interval or not cfg.moe_layer_start_index <= layer_idx <= end:
            return None
        return MoESpec(cfg.moe_num_experts, cfg.moe_k, cfg.moe_intermediate_size, renormalize=True,
                       weights_in_model_dtype=True,
                       shared_expert_size=cfg.moe_intermediate_size * (cfg.moe_num_shared_experts or 0))

    @classmethod
    def make_mlp(cls, b: DecoderBuild, layer_idx: int) -> nn.Module:
        spec = cls.moe_spec(b.hf_config, layer_idx)
        return LlamaMLP(b) if spec is None else ErnieMoE(spec, b)

    def __init__(self, hf_config: Any, **kwargs: Any) -> None:
        if getattr(hf_config, "use_bias", False):  # transformers gives its LM head a bias too (no release has one)
            raise NotBuiltError("use_bias", True, "ERNIE 4.5 MoE with biases (and a biased LM head)")
        super().__init__(hf_config, **kwargs)

    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        """The score correction under transformers 5's name too (its modules' ``mlp.gate.moe_statics``)."""
        return super().load_weights(renamed(weights, ((".mlp.gate.moe_statics.", ".mlp.moe_statics."),)))
