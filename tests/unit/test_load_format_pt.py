"""``load_format='pt'``: a hub snapshot fetches the repo's PyTorch pickles (never only its safetensors), and a
pre-quantized checkpoint saved as a pickle loads as its safetensors do."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from int4_reference import write_int4_checkpoint
from safetensors.torch import load_file

from asyncllm.config import EngineConfig
from asyncllm.engine.prepare import prepare
from asyncllm.models import loader
from asyncllm.tiny import tiny_checkpoint

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def awq(tmp_path_factory) -> Path:
    """An AWQ checkpoint with both ``model.safetensors`` and the same tensors in ``pytorch_model.bin``."""
    path = tmp_path_factory.mktemp("awq") / "awq"
    write_int4_checkpoint(tiny_checkpoint("llama"), path, "awq", 32)
    (path / "model.safetensors.index.json").unlink(missing_ok=True)
    state = {}
    for file in sorted(path.glob("*.safetensors")):
        state.update(load_file(str(file)))
    torch.save(state, path / "pytorch_model.bin")
    return path


@pytest.mark.parametrize("load_format, fetched", [("pt", "pytorch_model.bin"), ("auto", "model.safetensors")])
def test_a_hub_snapshot_fetches_the_pickles_with_load_format_pt(awq, tmp_path, monkeypatch, load_format: str,
                                                                 fetched: str) -> None:
    import huggingface_hub
    from huggingface_hub.utils import filter_repo_objects

    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()

    def snapshot_download(model, allow_patterns, **_):  # the hub's selection (huggingface_hub's own filter)
        for name in filter_repo_objects([p.name for p in awq.iterdir()], allow_patterns=allow_patterns):
            shutil.copy(awq / name, snapshot / name)
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    prepared = prepare(EngineConfig.create("some-org/awq-model", load_format=load_format))
    assert prepared.config.model == str(snapshot)
    assert {p.name for p in snapshot.glob("*.safetensors")} | {p.name for p in snapshot.glob("*.bin")} == {fetched}


def test_a_pre_quantized_pickle_loads_as_its_safetensors(awq, tmp_path) -> None:
    pickled = tmp_path / "awq-pt"
    shutil.copytree(awq, pickled, ignore=shutil.ignore_patterns("*.safetensors"))
    expected = loader.load_model(EngineConfig.create(str(awq)), loader.load_hf_config(str(awq)), CPU, torch.float32)
    config = EngineConfig.create(str(pickled), load_format="pt")
    model = loader.load_model(config, loader.load_hf_config(str(pickled)), CPU, torch.float32)
    got, want = model.state_dict(), expected.state_dict()
    assert got.keys() == want.keys() and "model.layers.0.self_attn.qkv_proj.weight" in got
    assert [name for name in want if not torch.equal(got[name], want[name])] == []
