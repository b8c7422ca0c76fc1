"""The served config's rope parameters: ``hf_overrides``' rope keys, and the length a rope scaling allows.

transformers 5 keeps a model's rope in one ``rope_parameters`` dict; vLLM users still pass the older pair,
``hf_overrides={"rope_theta": ...}`` and ``{"rope_scaling": {...}}``. `apply_rope_overrides` folds them into
``rope_parameters`` as vLLM's ``patch_rope_parameters`` does (a scaling keeps the model's theta; a multimodal
model's go to its text config, which holds its rope), then has transformers standardize and validate the result on
the host, so that a bad rope, or one no worker builds, is a `ConfigError` before any worker starts.
`rope_scaled_length` is vLLM's ``_get_and_verify_max_len``: the longest sequence a scaled rope serves. Torch-free
(the host's preparation runs these).
"""

from __future__ import annotations

import copy
import numbers
from typing import Any

from asyncllm.errors import ConfigError

__all__ = ["ROPE_OVERRIDE_KEYS", "UNBUILT_ROPE_TYPES", "apply_rope_overrides", "is_longrope", "rope_scaled_length"]

ROPE_OVERRIDE_KEYS = ("rope_theta", "rope_scaling", "rope_parameters")
"""The ``hf_overrides`` keys `apply_rope_overrides` sets (the legacy pair folded into ``rope_parameters``)."""
UNBUILT_ROPE_TYPES = ("dynamic",)
"""Rope types no worker builds: dynamic NTK's frequencies change with the batch's longest sequence
(asyncllm/models/rotary.py), so a token's rotation would depend on what it is batched with."""
_TYPE_INDEPENDENT = ("rope_theta", "partial_rotary_factor", "mrope_section", "mrope_interleaved")
"""The keys of ``rope_parameters`` an override keeps from the model's unless it gives them (those of the old
scaling go)."""
_UNSCALED_LENGTH_TYPES = ("su", "longrope", "llama3")
"""Rope types whose ``max_position_embeddings`` already counts the scaling (vLLM's list)."""


def is_longrope(params: dict[str, Any]) -> bool:
    """Whether rope parameters are LongRoPE's: ``rope_type`` (else the older ``type``) ``longrope``, or its legacy
    name ``su`` in any config, as vLLM's ``patch_rope_parameters`` renames it for every config (transformers only in
    Phi-3's config classes: a remote-code config's ``su``, phi3_v's, is served as vLLM serves it)."""
    return params.get("rope_type", params.get("type")) in ("longrope", "su")


def _folds_rope_overrides(hf_config: Any) -> bool:
    """Whether the config keeps its rope in ``rope_parameters`` (transformers 5), where the legacy keys go."""
    return isinstance(getattr(hf_config, "rope_parameters", None), dict)


def apply_rope_overrides(hf_config: Any, overrides: dict[str, Any]) -> None:
    """``overrides``' rope keys (copies) set on ``hf_config`` (in place): folded into the ``rope_parameters`` of
    the config that has them, its own or, where only its text config has them (Qwen2-VL's), the text config's
    (where the model reads them); the rope then checked. A `ConfigError` on ``hf_overrides`` (quoting
    ``overrides`` as given) otherwise."""
    given = {key: copy.deepcopy(overrides[key]) for key in ROPE_OVERRIDE_KEYS if key in overrides}
    if not given:
        return
    text_config = getattr(hf_config, "text_config", None)  # what the engine serves a multimodal model's decoder from
    target = next((c for c in (hf_config, text_config) if _folds_rope_overrides(c)), None)
    if target is None:  # transformers 4, or a model without rope parameters: the keys set as given
        target = hf_config
        _set_attributes(target, given, overrides)
    else:
        target.rope_parameters = _folded(target.rope_parameters, given, overrides)
    if hasattr(target, "validate_rope"):  # transformers 5
        _check_rope(target, overrides)


def _set_attributes(hf_config: Any, given: dict[str, Any], overrides: dict[str, Any]) -> None:
    try:  # transformers 5's rope_scaling setter standardizes the rope at once
        for key, value in given.items():
            setattr(hf_config, key, value)
    except (KeyError, ValueError, TypeError, AttributeError) as exc:
        raise ConfigError("hf_overrides", overrides, f"a rope configuration transformers accepts ({exc})") from exc


def _folded(params: dict[str, Any], given: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """``params`` with ``given``'s rope keys: ``rope_parameters`` and ``rope_scaling`` replace them but keep the
    model's type-independent keys (its theta) they lack, ``rope_theta`` replaces the theta."""
    if "rope_parameters" in given:
        if not isinstance(given["rope_parameters"], dict):
            raise ConfigError("hf_overrides", overrides, "rope_parameters as a dict (one, or one per layer type)")
        params = _keeping_model_keys(params, given["rope_parameters"])
    if _per_layer_type(params) and ("rope_theta" in given or "rope_scaling" in given):
        raise ConfigError("hf_overrides", overrides, "rope_parameters given per layer type (this model's rope "
                                                     f"differs by layer type: {', '.join(params)}), not rope_theta "
                                                     "or rope_scaling")
    if "rope_scaling" in given:
        scaling = given["rope_scaling"] or {"rope_type": "default"}  # None: no scaling
        if not isinstance(scaling, dict):
            raise ConfigError("hf_overrides", overrides, "rope_scaling as a dict such as {'rope_type': 'yarn', "
                                                         "'factor': 4.0}, or None")
        params = _keeping_model_keys(params, scaling)
    if "rope_theta" in given:
        params = {**params, "rope_theta": given["rope_theta"]}
    return params


def _keeping_model_keys(params: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """``new`` plus the type-independent keys of the model's ``params`` it lacks (per layer type where both are
    given per layer type; ``new`` as given where one is and the other is not)."""
    if _per_layer_type(params) and _per_layer_type(new):
        return {layer_type: _keeping_model_keys(params.get(layer_type) or {}, value) if isinstance(value, dict)
                else value for layer_type, value in new.items()}
    if _per_layer_type(params) or _per_layer_type(new):
        return dict(new)
    return {**{key: value for key, value in params.items() if key in _TYPE_INDEPENDENT}, **new}


def _check_rope(hf_config: Any, overrides: dict[str, Any]) -> None:
    """transformers' own standardization and validation, plus what it only warns about: an unknown rope type, a
    theta or factor that is not a positive number (a worker would fail on them building its rotary table), and
    the rope types no worker builds (`UNBUILT_ROPE_TYPES`)."""
    try:
        hf_config.standardize_rope_params()
        hf_config.validate_rope()
    except (KeyError, ValueError, TypeError, AttributeError) as exc:
        raise ConfigError("hf_overrides", overrides, f"a rope configuration transformers accepts ({exc})") from exc
    for params in _each_layer_type(getattr(hf_config, "rope_parameters", None)):
        rope_type = params.get("rope_type")
        # validate_rope only warns on an unknown type, and transformers has no public list of the types it knows
        # (ROPE_INIT_FUNCTIONS lacks 'default'): its validators, which validate_rope looks up the same way, are it
        if not hasattr(hf_config, f"_validate_{rope_type}_rope_parameters"):
            raise ConfigError("hf_overrides", overrides, f"a rope_type transformers knows (not {rope_type!r})")
        if rope_type in UNBUILT_ROPE_TYPES:
            raise ConfigError("hf_overrides", overrides, f"a rope_type asyncllm builds (not {rope_type!r}: its "
                                                         "rotations change with the batch's longest sequence)")
        for key in ("rope_theta", "factor"):
            value = params.get(key)
            if key in params and not (isinstance(value, numbers.Real) and not isinstance(value, bool) and value > 0):
                raise ConfigError("hf_overrides", overrides, f"a positive number as the rope's {key} (not {value!r})")


def _per_layer_type(params: dict[str, Any] | None) -> bool:
    """Whether ``params`` are given per layer type (Gemma 3's ``{"sliding_attention": {...}, ...}``)."""
    return bool(params) and any(isinstance(value, dict) for value in params.values())


def _each_layer_type(params: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The rope parameter dicts: one, or one per layer type (Gemma 3's sliding and full layers)."""
    if not params:
        return []
    if _per_layer_type(params):
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
