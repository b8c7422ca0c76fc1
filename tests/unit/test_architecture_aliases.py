"""vLLM's other spellings of architectures asyncllm runs (`ARCHITECTURE_ALIASES`): a checkpoint whose config.json
names one loads the same model class and weights as under our name, and its config is rewritten to our name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from asyncllm.config import EngineConfig
from asyncllm.models.architectures import ARCHITECTURE_ALIASES, architecture_of
from asyncllm.models.checkpoint import served_hf_config
from asyncllm.models.loader import load_model
from asyncllm.models.registry import get_model_class
from asyncllm.tiny import tiny_checkpoint

ALIASES = {"ExaoneMoEForCausalLM": "exaone_moe", "PhiMoEForCausalLM": "phimoe", "MPTForCausalLM": "mpt",
           "LLaMAForCausalLM": "llama"}


def test_every_alias_is_tested_and_names_a_supported_architecture() -> None:
    from asyncllm.models.architectures import SUPPORTED_ARCHITECTURES

    assert set(ALIASES) | {"LightOnOCRForConditionalGeneration"} == set(ARCHITECTURE_ALIASES)
    assert all(ours in SUPPORTED_ARCHITECTURES and alias not in SUPPORTED_ARCHITECTURES
               for alias, ours in ARCHITECTURE_ALIASES.items())


def _model(path: str, hf_config) -> torch.nn.Module:
    return load_model(EngineConfig.create(path, max_model_len=64), hf_config, torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("alias, arch", sorted(ALIASES.items()))
def test_vllms_spelling_loads_the_same_model(alias: str, arch: str, tmp_path: Path) -> None:
    ours = tiny_checkpoint(arch)
    path = tmp_path / "ckpt"
    shutil.copytree(ours, path)
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == [ARCHITECTURE_ALIASES[alias]]
    config["architectures"] = [alias]
    (path / "config.json").write_text(json.dumps(config))
    hf_config, ours_config = served_hf_config(str(path), None), served_hf_config(ours, None)
    assert hf_config.architectures == [alias]  # as read, before the host's check
    assert architecture_of(hf_config) == ARCHITECTURE_ALIASES[alias]
    assert hf_config.architectures == [ARCHITECTURE_ALIASES[alias]]  # rewritten: every later lookup sees one name
    assert get_model_class(hf_config) is get_model_class(ours_config)
    loaded, reference = _model(str(path), hf_config), _model(ours, ours_config)
    pairs = zip(loaded.state_dict().items(), reference.state_dict().items(), strict=True)
    for (name, tensor), (ref_name, ref) in pairs:  # the checkpoint's weights, loaded alike
        assert name == ref_name and torch.equal(tensor, ref), name
