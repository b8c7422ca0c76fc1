"""Meituan LongCat-Flash (``LongcatFlashForCausalLM``, LongCat-Flash-Chat, 560B): DeepSeek's latent attention, twice
per layer, beside dense MLPs and a shortcut-connected mixture of experts with identity ("zero") experts.

- **Layer.** Each of the ``num_layers`` decoder layers runs attention 0, MLP 0, attention 1, MLP 1 (a pre-norm
  and a residual each: ``input_layernorm[i]``, ``post_attention_layernorm[i]``); the MoE reads the input of MLP 0
  (the normed stream after attention 0) and its output joins the stream at the layer's end, beside MLP 1's
  (transformers' "shortcut"). config.json's ``num_hidden_layers`` (transformers derives it) is ``2 * num_layers``:
  the attention blocks, each with its own cache layer (`kv_cache_shapes` counts them; layer ``i``'s blocks read
  caches ``2i`` and ``2i + 1``, as transformers' ``layer_idx * 2 + j``).
- **Attention.** `DeepseekAttention` (its latent cache, absorbed expansions) with LongCat's LoRA scales: the
  queries times ``sqrt(hidden / q_lora_rank)`` (applied to the normed query latent: ``q_b_proj`` has no bias),
  the normed key-value latent times ``sqrt(hidden / kv_lora_rank)`` before it is cached (so the keys' no-rope
  part and the values scale, the shared rotary key not), as transformers does; the rope always interleaved.
- **Experts.** A float32 softmax over ``n_routed_experts + zero_expert_num`` router logits (``router.classifier``,
  its ``router_bias`` refused as transformers never adds it); the top ``moe_topk`` by score plus ``e_score_correction_bias``,
  weighted by the plain scores times ``routed_scaling_factor``, not renormalized. Ids past ``n_routed_experts`` are
  identity experts: they add the token's input times their weight (every rank whole, after the routed experts'
  all-reduce). The checkpoint's gate/up rows for those ids (transformers < 5.25 stacks ``gate_up_proj`` over every
  id; 5.25 over the routed ones) are left unread.

Pipeline parallelism and LoRA adapters are not built for it (refused: asyncllm/pipeline_parallel.py,
asyncllm/engine/prepare.py). The multi-token-prediction weights (``model.mtp.*``) are left unread, as transformers
leaves them.
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from asyncllm.attention.metadata import AttentionMetadata
from asyncllm.errors import NotBuiltError
from asyncllm.models.deepseek import DeepseekAttention, DeepseekV2ForCausalLM
from asyncllm.models.embedding import VocabParallelEmbedding
from asyncllm.models.layers import RMSNorm, new_param, norm_in
from asyncllm.models.llama import DecoderBuild, LlamaMLP, LlamaModel, check_silu
from asyncllm.models.moe import FusedMoE, MoESpec, select_experts_by_scores

__all__ = ["LongcatFlashForCausalLM"]

_EXPERT_ID = re.compile(r"\.mlp\.experts\.(\d+)\.")


class LongcatAttention(DeepseekAttention):
    """DeepSeek's latent attention with LongCat's query and key-value LoRA scales, its rope interleaved."""

    def __init__(self, b: DecoderBuild, layer_idx: int) -> None:
        super().__init__(b, layer_idx)
        cfg = b.hf_config
        self.interleaved = True  # transformers' LongCat always rotates interleaved pairs
        self.q_scale = (cfg.hidden_size / cfg.q_lora_rank) ** 0.5
        self.kv_scale = (cfg.hidden_size / cfg.kv_lora_rank) ** 0.5
        self.kv_a_layernorm = _ScaledNorm(self.kv_a_layernorm, self.kv_scale)

    def query_latent(self, hidden: torch.Tensor) -> torch.Tensor:
        """The normed query latent times the query scale: ``q_b_proj`` (no bias) carries it to every query."""
        return super().query_latent(hidden) * self.q_scale


class _ScaledNorm(nn.Module):
    """An RMSNorm whose output is multiplied by ``scale`` (the key-value latent's LoRA scale); its weight keeps the
    checkpoint's name (``kv_a_layernorm.weight``)."""

    def __init__(self, norm: RMSNorm, scale: float) -> None:
        super().__init__()
        self.weight, self.eps, self.norm, self.scale = norm.weight, norm.eps, norm.ops.rms_norm, scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x, self.weight, self.eps) * self.scale


class LongcatRouter(nn.Module):
    """Softmax scores over the routed and the identity experts (float32, as transformers keeps the classifier) ->
    (weights ``[T, k]`` float32, ids ``[T, k]``)."""

    def __init__(self, cfg: Any, num_ids: int, spec: MoESpec) -> None:
        super().__init__()
        self.spec, self.scaling = spec, float(cfg.routed_scaling_factor)
        self.classifier = nn.Module()
        self.classifier.weight = new_param(num_ids, cfg.hidden_size, dtype=torch.float32)
        self.e_score_correction_bias = new_param(num_ids, dtype=torch.float32)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = F.linear(x.float(), self.classifier.weight).softmax(dim=-1)
        return select_experts_by_scores(scores, self.spec.top_k, renormalize=self.spec.renormalize,
                                        scaling=self.scaling, bias=self.e_score_correction_bias)


class LongcatMoE(nn.Module):
    """The routed experts (fused) and the identity experts: ``sum_k w_k * expert_k(x)``, an identity's ``w_k * x``."""

    def __init__(self, spec: MoESpec, b: DecoderBuild) -> None:
        super().__init__()
        cfg = b.hf_config
        self.num_routed = spec.num_experts
        self.router = LongcatRouter(cfg, spec.num_experts + int(cfg.zero_expert_num or 0), spec)
        self.experts = FusedMoE(spec, cfg.hidden_size, b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.router(x)
        identity = ids >= self.num_routed
        out = self.experts(x, weights.masked_fill(identity, 0.0), ids.masked_fill(identity, -1))
        kept = (weights * identity).sum(dim=-1, keepdim=True)  # the identity experts' weights
        return out + (x * kept).to(x.dtype)


class LongcatDecoderLayer(nn.Module):
    """Two attention blocks and two dense MLPs, each pre-normed, and the shortcut MoE (the module doc)."""

    def __init__(self, b: DecoderBuild, layer_idx: int) -> None:
        super().__init__()
        cfg, ops = b.hf_config, b.attn_backend.ops
        self.self_attn = nn.ModuleList(LongcatAttention(b, 2 * layer_idx + i) for i in range(2))
        self.mlps = nn.ModuleList(LlamaMLP(b) for _ in range(2))
        self.mlp = b.make_mlp(b, layer_idx)
        self.input_layernorm = nn.ModuleList(RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, b.dtype, ops)
                                             for _ in range(2))
        self.post_attention_layernorm = nn.ModuleList(RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, b.dtype, ops)
                                                      for _ in range(2))

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                kv_caches: list[torch.Tensor], metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's output, the residual stream before it), as `LlamaDecoderLayer`'s; ``kv_caches``:
        its two attention blocks' caches."""
        hidden, residual = norm_in(self.input_layernorm[0], hidden, residual)
        hidden = self.self_attn[0](positions, hidden, kv_caches[0], metadata)
        hidden, residual = self.post_attention_layernorm[0](hidden, residual)
        shortcut = self.mlp(hidden)
        hidden, residual = self.input_layernorm[1](self.mlps[0](hidden), residual)
        hidden = self.self_attn[1](positions, hidden, kv_caches[1], metadata)
        hidden, residual = self.post_attention_layernorm[1](hidden, residual)
        return self.mlps[1](hidden) + shortcut, residual


class LongcatModel(LlamaModel):
    """``num_layers`` LongCat layers over ``2 * num_layers`` cache layers (no pipeline stages)."""

    def __init__(self, b: DecoderBuild) -> None:
        nn.Module.__init__(self)
        cfg = b.hf_config
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, b.tp, b.dtype)
        self.layers = nn.ModuleList(LongcatDecoderLayer(b, i) for i in range(num_layers(cfg)))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, b.dtype, b.attn_backend.ops)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                metadata: AttentionMetadata, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        assert len(kv_caches) == 2 * len(self.layers), (len(kv_caches), len(self.layers))
        hidden, residual = self.embed(input_ids, positions, inputs_embeds), None
        for i, layer in enumerate(self.layers):
            hidden, residual = layer(positions, hidden, residual, kv_caches[2 * i: 2 * i + 2], metadata)
        return self.final(hidden, residual)


def num_layers(cfg: Any) -> int:
    """The decoder layers: ``num_layers`` (config.json's), else half the attention blocks."""
    return int(getattr(cfg, "num_layers", None) or cfg.num_hidden_layers // 2)


class LongcatFlashForCausalLM(DeepseekV2ForCausalLM):
    """LongCat-Flash's causal LM (the module doc)."""

    model_cls = LongcatModel
    lora_experts = False

    @classmethod
    def kv_cache_shapes(cls, hf_config: Any) -> list[tuple[int, int]]:
        """One latent cache layer (one head, rotary key and latent) per attention block: two per decoder layer."""
        return [(1, int(hf_config.qk_rope_head_dim + hf_config.kv_lora_rank))] * (2 * num_layers(hf_config))

    @classmethod
    def moe_spec(cls, hf_config: Any, layer_idx: int) -> MoESpec | None:
        """Every layer's routed experts (the identity experts are the router's, `LongcatMoE`)."""
        return MoESpec(int(hf_config.n_routed_experts), int(hf_config.moe_topk), int(hf_config.expert_ffn_hidden_size),
                       renormalize=False, weights_in_model_dtype=False)

    @classmethod
    def dense_mlp_sizes(cls, hf_config: Any) -> dict[str, int]:
        """The two dense MLPs of every layer, beside its experts (`registry.check_tensor_parallel` splits them)."""
        return {"ffn_hidden_size": int(hf_config.ffn_hidden_size)}

    @classmethod
    def make_mlp(cls, b: DecoderBuild, layer_idx: int) -> nn.Module:
        return LongcatMoE(cls.moe_spec(b.hf_config, layer_idx), b)

    def __init__(self, hf_config: Any, **kwargs: Any) -> None:
        check_longcat(hf_config)
        super().__init__(hf_config, **kwargs)

    def unread_weight(self, name: str) -> bool:
        """The multi-token-prediction weights (``model.mtp.*``) and the identity experts' gate/up rows (ids past
        ``n_routed_experts``), besides DeepSeek's unread ones."""
        expert = _EXPERT_ID.search(name)
        if expert is not None and int(expert.group(1)) >= self.model.layers[0].mlp.num_routed:
            return True
        return name.startswith("model.mtp.") or super().unread_weight(name)

    def _on_this_rank(self, ckpt_name: str) -> bool:
        """Stacked experts cut per id (`MoECausalLM._per_expert`) include the identity ids: not read."""
        return not self.unread_weight(ckpt_name) and super()._on_this_rank(ckpt_name)


def check_longcat(hf_config: Any) -> None:
    """`NotBuiltError` for LongCat settings transformers does not run: a router bias (its classifier's bias is never
    added), identity experts of another kind, MLA scales switched off (transformers always applies them), a rope
    width other than ``qk_rope_head_dim``, an activation other than SiLU."""
    if getattr(hf_config, "router_bias", False):
        raise NotBuiltError("router_bias", True, "LongCat's router without a bias (transformers adds none)")
    kind = getattr(hf_config, "zero_expert_type", None) or "identity"
    if kind != "identity":
        raise NotBuiltError("zero_expert_type", kind, "LongCat's identity zero experts")
    for field in ("mla_scale_q_lora", "mla_scale_kv_lora"):
        if getattr(hf_config, field, True) is False:
            raise NotBuiltError(field, False, "LongCat's MLA LoRA scales applied (transformers always applies them)")
    head_dim = getattr(hf_config, "head_dim", None)
    if head_dim is not None and head_dim != hf_config.qk_rope_head_dim:
        raise NotBuiltError("head_dim", head_dim, f"LongCat's rope as wide as qk_rope_head_dim "
                                                  f"({hf_config.qk_rope_head_dim}): transformers' rotary reads head_dim")
    check_silu(hf_config)
