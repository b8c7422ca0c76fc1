"""The tiny model asyncllm ships, used when no model is given.

A 2.4M-parameter Llama trained on the Python standard library's own source by
``python -m asyncllm.tiny_train`` (docs/tiny-model.md has the recipe, the
held-out perplexity and sample output). It lives in the package as data, so
``asyncllm generate``, ``asyncllm serve`` and ``AsyncEngine()`` work on a fresh
machine with no download. Its text looks like Python source; it answers nothing.
"""

from __future__ import annotations

from pathlib import Path

from asyncllm.errors import ConfigError

__all__ = ["BUNDLED_MODEL_NAME", "bundled_model_path", "model_label"]

BUNDLED_MODEL_NAME = "asyncllm-tiny"
"""The name the OpenAI-compatible server gives the bundled model (``/v1/models``)."""

_FOLDER = Path(__file__).resolve().parent / "data" / "tiny-llama"


def bundled_model_path() -> str:
    """The folder of the bundled checkpoint (config, bf16 safetensors, tokenizer, chat template)."""
    if not (_FOLDER / "config.json").is_file():
        raise ConfigError(
            "model", None,
            f"a model: the bundled tiny model is missing from {_FOLDER} (a broken install?); "
            "pass a local folder or a hub id, or rebuild it with `python -m asyncllm.tiny_train --out "
            f"{_FOLDER}`",
        )
    return str(_FOLDER)


def model_label(model: str) -> str:
    """What the metrics, spans and the OpenAI server call `model`: `BUNDLED_MODEL_NAME` for the bundled model's
    folder (``AsyncEngine()``), else `model` as given (a hub id, not the folder it resolves to)."""
    try:
        return BUNDLED_MODEL_NAME if model == bundled_model_path() else model
    except ConfigError:  # no bundled model in this install
        return model
