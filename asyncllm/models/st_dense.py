"""sentence-transformers' Dense modules: projections an embedding checkpoint applies after pooling.

A checkpoint folder's ``modules.json`` lists its pipeline (Transformer, Pooling, then any Dense layers, then
Normalize). Each Dense module has a ``config.json`` (``in_features``, ``out_features``, ``bias``,
``activation_function``) and its weights (``linear.weight``, ``linear.bias``) in its own folder. EmbeddingGemma
projects its 768-wide mean to 3072 and back to 768 this way; LaBSE and others use one Tanh layer.
`dense_modules` reads them (the host checks them before anything starts); `load_dense_projection` builds them in a
worker, applied to each pooled embedding before ``dimensions`` and the L2 norm (workers/pooler.py).
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass
from typing import Any

from asyncllm.errors import ConfigError, NotBuiltError

__all__ = ["DenseModule", "dense_modules", "dense_pickle_patterns", "embedding_width", "load_dense_projection",
           "read_st_config", "st_modules"]

_ACTIVATIONS = {"torch.nn.modules.linear.Identity": "identity", "torch.nn.modules.activation.Tanh": "tanh"}
"""sentence-transformers' ``activation_function`` names asyncllm applies (its default is Tanh)."""


@dataclass(frozen=True)
class DenseModule:
    folder: str
    in_features: int
    out_features: int
    bias: bool
    activation: str
    """``identity`` or ``tanh``."""


def st_modules(path: str | None) -> list[dict[str, Any]] | None:
    """The folder's ``modules.json`` (its sentence-transformers pipeline), None without one."""
    if path is None or not os.path.isfile(os.path.join(path, "modules.json")):
        return None
    modules = read_st_config(os.path.join(path, "modules.json"), list)
    if not all(isinstance(module, dict) for module in modules):
        raise ConfigError("model", os.path.join(path, "modules.json"), "a modules.json listing JSON objects")
    return modules


def read_st_config(file: str, kind: type[list] | type[dict]) -> Any:
    """A sentence-transformers config file's JSON (``modules.json``, a module's ``config.json``,
    ``sentence_bert_config.json``; null: an empty ``kind``); `ConfigError` naming it unless it parses to a ``kind``."""
    try:
        with open(file) as f:
            value = json.load(f)
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise ConfigError("model", file, f"a {os.path.basename(file)} of valid JSON ({exc})") from exc
    value = kind() if value is None else value
    if not isinstance(value, kind):
        raise ConfigError("model", file, f"a {os.path.basename(file)} holding a JSON "
                                         f"{'list' if kind is list else 'object'}, not a {type(value).__name__}")
    return value


def dense_modules(path: str | None) -> list[DenseModule]:
    """The folder's Dense modules in pipeline order (none without a ``modules.json``)."""
    out = []
    for module in st_modules(path) or []:
        if not str(module.get("type", "")).endswith(".Dense"):
            continue
        folder = os.path.join(path, module.get("path", ""))  # type: ignore[arg-type]
        config = read_st_config(os.path.join(folder, "config.json"), dict)
        name = config.get("activation_function", "torch.nn.modules.activation.Tanh")
        if name not in _ACTIVATIONS:
            raise NotBuiltError("model", name, f"a sentence-transformers Dense module with {name} (built: "
                                               f"{', '.join(_ACTIVATIONS)})")
        out.append(DenseModule(folder, int(config["in_features"]), int(config["out_features"]),
                               bool(config.get("bias", True)), _ACTIVATIONS[name]))
    return out


def dense_pickle_patterns(path: str) -> list[str]:
    """The hub patterns of the PyTorch weights of the snapshot's Dense modules that have no safetensors in it (older
    sentence-transformers repos: a root ``model.safetensors`` beside ``2_Dense/pytorch_model.bin``), as vLLM
    fetches each Dense folder's ``model.safetensors`` else its ``pytorch_model.bin``."""
    return [f"{folder}/{name}" for folder in dense_folders(path)
            if not glob.glob(os.path.join(path, folder, "*.safetensors")) for name in ("*.bin", "*.pt")]


def dense_folders(path: str) -> list[str]:
    """The folders of the snapshot's Dense modules, as its ``modules.json`` names them."""
    return [m.get("path", "") for m in st_modules(path) or [] if str(m.get("type", "")).endswith(".Dense")]


def embedding_width(path: str | None, hidden_size: int) -> int:
    """The width of the model's embeddings: the last Dense module's output, else the hidden size (the width of the
    rows the model pools: a ColBERT's projected ones). Dense modules that do not chain from it (a module whose
    ``in_features`` is not the width before it) are a `ConfigError` naming the module, before any worker starts."""
    width = hidden_size
    for module in dense_modules(path):
        if module.in_features != width:
            raise ConfigError("model", path, f"sentence-transformers Dense modules that chain from the model's "
                                             f"{width}-wide rows; {os.path.basename(module.folder)} takes "
                                             f"{module.in_features} features")
        width = module.out_features
    return width


def load_dense_projection(path: str, device: Any, dtype: Any) -> Any:
    """The Dense modules as one ``torch.nn.Sequential`` on ``device`` (``dtype``), None without any."""
    from torch import nn

    from asyncllm.models.loader import checkpoint_files, iterate_safetensors
    from asyncllm.models.layers import copy_weight

    layers: list[nn.Module] = []
    for module in dense_modules(path):
        linear = nn.Linear(module.in_features, module.out_features, bias=module.bias, device=device, dtype=dtype)
        weights = dict(iterate_safetensors(checkpoint_files(module.folder)))
        for name, param in linear.named_parameters():
            if f"linear.{name}" not in weights:
                raise ConfigError("model", module.folder, f"a Dense module with linear.{name}")
            try:
                copy_weight(param.data, weights[f"linear.{name}"])
            except ValueError as exc:
                raise ConfigError("model", module.folder, f"linear.{name} as its config.json shapes it, but it "
                                                          f"{exc}") from exc
        layers += [linear] if module.activation == "identity" else [linear, nn.Tanh()]
    return nn.Sequential(*layers).requires_grad_(False) if layers else None
