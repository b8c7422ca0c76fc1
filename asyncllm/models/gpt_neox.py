"""EleutherAI GPT-NeoX (gpt-neox-20b, Pythia, Dolly v2, RedPajama-INCITE, StableLM-alpha): ``GPTNeoXForCausalLM``.

GPT-J-style parallel layers (``use_parallel_residual``: ``x + attn(ln1(x)) + mlp(ln2(x))``,
asyncllm/models/parallel_residual.py) or sequential ones, LayerNorms with biases, a partial rotary
(``partial_rotary_factor``, from ``rotary_pct``: 0.25), half-split within the rotated dims as the backends turn
them, a GELU MLP. The checkpoint's fused ``query_key_value`` holds each head's q, k and v rows together; it is cut
into q, k and v at load (each then sharded over tensor-parallel ranks as Llama's), and the ``gpt_neox.`` names
(``embed_in``, ``attention``, ``dense_h_to_4h``, ``final_layer_norm``, ``embed_out``) are mapped to the shared
layers'.
"""

from __future__ import annotations

import copy
from typing import Any, Iterable, Iterator

import torch
from torch import nn

from asyncllm.attention.metadata import AttentionMetadata
from asyncllm.models.layers import LoadedWeight, head_dim_of
from asyncllm.models.llama import DecoderBuild, DecoderFlags, LlamaForCausalLM, LlamaModel
from asyncllm.models.parallel_residual import ParallelResidualLayer
from asyncllm.models.phi import renamed
from asyncllm.models.phi3 import check_phi3
from asyncllm.models.starcoder2 import BiasLayerNorm, GatelessMLP

__all__ = ["GPTNeoXForCausalLM"]

_NEOX_NAMES = (("gpt_neox.embed_in.", "model.embed_tokens."), ("gpt_neox.final_layer_norm.", "model.norm."),
               ("gpt_neox.layers.", "model.layers."), ("embed_out.", "lm_head."))
_LAYER_NAMES = ((".attention.dense.", ".self_attn.o_proj."), (".mlp.dense_h_to_4h.", ".mlp.c_fc."),
                (".mlp.dense_4h_to_h.", ".mlp.c_proj."))


class NeoXParallelLayer(ParallelResidualLayer):
    two_norms = True


class NeoXSequentialLayer(NeoXParallelLayer):
    """``h = x + attn(ln1(x))``, then ``h + mlp(ln2(h))``."""

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: torch.Tensor, metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        stream = hidden if residual is None else hidden + residual
        stream = self.self_attn(positions, self.input_layernorm(stream), kv_cache, metadata) + stream
        return self.mlp(self.post_attention_layernorm(stream)), stream


class GPTNeoXModel(LlamaModel):
    norm_cls = BiasLayerNorm

    @classmethod
    def layer_class(cls, hf_config: Any) -> type[nn.Module]:
        return NeoXParallelLayer if getattr(hf_config, "use_parallel_residual", True) else NeoXSequentialLayer


class GPTNeoXForCausalLM(LlamaForCausalLM):
    """Parallel (or sequential) layers with LayerNorms, a fused per-head q/k/v cut at load, a GELU MLP."""
    hf_decoder_prefix = "gpt_neox."

    model_cls = GPTNeoXModel
    packed_modules: dict[str, list[tuple[str, object]]] = {
        "qkv_proj": [("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")],
    }

    @classmethod
    def decoder_flags(cls, hf_config: Any) -> DecoderFlags:
        bias = bool(getattr(hf_config, "attention_bias", True))
        return DecoderFlags(qkv_bias=bias, o_bias=bias, mlp_bias=True)

    @classmethod
    def make_mlp(cls, b: DecoderBuild, layer_idx: int) -> nn.Module:
        return GatelessMLP(b)

    @classmethod
    def kv_cache_shapes(cls, hf_config: Any) -> list[tuple[int, int]]:
        """One KV head per attention head: GPT-NeoX has no grouped KV heads, and transformers' ignores a
        ``num_key_value_heads`` in its config, as the model and its cache do here."""
        return [(hf_config.num_attention_heads, head_dim_of(hf_config))] * hf_config.num_hidden_layers

    def __init__(self, hf_config: Any, **kwargs: Any) -> None:
        check_phi3(hf_config, "GPT-NeoX")  # the fused q/k/v is cut at load
        hf_config = copy.copy(hf_config)
        hf_config.rms_norm_eps = hf_config.layer_norm_eps  # every norm's eps, as the shared layers build them
        hf_config.num_key_value_heads = hf_config.num_attention_heads  # `kv_cache_shapes`
        super().__init__(hf_config, **kwargs)
        self.head_dim = head_dim_of(hf_config)
        rows = hf_config.num_attention_heads * self.head_dim
        self.fused_parts: dict[str, list[tuple[object, int]]] = {"qkv_proj": [("q", rows), ("k", rows), ("v", rows)]}
        """A LoRA adapter's ``query_key_value`` (one A, one B over the fused rows; asyncllm/models/lora.py), its B
        rows put in this order by `lora_b_rows`."""

    def lora_b_rows(self, name: str, weight: LoadedWeight) -> LoadedWeight:
        """An adapter's ``query_key_value`` B (rows head by head: q, k, v of each) as q's rows, k's, then v's."""
        if ".self_attn.qkv_proj." not in name:
            return weight
        full = weight if isinstance(weight, torch.Tensor) else weight[:]
        per_head = full.view(-1, 3, self.head_dim, *full.shape[1:])
        return torch.cat([per_head[:, index].reshape(-1, *full.shape[1:]) for index in range(3)])

    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        return super().load_weights(self._split_qkv(renamed(renamed(weights, _NEOX_NAMES), _LAYER_NAMES)))

    def _split_qkv(self, weights: Iterable[tuple[str, LoadedWeight]]) -> Iterator[tuple[str, LoadedWeight]]:
        """``attention.query_key_value`` (rows head by head: q, k, v of head 0, then of head 1, ...) as
        ``self_attn.q_proj`` / ``k_proj`` / ``v_proj``."""
        for name, weight in weights:
            if ".attention.query_key_value." not in name:
                yield name, weight
                continue
            full = weight if isinstance(weight, torch.Tensor) else weight[:]
            per_head = full.view(-1, 3, self.head_dim, *full.shape[1:])
            for index, part in enumerate(("q_proj", "k_proj", "v_proj")):
                yield (name.replace(".attention.query_key_value.", f".self_attn.{part}."),
                       per_head[:, index].reshape(-1, *full.shape[1:]))
