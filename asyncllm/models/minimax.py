"""MiniMax-Text-01 / MiniMax-M1 (``MiniMaxForCausalLM``): by ``layer_types`` a lightning-attention layer
(asyncllm/models/lightning_attention.py) or Llama's softmax attention with the rotary, each followed by Mixtral's
experts (softmax top k, renormalized; ``block_sparse_moe``, experts ``w1`` / ``w3`` / ``w2``), on the hybrid stack of
asyncllm/models/hybrid.py.

- **Post-norm residuals.** A layer's residual is its normed input, weighted as the config says: ``h = a1 n1 +
  b1 mixer(n1)`` with ``n1 = input_layernorm(x)``, then ``out = a2 n2 + b2 moe(n2)`` with ``n2 =
  post_attention_layernorm(h)``; ``(a1, b1)`` are ``linear_attn_alpha_factor`` / ``linear_attn_beta_factor`` in
  the lightning layers, ``full_attn_alpha_factor`` / ``full_attn_beta_factor`` in the others, ``(a2, b2)``
  ``mlp_alpha_factor`` / ``mlp_beta_factor``. The two weighted terms travel as the stack's (hidden, residual) pair,
  summed inside the next norm's fused add (the final norm's too), so pipeline stages pass them as any decoder's.
- **States.** Only the softmax layers get KV-cache tensors; the lightning layers keep a state per request by worker
  row, restored from saved states on a prefix-cache hit (docs/hybrid-models.md).
- **Positions.** A config's ``rotary_dim`` (the original release's field: half of each 128-wide head) rotates that
  many dimensions, as MiniMax's own code and vLLM do; transformers 5.24's MiniMax ignores the field and rotates
  whole heads, which a config without it (or with ``rotary_dim == head_dim``) matches.

The checkpoint's decay buffers (``slope_rate``, ``query_decay``, ``key_decay``, ``diagonal_decay``: what
save_pretrained writes) are skipped; the layers compute their decay rates from the config as transformers does.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from typing import Any, Iterable

import torch

from asyncllm.attention.metadata import AttentionMetadata
from asyncllm.errors import ConfigError, NotBuiltError
from asyncllm.models.hybrid import HybridBuild, HybridLayer, HybridModel, StateLayersMixin
from asyncllm.models.layers import LoadedWeight, RMSNorm, TensorParallel, head_dim_of, norm_in
from asyncllm.models.lightning_attention import LightningAttention
from asyncllm.models.llama import LlamaAttention
from asyncllm.models.mixtral import MixtralForCausalLM
from asyncllm.models.phi3 import check_phi3
from asyncllm.models.rotary import RotaryEmbedding, rope_parameters

__all__ = ["MiniMaxForCausalLM"]

_DECAY_BUFFERS = ("slope_rate", "query_decay", "key_decay", "diagonal_decay")
"""transformers' lightning-attention buffers, saved in its checkpoints and computed here instead."""
_LAYER_O_PROJ = re.compile(r"^model\.layers\.(\d+)\.self_attn\.o_proj\.")


def _scaled(x: torch.Tensor, factor: float) -> torch.Tensor:
    return x if factor == 1 else x * factor


class MiniMaxDecoderLayer(HybridLayer):
    """Lightning or softmax attention (both ``self_attn``) and the experts, with MiniMax's weighted post-norm
    residuals (see the module doc)."""

    state_name = "self_attn"

    def __init__(self, b: HybridBuild, layer_idx: int) -> None:
        cfg = b.hf_config
        norm = lambda: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, b.dtype, b.attn_backend.ops)  # noqa: E731
        super().__init__(b, layer_idx, norm,
                         lambda: LightningAttention(cfg, layer_idx, b.dtype, b.state_rows, b.attn_backend.ops),
                         lambda: LlamaAttention(b, layer_idx))
        kind = "linear_attn" if self.is_linear else "full_attn"
        self.mixer_factors = (getattr(cfg, f"{kind}_alpha_factor"), getattr(cfg, f"{kind}_beta_factor"))
        self.mlp_factors = (cfg.mlp_alpha_factor, cfg.mlp_beta_factor)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: torch.Tensor | None, metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """``(b2 moe(n2), a2 n2)``: the layer's output, its two terms apart (their sum is the next layer's input)."""
        normed, _ = norm_in(self.input_layernorm, hidden, residual)
        out = self.mixer()(positions, normed, kv_cache, metadata)
        (alpha, beta), (mlp_alpha, mlp_beta) = self.mixer_factors, self.mlp_factors
        normed, _ = self.post_attention_layernorm(_scaled(out, beta), _scaled(normed, alpha))
        return _scaled(self.mlp(normed), mlp_beta), _scaled(normed, mlp_alpha)


class MiniMaxModel(HybridModel):
    layer_cls = MiniMaxDecoderLayer


class MiniMaxForCausalLM(StateLayersMixin, MixtralForCausalLM):
    """MiniMax's hybrid stack (see the module doc)."""

    model_cls = MiniMaxModel

    def __init__(self, hf_config: Any, **kwargs: Any) -> None:
        check_minimax(hf_config)
        super().__init__(hf_config, **kwargs)
        self.layer_kinds = list(hf_config.layer_types)

    def decoder_build(self, hf_config: Any, dtype: torch.dtype, tp: TensorParallel, attn_backend: Any,
                      max_position: int, expert_parallel: bool) -> HybridBuild:
        """The hybrid build, its rotary turning the config's ``rotary_dim`` of each head."""
        build = super().decoder_build(hf_config, dtype, tp, attn_backend, max_position, expert_parallel)
        partial = _with_rotary_dim(hf_config)
        if partial is None:
            return build
        return dataclasses.replace(build, rotary_emb=RotaryEmbedding(partial, head_dim_of(hf_config), max_position))

    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        return super().load_weights((name, w) for name, w in weights
                                    if not name.endswith(tuple(f".self_attn.{b}" for b in _DECAY_BUFFERS)))

    def _packed(self, ckpt_name: str) -> tuple[str, object]:
        """As Mixtral's; an adapter's lightning-layer ``o_proj`` (asyncllm/lora_names.py writes every attention's
        ``out_proj`` so) is that layer's ``out_proj``."""
        match = _LAYER_O_PROJ.match(ckpt_name)
        if match is not None and self.layer_kinds[int(match.group(1))] == "linear_attention":
            return ckpt_name.replace(".self_attn.o_proj.", ".self_attn.out_proj."), None
        return super()._packed(ckpt_name)

    def _unpacked(self, param_name: str) -> list[tuple[str, object]]:
        """A lightning layer's ``qkv_proj`` is the checkpoint's own (fused per head), not Llama's q, k and v."""
        module, _, _ = param_name.rpartition(".qkv_proj.")
        if module and isinstance(self.get_submodule(module), LightningAttention):
            return [(param_name, None)]
        return super()._unpacked(param_name)


def check_minimax(hf_config: Any) -> None:
    """`NotBuiltError` / `ConfigError` for what this model does not run: other layer kinds, a sliding window,
    pre-quantized checkpoints, an ``attn_type_list`` that contradicts ``layer_types``."""
    for kind in hf_config.layer_types:
        if kind not in ("linear_attention", "full_attention"):
            raise NotBuiltError("layer_types", kind, "MiniMax's lightning (linear_attention) and softmax "
                                                     "(full_attention) layers")
    if getattr(hf_config, "sliding_window", None) is not None:
        raise NotBuiltError("sliding_window", hf_config.sliding_window, "MiniMax with a sliding window (its "
                                                                        "releases attend to the whole context)")
    check_phi3(hf_config, "MiniMax")  # its lightning layers' fused qkv_proj is read whole, not as packed values
    listed = getattr(hf_config, "attn_type_list", None)
    if listed is not None:  # the original release's field: 0 lightning, 1 softmax
        implied = ["full_attention" if t else "linear_attention" for t in listed]
        if implied != list(hf_config.layer_types):
            raise ConfigError("attn_type_list", listed, f"the layer kinds of layer_types {hf_config.layer_types} "
                                                        "(1: full_attention, 0: linear_attention)")


def _with_rotary_dim(hf_config: Any) -> Any | None:
    """A copy of the config whose rope parameters rotate ``rotary_dim`` of each head; None when it rotates them
    whole (no ``rotary_dim``, or the head's size)."""
    rotary_dim, head_dim = getattr(hf_config, "rotary_dim", None), head_dim_of(hf_config)
    if rotary_dim is None or rotary_dim == head_dim:
        return None
    partial = copy.copy(hf_config)
    partial.rope_parameters = {**rope_parameters(hf_config), "partial_rotary_factor": rotary_dim / head_dim}
    return partial
