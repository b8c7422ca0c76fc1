"""What a benchmark runs: a model folder, or a shipped shape preset with dummy weights.

A preset is the published config.json of a real model (``presets/``) plus a
synthetic word-level tokenizer with exactly the model's vocabulary (token i is
the word ``t<i>``): requests are driven by token ids, and the tokenizer exists
only so the engine's detokenizer does its real per-token work on the output.
Preset folders are made once under the user cache folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from asyncllm.errors import ConfigError

__all__ = ["PRESETS", "BenchModel", "resolve_bench_model", "preset_config"]

PRESETS = ("qwen3-0.6b", "llama3.1-8b", "qwen3-30b-a3b", "gpt-oss-20b", "tiny")
"""Shape presets (dummy weights, synthetic tokenizer; qwen3-30b-a3b and gpt-oss-20b are mixtures of experts,
gpt-oss-20b with its MXFP4 quantization_config: dummy packed experts on a GPU, bf16 ones on the CPU), and
``tiny``: asyncllm's tiny random Llama (CPU runs)."""


@dataclass(frozen=True)
class BenchModel:
    """A model folder ready for both asyncllm and transformers."""

    name: str
    """The preset name or the folder given."""
    path: str
    load_format: str
    """``dummy`` for shape presets (random weights of the real size), else ``auto``."""
    vocab_size: int
    max_position_embeddings: int


def preset_config(name: str) -> dict[str, Any]:
    """The shipped config.json of shape preset ``name``."""
    text = resources.files("asyncllm.bench").joinpath("presets", f"{name}.json").read_text()
    return json.loads(text)


def resolve_bench_model(model: str | None, preset: str | None, load_format: str | None = None) -> BenchModel:
    """``--model PATH`` or ``--preset NAME`` (exactly one) -> a `BenchModel`."""
    if (model is None) == (preset is None):
        raise ConfigError("model", model, "exactly one of --model PATH or --preset NAME")
    if preset is not None:
        if preset not in PRESETS:
            raise ConfigError("preset", preset, f"one of {', '.join(PRESETS)}")
        path = _tiny_folder() if preset == "tiny" else _preset_folder(preset)
        default_format = "auto" if preset == "tiny" else "dummy"
        return _bench_model(preset, path, load_format or default_format)
    assert model is not None
    if not os.path.isdir(model):
        raise ConfigError("model", model, "a local checkpoint folder (config.json and tokenizer files)")
    return _bench_model(model, model, load_format or "auto")


def _bench_model(name: str, path: str, load_format: str) -> BenchModel:
    """`ConfigError` naming ``model`` for a folder without a readable config.json of a vocab_size (no traceback)."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
        vocab_size = int(config["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError("model", path, f"a local checkpoint folder whose config.json gives a vocab_size "
                                         f"({type(exc).__name__}: {exc})") from None
    max_position = int(config.get("max_position_embeddings", 2048))
    return BenchModel(name, path, load_format, vocab_size, max_position)


def _tiny_folder() -> str:
    from asyncllm.tiny import tiny_checkpoint

    return tiny_checkpoint("llama")


def _cache_root() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "asyncllm" / "bench"


def _preset_folder(name: str) -> str:
    """The preset's folder (config.json + tokenizer), built once; racing builders end with one folder."""
    config = preset_config(name)
    key = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:12]
    final = _cache_root() / f"{name}-{key}"
    if (final / "tokenizer.json").is_file():
        return str(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent)
    try:
        with open(os.path.join(staging, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
        _save_word_tokenizer(staging, int(config["vocab_size"]))
        try:
            os.rename(staging, final)
        except OSError:
            if not (final / "tokenizer.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return str(final)


def _save_word_tokenizer(path: str, vocab_size: int) -> None:
    """A word-level tokenizer whose token i is ``t<i>``: every id decodes, to a few bytes."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="t0", pad_token="t0")
    tokenizer.save_pretrained(path)
