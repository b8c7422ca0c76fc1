"""Tensor-parallel sizes the model's attention heads do not split over: refused on the host, before anything is
spawned (as vLLM's `ModelConfig.verify_with_parallel_config`), not by the workers after their start."""

from __future__ import annotations

import pytest

from asyncllm import EngineConfig
from asyncllm.bundled import bundled_model_path
from asyncllm.engine.prepare import prepare
from asyncllm.errors import ConfigError


def test_heads_that_do_not_split_over_tp_are_refused_before_spawning() -> None:
    """The bundled model's 3 heads over 2 ranks: the workers' ConfigError, from `prepare` (was: raised by the
    workers after spawning them, 2-16 s later)."""
    with pytest.raises(ConfigError) as caught:
        prepare(EngineConfig.create(bundled_model_path(), tensor_parallel_size=2))
    assert (caught.value.field, caught.value.value) == ("tensor_parallel_size", 2)
    assert caught.value.allowed == "a size that divides the model's num_attention_heads=3"


def test_heads_that_split_over_tp_pass_the_host_check() -> None:
    """3 heads over 3 ranks (1 KV head, replicated): the host refuses nothing."""
    prepare(EngineConfig.create(bundled_model_path(), tensor_parallel_size=3))


def test_a_config_without_attention_heads_passes_the_host_check() -> None:
    """An attention-free model (Mamba's config names no num_attention_heads): nothing to split, as vLLM's 0."""
    from types import SimpleNamespace

    from asyncllm.config_checks import check_heads_split

    check_heads_split(2, SimpleNamespace())
    check_heads_split(2, SimpleNamespace(num_attention_heads=None))
