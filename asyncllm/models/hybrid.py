"""What the hybrid decoders share (Qwen3.5: asyncllm/models/qwen3_5.py; Granite 4.0: asyncllm/models/granite4.py):
layers that keep per-request states (Gated DeltaNet, Mamba2: asyncllm/models/row_states.py) beside attention
layers on the paged KV cache.

- `StateLayersMixin` (before the causal LM class): the loader passes ``state_rows`` so the state layers
  preallocate a row per seat and the checkpoint slots of prefix caching (`HybridBuild.state_rows`); the worker
  lists each step's rows for them (``keeps_request_states``); only the attention layers count in the KV-cache spec
  (``kv_cache_layers``).
- `HybridModel`: Llama's decoder stack whose forward hands the KV caches to the attention layers only (a layer
  with ``is_linear`` set, or ``uses_kv_cache`` unset, gets None).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
from torch import nn

from asyncllm.attention.metadata import AttentionMetadata
from asyncllm.models.layers import TensorParallel, norm_in
from asyncllm.models.llama import DecoderBuild, LlamaModel
from asyncllm.models.pipeline import uses_kv_cache
from asyncllm.models.row_states import StateRows

__all__ = ["HybridBuild", "HybridLayer", "HybridModel", "STATE_LAYER_TYPES", "StateLayersMixin", "is_state_layer",
           "renamed"]

STATE_LAYER_TYPES = ("linear_attention", "mamba", "conv")
"""``layer_types`` entries of layers that keep states instead of a KV cache."""


def renamed(name: str, pairs: tuple[tuple[str, str], ...]) -> str:
    """A checkpoint name with each ``(old, new)`` part replaced: a family's names as Llama's modules have them."""
    for old, new in pairs:
        name = name.replace(old, new)
    return name


def is_state_layer(hf_config: Any, layer_idx: int) -> bool:
    return hf_config.layer_types[layer_idx] in STATE_LAYER_TYPES


@dataclasses.dataclass(frozen=True)
class HybridBuild(DecoderBuild):
    state_rows: StateRows = StateRows()
    """States each state layer preallocates: a row per seat (``max_num_seqs``), the checkpoint slots."""


class HybridLayer(nn.Module):
    """A hybrid's layer: a pre-norm (fusing the residual add), its state layer (named ``state_name``) or its
    attention (``self_attn``), a post-norm, the MLP. Granite 4.0's adds its shared MLP (`forward` overridden)."""

    state_name = "linear_attn"
    """The state layer's attribute: its checkpoint name (``linear_attn``, ``mamba``, ``conv``)."""
    mixer_residual_scale = 1.0
    """The mixer's output times this before it joins the residual stream (Granite's ``residual_multiplier``)."""

    def __init__(self, b: HybridBuild, layer_idx: int, norm: Callable[[], nn.Module],
                 state_layer: Callable[[], nn.Module], attention: Callable[[], nn.Module]) -> None:
        super().__init__()
        self.is_linear = is_state_layer(b.hf_config, layer_idx)
        self.input_layernorm = norm()
        if self.is_linear:
            setattr(self, self.state_name, state_layer())
        else:
            self.self_attn = attention()
        self.post_attention_layernorm = norm()
        self.mlp = b.make_mlp(b, layer_idx)

    def mixer(self) -> nn.Module:
        return getattr(self, self.state_name) if self.is_linear else self.self_attn

    def mix(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
            kv_cache: torch.Tensor | None, metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(the mixer's output, scaled, the residual stream before it)."""
        hidden, residual = norm_in(self.input_layernorm, hidden, residual)
        out = self.mixer()(positions, hidden, kv_cache, metadata)
        return (out if self.mixer_residual_scale == 1.0 else out * self.mixer_residual_scale), residual

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: torch.Tensor | None, metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.post_attention_layernorm(*self.mix(positions, hidden, residual, kv_cache, metadata))
        return self.mlp(hidden), residual


class HybridModel(LlamaModel):
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                metadata: AttentionMetadata, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """As Llama's, the KV caches handed to the attention layers in order (the state layers have none)."""
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        residual, caches = None, iter(kv_caches)
        for layer in self.layers:
            cache = next(caches) if uses_kv_cache(layer) else None
            hidden, residual = layer(positions, hidden, residual, cache, metadata)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class StateLayersMixin:
    """Mixin before a `LlamaForCausalLM` whose model is a `HybridModel`."""

    keeps_request_states = True
    """Its state layers keep per-request states by worker row (workers/input_batch.py)."""
    takes_state_rows = True
    """The loader passes ``state_rows``: the states' rows and checkpoint slots are preallocated."""

    @staticmethod
    def kv_cache_layers(hf_config: Any) -> int:
        """The layers with a KV cache: the attention ones."""
        return sum(1 for i in range(hf_config.num_hidden_layers) if not is_state_layer(hf_config, i))

    def __init__(self, hf_config: Any, *, state_rows: StateRows = StateRows(), **kwargs: Any) -> None:
        self.state_rows = state_rows
        super().__init__(hf_config, **kwargs)  # type: ignore[call-arg]

    def decoder_build(self, hf_config: Any, dtype: torch.dtype, tp: TensorParallel, attn_backend: Any,
                      max_position: int, expert_parallel: bool) -> HybridBuild:
        """The causal LM's build plus the states to preallocate (an instance's: it knows ``state_rows``)."""
        base = super().decoder_build(hf_config, dtype, tp, attn_backend, max_position,  # type: ignore[misc]
                                     expert_parallel)
        return HybridBuild(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)},
                           state_rows=self.state_rows)

    @property
    def checkpoint_slots(self) -> int:
        """Saved states its state layers keep for prefix caching (the worker tells the core)."""
        return self.state_rows.checkpoints
