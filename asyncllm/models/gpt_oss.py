"""OpenAI's gpt-oss (gpt-oss-20b, gpt-oss-120b): ``GptOssForCausalLM``.

The Llama decoder (asyncllm/models/llama.py) with these differences, each in transformers' order of operations:

- attention sinks: a learned logit per query head (``self_attn.sinks``) joins each query's softmax denominator
  and adds no value (the backends' ``sinks`` argument); q/k/v/o projections with biases; sliding-window
  (``sliding_window``, 128) and full-attention layers alternating by ``layer_types``; YaRN rope (rotary.py);
- a mixture of experts in every layer: a router with a bias, the top k of its logits and a softmax over
  those k; experts with biases whose activation is a clamped SwiGLU (`reference.ClampedSwiglu`);
- the checkpoint stores all experts of a layer in one tensor per projection, transformers' ``[E, in, out]``
  layout with gate and up interleaved (``gate_up_proj[..., 0::2]`` gate, ``[..., 1::2]`` up), plain or in
  MXFP4 (``_blocks`` / ``_scales``: kept packed on the Triton backend, asyncllm/models/mxfp4_experts.py, else
  dequantized at load, asyncllm/models/mxfp4.py). They load into `FusedMoE`'s ``w13 [E, 2I, H]`` (gate rows, then up
  rows) and ``w2 [E, H, I]``, split over tensor-parallel ranks as every MoE family's (by intermediate dim, or by
  whole experts with ``enable_expert_parallel``).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from asyncllm.attention.metadata import AttentionMetadata
from asyncllm.kernels.reference import ClampedSwiglu, Mxfp4Experts
from asyncllm.models.checkpoint import checkpoint_quantization
from asyncllm.models.layers import LoadedWeight, copy_weight, new_param, set_weight_loader, weight_narrow, weight_shape
from asyncllm.models.llama import (
    DecoderBuild, DecoderFlags, LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel,
)
from asyncllm.models.moe import FusedMoE, MoESpec, num_experts_of
from asyncllm.models.mxfp4 import dequantize_mxfp4
from asyncllm.models.mxfp4_experts import draw_packed, load_packed, make_packed_params, packed_off_reason

__all__ = ["GptOssForCausalLM", "GptOssExperts"]

_EXPERT_TENSORS = {
    "gate_up_proj": ("w13_weight", "gate_up"), "down_proj": ("w2_weight", "down"),
    "gate_up_proj_bias": ("w13_bias", "gate_up_bias"), "down_proj_bias": ("w2_bias", "down_bias"),
    "gate_up_proj_blocks": ("w13_weight", "gate_up_blocks"), "gate_up_proj_scales": ("w13_weight", "gate_up_scales"),
    "down_proj_blocks": ("w2_weight", "down_blocks"), "down_proj_scales": ("w2_weight", "down_scales"),
}
"""A layer's checkpoint tensors under ``mlp.experts.`` -> (this model's parameter, shard id)."""
_PACKED_SCALES = {"gate_up_proj_scales": "w13_scales", "down_proj_scales": "w2_scales"}
"""The MXFP4 scales' own parameters where the experts are kept packed (asyncllm/models/mxfp4_experts.py)."""

logger = logging.getLogger(__name__)


class GptOssAttention(LlamaAttention):
    """Llama's attention (with biases, windowed by layer type) plus this rank's heads' sink logits."""

    def __init__(self, b: DecoderBuild, layer_idx: int) -> None:
        super().__init__(b, layer_idx)
        self.tp = b.tp
        self.sinks = new_param(self.qkv_proj.num_heads, dtype=b.dtype, loader=self._load_sinks)

    def _load_sinks(self, param: nn.Parameter, loaded: LoadedWeight) -> None:
        heads = param.shape[0]
        copy_weight(param.data, weight_narrow(loaded, 0, self.tp.rank * heads, heads))

    def attend(
        self, positions: torch.Tensor, qkv: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        query, key, value = self.qkv_proj.split_qkv(qkv)
        attended = self.attn(query, key, value, kv_cache, metadata, self._rotary_inputs(positions), self.sinks)
        return self.o_proj(attended)


class GptOssExperts(FusedMoE):
    """`FusedMoE` with per-expert biases and the clamped SwiGLU, loaded from gpt-oss's stacked tensors.

    ``w2_bias`` is added once: by every rank for its own experts under expert parallelism, else by rank 0 only
    (the other ranks' partial sums over their slices of the intermediate dim carry none)."""

    def __init__(self, spec: MoESpec, hidden_size: int, b: DecoderBuild) -> None:
        super().__init__(spec, hidden_size, b)
        cfg = b.hf_config
        n, inter = self.num_local_experts, self.intermediate
        self.w13_bias = new_param(n, 2 * inter, dtype=b.dtype, loader=self.bias_loader)
        self.w2_bias = new_param(n, hidden_size, dtype=b.dtype, loader=self.bias_loader)
        self.adds_w2_bias = self.expert_parallel or self.tp.rank == 0
        self.swiglu = ClampedSwiglu(float(cfg.swiglu_alpha), float(cfg.swiglu_limit))
        self.interleaved_gate_up = True
        self._mxfp4_parts: dict[str, torch.Tensor] = {}
        """Blocks or scales read before their partner, by shard id (the checkpoint stores them as two tensors)."""

    def make_weights(self, b: DecoderBuild) -> None:
        """Float experts, or (an MXFP4 checkpoint on the Triton backend) its packed blocks and scales."""
        mxfp4 = checkpoint_quantization(b.hf_config) == "mxfp4"
        self.packed_off = packed_off_reason(getattr(b.attn_backend, "name", None), self.hidden_size, self.intermediate) \
            if mxfp4 else "no MXFP4 checkpoint"
        """Why the experts are float (dequantized at load where the checkpoint is MXFP4), or None: kept packed."""
        if self.packed:
            make_packed_params(self)
            return
        super().make_weights(b)
        set_weight_loader(self.w13_weight, self.stacked_loader)
        set_weight_loader(self.w2_weight, self.stacked_loader)

    @property
    def packed(self) -> bool:
        """The experts are MXFP4 blocks and scales (asyncllm/models/mxfp4_experts.py), not float weights."""
        return self.packed_off is None

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        fused_moe, lora = self.kernel()
        packed = {"mxfp4": Mxfp4Experts(self.w13_scales, self.w2_scales)} if self.packed else {}
        out = fused_moe(x, self.w13_weight, self.w2_weight, weights, self.local_ids(ids), w13_bias=self.w13_bias,
                        w2_bias=self.w2_bias if self.adds_w2_bias else None, swiglu=self.swiglu, **packed, **lora)
        return self.tp.all_reduce(out)

    def draw_dummy(self, generator: torch.Generator) -> None:
        """Dummy packed experts (`loader.init_dummy_weights` draws the float parameters)."""
        if self.packed:
            draw_packed(self, generator)

    def stacked_loader(self, param: nn.Parameter, loaded: LoadedWeight, shard_id: str) -> None:
        """A layer's whole ``gate_up_proj [E, H, 2I]`` / ``down_proj [E, I, H]``, or one of their MXFP4 halves."""
        self._check_experts(loaded)
        if self.packed:
            if shard_id in ("gate_up", "down"):
                raise ValueError(f"is a float {shard_id} matrix; this model's experts are MXFP4 blocks and scales")
            load_packed(self, param.data, loaded, shard_id)
            return
        if shard_id in ("gate_up", "down"):
            for expert in self.local_experts:
                rows_in = _expert(loaded, expert).t()  # transformers' [in, out] -> [out, in]
                self._load_rows(param, expert, rows_in, shard_id)
            return
        proj = shard_id.rsplit("_", 1)[0]
        self._mxfp4_parts[shard_id] = self._local_slice(loaded)
        if {f"{proj}_blocks", f"{proj}_scales"} <= self._mxfp4_parts.keys():
            blocks, scales = self._mxfp4_parts.pop(f"{proj}_blocks"), self._mxfp4_parts.pop(f"{proj}_scales")
            for i, expert in enumerate(self.local_experts):
                self._load_rows(param, expert, dequantize_mxfp4(blocks[i], scales[i], param.dtype), proj)

    def bias_loader(self, param: nn.Parameter, loaded: LoadedWeight, shard_id: str) -> None:
        """``gate_up_proj_bias [E, 2I]`` (interleaved) or ``down_proj_bias [E, H]``: this rank's experts and slice."""
        self._check_experts(loaded)
        start = self.intermediate_start
        for expert in self.local_experts:
            dst, bias = param.data[expert - self.expert_start], _expert(loaded, expert)
            if shard_id == "down_bias":
                copy_weight(dst, bias)
                continue
            gate, up = (part.narrow(0, start, self.intermediate) for part in (bias[0::2], bias[1::2]))
            copy_weight(dst, torch.cat([gate, up]))

    def _load_rows(self, param: nn.Parameter, expert: int, rows_in: torch.Tensor, proj: str) -> None:
        """One expert's ``[out, in]`` matrix into ``param``; gate_up's interleaved rows split into gate and up."""
        if proj == "down":
            self.weight_loader(param, rows_in, (expert, "down"))
            return
        self.weight_loader(param, rows_in[0::2], (expert, "gate"))
        self.weight_loader(param, rows_in[1::2], (expert, "up"))

    def _check_experts(self, loaded: LoadedWeight) -> None:
        if weight_shape(loaded)[0] != self.num_experts:
            raise ValueError(f"stacks {weight_shape(loaded)[0]} experts, config.json says {self.num_experts}")

    def _local_slice(self, loaded: LoadedWeight) -> torch.Tensor:
        """This rank's experts of a stacked MXFP4 tensor, read now: its partner may come from another file."""
        return weight_narrow(loaded, 0, self.expert_start, self.num_local_experts)[:]


def _expert(loaded: LoadedWeight, expert: int) -> torch.Tensor:
    """Expert ``expert`` of a stacked checkpoint tensor, reading only its part of a lazy slice."""
    return weight_narrow(loaded, 0, expert, 1)[0]


class GptOssRouter(nn.Module):
    """The replicated router, ``[E, H]`` with a bias: the top k of its logits, softmaxed over those k."""

    def __init__(self, spec: MoESpec, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.top_k = spec.top_k
        self.weight = new_param(spec.num_experts, hidden_size, dtype=dtype)
        self.bias = new_param(spec.num_experts, dtype=dtype)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[T, H]`` -> (weights ``[T, k]`` float32 holding model-dtype values, expert ids ``[T, k]``)."""
        top_logits, ids = torch.topk(F.linear(x, self.weight, self.bias), self.top_k, dim=-1)
        # transformers' softmax runs in the model dtype: round as it does
        return torch.softmax(top_logits, dim=-1, dtype=torch.float32).to(x.dtype).float(), ids


class GptOssMoE(nn.Module):
    def __init__(self, spec: MoESpec, b: DecoderBuild) -> None:
        super().__init__()
        hidden = b.hf_config.hidden_size
        self.router = GptOssRouter(spec, hidden, b.dtype)
        self.experts = GptOssExperts(spec, hidden, b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, *self.router(x))


class GptOssDecoderLayer(LlamaDecoderLayer):
    attention_cls = GptOssAttention


class GptOssModel(LlamaModel):
    layer_cls = GptOssDecoderLayer


class GptOssForCausalLM(LlamaForCausalLM):
    """gpt-oss's causal LM: Llama's layers with sinks and gpt-oss's experts, its checkpoint layout."""

    model_cls = GptOssModel
    is_moe = True
    lora_experts = True
    """Adapters may change the experts (PEFT's target_parameters: asyncllm/models/lora_experts.py)."""
    attention_sinks = True
    """Each attention layer holds a sink logit per query head (asyncllm/bench/roofline.py counts them)."""
    moe_biases = True
    """The router and every expert have biases (counted by the roofline as well)."""
    packed_modules = {"qkv_proj": LlamaForCausalLM.packed_modules["qkv_proj"]}

    @classmethod
    def moe_spec(cls, hf_config: Any, layer_idx: int) -> MoESpec:
        return MoESpec(num_experts_of(hf_config), hf_config.num_experts_per_tok, hf_config.intermediate_size,
                       renormalize=False, weights_in_model_dtype=True)

    @classmethod
    def decoder_flags(cls, hf_config: Any) -> DecoderFlags:
        bias = bool(getattr(hf_config, "attention_bias", True))
        return DecoderFlags(qkv_bias=bias, o_bias=bias)

    @classmethod
    def make_mlp(cls, b: DecoderBuild, layer_idx: int) -> nn.Module:
        return GptOssMoE(cls.moe_spec(b.hf_config, layer_idx), b)

    def __init__(self, hf_config: Any, **kwargs: Any) -> None:
        super().__init__(hf_config, **kwargs)
        self.mxfp4 = checkpoint_quantization(hf_config) == "mxfp4"
        """The experts' weights are stored as MXFP4 blocks and scales (biases stay float)."""
        experts = [module for module in self.modules() if isinstance(module, GptOssExperts)]
        self.mxfp4_packed = self.mxfp4 and bool(experts) and experts[0].packed
        """The experts are served packed (asyncllm/models/mxfp4_experts.py); else dequantized as they load."""
        if self.mxfp4 and experts and not self.mxfp4_packed:
            dtype = experts[0].params_dtype
            logger.warning("MXFP4 experts dequantized to %s at load (%.1fx the memory of the packed ones): %s", dtype,
                           torch.finfo(dtype).bits / 4.25, experts[0].packed_off)

    def _expert_param(self, leaf: str) -> str:
        """The parameter an expert checkpoint tensor ``leaf`` (a key of `_EXPERT_TENSORS`) loads into."""
        return _PACKED_SCALES[leaf] if self.mxfp4_packed and leaf in _PACKED_SCALES else _EXPERT_TENSORS[leaf][0]

    def _packed(self, ckpt_name: str) -> tuple[str, object]:
        prefix, _, leaf = ckpt_name.rpartition(".mlp.experts.")
        if prefix and leaf in _EXPERT_TENSORS:
            return f"{prefix}.mlp.experts.{self._expert_param(leaf)}", _EXPERT_TENSORS[leaf][1]
        return super()._packed(ckpt_name)

    def _unpacked(self, param_name: str) -> list[tuple[str, object]]:
        prefix, _, leaf = param_name.rpartition(".mlp.experts.")
        if not prefix:
            return super()._unpacked(param_name)
        names = [ckpt for ckpt in _EXPERT_TENSORS if self._expert_param(ckpt) == leaf]
        mxfp4 = [name for name in names if name.endswith(("_blocks", "_scales"))]
        names = mxfp4 if self.mxfp4 and mxfp4 else [name for name in names if name not in mxfp4]
        return [(f"{prefix}.mlp.experts.{name}", _EXPERT_TENSORS[name][1]) for name in names]
