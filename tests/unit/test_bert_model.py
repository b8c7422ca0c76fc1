"""The BERT encoder in process: transformers' last hidden states for prompts laid end to end, from checkpoint names
as task models and old checkpoints write them (``bert.`` prefix, LayerNorm ``gamma`` / ``beta``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import BertConfig, BertModel

from asyncllm.errors import ConfigError
from asyncllm.models.bert import BertEmbeddingModel
from asyncllm.models.layers import TensorParallel


def _pair():
    config = BertConfig(vocab_size=90, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=40)
    torch.manual_seed(0)
    reference = BertModel(config).eval()
    model = BertEmbeddingModel(config, dtype=torch.float32, tp=TensorParallel(0, 1), attn_backend=None,
                               max_position=40)
    return reference, model


def _old_name(name: str) -> str:
    name = "bert." + name
    if "LayerNorm" in name:
        name = name.replace(".weight", ".gamma").replace(".bias", ".beta")
    return name


def test_prompts_end_to_end_equal_transformers_from_prefixed_and_old_names() -> None:
    reference, model = _pair()
    weights = [(_old_name(name), tensor) for name, tensor in reference.state_dict().items()]
    assert model.load_weights(weights) == model.checkpoint_weight_names()
    prompts = [[2, 17, 40, 8, 3], [2, 9, 3], [2, 33, 12, 60, 61, 5, 3]]
    ids = torch.tensor([t for p in prompts for t in p])
    positions = torch.tensor([i for p in prompts for i in range(len(p))])
    starts = [0, 5, 8, 15]
    with torch.no_grad():
        out = model(ids, positions, [], SimpleNamespace(query_start_loc_cpu=starts))
        for prompt, start, end in zip(prompts, starts, starts[1:]):
            expected = reference(torch.tensor([prompt])).last_hidden_state[0]
            torch.testing.assert_close(out[start:end], expected, atol=1e-5, rtol=0)
    assert torch.equal(model.compute_logits(out[:2]), torch.zeros(2, 90))


def test_unknown_and_misshapen_weights_are_refused_by_name() -> None:
    reference, model = _pair()
    with pytest.raises(ConfigError, match="unexpected weights: encoder.layer.0.crossattention.x"):
        model.load_weights([("encoder.layer.0.crossattention.x.weight", torch.zeros(1))])
    with pytest.raises(ConfigError, match="encoder.layer.1.output.dense.weight"):
        model.load_weights([("encoder.layer.1.output.dense.weight", torch.zeros(32, 63))])
