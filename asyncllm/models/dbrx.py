"""Databricks DBRX (dbrx-base, dbrx-instruct): ``DbrxForCausalLM``.

Llama's pre-norm layers (asyncllm/models/llama.py) under LayerNorms with a weight and no bias (``norm_1``,
``norm_2``, ``norm_f``), the fused ``Wqkv`` clamped to ``[-clip_qkv, clip_qkv]`` after the projection (OLMo's
`OlmoAttention`), grouped-query attention (``attn_config.kv_n_heads``), and a mixture of experts in every layer
(asyncllm/models/moe.py): the router's softmax (in the model dtype, as transformers') top ``moe_top_k``, divided by
their ``moe_normalize_expert_weights``-norm (the p-norm; none when unset), then SiLU-gated experts.
``moe_jitter_eps`` only perturbs training. The nested ``attn_config`` / ``ffn_config`` are read into the flat names
the shared layers read (`llama_view`).

The checkpoint keeps transformers' names (``transformer.blocks.N.norm_attn_norm.attn.Wqkv``, ...): ``Wqkv`` (q's
rows, then k's, then v's) is cut into q / k / v at load and each sharded by heads as Llama's; the experts come as
three ``[E * I, H]`` matrices (``ffn.experts.mlp.w1`` gate, ``v1`` up, ``w2`` down transposed), cut per expert onto
`FusedMoE`'s stacked parameters (split by intermediate dim over tensor-parallel ranks, or whole experts a rank
with expert parallelism).

The rotary base is ``attn_config.rope_theta`` (the released checkpoints': 500000, as vLLM reads it), else the
top-level ``rope_parameters``' (transformers 5 reads only the latter: docs/moe.md).
"""

from __future__ import annotations

import copy
from typing import Any, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from asyncllm.errors import NotBuiltError
from asyncllm.models.layers import LoadedWeight, RMSNorm, head_dim_of
from asyncllm.models.llama import DecoderBuild, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from asyncllm.models.moe import MoECausalLM, MoESpec, SparseMoeBlock
from asyncllm.models.olmo import OlmoAttention
from asyncllm.models.phi import renamed
from asyncllm.models.rotary import rope_parameters

__all__ = ["DbrxForCausalLM", "llama_view"]

_TOP_NAMES = (("transformer.wte.", "model.embed_tokens."), ("transformer.norm_f.", "model.norm."),
              ("transformer.blocks.", "model.layers."))
_LAYER_NAMES = ((".norm_attn_norm.attn.out_proj.", ".self_attn.o_proj."),
                (".norm_attn_norm.norm_1.", ".input_layernorm."),
                (".norm_attn_norm.norm_2.", ".post_attention_layernorm."),
                (".ffn.router.layer.", ".mlp.gate."))
_WQKV = ".norm_attn_norm.attn.Wqkv.weight"
_EXPERTS = {".ffn.experts.mlp.w1": "gate_proj", ".ffn.experts.mlp.v1": "up_proj", ".ffn.experts.mlp.w2": "down_proj"}
"""The fused expert matrices (no ``.weight`` suffix) -> the per-expert names `MoECausalLM` maps."""


def llama_view(hf_config: Any) -> Any:
    """A copy of the DBRX config with the flat names the shared layers read: ``num_key_value_heads``,
    ``clip_qkv``, the rotary base, ``hidden_act`` (the experts' activation), the LayerNorms' eps."""
    attn, ffn = hf_config.attn_config, hf_config.ffn_config
    config = copy.copy(hf_config)
    config.num_key_value_heads = attn.kv_n_heads
    config.clip_qkv = getattr(attn, "clip_qkv", None)
    theta = getattr(attn, "rope_theta", None)
    params = rope_parameters(hf_config)
    config.rope_parameters = params if theta is None else {**params, "rope_theta": float(theta)}
    config.hidden_act = (getattr(ffn, "ffn_act_fn", None) or {}).get("name", "silu")
    config.rms_norm_eps = 1e-5  # torch.nn.LayerNorm's default, which transformers' DBRX norms keep
    return config


class WeightLayerNorm(RMSNorm):
    """``torch.nn.LayerNorm(bias=False)`` in the input's dtype, as transformers runs it; ``forward(x, residual)``
    adds the residual first and returns both, as `RMSNorm`."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            x = x + residual
        out = F.layer_norm(x, (x.shape[-1],), self.weight, None, self.eps)
        return out if residual is None else (out, x)


class DbrxMoE(SparseMoeBlock):
    """The softmax's top k (in the router's dtype) over their p-norm, then the experts."""

    def __init__(self, spec: MoESpec, b: DecoderBuild, norm_p: float | None) -> None:
        super().__init__(spec, b)
        self.norm_p = norm_p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)
        weights, ids = torch.topk(torch.softmax(logits, dim=-1, dtype=logits.dtype), self.spec.top_k, dim=-1)
        if self.norm_p is not None:
            weights = weights / torch.norm(weights, p=self.norm_p, dim=-1, keepdim=True)
        return self.experts(x, weights.float(), ids)


class DbrxDecoderLayer(LlamaDecoderLayer):
    attention_cls = OlmoAttention

    def __init__(self, b: DecoderBuild, layer_idx: int) -> None:
        super().__init__(b, layer_idx)
        cfg = b.hf_config
        self.input_layernorm = WeightLayerNorm(cfg.hidden_size, cfg.rms_norm_eps, b.dtype)
        self.post_attention_layernorm = WeightLayerNorm(cfg.hidden_size, cfg.rms_norm_eps, b.dtype)


class DbrxModel(LlamaModel):
    layer_cls = DbrxDecoderLayer
    norm_cls = WeightLayerNorm


class DbrxForCausalLM(MoECausalLM, LlamaForCausalLM):
    """Llama's layers with bias-free LayerNorms, a clamped fused q/k/v and p-normed top-k experts."""
    hf_decoder_prefix = "transformer."

    model_cls = DbrxModel

    @classmethod
    def moe_spec(cls, hf_config: Any, layer_idx: int) -> MoESpec:
        ffn = hf_config.ffn_config  # the routing flags are `DbrxMoE`'s own (its p-norm, its softmax's dtype)
        return MoESpec(int(ffn.moe_num_experts), int(ffn.moe_top_k), int(ffn.ffn_hidden_size), renormalize=False,
                       weights_in_model_dtype=True)

    @classmethod
    def kv_cache_shapes(cls, hf_config: Any) -> list[tuple[int, int]]:
        """Each layer's (KV heads, head_dim): ``attn_config.kv_n_heads``, what the attention reads (a top-level
        ``num_key_value_heads`` given beside it is not)."""
        return [(int(hf_config.attn_config.kv_n_heads), head_dim_of(hf_config))] * hf_config.num_hidden_layers

    @classmethod
    def make_mlp(cls, b: DecoderBuild, layer_idx: int) -> nn.Module:
        norm_p = b.hf_config.ffn_config.moe_normalize_expert_weights
        return DbrxMoE(cls.moe_spec(b.hf_config, layer_idx), b, None if norm_p is None else float(norm_p))

    def __init__(self, hf_config: Any, **kwargs: Any) -> None:
        config = llama_view(hf_config)
        if config.rope_parameters.get("rope_type", "default") != "default":
            raise NotBuiltError("rope_parameters", config.rope_parameters["rope_type"], "DBRX with the default rope")
        super().__init__(config, **kwargs)
        head_dim = head_dim_of(config)
        self.qkv_rows = (config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim)
        q_rows, kv_rows = self.qkv_rows
        self.fused_parts: dict[str, list[tuple[object, int]]] = {"qkv_proj": [("q", q_rows), ("k", kv_rows),
                                                                              ("v", kv_rows)]}
        """A LoRA adapter's ``Wqkv`` (one A, one B over q's, k's, then v's rows; asyncllm/models/lora.py)."""
        self.expert_rows = int(config.ffn_config.ffn_hidden_size)

    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        return super().load_weights(self._split_fused(renamed(renamed(weights, _TOP_NAMES), _LAYER_NAMES)))

    def _split_fused(self, weights: Iterable[tuple[str, LoadedWeight]]) -> Iterator[tuple[str, LoadedWeight]]:
        """``Wqkv`` as ``self_attn.q_proj`` / ``k_proj`` / ``v_proj``; each fused expert matrix as its experts'
        ``mlp.experts.{e}.{gate,up,down}_proj.weight`` (down: ``w2``'s ``[I, H]`` block transposed)."""
        for name, weight in weights:
            fused = next((key for key in _EXPERTS if name.endswith(key)), None)
            if name.endswith(_WQKV):
                yield from self._qkv_parts(name.removesuffix(_WQKV), weight)
            elif fused is not None:
                yield from self._expert_parts(name.removesuffix(fused), _EXPERTS[fused], weight)
            else:
                yield name, weight

    def _qkv_parts(self, prefix: str, weight: LoadedWeight) -> Iterator[tuple[str, torch.Tensor]]:
        full = weight if isinstance(weight, torch.Tensor) else weight[:]
        q_rows, kv_rows = self.qkv_rows
        for part, rows in zip(("q_proj", "k_proj", "v_proj"), full.split([q_rows, kv_rows, kv_rows])):
            yield f"{prefix}.self_attn.{part}.weight", rows

    def _expert_parts(self, prefix: str, part: str, weight: LoadedWeight) -> Iterator[tuple[str, torch.Tensor]]:
        full = weight if isinstance(weight, torch.Tensor) else weight[:]
        per_expert = full.view(-1, self.expert_rows, full.shape[-1])
        for expert, matrix in enumerate(per_expert):
            yield f"{prefix}.mlp.experts.{expert}.{part}.weight", matrix.t() if part == "down_proj" else matrix
