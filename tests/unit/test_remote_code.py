"""A checkpoint's own code (trust_remote_code) from a folder and from the hub, and a config.json naming no
architecture."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import huggingface_hub
import pytest
from huggingface_hub.utils import filter_repo_objects

from asyncllm import EngineConfig
from asyncllm.engine.prepare import prepare
from asyncllm.errors import ConfigError, NotBuiltError
from asyncllm.tokenizer import load_tokenizer


def _checkpoint(folder: Path, tiny_llama: str, config: dict, tokenizer: dict | None = None) -> str:
    """The tiny Llama in `folder`, its config.json and tokenizer_config.json updated with `config`, `tokenizer`."""
    folder.mkdir()
    for name in ("model.safetensors", "tokenizer.json"):
        shutil.copy(os.path.join(tiny_llama, name), folder)
    for name, update in (("config.json", config), ("tokenizer_config.json", tokenizer or {})):
        with open(os.path.join(tiny_llama, name)) as f:
            (folder / name).write_text(json.dumps({**json.load(f), **update}))
    return str(folder)


_OWN_TOKENIZER = {"tokenizer_class": "MineTokenizer",
                  "auto_map": {"AutoTokenizer": [None, "tokenization_mine.MineTokenizer"]}}
"""tokenizer_config.json's keys naming the checkpoint's own tokenizer class (`_own_code`)."""


def _own_code(folder: Path, config: bool) -> None:
    """The checkpoint's tokenizer class (and its `config` class) as its own *.py files."""
    (folder / "tokenization_mine.py").write_text(
        "from transformers import PreTrainedTokenizerFast\n\n\n"
        "class MineTokenizer(PreTrainedTokenizerFast):\n    pass\n")
    if config:
        (folder / "configuration_mine.py").write_text(
            "from transformers import LlamaConfig\n\n\nclass MineConfig(LlamaConfig):\n    model_type = 'mine'\n")


def test_a_hub_checkpoints_own_code_is_fetched_with_trust_remote_code(tmp_path: Path, tiny_llama: str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A hub id whose config and tokenizer are its own code: its *.py files are downloaded with trust_remote_code
    (and only then), so it loads as the same folder does."""
    own_config = {"model_type": "mine", "auto_map": {"AutoConfig": "configuration_mine.MineConfig"}}
    repo = _checkpoint(tmp_path / "repo", tiny_llama, own_config, _OWN_TOKENIZER)
    _own_code(tmp_path / "repo", config=True)
    snapshots = []

    def snapshot_download(model, allow_patterns, **_):  # the hub's selection (huggingface_hub's own filter)
        snapshot = tmp_path / f"snapshot{len(snapshots)}"
        snapshot.mkdir()
        snapshots.append(snapshot)
        for name in filter_repo_objects(sorted(os.listdir(repo)), allow_patterns=allow_patterns):
            shutil.copy(os.path.join(repo, name), snapshot)
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    prepared = prepare(EngineConfig.create("org/mine", trust_remote_code=True))
    assert type(prepared.tokenizer).__name__ == "MineTokenizer"
    assert {p.name for p in snapshots[-1].glob("*.py")} == {"configuration_mine.py", "tokenization_mine.py"}
    with pytest.raises(ConfigError) as info:
        prepare(EngineConfig.create("org/mine"))
    assert info.value.field == "trust_remote_code" and not list(snapshots[-1].glob("*.py"))


def test_a_tokenizers_own_code_is_refused_naming_trust_remote_code(tmp_path: Path, tiny_llama: str) -> None:
    path = _checkpoint(tmp_path / "model", tiny_llama, {}, _OWN_TOKENIZER)
    _own_code(tmp_path / "model", config=False)
    with pytest.raises(ConfigError, match="trust_remote_code=False .*own tokenizer code") as info:
        load_tokenizer(path)
    assert info.value.field == "trust_remote_code"
    assert type(load_tokenizer(path, trust_remote_code=True)).__name__ == "MineTokenizer"


def test_a_config_without_architectures_is_a_config_error(tmp_path: Path, tiny_llama: str) -> None:
    """vLLM's "No model architectures are specified": a ConfigError saying so, not an unsupported (None) one;
    hf_overrides can name the architecture."""
    path = _checkpoint(tmp_path / "model", tiny_llama, {"architectures": None})
    with pytest.raises(ConfigError, match="config.json lists its architectures: it lists none") as info:
        prepare(EngineConfig.create(path, skip_tokenizer_init=True))
    assert not isinstance(info.value, NotBuiltError) and info.value.field == "model"
    overrides = {"architectures": ["LlamaForCausalLM"]}
    assert prepare(EngineConfig.create(path, skip_tokenizer_init=True, hf_overrides=overrides)).vocab_size > 0
