"""Whisper's cross-attention states (asyncllm/models/whisper.py): preallocated per seat, refused by name when the
seats would take over half the device's free memory."""

from __future__ import annotations

import pytest
import torch

from asyncllm.errors import ConfigError
from asyncllm.models import whisper


def test_seats_that_do_not_fit_are_refused_naming_max_num_seqs(monkeypatch):
    monkeypatch.setattr(torch, "get_default_device", lambda: torch.device("cuda", 0))
    row_bytes = 4 * 2 * 94 * 16 * 2 * 8 * 2  # 4 layers, 1500 rows in 94 blocks of 16, 2 heads of 8, float16
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (10 * row_bytes, 20 * row_bytes))
    with pytest.raises(ConfigError, match="max_num_seqs.*at most 5 on this device"):
        whisper.CrossStates(4, 6, 1500, 2, 8, torch.float16)
    monkeypatch.setattr(torch, "get_default_device", lambda: torch.device("cpu"))
    states = whisper.CrossStates(4, 6, 1500, 2, 8, torch.float16)  # on the CPU: no check
    assert states.caches[0].shape == (2, 6 * 94, 16, 2, 8)



def test_pipeline_stages_are_refused_by_name():
    """Not built for Whisper's encoder-decoder path: a `NotBuiltError` naming it, on the host."""
    from types import SimpleNamespace

    from asyncllm.config import EngineConfig
    from asyncllm.errors import NotBuiltError
    from asyncllm.pipeline_parallel import check_pipeline_model

    with pytest.raises(NotBuiltError, match="pipeline parallelism for WhisperForConditionalGeneration"):
        check_pipeline_model(EngineConfig.create("m", pipeline_parallel_size=2), "WhisperForConditionalGeneration",
                             SimpleNamespace(num_hidden_layers=2))
