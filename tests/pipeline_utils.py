"""Pipeline stages in one process (tests/unit/test_pipeline_parallel*.py): (hidden, residual) passed in memory,
the stages chained as `PagedRun` calls a model, what each stage should hold, and a spy on what it reads."""

from __future__ import annotations

import re
from collections import deque
from typing import Any

import torch
from model_utils import PagedRun

from asyncllm.models.loader import load_hf_config
from asyncllm.models.pipeline import PipelineStage, StageModel
from asyncllm.models.registry import kv_cache_spec


class MemoryChannel:
    """Stages in one process: (hidden, residual) handed over in memory, in order."""

    def __init__(self) -> None:
        self.queue: deque[tuple[torch.Tensor, torch.Tensor]] = deque()

    def send(self, hidden: torch.Tensor, residual: torch.Tensor) -> None:
        self.queue.append((hidden.clone(), residual.clone()))

    def recv(self, num_tokens: int, widths: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.queue.popleft()
        assert hidden.shape[0] == residual.shape[0] == num_tokens
        assert widths is None or (hidden.shape[1], residual.shape[1]) == widths, (hidden.shape, residual.shape, widths)
        return hidden, residual


class Stages:
    """The stages run one after the other, as `PagedRun` calls a model (each takes its layers' KV caches: a
    hybrid's attention layers')."""

    def __init__(self, stages: list[StageModel]) -> None:
        self.stages = stages

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                 metadata: Any) -> torch.Tensor:
        first = 0
        for stage in self.stages:
            hidden = stage(input_ids, positions, kv_caches[first : first + stage.num_kv_layers], metadata)
            first += stage.num_kv_layers
        assert first == len(kv_caches)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.stages[-1].compute_logits(hidden)


def stage_params(full_names: set[str], stage: PipelineStage, tied: bool) -> set[str]:
    """The unsplit model's parameter names that `stage` should hold."""
    def held(name: str) -> bool:
        layer = re.match(r"model\.layers\.(\d+)\.", name)
        if layer is not None:
            return stage.owns_layer(int(layer.group(1)))
        if name.startswith("model.embed_tokens."):
            return stage.is_first or (tied and stage.is_last)
        if name.startswith(("model.embed_positions.", "model.project_in.", "model.embed_norm.")):  # GPT-2, OPT, BLOOM
            return stage.is_first
        return stage.is_last  # the final norm, the LM head (OPT's projection out)

    return {name for name in full_names if held(name)}


def paged_logits(model: Any, path: str) -> list[torch.Tensor]:
    """Three requests in chunks of up to 8 tokens over a shuffled paged cache (block 4)."""
    spec = kv_cache_spec(load_hf_config(path), 1)
    gen = torch.Generator().manual_seed(0)
    sequences = [torch.randint(6, 500, (n,), generator=gen).tolist() for n in (19, 11, 30)]
    run = PagedRun(model, sequences)
    run.new_kv_caches_for(spec, torch.float32)
    return run.run([[8, 8, 8], [8, 3, 8], [3, 0, 8], [0, 0, 6]])


class ReadSpy:
    """A lazy safetensors slice that records the names whose data were read."""

    def __init__(self, name: str, slice_: Any, read: set[str]) -> None:
        self.name, self.slice, self.read = name, slice_, read

    def get_shape(self) -> list[int]:
        return self.slice.get_shape()

    def __getitem__(self, index: Any) -> torch.Tensor:
        self.read.add(self.name)
        return self.slice[index]
