"""Which attention backends can be asked for here: their packages, without importing them.

Torch-free, so `asyncllm.config` can check ``attention_backend`` when an
`EngineConfig` is made (``import asyncllm`` stays cheap; not the config a host
attached to a core takes from it: `EngineConfig.from_dict`); whether the backend
runs on the device is `asyncllm.attention.selector`'s check, in the worker.
"""

from __future__ import annotations

import importlib.util

from asyncllm.errors import ConfigError, NotBuiltError

__all__ = ["ATTENTION_BACKENDS", "BACKEND_PACKAGES", "BUILT_BACKENDS", "VLLM_BACKEND_NAMES", "backend_name",
           "package_installed", "check_backend_available"]

ATTENTION_BACKENDS = ("torch_sdpa", "triton", "flashinfer", "flash_attn")
BACKEND_PACKAGES = {"triton": "triton", "flashinfer": "flashinfer", "flash_attn": "flash_attn"}
"""Backend name -> the Python package it needs (torch_sdpa needs only torch)."""
BUILT_BACKENDS = ("torch_sdpa", "triton")
VLLM_BACKEND_NAMES = {"FLASH_ATTN": "flash_attn", "FLASHINFER": "flashinfer", "TRITON_ATTN": "triton",
                      "TORCH_SDPA": "torch_sdpa"}
"""vLLM's names of the backends asyncllm has (its ``AttentionBackendEnum``, read case-insensitively as vLLM reads
``attention_backend``) -> asyncllm's."""


def backend_name(name: object) -> object:
    """``attention_backend`` in asyncllm's name: vLLM's (``"FLASH_ATTN"``, ``"triton_attn"``, ...) translated, any
    other value as given (checked by the caller)."""
    return VLLM_BACKEND_NAMES.get(name.upper(), name) if isinstance(name, str) else name


def package_installed(package: str) -> bool:
    """Whether ``package`` can be imported (looked up, not imported)."""
    return importlib.util.find_spec(package) is not None


def check_backend_available(name: str) -> None:
    """`ConfigError` naming the missing package, or `NotBuiltError` for an installed but unbuilt backend."""
    package = BACKEND_PACKAGES.get(name)
    if package is not None and not package_installed(package):
        pip_name = {"flashinfer": "flashinfer-python", "flash_attn": "flash-attn"}.get(name, package)
        raise ConfigError(
            "attention_backend", name,
            f"a backend whose package is installed: {name} needs the {package!r} package, which is not "
            f"installed (pip install {pip_name}); or use 'torch_sdpa'",
        )
    if name not in BUILT_BACKENDS:
        raise NotBuiltError("attention_backend", name, f"the {name} attention backend")
