"""A hub snapshot fetches the safetensors its index names, not the repo's other copies of the weights
(Mistral's consolidated.safetensors, gpt-oss's original/), and still every file without an index."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from asyncllm.models.hub import resolve_model_path
from asyncllm.tiny import tiny_checkpoint


@pytest.fixture
def fake_hub(tmp_path, monkeypatch):
    """A repo folder and a snapshot_download that copies what huggingface_hub's own filter selects from it."""
    import huggingface_hub
    from huggingface_hub.utils import filter_repo_objects

    repo, snapshot = tmp_path / "repo", tmp_path / "snapshot"
    shutil.copytree(tiny_checkpoint("llama"), repo)
    snapshot.mkdir()

    def snapshot_download(model, allow_patterns, **_):
        names = [str(p.relative_to(repo)) for p in repo.rglob("*") if p.is_file()]
        for name in filter_repo_objects(names, allow_patterns=allow_patterns):
            (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(repo / name, snapshot / name)
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return repo, snapshot


def _fetched(snapshot: Path) -> set[str]:
    return {str(p.relative_to(snapshot)) for p in snapshot.rglob("*.safetensors")}


def test_an_index_fetches_its_files_only(fake_hub) -> None:
    repo, snapshot = fake_hub
    (repo / "model.safetensors").rename(repo / "model-[1]-of-00001.safetensors")  # brackets: no pattern syntax
    (repo / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "model.embed_tokens.weight": "model-[1]-of-00001.safetensors"}}))
    shutil.copy(repo / "model-[1]-of-00001.safetensors", repo / "consolidated.safetensors")
    (repo / "original").mkdir()
    shutil.copy(repo / "consolidated.safetensors", repo / "original" / "model.safetensors")
    (repo / "2_Dense").mkdir()
    shutil.copy(repo / "consolidated.safetensors", repo / "2_Dense" / "model.safetensors")
    (repo / "modules.json").write_text(json.dumps([{"idx": 2, "name": "2", "path": "2_Dense",
                                                    "type": "sentence_transformers.models.Dense"}]))
    assert resolve_model_path("some-org/mistral-like") == str(snapshot)
    assert _fetched(snapshot) == {"model-[1]-of-00001.safetensors", "2_Dense/model.safetensors"}


def test_without_an_index_every_safetensors_is_fetched(fake_hub) -> None:
    repo, snapshot = fake_hub
    shutil.copy(repo / "model.safetensors", repo / "consolidated.safetensors")
    resolve_model_path("some-org/unindexed")
    assert _fetched(snapshot) == {"model.safetensors", "consolidated.safetensors"}
    assert (snapshot / "config.json").is_file() and (snapshot / "tokenizer.json").is_file()


def test_load_format_mistral_fetches_consolidated_files_and_never_pickles(fake_hub) -> None:
    """A repo without Mistral's files: nothing but configs comes (the loader then names load_format), not the
    PyTorch pickles an auto load falls back to."""
    import torch

    repo, snapshot = fake_hub
    torch.save({}, repo / "pytorch_model.bin")
    resolve_model_path("some-org/no-consolidated", load_format="mistral")
    assert _fetched(snapshot) == set() and not list(snapshot.glob("*.bin"))
    shutil.copy(repo / "model.safetensors", repo / "consolidated.safetensors")
    resolve_model_path("some-org/no-consolidated", load_format="mistral")
    assert _fetched(snapshot) == {"consolidated.safetensors"}


def test_load_format_dummy_fetches_no_weights(fake_hub) -> None:
    """vLLM's dummy loader downloads nothing: a hub id's configs and tokenizer come, not its safetensors or
    pickles (a 70B model benchmarked with random weights would otherwise download all of them first)."""
    import torch

    from asyncllm.config import EngineConfig
    from asyncllm.engine.prepare import prepare

    repo, snapshot = fake_hub
    torch.save({}, repo / "pytorch_model.bin")
    prepared = prepare(EngineConfig.create("some-org/benchmarked", load_format="dummy"))
    assert prepared.config.model == str(snapshot) and prepared.tokenizer is not None
    assert _fetched(snapshot) == set() and not list(snapshot.glob("*.bin"))
    assert (snapshot / "config.json").is_file() and (snapshot / "tokenizer.json").is_file()


def test_load_format_safetensors_never_fetches_the_pickles_auto_falls_back_to(fake_hub) -> None:
    """A repo of pickles only: with load_format='safetensors' (vLLM's ``*.safetensors`` patterns) none of its
    ``*.bin`` come (the loader then names load_format); auto fetches them."""
    import torch

    from asyncllm.config import EngineConfig
    from asyncllm.errors import ConfigError
    from asyncllm.models.loader import checkpoint_files

    repo, snapshot = fake_hub
    (repo / "model.safetensors").unlink()
    torch.save({}, repo / "pytorch_model.bin")
    path = resolve_model_path("some-org/pickled", load_format="safetensors")
    assert not list(snapshot.glob("*.bin")) and (snapshot / "config.json").is_file()
    with pytest.raises(ConfigError, match="load_format"):
        checkpoint_files(path, EngineConfig.create(path, load_format="safetensors").load_format)
    resolve_model_path("some-org/pickled")
    assert [p.name for p in snapshot.glob("*.bin")] == ["pytorch_model.bin"]


def test_load_format_dummy_fetches_no_draft_weights_either(fake_hub) -> None:
    """A dummy engine's draft model is loaded with random weights too (the engine's load_format): its hub id's
    configs come, none of its safetensors (until 2026-12-07 every draft weight was downloaded first)."""
    from asyncllm.config import EngineConfig
    from asyncllm.engine.prepare import prepare

    _, snapshot = fake_hub
    spec = {"model": "some-org/draft", "num_speculative_tokens": 2}
    prepared = prepare(EngineConfig.create(tiny_checkpoint("llama"), load_format="dummy", speculative_config=spec))
    assert prepared.config.speculative_config["model"] == str(snapshot)
    assert _fetched(snapshot) == set() and (snapshot / "config.json").is_file()
