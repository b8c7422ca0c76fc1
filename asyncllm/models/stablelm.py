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
from torch import nn

from asyncllm.models.cohere import HeadNormAttention
from asyncllm.models.layers import LoadedWeight
from asyncllm.models.llama import DecoderFlags, LlamaForCausalLM, LlamaModel
from asyncllm.models.parallel_residual import ParallelResidualLayer
from asyncllm.models.starcoder2 import BiasLayerNorm, Starcoder2DecoderLayer

__all__ = ["StableLmForCausalLM"]


_HEAD_NORM = re.compile(r"^(.*\.self_attn\.[qk]_layernorm)\.norms\.(\d+)\.weight$")


class StableLmAttention(HeadNormAttention):
    """Command R+'s per-head norms under StableLM's flag and names."""

    norm_flag = "qk_layernorm"
    norm_names = ("q_layernorm", "k_layernorm")


class StableLmParallelLayer(ParallelResidualLayer):
    attention_cls = StableLmAttention
    attention_joins_first = True


class StableLmSequentialLayer(Starcoder2DecoderLayer):
    attention_cls = StableLmAttention


class StableLmModel(LlamaModel):
    norm_cls = BiasLayerNorm

    @classmethod
    def layer_class(cls, hf_config: Any) -> type[nn.Module]:
        return StableLmParallelLayer if getattr(hf_config, "use_parallel_residual", False) else StableLmSequentialLayer


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
