"""The served config's rope parameters: ``hf_overrides``' rope keys, and the length a rope scaling allows.

transformers 5 keeps a model's rope in one ``rope_parameters`` dict; vLLM users still pass the older pair,
``hf_overrides={"rope_theta": ...}`` and ``{"rope_scaling": {...}}``. `apply_rope_overrides` folds them into
``rope_parameters`` as vLLM's ``patch_rope_parameters`` does (a scaling keeps the model's theta), then has
transformers standardize and validate the result on the host, so that a bad rope is a `ConfigError` before any
worker starts. `rope_scaled_length` is vLLM's ``_get_and_verify_max_len``: the longest sequence a scaled rope
serves. Torch-free (the host's preparation runs these).
"""

from __future__ import annotations

import numbers
from typing import Any

from asyncllm.errors import ConfigError

__all__ = ["ROPE_OVERRIDE_KEYS", "folds_rope_overrides", "apply_rope_overrides", "rope_scaled_length"]

ROPE_OVERRIDE_KEYS = ("rope_theta", "rope_scaling")
"""The legacy keys folded into ``rope_parameters`` rather than set as attributes."""
_TYPE_INDEPENDENT = ("rope_theta", "partial_rotary_factor", "mrope_section", "mrope_interleaved")
"""The keys of ``rope_parameters`` a ``rope_scaling`` override keeps (those of the old scaling go)."""
_UNSCALED_LENGTH_TYPES = ("su", "longrope", "llama3")
"""Rope types whose ``max_position_embeddings`` already counts the scaling (vLLM's list)."""


def folds_rope_overrides(hf_config: Any) -> bool:
    """Whether the config keeps its rope in ``rope_parameters`` (transformers 5), where the legacy keys go."""
    return isinstance(getattr(hf_config, "rope_parameters", None), dict)


def apply_rope_overrides(hf_config: Any, overrides: dict[str, Any]) -> None:
    """``overrides``' ``rope_theta`` / ``rope_scaling`` folded into ``hf_config.rope_parameters`` (in place), and
    the rope checked whenever an override touches it; a `ConfigError` on ``hf_overrides`` otherwise."""
    if not any(key in overrides for key in (*ROPE_OVERRIDE_KEYS, "rope_parameters")):
        return
    if folds_rope_overrides(hf_config) and any(key in overrides for key in ROPE_OVERRIDE_KEYS):
        hf_config.rope_parameters = _folded(hf_config.rope_parameters, overrides)
    if hasattr(hf_config, "validate_rope"):  # transformers 5
        _check_rope(hf_config, overrides)


def _folded(params: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    if any(isinstance(value, dict) for value in params.values()):
        raise ConfigError("hf_overrides", overrides, "rope_parameters given per layer type (this model's rope "
                                                     f"differs by layer type: {', '.join(params)}), not rope_theta "
                                                     "or rope_scaling")
    if "rope_scaling" in overrides:
        scaling = overrides["rope_scaling"] or {"rope_type": "default"}  # None: no scaling
        if not isinstance(scaling, dict):
            raise ConfigError("hf_overrides", overrides, "rope_scaling as a dict such as {'rope_type': 'yarn', "
                                                         "'factor': 4.0}, or None")
        params = {**{k: v for k, v in params.items() if k in _TYPE_INDEPENDENT}, **scaling}
    if "rope_theta" in overrides:
        params = {**params, "rope_theta": overrides["rope_theta"]}
    return params


def _check_rope(hf_config: Any, overrides: dict[str, Any]) -> None:
    """transformers' own standardization and validation, plus what it only warns about: an unknown rope type, a
    theta or factor that is not a positive number (a worker would fail on them building its rotary table)."""
    try:
        hf_config.standardize_rope_params()
        hf_config.validate_rope()
    except (KeyError, ValueError, TypeError, AttributeError) as exc:
        raise ConfigError("hf_overrides", overrides, f"a rope configuration transformers accepts ({exc})") from exc
    for params in _each_layer_type(getattr(hf_config, "rope_parameters", None)):
        rope_type = params.get("rope_type")
        if not hasattr(hf_config, f"_validate_{rope_type}_rope_parameters"):
            raise ConfigError("hf_overrides", overrides, f"a rope_type transformers knows (not {rope_type!r})")
        for key in ("rope_theta", "factor"):
            value = params.get(key)
            if key in params and not (isinstance(value, numbers.Real) and not isinstance(value, bool) and value > 0):
                raise ConfigError("hf_overrides", overrides, f"a positive number as the rope's {key} (not {value!r})")


def _each_layer_type(params: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The rope parameter dicts: one, or one per layer type (Gemma 3's sliding and full layers)."""
    if not params:
        return []
    if any(isinstance(value, dict) for value in params.values()):
        return [value for value in params.values() if isinstance(value, dict)]
    return [params]


def rope_scaled_length(hf_config: Any, limit: int) -> int:
    """``limit`` (the config's ``max_position_embeddings``) as the rope scaling extends it, as vLLM derives it:
    times the scaling ``factor``, from ``original_max_position_embeddings`` for YaRN; unchanged for the types
    whose limit already counts it (llama3, LongRoPE) and for Gemma 3 (its limit is the scaled one)."""
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None)
    if not params or "gemma3" in str(getattr(hf_config, "model_type", "")):
        return limit
    factor = 1.0
    for layer in _each_layer_type(params):
        rope_type = layer.get("rope_type", layer.get("type", "default"))
        if rope_type in _UNSCALED_LENGTH_TYPES:
            continue
        factor = layer.get("factor") or factor  # the layer types share one factor (vLLM's assumption too)
        if rope_type == "yarn":
            limit = (layer.get("original_max_position_embeddings")
                     or getattr(hf_config, "original_max_position_embeddings", None) or limit)
    return int(limit * factor)
