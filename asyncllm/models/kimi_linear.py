"""Kimi-Linear (``KimiLinearForCausalLM``: Moonshot's Kimi-Linear-48B-A3B Base / Instruct): a hybrid of Kimi
Delta Attention layers (asyncllm/models/kimi_delta.py) and DeepSeek's multi-head latent attention without positions,
over DeepSeek-V3's experts.

- **Layers.** By ``layer_types`` (from the checkpoint's ``linear_attn_config``: ``kda_layers`` / ``full_attn_layers``,
  1-based), a KDA layer or latent attention, both named ``self_attn``; plain RMSNorms before each mixer and MLP.
- **Latent attention** is `DeepseekAttention` (its latent cache, the absorbed key and value expansions) with no
  rotation at all: transformers leaves the ``qk_rope_head_dim`` part of the query and of the shared key as they
  are (Kimi's NoPE MLA), so the layer gets no rotary table; scores scaled by ``(nope + rope) ** -0.5``.
- **Experts.** Dense SiLU MLPs where ``mlp_layer_types`` says "dense" (the first ``first_k_dense_replace``), then
  DeepSeek-V3's routing (sigmoid scores plus ``e_score_correction_bias`` among the best ``topk_group`` of
  ``num_expert_group`` groups, renormalized when ``moe_renormalize``, times ``routed_scaling_factor``) over
  ``num_experts`` experts plus ``num_shared_experts`` shared ones.
- **States.** Only the latent-attention layers get KV-cache tensors (one ``rope + kv_lora_rank`` wide row a
  token); the KDA layers keep per-request states by worker row, preallocated with the model (asyncllm/models/
  hybrid.py), restored from saved states on a prefix-cache hit.

Checkpoint names are Moonshot's (``block_sparse_moe``, experts ``w1`` / ``w3`` / ``w2``, ``q_conv1d`` /
``k_conv1d`` / ``v_conv1d``: stacked into one convolution at load), which transformers also saves; its in-memory
``mlp``, ``conv1d`` and ``forget_gate.`` names load too.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import torch

from asyncllm.errors import NotBuiltError
from asyncllm.models.deepseek import DeepseekAttention, DeepseekV2ForCausalLM
from asyncllm.models.hybrid import HybridBuild, HybridLayer, HybridModel, StateLayersMixin, renamed
from asyncllm.models.kimi_delta import KimiDeltaAttention
from asyncllm.models.layers import LoadedWeight, RMSNorm, TensorParallel
from asyncllm.models.moe import MoESpec

__all__ = ["KimiLinearForCausalLM"]

_RENAMES = ((".block_sparse_moe.", ".mlp."), (".self_attn.forget_gate.", ".self_attn."))
"""Moonshot's MoE block and transformers' forget-gate module, as this model names them."""
_CONVS = ("q_conv1d", "k_conv1d", "v_conv1d")


class KimiLinearDecoderLayer(HybridLayer):
    """A KDA layer or latent attention (both ``self_attn``) after an RMSNorm, then a dense MLP or experts."""

    state_name = "self_attn"

    def __init__(self, b: HybridBuild, layer_idx: int) -> None:
        cfg = b.hf_config
        norm = lambda: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, b.dtype, b.attn_backend.ops)  # noqa: E731
        super().__init__(b, layer_idx, norm, lambda: KimiDeltaAttention(cfg, b.dtype, b.state_rows),
                         lambda: DeepseekAttention(b, layer_idx))


class KimiLinearModel(HybridModel):
    layer_cls = KimiLinearDecoderLayer


class KimiLinearForCausalLM(StateLayersMixin, DeepseekV2ForCausalLM):
    """Kimi-Linear's hybrid stack (see the module doc)."""

    model_cls = KimiLinearModel
    expert_parts = {"w1": "gate", "w3": "up", "w2": "down"}

    @classmethod
    def kv_cache_shapes(cls, hf_config: Any) -> list[tuple[int, int]]:
        """One latent row a token, in the latent-attention layers only."""
        width = int(hf_config.qk_rope_head_dim + hf_config.kv_lora_rank)
        return [(1, width)] * cls.kv_cache_layers(hf_config)

    @classmethod
    def moe_spec(cls, hf_config: Any, layer_idx: int) -> MoESpec | None:
        if hf_config.mlp_layer_types[layer_idx] != "sparse":
            return None
        size = hf_config.moe_intermediate_size
        return MoESpec(hf_config.num_local_experts, hf_config.num_experts_per_tok, size,
                       renormalize=bool(hf_config.norm_topk_prob), weights_in_model_dtype=False,
                       shared_expert_size=size * (hf_config.n_shared_experts or 0))

    def __init__(self, hf_config: Any, **kwargs: Any) -> None:
        for kind in hf_config.layer_types:
            if kind not in ("linear_attention", "full_attention"):
                raise NotBuiltError("layer_types", kind, "Kimi-Linear's KDA (linear_attention) and latent "
                                                         "attention (full_attention) layers")
        quant = getattr(hf_config, "quantization_config", None)
        if quant:
            method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
            raise NotBuiltError("quantization_config", method, "a pre-quantized Kimi-Linear checkpoint (its "
                                                               "bfloat16 release is served)")
        super().__init__(hf_config, **kwargs)

    def decoder_build(self, hf_config: Any, dtype: torch.dtype, tp: TensorParallel, attn_backend: Any,
                      max_position: int, expert_parallel: bool) -> HybridBuild:
        """No rotary table: the latent attention uses no positions."""
        return HybridBuild(hf_config, self.decoder_flags(hf_config), dtype, tp, attn_backend, None,  # type: ignore[arg-type]
                           self.make_mlp, expert_parallel, state_rows=self.state_rows)

    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        named = ((renamed(name, _RENAMES), w) for name, w in weights)
        return super().load_weights(_stacked_convs(named))


def _stacked_convs(weights: Iterable[tuple[str, LoadedWeight]]) -> Iterator[tuple[str, LoadedWeight]]:
    """The checkpoint's three short convolutions of a KDA layer as its one ``conv1d`` (q's, k's, v's channels in
    that order), yielded once all three are read."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, weight in weights:
        prefix, _, leaf = name.rpartition(".")
        if leaf != "weight" or not prefix.endswith(_CONVS):
            yield name, weight
            continue
        layer, _, conv = prefix.rpartition(".")
        parts = pending.setdefault(layer, {})
        parts[conv] = weight if isinstance(weight, torch.Tensor) else weight[:]
        if len(parts) == len(_CONVS):
            del pending[layer]
            yield f"{layer}.conv1d.weight", torch.cat([parts[c] for c in _CONVS])
    if pending:
        raise ValueError(f"KDA convolutions missing from the checkpoint: {sorted(pending)} lack one of {_CONVS}")
