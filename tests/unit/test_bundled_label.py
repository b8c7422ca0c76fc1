"""The bundled model's series and spans are labelled `asyncllm-tiny` (docs/observability.md), not its folder: by
`AsyncEngine()` as by `asyncllm serve` (one rule, `asyncllm.bundled.model_label`)."""

from __future__ import annotations

import re

import prometheus_client

from asyncllm import AsyncEngine
from asyncllm.bundled import BUNDLED_MODEL_NAME, bundled_model_path, model_label
from asyncllm.metrics.observer import RequestObserver


def _labels(engine: AsyncEngine) -> set[str]:
    text = prometheus_client.generate_latest(engine.metrics_registry).decode()
    return set(re.findall(r'model_name="([^"]*)"', text))


def test_the_default_engine_labels_its_series_with_the_bundled_models_name() -> None:
    assert _labels(AsyncEngine(disable_log_stats=True)) == {BUNDLED_MODEL_NAME}  # nothing is started


def test_every_data_parallel_replica_is_labelled_so() -> None:
    assert _labels(AsyncEngine(disable_log_stats=True, data_parallel_size=2)) == {BUNDLED_MODEL_NAME}


def test_a_host_attached_to_a_bundled_core_learns_the_name() -> None:
    observer = RequestObserver("ipc:///tmp/core.sock", named=False)
    observer.set_model_name(bundled_model_path())  # the core's config.model: the folder
    assert observer.stats.model_name == BUNDLED_MODEL_NAME


def test_other_models_keep_the_name_they_were_given() -> None:
    assert model_label("Qwen/Qwen3-0.6B") == "Qwen/Qwen3-0.6B"
    assert RequestObserver("/models/llama").stats.model_name == "/models/llama"
