"""PyTorch pickle checkpoints (``pytorch_model.bin``, sharded with ``pytorch_model.bin.index.json``, or ``*.pt``):
what older releases (OPT, GPT-J, many fine-tunes) ship instead of safetensors.

``load_format="auto"`` reads them when a folder has no safetensors, ``"pt"`` always. Each file is opened with
``torch.load(weights_only=True)`` (no arbitrary code runs: only tensors and plain containers unpickle) and
memory-mapped where its format allows, so a rank touches only the rows it copies.
"""

from __future__ import annotations

import glob
import os
from typing import Iterator

import torch

from asyncllm.errors import ConfigError

__all__ = ["PT_INDEX", "indexed_files", "iterate_pt", "pt_checkpoint_files"]

PT_INDEX = "pytorch_model.bin.index.json"
_NOT_WEIGHTS = ("training_args.bin", "optimizer.bin", "optimizer.pt", "scheduler.pt", "rng_state.pth", "scaler.pt")
"""Files a trainer leaves beside the weights."""


def indexed_files(path: str, index_name: str) -> list[str] | None:
    """The files a checkpoint's index (``model.safetensors.index.json``, ``pytorch_model.bin.index.json``) names;
    None without one; `ConfigError` when one it names is absent."""
    from asyncllm.models.hub import index_names

    names = index_names(path, index_name)
    if names is None:
        return None
    files = [os.path.join(path, name) for name in names]
    absent = [os.path.basename(file) for file in files if not os.path.exists(file)]
    if absent:
        raise ConfigError("model", path, f"a complete checkpoint; its index names absent files {absent}")
    return files


def pt_checkpoint_files(path: str) -> list[str]:
    """The pickle files to read: those of the index when there is one, else every ``*.bin`` (or ``*.pt``) that
    is not a trainer's state; empty when there are none."""
    indexed = indexed_files(path, PT_INDEX)
    if indexed is not None:
        return indexed
    for pattern in ("*.bin", "*.pt"):
        files = [f for f in sorted(glob.glob(os.path.join(path, pattern))) if os.path.basename(f) not in _NOT_WEIGHTS]
        if files:
            return files
    return []


def _load(file: str) -> object:
    try:
        return torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError as exc:  # the legacy (non-zip) format cannot be memory-mapped
        if "mmap" not in str(exc):
            raise
        return torch.load(file, map_location="cpu", weights_only=True)


def iterate_pt(files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of every file, read with ``weights_only=True``."""
    for file in files:
        try:
            state = _load(file)
        except Exception as exc:
            why = " ".join(str(exc).split())  # torch's text runs over lines; the CLI prints one
            raise ConfigError("model", file, f"a PyTorch checkpoint of tensors only ({type(exc).__name__}: {why})") \
                from exc
        if not isinstance(state, dict):
            raise ConfigError("model", file, f"a PyTorch checkpoint holding a dict of tensors, not a {type(state)}")
        for name, tensor in state.items():
            if isinstance(tensor, torch.Tensor):
                yield name, tensor
        del state
