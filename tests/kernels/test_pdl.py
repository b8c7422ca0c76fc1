"""kernels/_pdl.py: which launches get programmatic dependent launch (the PTX side: test_kernels_compile.py)."""

from __future__ import annotations

import pytest
import torch

from asyncllm.errors import ConfigError
from asyncllm.kernels import _pdl


@pytest.fixture(autouse=True)
def _fresh_cache():
    _pdl._enabled.cache_clear()
    yield
    _pdl._enabled.cache_clear()


def test_cpu_tensors_launch_without_pdl() -> None:
    assert _pdl.pdl_launch(torch.device("cpu")) == {"PDL": False}


@pytest.mark.parametrize("capability, env, interpret, on", [
    ((9, 0), None, "0", True), ((10, 0), "1", "0", True), ((8, 9), None, "0", False), ((9, 0), "0", "0", False),
    ((9, 0), None, "1", False),
])
def test_on_for_hopper_and_later_unless_switched_off(monkeypatch: pytest.MonkeyPatch, capability, env, interpret,
                                                     on: bool) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    if env is None:
        monkeypatch.delenv("ASYNCLLM_PDL", raising=False)
    else:
        monkeypatch.setenv("ASYNCLLM_PDL", env)
    expected = {"PDL": True, "launch_pdl": True} if on else {"PDL": False}
    assert _pdl.pdl_launch(torch.device("cuda", 0)) == expected


def test_never_on_rocm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 4))  # an MI300's gfx942
    monkeypatch.setattr(torch.version, "hip", "6.4")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert _pdl.pdl_launch(torch.device("cuda", 0)) == {"PDL": False}


def test_a_bad_value_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv("ASYNCLLM_PDL", "maybe")
    with pytest.raises(ConfigError, match="ASYNCLLM_PDL"):
        _pdl.pdl_launch(torch.device("cuda", 0))
