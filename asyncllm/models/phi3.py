"""Phi-3 (mini, small-context and 128k, medium), Phi-3.5-mini, Phi-4 and Phi-4-mini: ``Phi3ForCausalLM``.

The Llama decoder (asyncllm/models/llama.py) with these differences, all in the checkpoint or its config:

- the checkpoint stores q/k/v and gate/up already fused (``qkv_proj``: q rows, then k, then v;
  ``gate_up_proj``: gate rows, then up). Each fused matrix is cut into its parts here and each part loads as
  Llama's separate matrices do, so every tensor-parallel rank keeps its heads of q, of k and of v (and its
  rows of gate and of up), reading only those rows of a safetensors file;
- rotary on the first ``partial_rotary_factor`` of each head only (Phi-4-mini: 0.75), the rest passing
  through (asyncllm/models/rotary.py; the triton backend's rotary/KV-write kernel takes any even rotary dim);
- LongRoPE scaling (``rope_scaling`` of type ``longrope``, formerly ``su``): one set of factors for the
  whole model, chosen by ``max_model_len`` (`fix_longrope_factors`; docs/phi3.md says which keeps
  transformers' outputs);
- a model-wide ``sliding_window`` (some Phi-3-mini-4k configs: 2047) as Mistral's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from asyncllm.errors import ConfigError, NotBuiltError
from asyncllm.models.layers import LoadedWeight, head_dim_of, weight_shape
from asyncllm.models.llama import LlamaForCausalLM
from asyncllm.models.rotary import fix_longrope_factors

__all__ = ["FusedCheckpointLoading", "FusedRows", "Phi3ForCausalLM", "fused_rows"]


class FusedRows:
    """Rows ``[start, start + length)`` of a lazily read checkpoint weight (a safetensors slice), itself read
    lazily: indexing it reads only the rows asked for, as the parallel layers' loaders index a slice."""

    def __init__(self, loaded: Any, start: int, length: int) -> None:
        self.loaded, self.start, self.length = loaded, start, length

    def get_shape(self) -> list[int]:
        return [self.length, *weight_shape(self.loaded)[1:]]

    def __getitem__(self, index: Any) -> torch.Tensor:
        index = index if isinstance(index, tuple) else (index,)
        rows = index[0] if index else slice(None)
        start, stop, step = rows.indices(self.length)
        if step != 1:
            raise ValueError(f"rows {rows} of a fused weight: only contiguous rows are read")
        return self.loaded[(slice(self.start + start, self.start + stop), *index[1:])]


def fused_rows(loaded: LoadedWeight, start: int, length: int) -> LoadedWeight:
    """Rows ``[start, start + length)`` of a checkpoint weight: a view of a tensor, a `FusedRows` of a slice."""
    if isinstance(loaded, torch.Tensor):
        return loaded.narrow(0, start, length)
    return FusedRows(loaded, start, length)


def check_phi3(hf_config: Any, family: str = "Phi-3") -> None:
    """`NotBuiltError` for a pre-quantized checkpoint of ``family``, whose weights are reshaped at load (Phi-3's fused
    matrices cut, GLM's and Cohere's q/k rows reordered) where their packed values and scales are not."""
    quant = getattr(hf_config, "quantization_config", None)
    if quant:
        method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", quant)
        raise NotBuiltError("model", method, f"pre-quantized {family} checkpoints (a bfloat16 one with "
                            "quantization='fp8' is quantized online)")


class FusedCheckpointLoading:
    """For a decoder whose checkpoint stores some projections fused (``self.fused_parts``: fused module name ->
    its parts in row order, (shard id, rows)): each fused matrix is cut into its parts, and each part loads as the
    separate matrices of Llama's checkpoints do (every tensor-parallel rank its rows of each)."""

    fused_parts: dict[str, list[tuple[object, int]]]

    def _load_one(self, param: nn.Parameter, ckpt_name: str, weight: LoadedWeight, shard_id: object) -> None:
        parts = next((p for fused, p in self.fused_parts.items() if f".{fused}." in ckpt_name), None)
        if parts is None:
            super()._load_one(param, ckpt_name, weight, shard_id)  # type: ignore[misc]
            return
        rows = weight_shape(weight)[0]
        if rows != sum(n for _, n in parts):
            sizes = " + ".join(str(n) for _, n in parts)
            raise ConfigError("model", ckpt_name, f"a fused weight of {sizes} rows (config.json), not {rows}")
        start = 0
        for part_id, length in parts:
            super()._load_one(param, ckpt_name, fused_rows(weight, start, length), part_id)  # type: ignore[misc]
            start += length


class Phi3ForCausalLM(FusedCheckpointLoading, LlamaForCausalLM):
    """The Phi-3 family's causal LM: Llama's layers, Phi-3's checkpoint layout and rope."""

    packed_modules: dict[str, list[tuple[str, object]]] = {}
    """None: the checkpoint's ``qkv_proj`` and ``gate_up_proj`` are the parameters' own names (`_load_one`)."""
    takes_max_model_len = True
    """The loader passes ``max_model_len``: it chooses LongRoPE's factors."""

    def __init__(self, hf_config: Any, *, max_position: int, max_model_len: int | None = None, **kwargs: Any) -> None:
        """``max_model_len`` None (a direct build; the engine passes its own): ``max_position``."""
        check_phi3(hf_config)
        hf_config = fix_longrope_factors(hf_config, max_model_len or max_position)
        super().__init__(hf_config, max_position=max_position, **kwargs)
        q_rows = hf_config.num_attention_heads * head_dim_of(hf_config)
        kv_rows = hf_config.num_key_value_heads * head_dim_of(hf_config)
        mlp_rows = hf_config.intermediate_size
        self.fused_parts: dict[str, list[tuple[object, int]]] = {
            "qkv_proj": [("q", q_rows), ("k", kv_rows), ("v", kv_rows)],
            "gate_up_proj": [(0, mlp_rows), (1, mlp_rows)],
        }
        """Each fused checkpoint matrix's parts, in its row order: (shard id, rows). The weights load by it, and so
        does a LoRA adapter's B of the fused module (asyncllm/models/lora.py)."""
