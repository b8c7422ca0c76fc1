"""Rotary position embedding, with the inverse frequencies computed by transformers.

transformers' own ``ROPE_INIT_FUNCTIONS`` give the frequencies of every scaled
rope_type (linear, llama3, yarn, ...), so a checkpoint's ``rope_parameters``
mean exactly what they mean in HF. The cos/sin table is built once in float32.

LongRoPE (Phi-3 128k, Phi-3.5, Phi-4-mini) has two sets of factors and transformers picks one per
forward by the sequence's length; `fix_longrope_factors` picks one set for the whole model from
``max_model_len`` (docs/phi3.md), after which the rope no longer depends on the length.

A config with ``rope_freq_factors`` (a GGUF file's ``rope_freqs.weight``: llama.cpp's per-frequency divisors, how
its converter stores Llama 3.1's llama3 scaling; asyncllm/models/gguf_config.py) has its inverse frequencies
divided by them, as llama.cpp does.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from asyncllm.errors import ConfigError, NotBuiltError
from asyncllm.models.checkpoint import pretrained_config
from asyncllm.models.rope_config import UNBUILT_ROPE_TYPES, is_longrope, longrope_original
from asyncllm.kernels import reference

__all__ = ["FREQ_FACTORS", "rope_parameters", "compute_inv_freq", "fix_longrope_factors", "RotaryEmbedding", "identity_rotary"]

# Their frequencies change with the batch's sequence length in HF, so the same token would get different rotations
# depending on what it is batched with (LongRoPE's, unless `fix_longrope_factors` fixed them).
_LENGTH_DEPENDENT_ROPE_TYPES = (*UNBUILT_ROPE_TYPES, "longrope")
FREQ_FACTORS = "rope_freq_factors"
"""The config attribute of per-frequency divisors of the inverse frequencies (GGUF's ``rope_freqs.weight``)."""


def rope_parameters(hf_config: Any, layer_type: str | None = None) -> dict[str, Any]:
    """The config's rope parameters as one dict (transformers 5 ``rope_parameters``, or the
    older ``rope_theta`` + ``rope_scaling`` pair). Where they are given per layer type (Gemma 3:
    ``{"sliding_attention": {...}, "full_attention": {...}}``), those of ``layer_type``. A legacy ``su`` is
    ``longrope`` (`is_longrope`, vLLM's rename)."""
    params = _given_rope_parameters(hf_config, layer_type)
    return {**params, "rope_type": "longrope"} if is_longrope(params) else params


def _given_rope_parameters(hf_config: Any, layer_type: str | None) -> dict[str, Any]:
    params = getattr(hf_config, "rope_parameters", None)
    if _per_layer_type(hf_config, layer_type):
        return dict(params[layer_type])
    if params:
        return dict(params)
    params = dict(getattr(hf_config, "rope_scaling", None) or {})
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params


def _per_layer_type(hf_config: Any, layer_type: str | None) -> bool:
    """Whether the config gives ``layer_type`` rope parameters of its own."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    return layer_type is not None and isinstance(params.get(layer_type), dict)


def _length_dependent(params: dict[str, Any]) -> bool:
    """Whether the rotation of a position depends on the sequence it is in (see above); a LongRoPE whose
    short and long factors agree (`fix_longrope_factors`) does not."""
    if is_longrope(params):
        return list(params["short_factor"]) != list(params["long_factor"])
    return params.get("rope_type") in _LENGTH_DEPENDENT_ROPE_TYPES


def fix_longrope_factors(hf_config: Any, max_model_len: int) -> Any:
    """``hf_config`` itself, or, for a LongRoPE rope, a copy that rotates every position with one set of factors:
    the short ones when ``max_model_len <= original_max_position_embeddings`` (the engine's default max_model_len
    for LongRoPE, as vLLM's: what transformers uses for every sequence that fits there, outputs equal its), the
    long ones for an explicit longer max_model_len (as vLLM's; transformers switches to them only for a sequence
    longer than that). ``attention_factor`` stays as transformers computes it."""
    params = rope_parameters(hf_config)
    if not is_longrope(params):
        return hf_config
    original = longrope_original(hf_config)
    factors = list(params["long_factor"] if max_model_len > original else params["short_factor"])
    fixed = copy.copy(hf_config)
    fixed.rope_parameters = {**params, "original_max_position_embeddings": original, "short_factor": factors,
                             "long_factor": factors}
    return fixed


def compute_inv_freq(hf_config: Any, head_dim: int, layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """(inv_freq ``[rotary_dim / 2]`` float32, attention_scaling) exactly as transformers computes them
    (for the layers of ``layer_type`` when the config has rope parameters per layer type), divided by the
    config's ``rope_freq_factors`` when it has them.

    ``rotary_dim = head_dim * partial_rotary_factor``: only the first rotary_dim
    features of each head rotate.
    """
    params = rope_parameters(hf_config, layer_type)
    rope_type = params.get("rope_type", "default")
    if rope_type == "proportional":
        return _proportional_inv_freq(params, head_dim), 1.0
    if rope_type == "ntk":
        return _ntk_inv_freq(params, head_dim), 1.0
    if rope_type == "default":
        dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
        exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").to(torch.float32) / dim
        return _divided_by_freq_factors(hf_config, 1.0 / (params["rope_theta"] ** exponents), rope_type), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # only here: it imports transformers

    if _length_dependent(params) or rope_type not in ROPE_INIT_FUNCTIONS:
        raise NotBuiltError("model", rope_type, f"rotary embedding with rope_type={rope_type!r}")
    per_type = {"layer_type": layer_type} if _per_layer_type(hf_config, layer_type) else {}
    with torch.device("cpu"):  # the tables are computed on the host even inside a meta-device model build
        inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](pretrained_config(hf_config), torch.device("cpu"),
                                                                     **per_type)
    return _divided_by_freq_factors(hf_config, inv_freq.to(torch.float32), rope_type), float(attention_scaling)


def _ntk_inv_freq(params: dict[str, Any], head_dim: int) -> torch.Tensor:
    """Fixed NTK-aware scaling, ``{"type": "ntk", "factor": f}`` (GTE v1.5's remote code, vLLM's
    ``NTKScalingRotaryEmbedding``): the default frequencies of base ``theta * f``, each divided by
    ``f ** (2 / rotary_dim)``, at every position. Its "mixed" form (``mixed_b``) is not built."""
    if params.get("mixed_b") is not None:
        raise NotBuiltError("model", {"mixed_b": params["mixed_b"]}, "NTK rotary scaling with mixed_b")
    factor = float(params["factor"])
    dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").to(torch.float32) / dim
    return 1.0 / ((params["rope_theta"] * factor) ** exponents) / factor ** (2 / dim)


def _proportional_inv_freq(params: dict[str, Any], head_dim: int) -> torch.Tensor:
    """Gemma 4's ``proportional`` rope: the first ``partial_rotary_factor`` of each head's frequency pairs turn at
    ``theta ** (-2i / head_dim)`` (exponents over the whole head, not the rotated part), the other pairs turn by
    nothing (frequency 0: cos 1, sin 0), all divided by ``factor``. Computed here, as transformers computes it,
    because its own function reads the per-layer view only a transformers config has."""
    angles = int(params.get("partial_rotary_factor", 1.0) * head_dim // 2)
    exponents = torch.arange(0, 2 * angles, 2, dtype=torch.int64, device="cpu").to(torch.float32) / head_dim
    rotated = 1.0 / (params["rope_theta"] ** exponents)
    zeros = torch.zeros(head_dim // 2 - angles, dtype=torch.float32, device="cpu")
    return torch.cat((rotated, zeros)) / params.get("factor", 1.0)


def _divided_by_freq_factors(hf_config: Any, inv_freq: torch.Tensor, rope_type: str) -> torch.Tensor:
    """``inv_freq / rope_freq_factors`` (llama.cpp's ``theta / freq_factor``), ``inv_freq`` without factors."""
    factors = getattr(hf_config, FREQ_FACTORS, None)
    if factors is None:
        return inv_freq
    if rope_type != "default":
        raise NotBuiltError("model", rope_type, f"{FREQ_FACTORS} together with rope_type={rope_type!r}")
    if len(factors) != inv_freq.numel():
        raise ConfigError(FREQ_FACTORS, f"{len(factors)} factors", f"one per rotary frequency ({inv_freq.numel()})")
    return inv_freq / torch.tensor(factors, dtype=torch.float32)


class RotaryEmbedding(nn.Module):
    """Rotates q and k by their positions from a precomputed float32 cos/sin table."""

    def __init__(self, hf_config: Any, head_dim: int, max_position: int, layer_type: str | None = None,
                 scaling: float | None = None) -> None:
        """``scaling``: cos and sin's factor in place of the rope's own attention scaling (Phi-3.5-MoE's mscale)."""
        super().__init__()
        inv_freq, attention_scaling = compute_inv_freq(hf_config, head_dim, layer_type)
        attention_scaling = attention_scaling if scaling is None else scaling
        self.head_dim = head_dim
        self.rotary_dim = 2 * inv_freq.numel()
        self.max_position = max_position
        cache = reference.build_cos_sin_cache(inv_freq.to(torch.get_default_device()), attention_scaling, max_position)
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """query ``[T, Hq, D]``, key ``[T, Hkv, D]`` -> rotated copies."""
        return reference.apply_rotary(query, key, positions, self.cos_sin_cache)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, rotary_dim={self.rotary_dim}, max_position={self.max_position}"


def identity_rotary(hf_config: Any, head_dim: int, max_position: int) -> RotaryEmbedding:
    """A rotary embedding that turns nothing (cos 1, sin 0 at every position: ``x * 1 + rotated * 0`` is x
    exactly), for the layers of a model that use no positions there (SmolLM3's NoPE layers), so the backends and
    their fused rotary kernels need no other path."""
    rotary = RotaryEmbedding(hf_config, head_dim, max_position)
    zeros = torch.zeros(rotary.rotary_dim // 2, device=rotary.cos_sin_cache.device)
    rotary.cos_sin_cache = reference.build_cos_sin_cache(zeros, 1.0, max_position)
    return rotary
