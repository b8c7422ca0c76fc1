"""Finding a checkpoint and reading its config, without torch (the host process runs these).

``resolve_model_path`` (asyncllm/models/hub.py) finds the checkpoint folder (a local folder, or a hub id
through huggingface_hub's cache); ``load_hf_config`` reads its config.json with
transformers' ``AutoConfig`` (its own code only with trust_remote_code). The host prepares an engine
with these and the architecture table (asyncllm/models/architectures.py), so
importing `AsyncEngine` imports neither torch nor the model classes; the
engine's start does its preparation on a worker thread (where transformers,
when torch is installed, imports it), never at an app's import time.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import types
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from asyncllm.config_checks import is_int
from asyncllm.errors import ConfigError, NotBuiltError, check_remote_code
from asyncllm.models.hub import resolve_model_path
from asyncllm.models.rope_config import ROPE_OVERRIDE_KEYS, apply_rope_overrides

logger = logging.getLogger("asyncllm.engine")

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from asyncllm.models.compressed_tensors_config import CompressedTensorsCheckpointConfig
    from asyncllm.models.gguf_config import GgufCheckpointConfig
    from asyncllm.models.int4_config import Int4CheckpointConfig

__all__ = ["resolve_model_path", "load_hf_config", "apply_hf_overrides", "served_hf_config", "hf_config_json", "hf_config_from_json", "WireConfig",
           "pretrained_config", "checkpoint_quantization", "Fp8CheckpointConfig", "prequantized_fp8_config", "prequantized_config"]

def load_hf_config(path: str, trust_remote_code: bool = False, config_format: str = "auto") -> PretrainedConfig:
    """The checkpoint's transformers config (its own code run only with `trust_remote_code`); a GGUF file's from
    its metadata; Mistral's params.json as a `MistralConfig` (asyncllm/models/mistral_format.py)."""
    from transformers import AutoConfig

    if os.path.isfile(path) and path.lower().endswith(".gguf"):
        from asyncllm.models.gguf_config import load_gguf_config

        return load_gguf_config(path)

    from asyncllm.models.mistral_format import mistral_config, uses_mistral_config

    if uses_mistral_config(path, config_format):
        return mistral_config(path)
    from huggingface_hub.errors import StrictDataclassError  # a field of the wrong type (transformers' strict configs)

    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    # ImportError: the checkpoint's own code (trust_remote_code) imports a package that is not installed;
    # TypeError: config.json holds JSON that is no object (null, a number)
    except (OSError, ValueError, KeyError, StrictDataclassError, ImportError, TypeError) as exc:
        check_remote_code(exc, trust_remote_code, path, "configuration")
        why = " ".join(str(exc).split())  # transformers' text runs over lines; the CLI prints one
        allowed = f"a checkpoint folder whose config.json transformers can read ({why})"
        raise ConfigError("model", path, allowed) from exc
    from asyncllm.models.family_config import omni_thinker_config  # Qwen2.5-Omni: its thinker's config is served
    from asyncllm.models.rotary_bert_config import rotary_bert_config  # NomicBERT's hub names, GTE's options

    return allow_global_layer_values(rotary_bert_config(omni_thinker_config(config)))


def allow_global_layer_values(config: PretrainedConfig) -> PretrainedConfig:
    """``config`` (and its sub-configs) with the model-wide value of a per-layer attribute readable (transformers
    refuses ``config.head_dim`` when ``per_layer_config`` overrides it for some layers, Gemma 4's global ones): the
    engine reads the model-wide values where every layer agrees, the layers' own where they differ
    (asyncllm/models/gemma4.py). transformers' warning for each such read is not shown."""
    import logging

    try:
        from transformers.integrations.heterogeneity import configuration_utils as heterogeneity
    except ImportError:  # a transformers without per-layer configs (before Gemma 4's)
        return config

    logger = logging.getLogger(heterogeneity.__name__)
    if not any(isinstance(f, _GlobalReadFilter) for f in logger.filters):
        logger.addFilter(_GlobalReadFilter())
    for cfg in (config, *(getattr(config, name, None) for name in getattr(config, "sub_configs", {}))):
        if getattr(cfg, "is_heterogeneous", False):
            cfg.allow_global_per_layer_attribute_access = True
    return config


class _GlobalReadFilter:
    """Drops transformers' "Reading global config value for per-layer attribute" warnings."""

    def filter(self, record: Any) -> bool:
        return not str(record.msg).startswith("Reading global config value for per-layer attribute")


def apply_hf_overrides(hf_config: PretrainedConfig, overrides: dict[str, Any] | None) -> PretrainedConfig:
    """``hf_config`` with copies of ``hf_overrides`` set (in place; a dict over a sub-config sets its keys)."""
    from transformers import PretrainedConfig
    overrides = overrides or {}
    for key, value in overrides.items():
        nested = getattr(hf_config, key, None)
        if key == "architectures" and not (isinstance(value, list) and all(isinstance(a, str) for a in value)):
            raise ConfigError("hf_overrides", {key: value}, "architectures as a list of names, as config.json's "
                                                            '(["LlamaForCausalLM"])')
        if isinstance(value, dict) and isinstance(nested, PretrainedConfig):
            apply_hf_overrides(nested, value)
        elif key not in ROPE_OVERRIDE_KEYS:
            try:
                setattr(hf_config, key, copy.deepcopy(value))
            except Exception as exc:  # noqa: BLE001 - transformers 5's typed configs refuse a value of a wrong type
                raise ConfigError("hf_overrides", {key: value}, f"a value {type(hf_config).__name__} takes "
                                                                f"({type(exc).__name__}: {exc})") from exc
    apply_rope_overrides(hf_config, overrides)  # the rope keys: into rope_parameters (the text config's), checked
    return hf_config


def served_hf_config(path: str, overrides: dict[str, Any] | None, trust_remote_code: bool = False,
                     config_format: str = "auto") -> PretrainedConfig:
    """The checkpoint's config as the engine serves it: read (`load_hf_config`), ``hf_overrides`` applied."""
    from asyncllm.models.rotary_bert_config import rotary_bert_config  # checked again with the overrides

    return rotary_bert_config(apply_hf_overrides(load_hf_config(path, trust_remote_code, config_format), overrides))


_DERIVED = ("num_hidden_layers", "layer_types", "layers_block_type", "layers_num_experts")
"""Attributes some configs derive rather than store (Nemotron-H's from ``layers_block_type``, Bamba's from
``attn_layer_indices``, Jamba's from its periods and offsets): sent too."""


def hf_config_json(hf_config: PretrainedConfig) -> str:
    """The config with every default filled in, as JSON: the host sends it to the workers."""
    return json.dumps(_wire_values(hf_config), default=str)


def _wire_values(hf_config: PretrainedConfig) -> dict[str, Any]:
    """``to_dict()`` plus the derived attributes and transformers' aliases (GPT-2's ``num_attention_heads`` is
    its ``n_head``: ``attribute_map``), sub-configs alike, so that the workers read every name the host does."""
    from transformers import PretrainedConfig

    values = hf_config.to_dict()
    for name in (*_DERIVED, *getattr(hf_config, "attribute_map", {})):
        if name not in values and getattr(hf_config, name, None) is not None:
            values[name] = getattr(hf_config, name)
    for name, value in vars(hf_config).items():
        if isinstance(value, PretrainedConfig) and isinstance(values.get(name), dict):
            values[name] = _wire_values(value)
    return values


class WireConfig(types.SimpleNamespace):
    """A checkpoint's config rebuilt from the host's JSON (`hf_config_from_json`): every attribute of it, read as
    attributes, with no transformers import (which alone costs a worker start 1 to 2 s)."""

    @property
    def num_labels(self) -> int:
        """transformers' ``PretrainedConfig.num_labels``: the number of ``id2label`` entries."""
        return len(getattr(self, "id2label", None) or {})

    def to_dict(self) -> dict[str, Any]:
        return {k: v.to_dict() if isinstance(v, WireConfig) else v for k, v in vars(self).items()}


def hf_config_from_json(text: str) -> WireConfig:
    """`hf_config_json`'s config again, as a `WireConfig` (its sub-configs too).

    The model classes read only attributes, all of them in the JSON, so a worker rebuilds the host's config
    without transformers; the rotary tables of scaled rope types convert it back (`pretrained_config`).
    """

    def build(values: dict[str, Any]) -> WireConfig:
        return WireConfig(**{k: build(v) if isinstance(v, dict) and "model_type" in v else v
                             for k, v in values.items()})

    return build(json.loads(text))


def pretrained_config(hf_config: Any) -> PretrainedConfig:
    """``hf_config`` as a transformers ``PretrainedConfig`` (itself when it is one): what transformers' own
    functions take. A `WireConfig` becomes the plain ``PretrainedConfig`` of its values (its sub-configs too)."""
    from transformers.configuration_utils import PretrainedConfig

    if not isinstance(hf_config, WireConfig):
        return hf_config

    def build(values: dict[str, Any]) -> PretrainedConfig:
        nested = {k: build(v) for k, v in values.items() if isinstance(v, dict) and "model_type" in v}
        return PretrainedConfig.from_dict({**values, **nested})

    return build(hf_config.to_dict())


_QUANTIZATION_CONFIG_KEYS = ("quantization_config", "compression_config")
"""Where config.json names a pre-quantized checkpoint's method (compressed-tensors' older name second)."""


def _quantization_section(hf_config: Any) -> dict[str, Any] | None:
    """The ``quantization_config`` (or ``compression_config``) of the config or its ``text_config``, as a dict."""
    for cfg in (hf_config, getattr(hf_config, "text_config", None)):
        for key in _QUANTIZATION_CONFIG_KEYS:
            section = getattr(cfg, key, None) if cfg is not None else None
            if not section:
                continue
            if not isinstance(section, dict):  # a transformers QuantizationConfigMixin
                section = section.to_dict() if hasattr(section, "to_dict") else {}
            return section
    return None


def checkpoint_quantization(hf_config: Any) -> str | None:
    """The method a pre-quantized checkpoint's config names (``quant_method``: fp8, awq, gptq, compressed-tensors,
    bitsandbytes, ...; lower-cased, ``compressed_tensors`` read as ``compressed-tensors``, as vLLM does), or None for
    a float checkpoint (a multimodal one's ``text_config`` is looked at too)."""
    if (section := _quantization_section(hf_config)) is None:
        return None
    method = str(section.get("quant_method") or section.get("format") or "unknown").lower()
    return method.replace("compressed_tensors", "compressed-tensors")


MODELOPT_KV_CACHE_DTYPES = {"fp8": "fp8_e4m3"}
"""ModelOpt's ``kv_cache_quant_algo`` values and the `kv_cache_dtype` they are (vLLM's
``MODELOPT_TO_VLLM_KV_CACHE_DTYPE_MAP``)."""


def resolve_kv_cache_dtype(kv_cache_dtype: str, hf_config: Any) -> str:
    """``kv_cache_dtype`` as served: an explicit value as given; ``auto`` the fp8 cache a pre-quantized checkpoint
    declares, as vLLM resolves it: ``fp8`` for a compressed-tensors ``quantization_config.kv_cache_scheme``
    (llm-compressor's; vLLM's ``Attention`` sets it), ``fp8_e4m3`` for ModelOpt's ``kv_cache_quant_algo: FP8``
    (vLLM's ``resolve_kv_cache_dtype_string``), else ``auto`` (the model dtype; so too, with a warning, under latent
    attention, ``kv_lora_rank``: its one-part cache takes no calibrated scales, asyncllm/models/kv_scales.py, so it
    keeps the model-dtype cache it was served with before). Called by the host's preparation
    (asyncllm/engine/prepare.py), so the core, the stats and Prometheus' ``cache_config_info`` see the resolved value
    (docs/fp8-kv-cache.md)."""
    if kv_cache_dtype != "auto" or (section := _quantization_section(hf_config)) is None:
        return kv_cache_dtype
    method, resolved, source = checkpoint_quantization(hf_config) or "", None, ""
    if method == "compressed-tensors" and section.get("kv_cache_scheme"):
        resolved, source = "fp8", "quantization_config.kv_cache_scheme"
    elif method.startswith("modelopt"):
        inner = section.get("quantization") if isinstance(section.get("quantization"), dict) else section
        algo = inner.get("kv_cache_quant_algo") or section.get("kv_cache_quant_algo")
        if isinstance(algo, str) and algo.lower() in MODELOPT_KV_CACHE_DTYPES:
            resolved, source = MODELOPT_KV_CACHE_DTYPES[algo.lower()], f"kv_cache_quant_algo {algo!r}"
        elif algo is not None:
            logger.warning("the checkpoint's kv_cache_quant_algo %r is none of %s: kv_cache_dtype 'auto' is the "
                           "model dtype", algo, list(MODELOPT_KV_CACHE_DTYPES))
    if resolved is None:
        return kv_cache_dtype
    if getattr(getattr(hf_config, "text_config", None) or hf_config, "kv_lora_rank", None):
        logger.warning("kv_cache_dtype 'auto' is the model dtype: the checkpoint declares an fp8 KV cache (its %s), "
                       "vLLM's is %r, and calibrated scales over a latent attention cache are not built "
                       "(docs/fp8-kv-cache.md)", source, resolved)
        return kv_cache_dtype
    logger.info("kv_cache_dtype 'auto' is %r: the checkpoint declares an fp8 KV cache (its %s; an explicit "
                "kv_cache_dtype overrides it)", resolved, source)
    return resolved


@dataclass(frozen=True)
class Fp8CheckpointConfig:
    """A pre-quantized fp8 checkpoint's ``quantization_config`` (asyncllm/models/fp8_checkpoint.py loads it)."""

    weight_block_size: tuple[int, int] | None
    """``(rows, cols)`` of a weight block with one ``weight_scale_inv`` each; None: one ``weight_scale`` per tensor."""
    ignored_layers: tuple[str, ...] = ()
    """``modules_to_not_convert`` / ``ignored_layers``: a layer whose checkpoint name contains one of these loads
    unquantized (transformers' rule)."""
    static_input: bool = False
    """``activation_scheme == "static"``: each layer's activations quantized with the checkpoint's per-tensor
    ``input_scale`` (a fused layer's largest; per-tensor experts: each product's largest over the experts);
    False: dynamic, per token (per token group when block-wise)."""

    def is_ignored(self, checkpoint_name: str) -> bool:
        return any(entry in checkpoint_name for entry in self.ignored_layers)


def prequantized_fp8_config(hf_config: Any, model: str, quantization: str | None) -> Fp8CheckpointConfig | None:
    """What a pre-quantized checkpoint asks for: None for a float checkpoint, the `Fp8CheckpointConfig` of an
    ``"fp8"`` one (served with ``quantization`` None, "use the checkpoint's method", or "fp8"); `NotBuiltError`
    for other methods, static activation scales over block-wise weights or latent attention, and fp8
    mixture-of-experts models with fused experts or multimodal models."""
    method = checkpoint_quantization(hf_config)
    if method is None:
        return None
    if method != "fp8":
        raise NotBuiltError("model", model,
                            f"loading a pre-quantized {method!r} checkpoint (its config.json has a "
                            "quantization_config; "
                            "asyncllm loads pre-quantized 'fp8', 'awq', 'gptq' and 'compressed-tensors' checkpoints "
                            "and gpt-oss's 'mxfp4' ones, "
                            "and quantizes float checkpoints "
                            "online with quantization='fp8', docs/quantization.md)")
    if quantization not in (None, "fp8"):
        raise ConfigError("quantization", quantization,
                          "None or 'fp8': the checkpoint is pre-quantized with 'fp8' "
                          "(its config.json's quantization_config)")
    section = _quantization_section(hf_config) or {}
    ignored = tuple(section.get("modules_to_not_convert") or ()) + tuple(section.get("ignored_layers") or ())
    block = _block_size(section.get("weight_block_size"), model)
    cfg = Fp8CheckpointConfig(block, ignored, _static_input(section.get("activation_scheme", "dynamic"), block, model))
    _refuse_static_input(hf_config, model, cfg)
    _refuse_fp8_architecture(hf_config, model, cfg)
    return cfg


def prequantized_config(
    hf_config: Any, model: str, quantization: str | None,
) -> Fp8CheckpointConfig | Int4CheckpointConfig | CompressedTensorsCheckpointConfig | GgufCheckpointConfig | None:
    """`prequantized_fp8_config`'s answer, or for an AWQ / GPTQ checkpoint its `Int4CheckpointConfig`
    (asyncllm/models/int4_config.py), for a compressed-tensors one its `CompressedTensorsCheckpointConfig`
    (asyncllm/models/compressed_tensors_config.py), for a GGUF file its `GgufCheckpointConfig`
    (asyncllm/models/gguf_config.py); `ConfigError` for ``quantization`` 'awq' / 'gptq' / 'compressed-tensors' over
    a float checkpoint (there is no online AWQ, GPTQ or compressed-tensors) and 'gguf' over anything but a GGUF
    file."""
    from asyncllm.models.compressed_tensors_config import COMPRESSED_TENSORS, compressed_tensors_config
    from asyncllm.models.gguf_config import gguf_checkpoint_config
    from asyncllm.models.int4_config import INT4_METHODS, QUANTIZATION_NAMES, int4_checkpoint_config

    gguf = gguf_checkpoint_config(model, quantization)
    if gguf is not None:
        return gguf

    method = checkpoint_quantization(hf_config)
    if method == "mxfp4":
        _check_mxfp4(hf_config, model, quantization)
        return None  # the experts load packed or dequantized as the model builds them (asyncllm/models/gpt_oss.py)
    if method in INT4_METHODS:
        return int4_checkpoint_config(_quantization_section(hf_config) or {}, hf_config, model, quantization)
    if method == COMPRESSED_TENSORS:
        return compressed_tensors_config(_quantization_section(hf_config) or {}, hf_config, model, quantization)
    if method is None and (quantization in (COMPRESSED_TENSORS, "mxfp4")
                           or any(quantization in names for names in QUANTIZATION_NAMES.values())):
        raise ConfigError("quantization", quantization, "None or 'fp8' for a float checkpoint: "
                          f"{quantization!r} serves checkpoints pre-quantized with it (config.json's "
                          "quantization_config); this one has none")
    return prequantized_fp8_config(hf_config, model, quantization)


def _check_mxfp4(hf_config: Any, model: str, quantization: str | None) -> None:
    """`NotBuiltError` for another architecture than gpt-oss's or ``quantization="fp8"``; `ConfigError` for another
    method's name (None or "mxfp4", vLLM's name, serve it)."""
    if (arch := (getattr(hf_config, "architectures", None) or [None])[0]) != "GptOssForCausalLM":
        raise NotBuiltError("model", model, f"an MXFP4 {arch} checkpoint (only gpt-oss's are served)")
    if quantization == "fp8":
        raise NotBuiltError("quantization", quantization, "quantizing a gpt-oss MXFP4 checkpoint again (leave "
                                                          "quantization unset or 'mxfp4')")
    if quantization not in (None, "mxfp4"):
        raise ConfigError("quantization", quantization, "None or 'mxfp4' for this pre-quantized MXFP4 checkpoint")


def _static_input(scheme: Any, block: tuple[int, int] | None, model: str) -> bool:
    """Whether ``activation_scheme`` is ``"static"`` (``"dynamic"``: False); `ConfigError` for another value,
    `NotBuiltError` for static scales over block-wise weights (vLLM refuses them too)."""
    if scheme not in ("dynamic", "static"):
        raise ConfigError("model", model, f"a quantization_config whose activation_scheme is 'dynamic' or 'static', "
                                          f"not {scheme!r}")
    if scheme == "static" and block is not None:
        raise NotBuiltError("model", model, f"static fp8 activation scales (activation_scheme='static') over "
                                            f"block-wise weights (weight_block_size {list(block)}): block-wise "
                                            "checkpoints quantize activations per token group")
    return scheme == "static"


def _refuse_static_input(hf_config: Any, model: str, cfg: Fp8CheckpointConfig) -> None:
    """`NotBuiltError` for static activation scales on a latent-attention model (``kv_b_proj``'s matrix is read
    through the layer's product with the identity, which a static scale rounds). Per-tensor experts take them
    (asyncllm/models/fp8_experts.py)."""
    from asyncllm.models.architectures import architecture_of

    if cfg.static_input and getattr(hf_config, "kv_lora_rank", 0):
        raise NotBuiltError("model", model, f"static fp8 activation scales (activation_scheme='static') on the "
                                            f"latent attention of {architecture_of(hf_config)} (its kv_b_proj is "
                                            "absorbed): served for dense layers and per-tensor experts only")


def _block_size(value: Any, model: str) -> tuple[int, int] | None:
    if value is None:
        return None
    if (not isinstance(value, (list, tuple)) or len(value) != 2
            or not all(is_int(v) and v > 0 for v in value)):
        raise ConfigError("model", model, f"a quantization_config whose weight_block_size is two positive integers, "
                                          f"not {value!r}")
    return int(value[0]), int(value[1])


FUSED_EXPERT_ARCHITECTURES = ("GptOssForCausalLM", "Llama4ForCausalLM", "Llama4ForConditionalGeneration",
                               "GraniteMoeForCausalLM", "GraniteMoeHybridForCausalLM", "GraniteMoeSharedForCausalLM",
                               "DbrxForCausalLM",
                               "Qwen3VLMoeForConditionalGeneration", "Gemma4ForCausalLM",
                               "Gemma4ForConditionalGeneration")
"""Mixtures of experts whose checkpoints store each layer's experts fused (or MXFP4): their fp8 form is not read."""


def _refuse_fp8_architecture(hf_config: Any, model: str, cfg: Fp8CheckpointConfig) -> None:
    from asyncllm.models.architectures import (architecture_of, base_architecture, has_experts,
                                               refuse_quantized_multimodal)

    arch = architecture_of(hf_config)
    if has_experts(hf_config, arch) and base_architecture(arch) in FUSED_EXPERT_ARCHITECTURES:
        raise NotBuiltError("model", model, f"pre-quantized fp8 experts of {arch} (fp8 experts stored per expert "
                                            "are served, block-wise or per tensor; online quantization='fp8' "
                                            "of a float checkpoint quantizes the experts too, but for gpt-oss)")
    refuse_quantized_multimodal(arch, model, "fp8", cfg.is_ignored)
