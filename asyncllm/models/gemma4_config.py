"""Gemma 4's per-layer shapes, read from its config alone (no torch: the host's LoRA check reads them too).

The global layers take ``per_layer_config``'s head size and KV heads (a transformers config's per-layer view, or
the plain dict a worker receives); the last ``num_kv_shared_layers`` layers share the KV cache of the last earlier
layer of their type and compute no keys or values (asyncllm/models/gemma4.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from asyncllm.errors import ConfigError, NotBuiltError

__all__ = ["KVCacheLayout", "check_gemma4", "check_kv_sharing_split", "kv_cache_layout", "layer_attention_shape",
           "projection_shapes"]


def layer_attention_shape(cfg: Any, layer_idx: int) -> tuple[int, int]:
    """Layer ``layer_idx``'s (KV heads, head_dim): the config's, or its ``per_layer_config`` overrides (the
    global layers'; a transformers config's view or the plain dict a worker receives)."""
    overrides = getattr(cfg, "per_layer_config", None) or {}
    if isinstance(overrides, dict):
        layer = overrides.get(str(layer_idx)) or overrides.get(layer_idx) or {}
        get = layer.get
    else:
        view = overrides[layer_idx]
        get = lambda key, default: getattr(view, key, default)  # noqa: E731
    return int(get("num_key_value_heads", cfg.num_key_value_heads)), int(get("head_dim", cfg.head_dim))


@dataclass(frozen=True)
class KVCacheLayout:
    """Which KV cache each layer uses, and each cache's shape."""

    cache_of_layer: tuple[int, ...]
    """Layer -> its cache's index; a KV-sharing layer has its source layer's."""
    shares: tuple[bool, ...]
    """Whether the layer reads another layer's cache (and computes no keys or values)."""
    shapes: tuple[tuple[int, int], ...]
    """Each cache's (total KV heads, head_dim)."""


def kv_cache_layout(cfg: Any) -> KVCacheLayout:
    """transformers' ``kv_sharing_modes``: layers from ``num_hidden_layers - num_kv_shared_layers`` on reuse the
    keys and values of the last earlier layer of their type; every other layer has a cache of its own."""
    layers, types = cfg.num_hidden_layers, list(cfg.layer_types)
    first_shared = layers - int(getattr(cfg, "num_kv_shared_layers", 0) or 0)
    if first_shared <= 0:
        raise NotBuiltError("model", cfg.num_kv_shared_layers, "Gemma 4 / 3n with every layer's KV shared (an "
                                                               "assistant model that reads another model's keys and "
                                                               "values)")
    missing = set(types[first_shared:]) - set(types[:first_shared])
    if missing:
        raise NotBuiltError("model", sorted(missing), "Gemma 4 / 3n KV-sharing layers of a type no "
                                                    "earlier layer computes")
    cache_of_layer: list[int] = []
    last_of_type: dict[str, int] = {}
    shapes: list[tuple[int, int]] = []
    for i, layer_type in enumerate(types):
        if i < first_shared:
            last_of_type[layer_type] = len(shapes)
            shapes.append(layer_attention_shape(cfg, i))
        cache_of_layer.append(last_of_type[layer_type])
    shares = tuple(i >= first_shared for i in range(layers))
    return KVCacheLayout(tuple(cache_of_layer), shares, tuple(shapes))


def check_gemma4(cfg: Any) -> None:
    """`NotBuiltError` for the Gemma 4 variants not built."""
    if getattr(cfg, "use_bidirectional_attention", None) == "all":
        raise NotBuiltError("model", "all", "Gemma 4 with use_bidirectional_attention='all'")
    if cfg.hidden_activation != "gelu_pytorch_tanh":
        raise NotBuiltError("model", cfg.hidden_activation, f"the {cfg.hidden_activation!r} activation in Gemma 4 "
                                                            "(only 'gelu_pytorch_tanh')")


def projection_shapes(cfg: Any) -> list[dict[str, tuple[int, int]]]:
    """Each layer's adaptable projections as (input features, output features), by checkpoint name (Gemma 4's and
    Gemma 3n's): a KV-sharing layer has no k or v projection, a global layer whose values are its keys no v projection, and a sharing
    layer's MLP is twice as wide with ``use_double_wide_mlp``."""
    hidden, heads = cfg.hidden_size, cfg.num_attention_heads
    layout = kv_cache_layout(cfg)
    out = []
    for i, layer_type in enumerate(cfg.layer_types):
        kv_heads, head_dim = layer_attention_shape(cfg, i)
        q, kv = heads * head_dim, kv_heads * head_dim
        wide = bool(getattr(cfg, "use_double_wide_mlp", False)) and layout.shares[i]
        size = cfg.intermediate_size  # Gemma 3n: one per layer
        inter = (size[i] if isinstance(size, (list, tuple)) else size) * (2 if wide else 1)
        shapes = {"q_proj": (hidden, q), "o_proj": (q, hidden), "gate_proj": (hidden, inter),
                  "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
        if not layout.shares[i]:
            shapes["k_proj"] = (hidden, kv)
            if not (getattr(cfg, "attention_k_eq_v", False) and layer_type == "full_attention"):
                shapes["v_proj"] = (hidden, kv)
        out.append(shapes)
    return out


def check_kv_sharing_split(cfg: Any, counts: list[int]) -> None:
    """`ConfigError` unless every KV-sharing layer is on the pipeline stage of the layer whose cache it reads
    (``counts``: layers per stage): a cache lives on its stage's device, and no stage sends one to another."""
    from asyncllm import envs

    layout = kv_cache_layout(cfg)
    source = {cache: layer for layer, cache in enumerate(layout.cache_of_layer) if not layout.shares[layer]}
    stage_of = [stage for stage, count in enumerate(counts) for _ in range(count)]
    apart = [(layer, source[cache]) for layer, cache in enumerate(layout.cache_of_layer)
             if layout.shares[layer] and stage_of[layer] != stage_of[source[cache]]]
    if not apart:
        return
    first = min(source[cache] for cache, shares in zip(layout.cache_of_layer, layout.shares) if shares)
    pp, layers = len(counts), len(stage_of)
    hint = ""
    if first >= pp - 1:  # the layers before ``first`` spread over the other stages (as vLLM splits them)
        before = [first // (pp - 1) + (i < first % (pp - 1)) for i in range(pp - 1)]
        hint = f", e.g. {envs.PP_LAYER_PARTITION.name}={','.join(map(str, [*before, layers - first]))}"
    layer, src = apart[0]
    raise ConfigError(envs.PP_LAYER_PARTITION.name, ",".join(map(str, counts)),
                      f"a split that keeps each KV-sharing layer on the stage of the layer whose KV cache it reads "
                      f"(layer {layer} reads layer {src}'s, on another stage): layers {first} to {layers - 1} on "
                      f"one stage{hint}")
