"""Finding a checkpoint and reading its config, without torch (the host process runs these).

``resolve_model_path`` finds the checkpoint folder (a local folder, or a hub id
through huggingface_hub's cache); ``load_hf_config`` reads its config.json with
transformers' ``AutoConfig`` (no remote code). The host prepares an engine
with these and the architecture table (asyncllm/models/architectures.py), so
importing `AsyncEngine` imports neither torch nor the model classes; the
engine's start does its preparation on a worker thread (where transformers,
when torch is installed, imports it), never at an app's import time.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

from asyncllm.errors import ConfigError, NotBuiltError

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = ["resolve_model_path", "load_hf_config", "hf_config_json", "hf_config_from_json",
           "checkpoint_quantization", "refuse_prequantized"]

_HUB_ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.tiktoken", "*.txt", "*.jinja"]
"""What a snapshot needs for serving: configs, safetensors weights, tokenizer files."""


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().upper() in ("1", "ON", "YES", "TRUE")


def resolve_model_path(model: str, revision: str | None = None) -> str:
    """A local folder as is; otherwise a hub id looked up through huggingface_hub.

    The hub is asked first unless HF_HUB_OFFLINE is set (read now, not at import),
    and huggingface_hub falls back to its cache (HF_HUB_CACHE) when the hub is
    unreachable. Anything else is a `ConfigError` saying what was tried.
    """
    if os.path.isdir(model):
        return model
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    offline = constants.HF_HUB_OFFLINE or _env_flag("HF_HUB_OFFLINE")
    cache_dir = os.environ.get("HF_HUB_CACHE") or constants.HF_HUB_CACHE
    try:
        return snapshot_download(
            model, revision=revision, cache_dir=cache_dir, local_files_only=offline, allow_patterns=_HUB_ALLOW_PATTERNS
        )
    except HFValidationError as exc:
        raise ConfigError("model", model, f"a local folder or a hub id: {model!r} is neither ({exc})") from exc
    except LocalEntryNotFoundError as exc:
        hub = "offline mode is on (HF_HUB_OFFLINE=1)" if offline else "the hub could not be reached"
        raise ConfigError(
            "model",
            model,
            f"a local folder or a hub id in the Hugging Face cache: it is not a folder, not in the cache "
            f"({cache_dir}), and {hub}; set HF_HUB_OFFLINE=0 or download it first "
            f"(`huggingface-cli download {model}`)",
        ) from exc
    except OSError as exc:  # RepositoryNotFoundError, GatedRepoError, RevisionNotFoundError, HTTP errors
        raise ConfigError("model", model, f"a hub id that can be downloaded ({type(exc).__name__}: {exc})") from exc


def load_hf_config(path: str) -> PretrainedConfig:
    """The checkpoint's transformers config (no remote code is ever run)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=False)
    except (OSError, ValueError, KeyError) as exc:
        allowed = f"a checkpoint folder whose config.json transformers can read ({exc})"
        raise ConfigError("model", path, allowed) from exc


def hf_config_json(hf_config: PretrainedConfig) -> str:
    """The config with every default filled in, as JSON: the host sends it to the workers."""
    return json.dumps(hf_config.to_dict(), default=str)


def hf_config_from_json(text: str) -> PretrainedConfig:
    """`hf_config_json`'s config again, as a plain ``PretrainedConfig`` (its sub-configs too).

    The model classes read only attributes, all of them in the JSON, so a
    worker rebuilds the host's config without importing the architecture's
    config class (in transformers 5 that import alone costs seconds).
    """
    from transformers.configuration_utils import PretrainedConfig

    def build(values: dict[str, Any]) -> PretrainedConfig:
        nested = {k: build(v) for k, v in values.items() if isinstance(v, dict) and "model_type" in v}
        return PretrainedConfig.from_dict({**values, **nested})

    return build(json.loads(text))


_QUANTIZATION_CONFIG_KEYS = ("quantization_config", "compression_config")
"""Where config.json names a pre-quantized checkpoint's method (compressed-tensors' older name second)."""


def checkpoint_quantization(hf_config: Any) -> str | None:
    """The method a pre-quantized checkpoint's config names (``quant_method``: fp8, awq, gptq,
    compressed-tensors, bitsandbytes, ...), or None for a float checkpoint (a multimodal one's
    ``text_config`` is looked at too)."""
    for cfg in (hf_config, getattr(hf_config, "text_config", None)):
        for key in _QUANTIZATION_CONFIG_KEYS:
            section = getattr(cfg, key, None) if cfg is not None else None
            if not section:
                continue
            if not isinstance(section, dict):  # a transformers QuantizationConfigMixin
                section = section.to_dict() if hasattr(section, "to_dict") else {}
            return str(section.get("quant_method") or section.get("format") or "unknown")
    return None


def refuse_prequantized(hf_config: Any, model: str) -> None:
    """`NotBuiltError` for a pre-quantized checkpoint: asyncllm only quantizes float weights itself."""
    method = checkpoint_quantization(hf_config)
    if method is not None:
        raise NotBuiltError("model", model,
                            f"loading a pre-quantized {method!r} checkpoint (its config.json has a quantization_config; "
                            "asyncllm quantizes only online: quantization='fp8' on a bfloat16/float16/float32 "
                            "checkpoint, docs/quantization.md)")
