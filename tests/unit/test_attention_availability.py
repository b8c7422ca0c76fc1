"""attention_backend in EngineConfig: a missing package is named, an installed unbuilt one is NotBuilt."""

from __future__ import annotations

import pytest

from asyncllm import EngineConfig
from asyncllm.attention import availability
from asyncllm.errors import ConfigError, NotBuiltError


def _pretend_installed(monkeypatch: pytest.MonkeyPatch, installed: set[str]) -> None:
    monkeypatch.setattr(availability, "package_installed", lambda package: package in installed)


@pytest.mark.parametrize("backend, pip_name", [("flashinfer", "flashinfer-python"), ("flash_attn", "flash-attn"),
                                               ("triton", "triton")])
def test_missing_package_is_named(monkeypatch: pytest.MonkeyPatch, backend: str, pip_name: str) -> None:
    _pretend_installed(monkeypatch, set())
    with pytest.raises(ConfigError) as info:
        EngineConfig.create("m", attention_backend=backend)
    assert not isinstance(info.value, NotBuiltError)
    assert info.value.field == "attention_backend" and f"pip install {pip_name}" in str(info.value)


@pytest.mark.parametrize("backend", ["flashinfer", "flash_attn"])
def test_installed_but_unbuilt_backend(monkeypatch: pytest.MonkeyPatch, backend: str) -> None:
    _pretend_installed(monkeypatch, {backend})
    with pytest.raises(NotBuiltError, match=f"the {backend} attention backend is not built yet"):
        EngineConfig.create("m", attention_backend=backend)


def test_built_backends_are_accepted(monkeypatch: pytest.MonkeyPatch) -> None:
    _pretend_installed(monkeypatch, {"triton"})
    assert EngineConfig.create("m", attention_backend="triton").attention_backend == "triton"
    assert EngineConfig.create("m", attention_backend="torch_sdpa").attention_backend == "torch_sdpa"
    with pytest.raises(ConfigError, match="one of"):
        EngineConfig.create("m", attention_backend="xformers")


def test_package_lookup_does_not_import() -> None:
    assert availability.package_installed("json") and not availability.package_installed("no_such_pkg_xyz")


def test_core_config_skips_this_machines_package_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """A host attached to a core (`from_dict(from_core=True)`) runs no attention: the core's backend package need
    not be installed on the host's machine, also through `replace` (prepare resolves the config with it)."""
    _pretend_installed(monkeypatch, {"triton"})
    flat = EngineConfig.create("m", attention_backend="triton").to_dict(wire=True)
    _pretend_installed(monkeypatch, set())
    config = EngineConfig.from_dict(flat, from_core=True).replace(max_model_len=64)
    assert config.attention_backend == "triton" and config.max_model_len == 64
    with pytest.raises(ConfigError, match="pip install triton"):
        EngineConfig.from_dict(flat)
    with pytest.raises(ConfigError, match="pip install triton"):
        config.replace(attention_backend="triton")


def test_vllm_backend_names(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's documented `attention_backend="FLASH_ATTN"` (its AttentionBackendEnum names, read in any case) was
    "not allowed: one of 'torch_sdpa', 'triton', ..."; now each names the same backend here: TRITON_ATTN runs triton,
    TORCH_SDPA torch_sdpa, FLASH_ATTN / FLASHINFER get the missing-package error (or NotBuilt) of ours."""
    import torch

    from asyncllm.attention.selector import get_attention_backend

    _pretend_installed(monkeypatch, {"triton"})
    for name, ours in (("TRITON_ATTN", "triton"), ("triton_attn", "triton"), ("TORCH_SDPA", "torch_sdpa"),
                       ("Torch_SDPA", "torch_sdpa")):
        assert EngineConfig.create("m", attention_backend=name).attention_backend == ours
    with pytest.raises(ConfigError, match="pip install flash-attn"):
        EngineConfig.create("m", attention_backend="FLASH_ATTN")
    with pytest.raises(ConfigError, match="pip install flashinfer-python"):
        EngineConfig.create("m", attention_backend="FLASHINFER")
    assert get_attention_backend("TORCH_SDPA", torch.device("cpu")).name == "torch_sdpa"
    with pytest.raises(ConfigError, match="one of"):
        EngineConfig.create("m", attention_backend="FLEX_ATTENTION")
