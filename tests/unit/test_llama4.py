"""Llama 4 text (asyncllm/models/llama4.py) against transformers: float32 logits within 1e-4 over a paged run, a
rotary layer attending in chunks of 8 positions (prompts of 12 to 20 tokens straddle them) with q/k L2 norms, then
a layer without positions whose query is scaled by the temperature and whose MLP routes each token's scaled input
to one expert beside the shared one; leaving out any of those fails the match."""

from __future__ import annotations

import pytest
import torch
from model_utils import assert_paged_logits_match_checkpoint

from asyncllm.config import EngineConfig
from asyncllm.errors import NotBuiltError
from asyncllm.models.llama4 import Llama4ForCausalLM
from asyncllm.models.loader import load_hf_config, load_model
from asyncllm.tiny import tiny_checkpoint

SEQ_LENS = [12, 20, 11]
SCHEDULE = [[5, 9, 0], [4, 9, 4], [1, 1, 5], [1, 1, 1], [1, 0, 1]]


def _model() -> Llama4ForCausalLM:
    path = tiny_checkpoint("llama4")
    return load_model(EngineConfig.create(path), load_hf_config(path), torch.device("cpu"), torch.float32)


def test_logits_match_transformers() -> None:
    model = _model()
    assert model.model.layers[0].self_attn.attn.attention_chunk_size == 8
    assert_paged_logits_match_checkpoint(model, tiny_checkpoint("llama4"), SEQ_LENS, SCHEDULE, seed=4)


@pytest.mark.parametrize("change", ["chunks", "temperature", "qk norm", "pairs"])
def test_each_detail_matters(change: str) -> None:
    model = _model()
    rope, nope = model.model.layers[0].self_attn, model.model.layers[1].self_attn
    if change == "chunks":
        rope.attn.attention_chunk_size = None
    elif change == "temperature":
        nope.temperature = (False, 1.0, 0.0)
    elif change == "qk norm":
        rope.qk_norm = False
    else:
        rope.use_rope = False  # no de-interleaving of the rotary pairs
    with pytest.raises(AssertionError):
        assert_paged_logits_match_checkpoint(model, tiny_checkpoint("llama4"), SEQ_LENS, SCHEDULE, seed=4)


def test_more_than_one_routed_expert_is_refused() -> None:
    hf_config = load_hf_config(tiny_checkpoint("llama4"))
    hf_config.num_experts_per_tok = 2
    with pytest.raises(NotBuiltError, match="one routed expert"):
        load_model(EngineConfig.create(tiny_checkpoint("llama4")), hf_config, torch.device("cpu"), torch.float32)
