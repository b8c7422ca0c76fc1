"""MiniMax (asyncllm/models/minimax.py, lightning_attention.py): lightning attention's blocked prefill and batched
decode step equal the token-by-token recurrence ``S <- e^-s S + k v^T``, ``o = q S`` (within a block, at and across
block edges, from a carried state); the decay rates are transformers'; the tiny model's float32 logits equal
transformers' within 1e-4 over a paged run (a 72-token request in 40- and 30-token chunks beside decodes, states in
rows apart), with its residual weights away from 1; configs it does not run are refused by name."""

from __future__ import annotations

import pytest
import torch
from model_utils import assert_paged_logits_match_checkpoint
from transformers import MiniMaxConfig
from transformers.models.minimax.modeling_minimax import MiniMaxLightningAttention

from asyncllm.config import EngineConfig
from asyncllm.errors import ConfigError, NotBuiltError
from asyncllm.models.lightning_attention import chunked_lightning, decay_rates, lightning_step
from asyncllm.models.loader import load_hf_config, load_model
from asyncllm.models.minimax import MiniMaxForCausalLM
from asyncllm.models.registry import kv_cache_spec
from asyncllm.tiny import tiny_checkpoint

HEADS, DIM = 4, 16
RATES = decay_rates(HEADS, 0, 2)


def _inputs(tokens: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(tokens, HEADS, DIM, generator=gen) for _ in range(3))


def _recurrence(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The rule token by token, in float64: (outputs, final state)."""
    state, decay, out = state.double(), (-RATES.double()).exp()[:, None, None], []
    for q_t, k_t, v_t in zip(q.double(), k.double(), v.double()):
        state = decay * state + k_t.unsqueeze(-1) * v_t.unsqueeze(-2)
        out.append((q_t.unsqueeze(-1) * state).sum(-2))
    return torch.stack(out).float(), state.float()


@pytest.mark.parametrize("tokens", [1, 5, 64, 150])  # within a block, exactly one, across block edges
def test_blocked_prefill_equals_the_recurrence(tokens: int) -> None:
    q, k, v = _inputs(tokens)
    start = torch.randn(HEADS, DIM, DIM, generator=torch.Generator().manual_seed(9))
    expected, expected_state = _recurrence(start, q, k, v)
    state = start.clone()
    out = chunked_lightning(state, q, k, v, RATES)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(state, expected_state, atol=1e-4, rtol=1e-5)


def test_batched_decode_step_equals_the_recurrence() -> None:
    q, k, v = _inputs(3, seed=1)  # three requests, one token each, their states at rows apart
    states = torch.randn(5, HEADS, DIM, DIM, generator=torch.Generator().manual_seed(2))
    rows = torch.tensor([3, 0, 2])
    expected = [_recurrence(states[r], q[n:n + 1], k[n:n + 1], v[n:n + 1]) for n, r in enumerate(rows.tolist())]
    untouched = states[1].clone()
    out = lightning_step(states, rows, q, k, v, RATES)
    torch.testing.assert_close(out, torch.cat([e[0] for e in expected]), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(states[rows], torch.stack([e[1] for e in expected]), atol=1e-5, rtol=1e-5)
    assert torch.equal(states[1], untouched)


@pytest.mark.parametrize("layer_idx", [0, 3, 7])
def test_decay_rates_are_transformers(layer_idx: int) -> None:
    cfg = MiniMaxConfig(num_hidden_layers=8, num_attention_heads=8, hidden_size=64, head_dim=8, block_size=4)
    expected = MiniMaxLightningAttention(cfg, layer_idx).get_slope_rate().flatten()
    assert torch.equal(decay_rates(8, layer_idx, 8), expected)


def test_minimax_logits_match_transformers() -> None:
    path = tiny_checkpoint("minimax")
    hf_config = load_hf_config(path)
    assert hf_config.layer_types == ["linear_attention", "full_attention"] and hf_config.mlp_beta_factor == 0.7
    assert kv_cache_spec(hf_config, 1).num_layers == 1  # the softmax layer only
    model = load_model(EngineConfig.create(path), hf_config, torch.device("cpu"), torch.float32)
    assert_paged_logits_match_checkpoint(model, path, [12, 72, 11],
                                         [[5, 40, 0], [4, 30, 4], [1, 1, 5], [1, 1, 1], [1, 0, 1]], seed=4)


@pytest.mark.parametrize("fields, error, field", [
    ({"sliding_window": 8}, NotBuiltError, "sliding_window"),
    ({"layer_types": ["linear_attention", "sliding_attention"]}, NotBuiltError, "layer_types"),
    ({"attn_type_list": [1, 0]}, ConfigError, "attn_type_list"),  # the reverse of layer_types
    ({"quantization_config": {"quant_method": "fp8"}}, NotBuiltError, "model"),
])
def test_configs_it_does_not_run_are_refused_by_name(fields: dict, error: type, field: str) -> None:
    hf_config = load_hf_config(tiny_checkpoint("minimax"))
    for name, value in fields.items():
        setattr(hf_config, name, value)
    with pytest.raises(error) as info:
        MiniMaxForCausalLM(hf_config)
    assert info.value.field == field


def test_rotary_dim_rotates_that_much_of_each_head() -> None:
    """The original release's ``rotary_dim`` (half of each head), which transformers' MiniMax does not read."""
    path = tiny_checkpoint("minimax")
    hf_config = load_hf_config(path)
    hf_config.rotary_dim = 8
    model = load_model(EngineConfig.create(path), hf_config, torch.device("cpu"), torch.float32)
    assert model.model.layers[1].self_attn.rotary_emb.rotary_dim == 8
    assert "partial_rotary_factor" not in hf_config.rope_parameters  # the config itself left as read
