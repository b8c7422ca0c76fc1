"""The served config's rope parameters: ``hf_overrides``' rope keys, and the length a rope scaling allows.

transformers 5 keeps a model's rope in one ``rope_parameters`` dict; vLLM users still pass the older pair,
``hf_overrides={"rope_theta": ...}`` and ``{"rope_scaling": {...}}``. `apply_rope_overrides` folds them into
``rope_parameters`` as vLLM's ``patch_rope_parameters`` does (a scaling keeps the model's theta; a multimodal
model's go to its text config, which holds its rope), then has transformers standardize and validate the result on
the host, so that a bad rope, or one no worker builds, is a `ConfigError` before any worker starts; rope keys on a
model without a configurable rope (OPT, GPT-2, BLOOM, Jamba: none; GPT-J: a fixed theta) are one too. A
``partial_rotary_factor`` (GPT-NeoX: ``rotary_pct``) is folded as transformers 5 reads it, and one that
transformers' model ignores (`WHOLE_HEAD_MODEL_TYPES`) is dropped from the served config as it ignores it.
`rope_scaled_length` is vLLM's ``_get_and_verify_max_len``: the longest sequence a scaled rope serves. Torch-free
(the host's preparation runs these).
"""

from __future__ import annotations

import copy
import logging
import numbers
from typing import Any

from asyncllm.errors import ConfigError

__all__ = ["ROPE_OVERRIDE_KEYS", "UNBUILT_ROPE_TYPES", "WHOLE_HEAD_MODEL_TYPES", "apply_rope_overrides", "is_longrope",
           "longrope_original", "rope_scaled_length"]

logger = logging.getLogger(__name__)

PARTIAL_ROTARY_KEYS = ("partial_rotary_factor", "rotary_pct")
"""The ``hf_overrides`` keys of the rotated fraction of each head (``rotary_pct``: GPT-NeoX's older name)."""
ROPE_OVERRIDE_KEYS = ("rope_theta", "rope_scaling", "rope_parameters", *PARTIAL_ROTARY_KEYS)
"""The ``hf_overrides`` keys `apply_rope_overrides` sets (the legacy pair and the fraction folded into
``rope_parameters``)."""
_FIXED_ROPES = {"gptj": "GPT-J's rotary embedding turns at a fixed theta of 10000, as transformers' GPTJ"}
"""Model types with a rotary embedding no rope key configures (in transformers either)."""
_FIXED_ALPHA_MODEL_TYPES = ("hunyuan_v1_dense", "hunyuan_v1_moe")
"""Model types whose "dynamic" rope with an ``alpha`` is built, as the plain rope of its stretched base
(asyncllm/models/hunyuan.py `ntk_alpha_config`): not `UNBUILT_ROPE_TYPES`' length-dependent one."""
WHOLE_HEAD_MODEL_TYPES = frozenset("""
    apertus arcee cohere cohere2 cwm dbrx deepseek_v2 deepseek_v3 deepseek_v32 dots1 ernie4_5 ernie4_5_moe
    ernie4_5_vl_moe ernie4_5_vl_moe_text exaone4 exaone_moe falcon falcon_h1 flex_olmo gemma gemma2 gemma3
    gemma3_text gemma3n gemma3n_text gemma4 gemma4_text glm_moe_dsa gpt_oss granite granitemoe granitemoehybrid
    granitemoeshared helium hunyuan_v1_dense hunyuan_v1_moe jais2 lfm2 lfm2_moe llama llama4 llama4_text minicpm3
    ministral ministral3 mistral mistral4 mixtral mllama mllama_text_model olmo olmo2 olmo3 olmoe phimoe qwen2
    qwen2_5_omni_text qwen2_5_omni_thinker qwen2_5_vl qwen2_5_vl_text qwen2_moe qwen2_vl qwen2_vl_text qwen3
    qwen3_moe qwen3_omni_moe_text qwen3_omni_moe_thinker qwen3_vl qwen3_vl_moe qwen3_vl_moe_text qwen3_vl_text
    seed_oss smollm3 starcoder2 vaultgemma youtu zamba2
""".split())
"""The served model types whose transformers rotary turns the whole head under the default rope whatever its
``partial_rotary_factor`` (their ``compute_default_rope_parameters`` never reads it; vLLM's Llama rotates the
fraction): the served config drops it there (docs/models.md). Phi, Phi-3, StableLM, GPT-NeoX, GLM, Nemotron,
MiniMax-M2, Qwen3-Next and Qwen3.5 read it, as asyncllm/models/rotary.py does."""
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


def longrope_original(hf_config: Any) -> int | None:
    """A LongRoPE model's ``original_max_position_embeddings`` (where transformers' short factors end), from its
    rope parameters (any layer type's) else the config's own; None for any other rope. vLLM's
    ``_get_and_verify_max_len`` defaults max_model_len to it (asyncllm/engine/prepare.py as well)."""
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None)
    for layer in _each_layer_type(params):
        if is_longrope(layer):
            original = (layer.get("original_max_position_embeddings")
                        or getattr(hf_config, "original_max_position_embeddings", None))
            return None if original is None else int(original)
    return None


def _folds_rope_overrides(hf_config: Any) -> bool:
    """Whether the config keeps its rope in ``rope_parameters`` (transformers 5), where the legacy keys go."""
    return isinstance(getattr(hf_config, "rope_parameters", None), dict)


def apply_rope_overrides(hf_config: Any, overrides: dict[str, Any]) -> None:
    """``overrides``' rope keys (copies) set on ``hf_config`` (in place): folded into the ``rope_parameters`` of
    the config that has them, its own or, where only its text config has them (Qwen2-VL's), the text config's
    (where the model reads them); the rope then checked. A `ConfigError` on ``hf_overrides`` (quoting
    ``overrides`` as given) otherwise. Given or not, a fraction transformers' model ignores is dropped
    (`WHOLE_HEAD_MODEL_TYPES`)."""
    given = {key: copy.deepcopy(overrides[key]) for key in ROPE_OVERRIDE_KEYS if key in overrides}
    if given:
        _apply_given(hf_config, given, overrides)
    _follow_whole_head_rotary(hf_config, overrides)


def _apply_given(hf_config: Any, given: dict[str, Any], overrides: dict[str, Any]) -> None:
    text_config = getattr(hf_config, "text_config", None)  # what the engine serves a multimodal model's decoder from
    target = next((c for c in (hf_config, text_config) if _folds_rope_overrides(c)), None)
    if target is None:  # transformers 4, a remote-code config, or a model without rope: the keys set as given
        _check_configurable(hf_config, given, overrides)
        target = hf_config
        _set_attributes(target, given, overrides)
    else:
        target.rope_parameters = _folded(target.rope_parameters, given, overrides)
    if hasattr(target, "validate_rope"):  # transformers 5
        _check_rope(target, overrides)


def _check_configurable(hf_config: Any, given: dict[str, Any], overrides: dict[str, Any]) -> None:
    """`ConfigError` for rope keys set on a config without ``rope_parameters`` that no model would read: a
    fraction (read from ``rope_parameters`` only), any key on a model with a fixed rope (`_FIXED_ROPES`) or, for a
    transformers config keeping no rope at all (OPT, GPT-2, BLOOM, MPT, Jamba), without a rotary embedding."""
    if any(key in given for key in PARTIAL_ROTARY_KEYS):
        raise ConfigError("hf_overrides", overrides, "partial_rotary_factor or rotary_pct only on a config with "
                                                     "rope_parameters (transformers 5), where the model reads it")
    model_type = getattr(hf_config, "model_type", None)
    if model_type in _FIXED_ROPES:
        raise ConfigError("hf_overrides", overrides, f"no rope keys ({', '.join(given)}): {_FIXED_ROPES[model_type]}")
    keeps_rope = any(getattr(hf_config, key, None) is not None for key in ("rope_theta", "rope_scaling"))
    if not keeps_rope and type(hf_config).__module__.startswith("transformers.models."):
        raise ConfigError("hf_overrides", overrides, f"no rope keys ({', '.join(given)}): {model_type} has no "
                                                     "rotary embedding")


def _set_attributes(hf_config: Any, given: dict[str, Any], overrides: dict[str, Any]) -> None:
    try:  # transformers 5's rope_scaling setter standardizes the rope at once
        for key, value in given.items():
            setattr(hf_config, key, value)
    except (KeyError, ValueError, TypeError, AttributeError) as exc:
        raise ConfigError("hf_overrides", overrides, f"a rope configuration transformers accepts ({exc})") from exc


def _folded(params: dict[str, Any], given: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """``params`` with ``given``'s rope keys: ``rope_parameters`` and ``rope_scaling`` replace them but keep the
    model's type-independent keys (its theta) they lack, ``rope_theta`` replaces the theta and
    ``partial_rotary_factor`` (``rotary_pct``) the fraction (transformers 5 reads both there)."""
    if "rope_parameters" in given:
        if not isinstance(given["rope_parameters"], dict):
            raise ConfigError("hf_overrides", overrides, "rope_parameters as a dict (one, or one per layer type)")
        params = _keeping_model_keys(params, given["rope_parameters"])
    if _per_layer_type(params) and any(key in given for key in ("rope_theta", "rope_scaling", *PARTIAL_ROTARY_KEYS)):
        raise ConfigError("hf_overrides", overrides, "rope_parameters given per layer type (this model's rope "
                                                     f"differs by layer type: {', '.join(params)}), not rope_theta, "
                                                     "rope_scaling or partial_rotary_factor")
    if "rope_scaling" in given:
        scaling = given["rope_scaling"] or {"rope_type": "default"}  # None: no scaling
        if not isinstance(scaling, dict):
            raise ConfigError("hf_overrides", overrides, "rope_scaling as a dict such as {'rope_type': 'yarn', "
                                                         "'factor': 4.0}, or None")
        params = _keeping_model_keys(params, scaling)
    if "rope_theta" in given:
        params = {**params, "rope_theta": given["rope_theta"]}
    for key in reversed(PARTIAL_ROTARY_KEYS):  # partial_rotary_factor over rotary_pct where both are given
        if key in given:
            params = {**params, "partial_rotary_factor": given[key]}
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
        if rope_type in UNBUILT_ROPE_TYPES and not _fixed_alpha(hf_config, params):
            raise ConfigError("hf_overrides", overrides, f"a rope_type asyncllm builds (not {rope_type!r}: its "
                                                         "rotations change with the batch's longest sequence)")
        for key in ("rope_theta", "factor", "partial_rotary_factor"):
            value = params.get(key)
            if key in params and not (isinstance(value, numbers.Real) and not isinstance(value, bool) and value > 0):
                raise ConfigError("hf_overrides", overrides, f"a positive number as the rope's {key} (not {value!r})")
        if params.get("partial_rotary_factor", 1.0) > 1:
            raise ConfigError("hf_overrides", overrides, "a partial_rotary_factor of at most 1 (the fraction of each "
                                                         f"head rotated, not {params['partial_rotary_factor']!r})")


def _fixed_alpha(hf_config: Any, params: dict[str, Any]) -> bool:
    """Whether ``params`` are the fixed-alpha "dynamic" rope of a model that builds it (`_FIXED_ALPHA_MODEL_TYPES`)."""
    return getattr(hf_config, "model_type", None) in _FIXED_ALPHA_MODEL_TYPES and bool(params.get("alpha"))


def _follow_whole_head_rotary(hf_config: Any, overrides: dict[str, Any]) -> None:
    """A default rope's ``partial_rotary_factor`` set to 1 (in place) where transformers' model turns the whole
    head whatever it says (`WHOLE_HEAD_MODEL_TYPES`), warned about; a `ConfigError` where ``overrides`` gave it."""
    for config in (hf_config, getattr(hf_config, "text_config", None)):
        if getattr(config, "model_type", None) not in WHOLE_HEAD_MODEL_TYPES:
            continue
        for params in _each_layer_type(getattr(config, "rope_parameters", None)):
            fraction = params.get("partial_rotary_factor", 1.0)
            if params.get("rope_type", "default") != "default" or fraction == 1.0:
                continue
            if _gives_partial(overrides):
                raise ConfigError("hf_overrides", overrides, f"no partial_rotary_factor for {config.model_type}: "
                                                             "transformers' model rotates the whole head with the "
                                                             "default rope (docs/models.md)")
            logger.warning("%s: rope_parameters' partial_rotary_factor %s is ignored, as transformers' model ignores "
                           "it with the default rope: the whole head rotates (docs/models.md)", config.model_type,
                           fraction)
            params["partial_rotary_factor"] = 1.0


def _gives_partial(overrides: dict[str, Any]) -> bool:
    """Whether ``overrides`` give a rotated fraction: a key of its own, or in a rope dict (any layer type's)."""
    dicts = [value for key in ("rope_parameters", "rope_scaling") if isinstance(value := overrides.get(key), dict)]
    return (any(key in overrides for key in PARTIAL_ROTARY_KEYS)
            or any("partial_rotary_factor" in params for value in dicts for params in _each_layer_type(value)))


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
