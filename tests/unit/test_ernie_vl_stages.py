"""ERNIE 4.5 VL's modality experts in pipeline stages, in one process: each stage routes its own layers' rows by
modality (`ModalityRows`, entered through the decoder's ``step_scope``), so the stages' logits with vision rows in the
step are bit-equal to the unsplit model's. (Text rows alone: tests/unit/test_pipeline_parallel.py's family table.)"""

from __future__ import annotations

from typing import Any

import torch
from ernie_vl_utils import make_tiny_ernie_vl
from pipeline_utils import MemoryChannel, Stages, paged_logits

from asyncllm.config import EngineConfig
from asyncllm.models.loader import load_hf_config, load_model
from asyncllm.models.pipeline import PipelineStage, StageModel
from asyncllm.pipeline_parallel import check_pipeline_model, get_pp_indices

CPU = torch.device("cpu")
VISION_IDS = torch.arange(6, 250)
"""Token ids routed to the vision experts here (about half of `paged_logits`' random prompt tokens)."""


class _PromptRows:
    """A model (or the stages) called with every row of the step marked as a prompt row of a request with images,
    as the multimodal runner marks them (`AttentionMetadata.mm_prompt_rows`)."""

    def __init__(self, model: Any, marked: bool = True) -> None:
        self.model, self.marked = model, marked

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                 metadata: Any) -> torch.Tensor:
        if self.marked:
            metadata.mm_prompt_rows = torch.ones(input_ids.shape[0], dtype=torch.bool)
        return self.model(input_ids, positions, kv_caches, metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)


def _routed(model: torch.nn.Module) -> torch.nn.Module:
    model.language_model.model.rows.token_ids = VISION_IDS
    return model


def test_stages_route_vision_rows_as_the_unsplit_model(tmp_path) -> None:
    path = make_tiny_ernie_vl(tmp_path / "ernie_vl")
    hf_config = load_hf_config(path)
    config = EngineConfig.create(path, max_model_len=128, pipeline_parallel_size=2)
    num_layers = hf_config.text_config.num_hidden_layers
    check_pipeline_model(config, hf_config.architectures[0], hf_config.text_config)
    full = _routed(load_model(config, hf_config, CPU, torch.float32))
    split = [PipelineStage(r, 2, *get_pp_indices(num_layers, r, 2)) for r in range(2)]
    parts = [_routed(load_model(config, hf_config, CPU, torch.float32, pipeline=stage)) for stage in split]
    assert all(name.startswith("language_model.") for name, _ in parts[1].named_parameters())  # no tower
    channel = MemoryChannel()
    stages = Stages([StageModel(part, stage, channel) for part, stage in zip(parts, split, strict=True)])
    want = paged_logits(_PromptRows(full), path)
    text = paged_logits(_PromptRows(full, marked=False), path)
    assert max((w - t).abs().max() for w, t in zip(want, text, strict=True)) > 1e-3  # the vision experts ran
    for got, expected in zip(paged_logits(_PromptRows(stages), path), want, strict=True):
        assert torch.equal(got, expected)
