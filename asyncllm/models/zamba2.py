"""Zyphra Zamba2 (``Zamba2ForCausalLM``: Zamba2-1.2B / 2.7B / 7B and -instruct): a stack of Mamba2 layers
(asyncllm/models/mamba2.py; each ``h + mamba(norm(h))``), where every ``hybrid`` layer (``layers_block_type``) first
runs a *shared* transformer block on the concatenation of the stream and the token embeddings (``2 x hidden`` wide),
passes its output through the layer's own ``linear`` and adds it to the Mamba layer's input (inside the norm, not
to the residual stream).

There are ``num_mem_blocks`` shared blocks; the i-th hybrid layer (its *invocation*) runs block ``i %
num_mem_blocks`` with that invocation's own low-rank adapters: ``x -> up(down(x))`` added to the q, k and v
projections (``use_shared_attention_adapter``) and to the MLP's fused gate-up projection (always, as transformers
builds it). A block is RMSNorm (2 x hidden), attention (head size ``2 x hidden / heads``, scores scaled by
``(head_dim / 2) ** -0.5``, rotary when ``use_mem_rope``) projected back to ``hidden``, RMSNorm, the gated MLP
(``act(gate) * up``, GELU in the releases), with no residual inside it. The weights are shared, the KV caches are
not: each invocation is one KV-cache layer (``kv_cache_layers`` counts the hybrid layers, in order).

Tensor parallelism splits the shared blocks' attention by heads (the adapters' up projections with them) and their
MLP by intermediate size; the Mamba layers and the ``linear`` layers are whole on every rank. Checkpoint names: a
hybrid layer's ``mamba_decoder.`` is read as the layer itself, ``layers.N.shared_transformer.`` as its block's
``shared_blocks.K.``, ``final_layernorm`` as ``norm``. LoRA adapters apply to the shared blocks' projections, each
invocation its own (asyncllm/models/zamba2_lora.py).

Pipeline stages: a stage holds the shared blocks its hybrid layers invoke, with those invocations' adapters only,
and receives the token embeddings beside the stream (`Zamba2Model.run_stage`; a stage must hold a hybrid layer).
"""

from __future__ import annotations

import copy
import re
from typing import Any, Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from asyncllm.attention.metadata import AttentionMetadata, RotaryInputs
from asyncllm.errors import ConfigError, NotBuiltError
from asyncllm.models.hybrid import HybridBuild, StateLayersMixin
from asyncllm.models.layers import (
    Attention, LoadedWeight, RMSNorm, TensorParallel, head_dim_of, weight_narrow, weight_shape,
)
from asyncllm.models.linear import (
    ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear,
)
from asyncllm.models.llama import LlamaForCausalLM, LlamaModel
from asyncllm.models.mamba2 import Mamba2Mixer, Mamba2Shape
from asyncllm.models.phi3 import check_phi3
from asyncllm.models.pipeline import PipelineStage, PPMissingLayer
from asyncllm.models.rotary import identity_rotary

__all__ = ["Zamba2ForCausalLM", "hybrid_layer_ids", "zamba2_mamba"]

_ADAPTER = re.compile(r"^model\.shared_blocks\.\d+\.\w+\.\w+_adapter_list\.(\d+)\.")
"""A shared block's adapter of one invocation: ``...self_attn.linear_q_adapter_list.{invocation}.``."""

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "silu": F.silu, "relu": F.relu,
}


def hybrid_layer_ids(cfg: Any) -> list[int]:
    """The layers that run a shared block, in order: the i-th is invocation i."""
    return [i for i, kind in enumerate(cfg.layer_types) if kind == "hybrid"]


def zamba2_mamba(cfg: Any) -> Mamba2Shape:
    """Zamba2's names for a Mamba2 layer's sizes (the convolution always has a bias, the gated norm's eps is 1e-5,
    ``dt`` clamped below by ``time_step_min`` in prefill chunks, as transformers)."""
    head_dim = int(cfg.mamba_expand * cfg.hidden_size) // cfg.n_mamba_heads
    return Mamba2Shape(cfg.hidden_size, cfg.n_mamba_heads, head_dim, cfg.mamba_ngroups, cfg.mamba_d_state,
                       cfg.mamba_d_conv, True, bool(cfg.add_bias_linear), 1e-5, (float(cfg.time_step_min), float("inf")))


class FusedGateUpLinear(MergedColumnParallelLinear):
    """``[gate; up]`` rows loaded from one fused checkpoint matrix: each rank keeps its part of each half."""

    def weight_loader(self, param: nn.Parameter, loaded: LoadedWeight, shard_id: object = None) -> None:
        if shard_id is not None:
            super().weight_loader(param, loaded, shard_id)
            return
        half = weight_shape(loaded)[0] // 2
        for part in (0, 1):
            super().weight_loader(param, weight_narrow(loaded, 0, part * half, half), part)


def _adapter(size_in: int, rank: int, up: nn.Module, dtype: torch.dtype) -> nn.Sequential:
    """``up(down(x))``: ``down`` whole on every rank, ``up`` split as the projection it adds to."""
    return nn.Sequential(ColumnParallelLinear(size_in, rank, False, TensorParallel(), dtype), up)


class Zamba2Attention(nn.Module):
    """The shared block's attention, on the ``2 x hidden`` input; per-invocation adapters on q, k and v."""

    def __init__(self, b: HybridBuild, invocations: list[int]) -> None:
        super().__init__()
        cfg, width = b.hf_config, 2 * b.hf_config.hidden_size
        head_dim, heads, kv_heads = head_dim_of(cfg), cfg.num_attention_heads, cfg.num_key_value_heads
        self.qkv_proj = QKVParallelLinear(width, head_dim, heads, kv_heads, False, b.tp, b.dtype)
        self.o_proj = RowParallelLinear(heads * head_dim, cfg.hidden_size, False, b.tp, b.dtype)
        self.adapters = bool(cfg.use_shared_attention_adapter)
        if self.adapters:
            if kv_heads != heads or heads * head_dim != width:
                raise ConfigError("num_key_value_heads", kv_heads, f"{heads} (Zamba2's attention adapters write "
                                  f"{width} features to q, k and v alike)")
            for name in ("linear_q_adapter_list", "linear_k_adapter_list", "linear_v_adapter_list"):
                setattr(self, name, nn.ModuleDict({str(i): _adapter(
                    width, cfg.adapter_rank, ColumnParallelLinear(cfg.adapter_rank, width, False, b.tp, b.dtype),
                    b.dtype) for i in invocations}))
        # without use_mem_rope, the rotary that turns nothing: the backends' one path (as Nemotron-H's)
        self.rotary_emb = (b.rotary_emb if cfg.use_mem_rope
                           else identity_rotary(cfg, head_dim, b.rotary_emb.max_position))
        self.attn = Attention(self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, head_dim, b.attn_backend,
                              scale=(head_dim / 2) ** -0.5)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, invocation: int, kv_cache: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        query, key, value = self.qkv_proj.split_qkv(self.qkv_proj(hidden))
        if self.adapters:
            key_of = str(invocation)
            query = query + self.linear_q_adapter_list[key_of](hidden).view_as(query)
            key = key + self.linear_k_adapter_list[key_of](hidden).view_as(key)
            value = value + self.linear_v_adapter_list[key_of](hidden).view_as(value)
        rotary = RotaryInputs(positions, self.rotary_emb.cos_sin_cache)
        return self.o_proj(self.attn(query, key, value, kv_cache, metadata, rotary))


class Zamba2MLP(nn.Module):
    """The shared block's gated MLP: ``down(act(gate) * up)``, the fused gate-up projection plus the invocation's
    adapter."""

    def __init__(self, b: HybridBuild, invocations: list[int]) -> None:
        super().__init__()
        cfg = b.hf_config
        if cfg.hidden_act not in _ACTIVATIONS:
            raise NotBuiltError("hidden_act", cfg.hidden_act, f"Zamba2 MLPs with {', '.join(_ACTIVATIONS)}")
        size, bias = cfg.intermediate_size, bool(cfg.add_bias_linear)
        self.gate_up_proj = FusedGateUpLinear(cfg.hidden_size, [size, size], bias, b.tp, b.dtype)
        self.gate_up_proj_adapter_list = nn.ModuleDict({str(i): _adapter(
            cfg.hidden_size, cfg.adapter_rank, FusedGateUpLinear(cfg.adapter_rank, [size, size], False, b.tp, b.dtype),
            b.dtype) for i in invocations})
        self.down_proj = RowParallelLinear(size, cfg.hidden_size, bias, b.tp, b.dtype)
        self.act = _ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor, invocation: int) -> torch.Tensor:
        gate, up = (self.gate_up_proj(x) + self.gate_up_proj_adapter_list[str(invocation)](x)).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class Zamba2SharedBlock(nn.Module):
    """A shared transformer block: norm(stream ++ embeddings) -> attention -> norm -> MLP, no residual."""

    def __init__(self, b: HybridBuild, invocations: list[int]) -> None:
        super().__init__()
        cfg = b.hf_config
        self.input_layernorm = RMSNorm(2 * cfg.hidden_size, cfg.rms_norm_eps, b.dtype, b.attn_backend.ops)
        self.self_attn = Zamba2Attention(b, invocations)
        self.pre_ff_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, b.dtype, b.attn_backend.ops)
        self.feed_forward = Zamba2MLP(b, invocations)
        self.invocation = invocations[0] if invocations else 0
        """The invocation running now: its LoRA adapters apply (asyncllm/models/zamba2_lora.py)."""

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, embeds: torch.Tensor, invocation: int,
                kv_cache: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        self.invocation = invocation
        x = self.input_layernorm(torch.cat([hidden, embeds], dim=-1))
        x = self.self_attn(positions, x, invocation, kv_cache, metadata)
        return self.feed_forward(self.pre_ff_layernorm(x), invocation)


class Zamba2Layer(nn.Module):
    """A Mamba2 layer ``h + mamba(norm(h + shared))``; a hybrid one (``invocation`` set) also holds the ``linear``
    that its shared block's output goes through (``shared``), and a KV cache for that block."""

    def __init__(self, b: HybridBuild, layer_idx: int) -> None:
        super().__init__()
        cfg = b.hf_config
        if cfg.layer_types[layer_idx] not in ("linear_attention", "hybrid"):
            raise NotBuiltError("layers_block_type", cfg.layer_types[layer_idx], "Zamba2 layers of the types "
                                "linear_attention (mamba) and hybrid")
        ids = hybrid_layer_ids(cfg)
        self.invocation = ids.index(layer_idx) if layer_idx in ids else None
        self.uses_kv_cache = self.invocation is not None
        if self.uses_kv_cache:
            self.linear = ColumnParallelLinear(cfg.hidden_size, cfg.hidden_size, False, TensorParallel(), b.dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, b.dtype, b.attn_backend.ops)
        self.mamba = Mamba2Mixer(zamba2_mamba(cfg), b.dtype, b.state_rows, b.attn_backend.ops)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, shared: torch.Tensor | None,
                metadata: AttentionMetadata) -> torch.Tensor:
        mixed = hidden if shared is None else hidden + self.linear(shared)
        return hidden + self.mamba(positions, self.input_layernorm(mixed), None, metadata)


class Zamba2Model(LlamaModel):
    layer_cls = Zamba2Layer

    def __init__(self, b: HybridBuild) -> None:
        super().__init__(b)
        blocks, ids, stage = b.hf_config.num_mem_blocks, hybrid_layer_ids(b.hf_config), b.pipeline
        self.hidden_size = b.hf_config.hidden_size
        self.invocations = {i for i, layer in enumerate(ids) if stage is None or stage.owns_layer(layer)}
        """The invocations this rank runs (a pipeline stage's hybrid layers'): the blocks and adapters it holds."""
        runs = [[i for i in sorted(self.invocations) if i % blocks == block] for block in range(blocks)]
        self.shared_blocks = nn.ModuleList(Zamba2SharedBlock(b, invocations) if invocations else PPMissingLayer()
                                           for invocations in runs)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                metadata: AttentionMetadata, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        hidden = embeds = self.embed(input_ids, positions, inputs_embeds)
        return self.norm(self.run_layers(range(len(self.layers)), hidden, embeds, positions, kv_caches, metadata))

    def run_layers(self, layers: range, hidden: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor,
                   kv_caches: list[torch.Tensor], metadata: AttentionMetadata) -> torch.Tensor:
        """Each hybrid layer's shared block reads the stream, the embeddings and its own KV cache, in order."""
        caches = iter(kv_caches)
        for index in layers:
            layer, shared = self.layers[index], None
            if layer.uses_kv_cache:
                block = self.shared_blocks[layer.invocation % len(self.shared_blocks)]
                shared = block(positions, hidden, embeds, layer.invocation, next(caches), metadata)
            hidden = layer(positions, hidden, shared, metadata)
        return hidden

    def stage_widths(self, stage: PipelineStage) -> tuple[int, int]:
        """A pipeline stage receives the stream and the token embeddings (its shared blocks read both)."""
        return self.hidden_size, self.hidden_size

    def run_stage(self, stage: PipelineStage, received: tuple[torch.Tensor, torch.Tensor] | None,
                  input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                  metadata: AttentionMetadata, inputs_embeds: torch.Tensor | None
                  ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """A stage's layers (`StageModel`): the final hidden states on the last, else (stream, embeddings)."""
        if received is None:
            hidden = embeds = self.embed(input_ids, positions, inputs_embeds)
        else:
            hidden, embeds = received
        layers = range(stage.start_layer, stage.end_layer)
        hidden = self.run_layers(layers, hidden, embeds, positions, kv_caches, metadata)
        return self.norm(hidden) if stage.is_last else (hidden, embeds)


class Zamba2ForCausalLM(StateLayersMixin, LlamaForCausalLM):
    model_cls = Zamba2Model
    packed_modules = {"qkv_proj": [("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")]}
    """Only q/k/v are fused here; the checkpoint's ``gate_up_proj`` is already fused (`FusedGateUpLinear`)."""

    @staticmethod
    def kv_cache_layers(hf_config: Any) -> int:
        """One KV-cache layer per invocation of a shared block."""
        return len(hybrid_layer_ids(hf_config))

    def __init__(self, hf_config: Any, **kwargs: Any) -> None:
        check_phi3(hf_config, "Zamba2")
        config = copy.copy(hf_config)
        config.num_hidden_layers = len(hf_config.layer_types)
        self.block_of_layer = {layer: i % hf_config.num_mem_blocks for i, layer in
                               enumerate(hybrid_layer_ids(hf_config))}
        super().__init__(config, **kwargs)
        size = hf_config.intermediate_size
        self.fused_parts: dict[str, list[tuple[object, int]]] = {"gate_up_proj": [(0, size), (1, size)]}
        """An adapter's fused ``gate_up_proj`` B: gate's rows, then up's (asyncllm/models/lora.py)."""

    def attach_lora(self, num_slots: int, max_rank: int, context: Any) -> dict[str, nn.Module]:
        """The shared blocks' adapter slots, per invocation (asyncllm/models/zamba2_lora.py)."""
        from asyncllm.models.zamba2_lora import attach_shared_block_lora

        return attach_shared_block_lora(self, num_slots, max_rank, context)

    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        return super().load_weights((self._our_name(name), w) for name, w in weights)

    def holds_weight(self, param_name: str) -> bool:
        """Also False for a shared block's adapters of an invocation another pipeline stage runs."""
        adapter = _ADAPTER.search(param_name)
        if adapter is not None and self.pipeline is not None:
            return int(adapter.group(1)) in self.model.invocations
        return super().holds_weight(param_name)

    def _our_name(self, name: str) -> str:
        """A checkpoint name as the modules here name it (a later invocation's copy of a block reads as the block)."""
        name = name.replace(".mamba_decoder.", ".").replace("model.final_layernorm.", "model.norm.")
        if ".shared_transformer." not in name:
            return name
        head, tail = name.split(".shared_transformer.", 1)
        layer = int(head.rsplit(".", 1)[1])
        return f"model.shared_blocks.{self.block_of_layer[layer]}.{tail}"
