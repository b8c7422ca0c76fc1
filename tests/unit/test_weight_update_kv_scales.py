"""A weight update that brings other fp8 KV-cache scales captures the decode graphs again (docs/weight-updates.md):
the scales are Python floats that a captured forward holds as constants (workers/cuda_graphs.py
`recapture_if_changed`). On the CPU no graph is captured: a stand-in marks the runner as holding graphs and a spy
takes the capture's place."""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from asyncllm import protocol
from asyncllm.config import EngineConfig
from asyncllm.models.loader import load_hf_config, load_model
from asyncllm.tiny import tiny_checkpoint
from asyncllm.workers import cuda_graphs
from asyncllm.workers.weight_update import update_weights

CPU = torch.device("cpu")
SCALES = {"model.layers.0.self_attn.k_scale": 0.5, "model.layers.0.self_attn.v_scale": 0.25,
          "model.layers.1.self_attn.k_scale": 2.0, "model.layers.1.self_attn.v_scale": 4.0}


def _with_scales(folder: Path, scales: dict[str, float]) -> str:
    """A copy of the tiny llama checkpoint with ``scales`` added as calibrated KV-cache scale tensors."""
    shutil.copytree(tiny_checkpoint("llama"), folder)
    [file] = folder.glob("*.safetensors")
    tensors = load_file(file)
    tensors.update({name: torch.tensor(value) for name, value in scales.items()})
    save_file(tensors, file)
    return str(folder)


def _scales(model: torch.nn.Module) -> list[tuple[float, float]]:
    return [(layer.self_attn.attn.k_scale, layer.self_attn.attn.v_scale) for layer in model.model.layers]


@pytest.fixture
def runner(monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    """A CPU runner of the tiny llama over an fp8 cache that "holds graphs"; ``captures`` records the scales each
    capture saw."""
    path = tiny_checkpoint("llama")
    config = EngineConfig.create(path, max_model_len=256, kv_cache_dtype="fp8")
    hf_config = load_hf_config(path)
    model = load_model(config, hf_config, CPU, torch.float32)
    runner = SimpleNamespace(config=config, hf_config=hf_config, model=model, device=CPU, dtype=torch.float32,
                             rank=0, tp_size=1, cuda_graphs="graphs captured at start", captures=[])

    def capture(r: SimpleNamespace) -> str:
        assert r.cuda_graphs is None, "the old graphs are dropped before the capture"
        r.captures.append(_scales(r.model))
        return f"graphs captured again ({len(r.captures)})"

    monkeypatch.setattr(cuda_graphs, "capture_decode_graphs", capture)
    return runner


def test_new_kv_scales_capture_the_graphs_again_and_the_same_ones_do_not(runner, tmp_path: Path) -> None:
    scaled = _with_scales(tmp_path / "scaled", SCALES)
    assert update_weights(runner, protocol.UpdateWeights("u1", scaled)).error == ""
    assert runner.captures == [[(0.5, 0.25), (2.0, 4.0)]] and runner.cuda_graphs == "graphs captured again (1)"
    assert update_weights(runner, protocol.UpdateWeights("u2", scaled)).error == ""  # the same scales
    assert len(runner.captures) == 1
    plain = tiny_checkpoint("llama", seed=1)  # no scales: 1.0 again, as a fresh load of it gives
    assert update_weights(runner, protocol.UpdateWeights("u3", plain)).error == ""
    assert runner.captures[1:] == [[(1.0, 1.0)] * 2] and runner.cuda_graphs == "graphs captured again (2)"


def test_a_runner_without_graphs_captures_none(runner, tmp_path: Path) -> None:
    """Eager, or asleep (the wake-up captures over the scales of its time)."""
    runner.cuda_graphs = None
    assert update_weights(runner, protocol.UpdateWeights("u1", _with_scales(tmp_path / "s", SCALES))).error == ""
    assert runner.captures == [] and runner.cuda_graphs is None and _scales(runner.model) == [(0.5, 0.25), (2.0, 4.0)]
