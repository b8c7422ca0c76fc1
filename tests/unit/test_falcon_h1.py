"""Falcon-H1 (asyncllm/models/falcon_h1.py): Mamba2 and attention side by side in every layer, the muP multipliers
folded into the weights at load: float32 logits equal transformers' within 1e-4 over a paged run (a 72-token request
in chunks beside decodes), for the mixer's three output forms and tied embeddings; without the folding they differ."""

from __future__ import annotations

import pytest
import torch
from model_utils import assert_paged_logits_match_checkpoint

from asyncllm.config import EngineConfig
from asyncllm.models import falcon_h1
from asyncllm.models.loader import load_hf_config, load_model
from asyncllm.models.registry import kv_cache_spec
from asyncllm.tiny import tiny_checkpoint

SEQ_LENS = [12, 72, 11]
SCHEDULE = [[5, 40, 0], [4, 30, 4], [1, 1, 5], [1, 1, 1], [1, 0, 1]]


def _model(path: str) -> torch.nn.Module:
    return load_model(EngineConfig.create(path), load_hf_config(path), torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("fields", [{}, {"mamba_rms_norm": True}, {"mamba_rms_norm": True,
                                                                     "mamba_norm_before_gate": False},
                                    {"tie_word_embeddings": True}],
                         ids=["gate", "norm-then-gate", "gate-then-norm", "tied"])
def test_logits_match_transformers(fields: dict) -> None:
    path = tiny_checkpoint("falcon_h1", **fields)
    assert kv_cache_spec(load_hf_config(path), 1).num_layers == 2  # every layer attends
    assert_paged_logits_match_checkpoint(_model(path), path, SEQ_LENS, SCHEDULE, seed=4)


def test_the_multipliers_matter(monkeypatch: pytest.MonkeyPatch) -> None:
    path = tiny_checkpoint("falcon_h1")
    monkeypatch.setattr(falcon_h1, "_weight_scales", lambda cfg: {})
    with pytest.raises(AssertionError):
        assert_paged_logits_match_checkpoint(_model(path), path, [12], [[12]], seed=4, atol=1e-2)
