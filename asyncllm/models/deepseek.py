"""DeepSeek-V2 / V2-Lite / V2.5 (``DeepseekV2ForCausalLM``) and DeepSeek-V3 / R1 / V3.1 (``DeepseekV3ForCausalLM``):
multi-head latent attention and a mixture of experts with shared experts, on the Llama layers of llama.py.

- **Attention.** Queries come from ``q_proj`` (or the low-rank ``q_a_proj`` -> RMSNorm -> ``q_b_proj``); keys and
  values from one latent: ``kv_a_proj_with_mqa`` gives the latent and a single rotary key shared by every head, the
  latent is normed and ``kv_b_proj`` would expand it to each head's key (no rope) and value. The paged cache holds
  the latent itself (vLLM's MLA cache): one head per token, ``[rotary key, normed latent]`` (576 = 64 + 512 wide in
  V3; a one-part cache, its keys are its values), 85 times less than the expanded keys and values of V3's 128 heads.
  Each query head absorbs its key expansion (``q_nope @ W_UK``, so ``q . k`` over the cached row equals the
  expanded ``q_nope . k_nope + q_rot . k_rot``); the attention's output over the cached rows, less its rotary part,
  goes through the head's value expansion ``W_UV`` before ``o_proj``. Both expansions are read from ``kv_b_proj``
  (its product with the identity, so a quantized layer's too) and kept, refreshed in place when its weight
  changes. The rotation runs in torch before the cache write (none where the build has no rotary table:
  Kimi-Linear's latent attention, asyncllm/models/kimi_linear.py). Interleaved rotary pairs (V2; V3's
  ``rope_interleave``) are de-interleaved before the half-split rotation, which turns them by the same angles:
  q . k is unchanged. The scores' scale is ``192 ** -0.5`` times YaRN's ``mscale(factor, mscale_all_dim) ** 2``.
- **Experts.** The first ``first_k_dense_replace`` layers are dense; the others route each token to
  ``num_experts_per_tok`` of ``n_routed_experts`` (the fused-MoE op) and add ``n_shared_experts`` dense experts.
  V2: a float32 softmax, the top k (``greedy``) or the top k of the best ``topk_group`` groups by their best expert
  (``group_limited_greedy``). V3: sigmoid scores, chosen by score plus ``e_score_correction_bias`` among the
  ``topk_group`` groups whose two best sum highest, weighted by the plain scores (renormalized when
  ``norm_topk_prob``). Both scale the weights by ``routed_scaling_factor``, as transformers does.

A checkpoint's multi-token-prediction layers (layer indices past ``num_hidden_layers``) are left unread, as
transformers does.
"""

from __future__ import annotations

import math
from typing import Any, Iterable

import torch
from torch import nn

from asyncllm.attention.metadata import AttentionMetadata
from asyncllm.errors import NotBuiltError
from asyncllm.kernels import reference
from asyncllm.models.deepseek_moe import DeepseekMoE, check_routing
from asyncllm.models.layers import Attention, LoadedWeight, RMSNorm, TensorParallel
from asyncllm.models.linear import ColumnParallelLinear, RowParallelLinear
from asyncllm.models.llama import DecoderBuild, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel
from asyncllm.models.lora import slot_masked
from asyncllm.models.ministral3 import attention_temperature
from asyncllm.models.moe import MoECausalLM, MoESpec
from asyncllm.models.rotary import RotaryEmbedding, rope_parameters

__all__ = ["DeepseekExperts", "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "Glm4MoeLiteForCausalLM",
           "Mistral4ForCausalLM", "kv_head_dim"]

_LATENT_NORM_EPS = 1e-6
"""transformers' q_a_layernorm / kv_a_layernorm use RMSNorm's default eps, not ``rms_norm_eps``."""


def kv_head_dim(hf_config: Any) -> int:
    """The width of a query head (and of the expanded key head it is scored against): the rotary part plus the
    rest."""
    return int(hf_config.qk_nope_head_dim + hf_config.qk_rope_head_dim)


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def attention_scale(hf_config: Any) -> float:
    """``head_dim ** -0.5``, times ``mscale(factor, mscale_all_dim) ** 2`` under a scaled rope (YaRN)."""
    scale = kv_head_dim(hf_config) ** -0.5
    params = rope_parameters(hf_config)
    if params.get("rope_type", "default") != "default" and params.get("mscale_all_dim"):
        scale *= _yarn_mscale(params["factor"], params["mscale_all_dim"]) ** 2
    return scale


def pairs_to_halves(x: torch.Tensor) -> torch.Tensor:
    """Interleaved rotary pairs ``(x0, x1), (x2, x3), ...`` -> ``x0, x2, ..., x1, x3, ...`` (last dim)."""
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)


class DeepseekAttention(nn.Module):
    """Multi-head latent attention over a cache of latents (see the module doc): the queries absorb each head's key
    expansion, the output its value expansion."""

    def __init__(self, b: DecoderBuild, layer_idx: int) -> None:
        super().__init__()
        cfg, tp, dtype, ops = b.hf_config, b.tp, b.dtype, b.attn_backend.ops
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.latent = cfg.kv_lora_rank
        self.head_dim = kv_head_dim(cfg)
        heads, hidden, bias = cfg.num_attention_heads, cfg.hidden_size, bool(getattr(cfg, "attention_bias", False))
        self.num_heads = tp.split(heads)
        whole = TensorParallel()  # the low-rank down projections: every rank computes them whole
        self.q_lora = cfg.q_lora_rank is not None
        if self.q_lora:
            self.q_a_proj = ColumnParallelLinear(hidden, cfg.q_lora_rank, bias, whole, dtype)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, _LATENT_NORM_EPS, dtype, ops)
            self.q_b_proj = ColumnParallelLinear(cfg.q_lora_rank, heads * self.head_dim, False, tp, dtype)
        else:
            self.q_proj = ColumnParallelLinear(hidden, heads * self.head_dim, False, tp, dtype)
        self.kv_a_proj_with_mqa = ColumnParallelLinear(hidden, self.latent + self.rope, bias, whole, dtype)
        self.kv_a_layernorm = RMSNorm(self.latent, _LATENT_NORM_EPS, dtype, ops)
        self.kv_b_proj = ColumnParallelLinear(self.latent, heads * (self.nope + self.v_dim), False, tp, dtype)
        self.o_proj = RowParallelLinear(heads * self.v_dim, hidden, bias, tp, dtype)
        self.interleaved = b.hf_config.model_type == "deepseek_v2" or bool(getattr(cfg, "rope_interleave", False))
        self.rotary_emb = b.rotary_emb
        self.attn = Attention(self.num_heads, 1, self.rope + self.latent, b.attn_backend, scale=attention_scale(cfg))
        params = rope_parameters(cfg)
        self.beta = float(params.get("llama_4_scaling_beta") or 0.0)
        """Mistral 4's query temperature by position (Ministral 3's, asyncllm/models/ministral3.py); 0: none."""
        self.original = int(params.get("original_max_position_embeddings") or 0)
        self.absorbed: tuple[torch.Tensor, torch.Tensor] | None = None
        """(each head's key expansion ``[heads, nope, latent]``, value expansion ``[heads, v, latent]``) from
        ``kv_b_proj``, refreshed in place whenever its weight changes (`expansions`)."""
        self._absorbed_from: tuple[int, int] | None = None

    def expansions(self, refresh: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """``kv_b_proj``'s matrix per head, split into its key and value expansions: the product of the layer (a
        quantized one too) with the identity, recomputed in place after a weight load or update (so CUDA graphs
        captured over these tensors read the new values). A weight replaced (quantized) is noticed here; one
        copied in place (``param.data``, which keeps the version counter still) needs ``refresh``, as
        `DeepseekV2ForCausalLM.refresh_derived_weights` asks after a weight update."""
        weight = self.kv_b_proj.weight
        version = (weight.data_ptr(), weight._version)
        if refresh or self._absorbed_from != version or self.absorbed is None:
            eye = torch.eye(self.latent, dtype=self.kv_b_proj.params_dtype, device=weight.device)
            # the weight alone (matmul): its adapters apply per token, beside these
            dense = self.kv_b_proj.matmul(eye, None).t().reshape(self.num_heads, self.nope + self.v_dim, self.latent)
            w_uk, w_uv = dense.split([self.nope, self.v_dim], dim=1)
            if self.absorbed is None:
                self.absorbed = (w_uk.contiguous(), w_uv.contiguous())
            else:
                self.absorbed[0].copy_(w_uk)
                self.absorbed[1].copy_(w_uv)
            self._absorbed_from = version
        return self.absorbed

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        query, key = self.query_and_key(positions, hidden, self.query_latent(hidden))
        out = self.attn(query, key, None, kv_cache, metadata).view(hidden.shape[0], self.num_heads, -1)
        return self.output(out[..., self.rope:])

    def query_latent(self, hidden: torch.Tensor) -> torch.Tensor:
        """The low-rank queries' normed latent (``q_a_layernorm(q_a_proj(x))``; DeepSeek-V3.2's indexer reads it
        too), or the hidden states where the queries are full-rank."""
        return self.q_a_layernorm(self.q_a_proj(hidden)) if self.q_lora else hidden

    def query_and_key(self, positions: torch.Tensor, hidden: torch.Tensor, q_latent_in: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """The absorbed queries ``[T, heads, rope + latent]`` and the cache's rows ``[T, 1, rope + latent]``."""
        tokens, heads = hidden.shape[0], self.num_heads
        q = self.q_b_proj(q_latent_in) if self.q_lora else self.q_proj(q_latent_in)
        q_nope, q_rot = q.view(tokens, heads, self.head_dim).split([self.nope, self.rope], dim=-1)
        latent, k_rot = self.kv_a_proj_with_mqa(hidden).split([self.latent, self.rope], dim=-1)
        if self.rotary_emb is None:  # Kimi-Linear's latent attention: no positions (its "rotary" part stays as is)
            k_rot = k_rot.unsqueeze(1)
        else:
            if self.interleaved:
                q_rot, k_rot = pairs_to_halves(q_rot), pairs_to_halves(k_rot)
            q_rot, k_rot = reference.apply_rotary(q_rot, k_rot.unsqueeze(1), positions,
                                                  self.rotary_emb.cos_sin_cache)
        q_latent = torch.bmm(q_nope.transpose(0, 1), self.expansions()[0]).transpose(0, 1)  # [T, heads, latent]
        adapters = self.kv_b_proj.lora
        if adapters is not None and adapters.context.mask is not None:
            q_latent = q_latent + self._key_adapters(adapters, q_nope)
        query = torch.cat([q_rot, q_latent], dim=-1)
        if self.beta:  # a per-position scalar
            query = query * attention_temperature(positions, self.beta, self.original).to(query.dtype)
        key = torch.cat([k_rot, self.kv_a_layernorm(latent).unsqueeze(1)], dim=-1)  # one head: the cache's row
        return query, key

    def output(self, out: torch.Tensor) -> torch.Tensor:
        """The attention-weighted latents ``[T, heads, latent]`` through each head's value expansion, then
        ``o_proj``."""
        tokens = out.shape[0]
        values = torch.bmm(out.transpose(0, 1), self.expansions()[1].transpose(1, 2)).transpose(0, 1)  # [T, heads, v]
        adapters = self.kv_b_proj.lora
        if adapters is not None and adapters.context.mask is not None:
            values = values + self._value_adapters(adapters, out)
        return self.o_proj(values.reshape(tokens, self.num_heads * self.v_dim))


    def _adapter_halves(self, adapters: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """``kv_b_proj``'s adapter slots' B (scaled) per head, split into the key rows ``[heads, nope, slots * r]``
        and the value rows ``[heads, v, slots * r]``."""
        b = adapters.b.view(self.num_heads, self.nope + self.v_dim, -1)
        return b[:, :self.nope], b[:, self.nope:]

    def _key_adapters(self, adapters: Any, q_nope: torch.Tensor) -> torch.Tensor:
        """The adapters' share of the absorbed queries: each head's key expansion gains ``B_k A`` (B's key rows, A
        over the latent), so ``q_nope`` gains ``(q_nope B_k) A`` per token, its request's slot alone kept."""
        tokens = q_nope.shape[0]
        qb = torch.einsum("thn,hnc->thc", q_nope, self._adapter_halves(adapters)[0])
        return _masked(adapters, qb.view(tokens, self.num_heads, adapters.num_slots, -1)) @ adapters.a

    def _value_adapters(self, adapters: Any, out: torch.Tensor) -> torch.Tensor:
        """The adapters' share of each head's values from the attention-weighted latent: ``B_v (A out)``."""
        tokens = out.shape[0]
        oa = (out @ adapters.a.t()).view(tokens, self.num_heads, adapters.num_slots, -1)
        return torch.einsum("thc,hvc->thv", _masked(adapters, oa), self._adapter_halves(adapters)[1])


def _masked(adapters: Any, per_slot: torch.Tensor) -> torch.Tensor:
    """``[tokens, heads, slots, r]`` with every slot but the token's request's zeroed, flattened to
    ``[tokens, heads, slots * r]``."""
    return slot_masked(per_slot, adapters.context.mask[:, None, :, None]).flatten(2)


class DeepseekDecoderLayer(LlamaDecoderLayer):
    attention_cls = DeepseekAttention  # type: ignore[assignment]

    def __init__(self, b: DecoderBuild, layer_idx: int) -> None:
        super().__init__(b, layer_idx)
        self.fused_decode_rows = 0  # the fused decode products read a qkv_proj these layers do not have


class DeepseekModel(LlamaModel):
    layer_cls = DeepseekDecoderLayer


class DeepseekExperts(MoECausalLM):
    """Mixin before `LlamaForCausalLM` for DeepSeek-style experts (DeepSeek, GLM-4.5): dense first layers, then
    `DeepseekMoE`; the multi-token-prediction layers past ``num_hidden_layers`` left unread."""

    lora_experts = True  # GLM-4.5, dots.llm1, EXAONE MoE, Solar Open, DeepSeek itself

    @classmethod
    def moe_spec(cls, hf_config: Any, layer_idx: int) -> MoESpec | None:
        kinds = getattr(hf_config, "mlp_layer_types", None)  # GLM-4.7-Flash's "dense" / "sparse" per layer
        first_dense = getattr(hf_config, "first_k_dense_replace", 0) or 0  # Solar Open: none
        dense = kinds[layer_idx] == "dense" if kinds else layer_idx < first_dense
        if dense or not hf_config.n_routed_experts:
            return None
        return MoESpec(hf_config.n_routed_experts, hf_config.num_experts_per_tok, hf_config.moe_intermediate_size,
                       renormalize=bool(getattr(hf_config, "norm_topk_prob", False)), weights_in_model_dtype=False,
                       shared_expert_size=hf_config.moe_intermediate_size * (hf_config.n_shared_experts or 0))

    @classmethod
    def make_mlp(cls, b: DecoderBuild, layer_idx: int) -> nn.Module:
        spec = cls.moe_spec(b.hf_config, layer_idx)
        return LlamaMLP(b) if spec is None else DeepseekMoE(spec, b)

    def unread_weight(self, name: str) -> bool:
        """Whether the loader leaves a checkpoint tensor unread: a multi-token-prediction layer's, past the last
        (files may hold them; a pushed one is refused, workers/weight_update.py)."""
        parts, num_layers = name.split("."), len(self.model.layers)  # type: ignore[attr-defined]
        return len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit() and int(parts[2]) >= num_layers

    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        return super().load_weights((name, w) for name, w in weights if not self.unread_weight(name))


class DeepseekV2ForCausalLM(DeepseekExperts, LlamaForCausalLM):
    """DeepSeek-V2's layers: latent attention, dense then mixture-of-experts MLPs."""

    model_cls = DeepseekModel
    kv_cache_parts = 1
    """The cache holds keys only: each token's rotary key and normed latent, which are the values too."""

    @classmethod
    def kv_cache_shapes(cls, hf_config: Any) -> list[tuple[int, int]]:
        """One head per layer, as wide as the rotary key and the latent (DeepSeek-V3: 64 + 512)."""
        return [(1, int(hf_config.qk_rope_head_dim + hf_config.kv_lora_rank))] * hf_config.num_hidden_layers
    packed_modules = {"gate_up_proj": [("gate_proj", 0), ("up_proj", 1)]}
    """The attention's projections load as the checkpoint names them; only the MLPs' gate and up are fused."""

    @classmethod
    def decoder_build(cls, hf_config: Any, dtype: torch.dtype, tp: TensorParallel, attn_backend: Any,
                      max_position: int, expert_parallel: bool) -> DecoderBuild:
        rotary = RotaryEmbedding(hf_config, hf_config.qk_rope_head_dim, max_position)
        return DecoderBuild(hf_config, cls.decoder_flags(hf_config), dtype, tp, attn_backend, rotary, cls.make_mlp,
                            expert_parallel)

    def __init__(self, hf_config: Any, **kwargs: Any) -> None:
        check_deepseek(hf_config)
        super().__init__(hf_config, **kwargs)

    @torch.inference_mode()
    def refresh_derived_weights(self) -> None:
        """Recompute every latent attention's absorbed expansions from its ``kv_b_proj`` now, in place (after a weight
        update, before the CUDA graphs that read them replay): each layer's, LongCat-Flash's two a layer."""
        for module in self.model.modules():
            if isinstance(module, DeepseekAttention) and module.absorbed is not None:
                module.expansions(refresh=True)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """DeepSeek-V3's: the same layers, sigmoid routing with a score correction."""


class Mistral4ForCausalLM(DeepseekV3ForCausalLM):
    """Mistral 4: V3's latent attention with Ministral 3's query temperature by position
    (``llama_4_scaling_beta``), experts routed by softmax scores among the groups whose two best scores lead,
    renormalized (``norm_topk_prob``), no score correction. Experts load per expert or fused (``mlp.experts.
    gate_up_proj`` / ``down_proj``, as transformers saves them)."""

    def __init__(self, hf_config: Any, **kwargs: Any) -> None:
        super().__init__(hf_config, **kwargs)
        self.expert_sizes = (int(hf_config.hidden_size), int(hf_config.moe_intermediate_size))

    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        from asyncllm.models.qwen3_vl_moe import split_fused_experts

        return super().load_weights(split_fused_experts(weights, *self.expert_sizes))


class Glm4MoeLiteForCausalLM(DeepseekV3ForCausalLM):
    """GLM-4.7-Flash: DeepSeek-V3's latent attention (its rope interleaved unless ``rope_interleave`` is off) and
    experts (GLM-4.5's routing: grouped sigmoid with the correction, shared experts), dense MLPs where
    ``mlp_layer_types`` says "dense"; the multi-token-prediction layer past ``num_hidden_layers`` left unread."""


def check_deepseek(hf_config: Any) -> None:
    """`NotBuiltError` for the DeepSeek variants not built."""
    if hf_config.num_key_value_heads != hf_config.num_attention_heads:
        raise NotBuiltError("num_key_value_heads", hf_config.num_key_value_heads,
                            "DeepSeek with one key and value head per query head (its latent expands to every head)")
    check_routing(hf_config)


class YoutuForCausalLM(DeepseekV3ForCausalLM):
    """Tencent Youtu-LLM (Youtu-LLM-2B): DeepSeek-V3's latent attention (its interleaved rope) with a dense SiLU MLP in
    every layer, no experts."""

    @classmethod
    def moe_spec(cls, hf_config: Any, layer_idx: int) -> MoESpec | None:
        return None
