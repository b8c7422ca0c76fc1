"""GGUF checkpoints (llama.cpp's single-file format) on the host, without torch.

A model given as a local ``.gguf`` file (vLLM's ``vllm serve ./model.Q4_K_M.gguf``) is a GGUF checkpoint:
`load_gguf_config` reads its transformers config from the file's metadata (transformers' own GGUF reader) after
refusing an architecture asyncllm does not load from GGUF, and `gguf_checkpoint_config` checks ``quantization``
against it. The weights are read and dequantized on each rank by asyncllm/models/gguf_loader.py; the format and
what is built are in docs/quantization.md.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from asyncllm.errors import ConfigError, NotBuiltError

__all__ = ["GGUF_QUANTIZATION", "GGUF_ARCHITECTURES", "GgufCheckpointConfig", "is_gguf_file", "gguf_architecture",
           "load_gguf_config", "gguf_checkpoint_config"]

GGUF_QUANTIZATION = "gguf"
"""The `quantization` value naming a GGUF checkpoint (vLLM's ``--quantization gguf``); None serves it too."""
GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3")
"""The GGUF ``general.architecture`` values asyncllm loads (a ``llama`` file whose ``general.name`` is "mistral" is
read by transformers as model_type mistral: MistralForCausalLM; other Mistral files as Llama, the same function
without a sliding window)."""
_MODEL_TYPE_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                             "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
"""transformers' model_type of a GGUF config -> its architecture (the config read from a GGUF names none)."""


@dataclass(frozen=True)
class GgufCheckpointConfig:
    """A GGUF checkpoint: its weights are dequantized to the model dtype at load (asyncllm/models/gguf_loader.py)."""

    path: str
    """The ``.gguf`` file."""


def is_gguf_file(model: str) -> bool:
    """Whether ``model`` names a GGUF file (by its extension, as vLLM does; it need not exist)."""
    return isinstance(model, str) and model.lower().endswith(".gguf") and not os.path.isdir(model)


def _reader(path: str) -> Any:
    from gguf import GGUFReader

    try:
        return GGUFReader(path)
    except (OSError, ValueError) as exc:
        raise ConfigError("model", path, f"a GGUF file gguf can read ({type(exc).__name__}: {exc})") from exc


def _string(reader: Any, key: str) -> str | None:
    field = reader.fields.get(key)
    return None if field is None or not field.data else bytes(field.parts[field.data[0]]).decode("utf-8")


def gguf_architecture(path: str) -> str:
    """The file's ``general.architecture``; `ConfigError` when it is not a GGUF file gguf can read."""
    arch = _string(_reader(path), "general.architecture")
    if arch is None:
        raise ConfigError("model", path, "a GGUF file with a general.architecture")
    return arch


def _refuse_unread(reader: Any, arch: str, path: str) -> None:
    """`NotBuiltError` for what changes the model's function but transformers' GGUF config does not carry."""
    scaling = _string(reader, f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise NotBuiltError("model", path, f"GGUF rope scaling ({arch}.rope.scaling.type {scaling!r})")
    if any(tensor.name == "rope_freqs.weight" for tensor in reader.tensors):
        raise NotBuiltError("model", path, "GGUF per-frequency rotary factors (rope_freqs.weight: Llama 3.1's rope "
                                           "scaling as llama.cpp stores it)")


def load_gguf_config(path: str) -> Any:
    """The transformers config of a GGUF file (its metadata), with ``architectures`` set to what asyncllm builds;
    `NotBuiltError` naming the GGUF architecture when asyncllm does not load it."""
    from transformers import AutoConfig

    reader = _reader(path)
    arch = _string(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise NotBuiltError("model", path, f"GGUF checkpoints of the {arch!r} architecture (GGUF loads "
                                           f"{', '.join(map(repr, GGUF_ARCHITECTURES))})")
    _refuse_unread(reader, arch, path)
    folder, name = os.path.split(os.path.abspath(path))
    try:
        hf_config = AutoConfig.from_pretrained(folder, gguf_file=name, trust_remote_code=False)
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError("model", path, f"a GGUF file whose metadata transformers can read ({exc})") from exc
    if hf_config.model_type not in _MODEL_TYPE_ARCHITECTURES:
        raise NotBuiltError("model", path, f"a GGUF {arch!r} file transformers reads as model_type "
                                           f"{hf_config.model_type!r}")
    hf_config.architectures = [_MODEL_TYPE_ARCHITECTURES[hf_config.model_type]]
    return hf_config


def gguf_checkpoint_config(model: str, quantization: str | None) -> GgufCheckpointConfig | None:
    """A GGUF model's `GgufCheckpointConfig` (``quantization`` None or "gguf"), None for another model;
    `ConfigError` for "gguf" with a model that is not a GGUF file, or another method with one."""
    if not is_gguf_file(model):
        if quantization == GGUF_QUANTIZATION:
            raise ConfigError("quantization", quantization, "a value other than 'gguf' for a model that is not a "
                              f"GGUF file ({model!r}: 'gguf' serves a local .gguf file given as the model)")
        return None
    if quantization not in (None, GGUF_QUANTIZATION):
        raise ConfigError("quantization", quantization, f"None or 'gguf' for a GGUF model ({model!r}: its weights "
                          "are GGUF's own quantization, dequantized at load)")
    return GgufCheckpointConfig(model)
