"""Mistral's own checkpoint format (vLLM's ``config_format="mistral"`` / ``load_format="mistral"``): ``params.json``
for the config, ``consolidated*.safetensors`` for the weights, under Mistral's names.

The config becomes transformers' `MistralConfig` (so the rest of the engine, the workers included, sees the
checkpoint as a Hugging Face one), and each weight its Hugging Face name, the query and key projections permuted
from Mistral's interleaved rotary halves to transformers' (the conversion transformers' own script makes). Built for
the dense text models (Mistral 7B, Nemo, Small / Devstral / Magistral) and, with a ``vision_encoder`` section, their
Pixtral image tower (asyncllm/models/mistral_vision_format.py: Pixtral-12B, Mistral Small 3.1 / 3.2); a params.json
section for experts, audio, quantization or another rope is a `NotBuiltError` naming it (docs/tokenizers.md).
"""

from __future__ import annotations

import glob
import json
import os
import re
from collections.abc import Iterator
from typing import Any

from asyncllm.errors import ConfigError, NotBuiltError
from asyncllm.models.mistral_vision_format import VISION, image_processor, vision_config, vision_name

__all__ = ["uses_mistral_config", "uses_mistral_weights", "mistral_config", "mistral_files",
           "mistral_weights", "mistral_image_processor"]

PARAMS = "params.json"

_CONFIG_KEYS = {"dim": "hidden_size", "n_layers": "num_hidden_layers", "head_dim": "head_dim",
                "hidden_dim": "intermediate_size", "n_heads": "num_attention_heads",
                "n_kv_heads": "num_key_value_heads", "norm_eps": "rms_norm_eps", "vocab_size": "vocab_size",
                "rope_theta": "rope_theta", "tied_embeddings": "tie_word_embeddings",
                "sliding_window": "sliding_window", "dtype": "dtype"}
"""params.json key -> `MistralConfig` argument."""

_POSITION_KEYS = ("max_seq_len", "max_position_embeddings")
"""params.json's lengths (`MistralConfig`'s max_position_embeddings): the shorter of those given (vLLM's)."""

_FIXED = {"model_type": "transformer", "activation": "silu", "use_biases": False}
"""Keys read only to check they hold the one value built."""

_DEFAULT_MAX_POSITIONS = 128_000
"""vLLM's max_position_embeddings for a params.json without max_seq_len."""

_NAMES = [(re.compile(p), r) for p, r in (
    (r"tok_embeddings\.weight", "model.embed_tokens.weight"), (r"norm\.weight", "model.norm.weight"),
    (r"output\.weight", "lm_head.weight"),
    (r"layers\.(\d+)\.attention_norm\.weight", r"model.layers.\1.input_layernorm.weight"),
    (r"layers\.(\d+)\.ffn_norm\.weight", r"model.layers.\1.post_attention_layernorm.weight"),
    (r"layers\.(\d+)\.attention\.w([qkvo])\.weight", r"model.layers.\1.self_attn.\2_proj.weight"),
    (r"layers\.(\d+)\.feed_forward\.w1\.weight", r"model.layers.\1.mlp.gate_proj.weight"),
    (r"layers\.(\d+)\.feed_forward\.w2\.weight", r"model.layers.\1.mlp.down_proj.weight"),
    (r"layers\.(\d+)\.feed_forward\.w3\.weight", r"model.layers.\1.mlp.up_proj.weight"),
)]
"""Mistral's weight names -> transformers' (a name matching none is passed on: the model names it unexpected)."""


def uses_mistral_config(path: str, config_format: str = "auto") -> bool:
    """Whether the config is read from params.json: ``config_format`` "mistral", or "auto" for a folder that has a
    params.json and no config.json."""
    if config_format == "mistral":
        return True
    return config_format == "auto" and _has(path, PARAMS) and not _has(path, "config.json")


def uses_mistral_weights(path: str, load_format: str = "auto") -> bool:
    """Whether the weights are read from consolidated*.safetensors: ``load_format`` "mistral", or "auto" where the
    config is params.json's (`uses_mistral_config`)."""
    return load_format == "mistral" or (load_format == "auto" and uses_mistral_config(path))


def _has(path: str, name: str) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, name))


def _params(path: str) -> dict[str, Any]:
    try:
        with open(os.path.join(path, PARAMS), encoding="utf-8") as f:
            params = json.load(f)
    except (OSError, ValueError) as exc:
        raise ConfigError("config_format", "mistral", f"a checkpoint with a readable {PARAMS} ({exc})") from exc
    if not isinstance(params, dict):
        raise ConfigError("config_format", "mistral", f"a {PARAMS} that holds a JSON object")
    return params


def mistral_config(path: str) -> Any:
    """params.json as transformers' `MistralConfig` (architectures ``MistralForCausalLM``), under a `Mistral3Config`
    or `LlavaConfig` when it has a ``vision_encoder`` section; a key it does not map is a `NotBuiltError` naming it,
    never dropped."""
    from transformers import MistralConfig

    params = _params(path)
    for key, built in _FIXED.items():
        if params.get(key, built) != built:
            raise NotBuiltError("config_format", "mistral", f"{PARAMS}'s {key}={params[key]!r} (built: {built!r})")
    known = {*_CONFIG_KEYS, *_POSITION_KEYS, *_FIXED, VISION}
    unknown = sorted(k for k in params if k not in known and params[k] not in (None, {}))
    if unknown:
        raise NotBuiltError("config_format", "mistral", f"{PARAMS} with {', '.join(unknown)} (built: the dense "
                                                        f"text models' keys {sorted(known)})")
    if isinstance(params.get("sliding_window"), list):
        raise NotBuiltError("config_format", "mistral", f"{PARAMS}'s per-layer sliding_window list")
    kwargs = {_CONFIG_KEYS[k]: v for k, v in params.items() if k in _CONFIG_KEYS}
    lengths = [params[k] for k in _POSITION_KEYS if params.get(k) is not None]
    kwargs["max_position_embeddings"] = min(lengths) if lengths else _DEFAULT_MAX_POSITIONS  # both: the shorter
    kwargs.setdefault("num_key_value_heads", kwargs.get("num_attention_heads"))  # none given: one per head
    kwargs.setdefault("tie_word_embeddings", False)
    try:
        text = MistralConfig(**kwargs, architectures=["MistralForCausalLM"], bos_token_id=1, eos_token_id=2)
    except (TypeError, ValueError) as exc:
        raise ConfigError("config_format", "mistral", f"a {PARAMS} transformers' MistralConfig takes ({exc})") from exc
    return vision_config(params[VISION], text) if params.get(VISION) else text


def mistral_files(path: str) -> list[str]:
    """The consolidated*.safetensors of the folder; a `ConfigError` when it has none."""
    files = sorted(glob.glob(os.path.join(path, "consolidated*.safetensors")))
    if not files:
        raise ConfigError("load_format", "mistral", f"a folder with consolidated*.safetensors, and {path} has none")
    return files


def mistral_weights(path: str, weights: Iterator[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """Mistral-named weights under transformers' names (the decoder's under ``language_model.`` beside an image
    tower), wq and wk (read whole) permuted to transformers' rotary layout; the head counts are params.json's."""
    params = _params(path)
    heads = int(params["n_heads"])
    kv_heads = int(params.get("n_kv_heads") or heads)
    tower_heads = int((params.get(VISION) or {}).get("num_attention_heads", 16))
    decoder = "language_model." if params.get(VISION) else ""  # beside a tower, the decoder's names are nested
    for name, weight in weights:
        hf_name = vision_name(name)
        if hf_name is not None:
            if hf_name.endswith(("q_proj.weight", "k_proj.weight")):
                weight = _rotary_halves(weight[:], tower_heads)
            yield hf_name, weight
            continue
        hf_name = _hf_name(name)
        if hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            weight = _rotary_halves(weight[:], heads if hf_name.endswith("q_proj.weight") else kv_heads)
        yield decoder + hf_name, weight


def _hf_name(name: str) -> str:
    for pattern, replacement in _NAMES:
        if pattern.fullmatch(name):
            return pattern.sub(replacement, name)
    return name


def mistral_image_processor(path: str, **overrides: Any) -> Any:
    """The image processor of a folder whose image settings are only params.json's (`image_processor`)."""
    return image_processor(_params(path), **overrides)


def _rotary_halves(weight: Any, heads: int) -> Any:
    """Each head's rows from Mistral's (x0, y0, x1, y1, ...) rotary pairs to transformers' halves (x0, x1, ...,
    y0, y1, ...)."""
    rows, cols = weight.shape
    return weight.reshape(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)
