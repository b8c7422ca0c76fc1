"""Stability AI StableLM (stablelm-3b-4e1t, stablelm-2-1_6b / zephyr, stablelm-zephyr-3b, StableCode):
``StableLmForCausalLM``.

Llama's attention and gated SiLU MLP (asyncllm/models/llama.py) under LayerNorms with biases (``layer_norm_eps``);
q, k and v biases by ``use_qkv_bias``; a partial rotary (``partial_rotary_factor``, 0.25), half-split within the
rotated dims as the backends turn them. ``use_parallel_residual`` (stablelm-2-12b) runs attention and the MLP side
by side from one norm (asyncllm/models/parallel_residual.py), with a LayerNorm per q and k head (``qk_layernorm``,
stored one module per head: ``q_layernorm.norms.{h}``; stacked at load into Command R+'s per-head norm, cohere.py)
before the rotary.
"""

from __future__ import annotations

import copy
import re
from typing import Any, Iterable, Iterator

import torch

from asyncllm.models.cohere import HeadLayerNorm
from asyncllm.models.layers import LoadedWeight, head_dim_of
from asyncllm.models.llama import DecoderBuild, DecoderFlags, LlamaAttention, LlamaForCausalLM, LlamaModel
from asyncllm.models.parallel_residual import ParallelResidualLayer
from asyncllm.models.starcoder2 import BiasLayerNorm, Starcoder2DecoderLayer

__all__ = ["StableLmForCausalLM"]


_HEAD_NORM = re.compile(r"^(.*\.self_attn\.[qk]_layernorm)\.norms\.(\d+)\.weight$")


class StableLmAttention(LlamaAttention):
    """Llama's attention with a LayerNorm per q and k head when ``qk_layernorm``."""

    def __init__(self, b: DecoderBuild, layer_idx: int) -> None:
        super().__init__(b, layer_idx)
        cfg, qkv = b.hf_config, self.qkv_proj
        self.qk_layernorm = bool(getattr(cfg, "qk_layernorm", False))
        if self.qk_layernorm:
            head_dim, eps = head_dim_of(cfg), cfg.layer_norm_eps
            self.q_layernorm = HeadLayerNorm(qkv.num_heads, b.tp.rank * qkv.num_heads, head_dim, eps, b.dtype)
            self.k_layernorm = HeadLayerNorm(qkv.num_kv_heads, qkv.kv_head_start, head_dim, eps, b.dtype)

    def norm_qk(self, query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.qk_layernorm:
            return query, key
        return self.q_layernorm(query), self.k_layernorm(key)


class StableLmParallelLayer(ParallelResidualLayer):
    attention_cls = StableLmAttention
    attention_joins_first = True


class StableLmSequentialLayer(Starcoder2DecoderLayer):
    attention_cls = StableLmAttention


class StableLmModel(LlamaModel):
    norm_cls = BiasLayerNorm

    def __init__(self, b: DecoderBuild) -> None:
        parallel = bool(getattr(b.hf_config, "use_parallel_residual", False))
        self.layer_cls = StableLmParallelLayer if parallel else StableLmSequentialLayer
        super().__init__(b)


class StableLmForCausalLM(LlamaForCausalLM):
    """Llama's layers under LayerNorms with biases; parallel attention and MLP when the config says so."""

    model_cls = StableLmModel

    @classmethod
    def decoder_flags(cls, hf_config: Any) -> DecoderFlags:
        return DecoderFlags(qkv_bias=bool(getattr(hf_config, "use_qkv_bias", False)))

    def __init__(self, hf_config: Any, **kwargs: Any) -> None:
        hf_config = copy.copy(hf_config)
        hf_config.rms_norm_eps = hf_config.layer_norm_eps  # every norm's eps, as the shared layers build them
        super().__init__(hf_config, **kwargs)

    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        return super().load_weights(_stacked_head_norms(weights))


def _stacked_head_norms(weights: Iterable[tuple[str, LoadedWeight]]) -> Iterator[tuple[str, LoadedWeight]]:
    """Each ``{q,k}_layernorm.norms.{h}.weight`` gathered into one ``{q,k}_layernorm.weight`` ``[heads, head_dim]``
    (yielded at the end: a layer's heads may come in any order); every other weight as it comes."""
    heads: dict[str, dict[int, torch.Tensor]] = {}
    for name, weight in weights:
        match = _HEAD_NORM.match(name)
        if match is None:
            yield name, weight
            continue
        heads.setdefault(match.group(1), {})[int(match.group(2))] = weight if isinstance(weight, torch.Tensor) \
            else weight[:]
    for prefix, rows in heads.items():
        yield prefix + ".weight", torch.stack([rows[h] for h in sorted(rows)])
