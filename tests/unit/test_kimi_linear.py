"""Kimi-Linear (asyncllm/models/kimi_linear.py, kimi_delta.py): Kimi Delta Attention's blocked rule and batched
decode step equal transformers' token-by-token recurrence (`recurrent_kimi_delta_attention`, its torch fallback),
and the tiny model's float32 logits equal transformers' within 1e-4 over a paged run (a 72-token request in 40- and
30-token chunks beside decodes, states in rows apart); the KV cache holds the latent-attention layer only.

transformers' own float32 chunked KDA and its recurrent form agree within ~1e-6 on these shapes, so float32 is the
reference (no float64 detour as Zamba2's test needs)."""

from __future__ import annotations

import pytest
import torch
from model_utils import assert_paged_logits_match_checkpoint
from transformers.models.kimi_linear.modeling_kimi_linear import recurrent_kimi_delta_attention

from asyncllm.config import EngineConfig
from asyncllm.errors import NotBuiltError
from asyncllm.models.kimi_delta import chunked_kda, kda_step, prepare_qk
from asyncllm.models.loader import load_hf_config, load_model
from asyncllm.models.registry import kv_cache_spec
from asyncllm.tiny import tiny_checkpoint

HEADS, DIM = 4, 16


def _inputs(tokens: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Raw q, k (not normed), v, a per-channel log decay (channels of a head apart) and beta."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(tokens, HEADS, DIM, generator=gen) for _ in range(3))
    g = -torch.rand(tokens, HEADS, DIM, generator=gen) * 1.5
    beta = torch.rand(tokens, HEADS, generator=gen)
    return q, k, v, g, beta


def _transformers(state: torch.Tensor, q, k, v, g, beta) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' recurrence over one request from ``state`` (q, k normed in it)."""
    out, final = recurrent_kimi_delta_attention(q[None], k[None], v[None], g[None], beta[None], state[None].clone(),
                                                True, use_qk_l2norm_in_kernel=True)
    return out[0], final[0]


@pytest.mark.parametrize("tokens", [1, 5, 64, 150])  # within a block, exactly one, across block edges
def test_blocked_rule_equals_transformers_recurrence(tokens: int) -> None:
    q, k, v, g, beta = _inputs(tokens)
    start = torch.randn(HEADS, DIM, DIM, generator=torch.Generator().manual_seed(9))
    expected, expected_state = _transformers(start, q, k, v, g, beta)
    state = start.clone()
    out = chunked_kda(state, *prepare_qk(q, k), v, g, beta)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, expected_state, atol=1e-5, rtol=1e-5)


def test_batched_decode_step_equals_transformers_recurrence() -> None:
    q, k, v, g, beta = _inputs(3, seed=1)  # three requests, one token each, their states at rows apart
    states = torch.randn(5, HEADS, DIM, DIM, generator=torch.Generator().manual_seed(2))
    rows = torch.tensor([3, 0, 2])
    expected = [_transformers(states[r], *(t[n:n + 1] for t in (q, k, v, g, beta)))
                for n, r in enumerate(rows.tolist())]
    untouched = states[1].clone()
    out = kda_step(states, rows, *prepare_qk(q, k), v, g, beta)
    torch.testing.assert_close(out, torch.cat([e[0] for e in expected]), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(states[rows], torch.stack([e[1] for e in expected]), atol=1e-5, rtol=1e-5)
    assert torch.equal(states[1], untouched)


def test_a_per_head_decay_is_not_the_rule() -> None:
    """The decay's channels matter: averaged over each head's channels, the outputs move well past the tolerance."""
    q, k, v, g, beta = _inputs(40, seed=3)
    start = torch.zeros(HEADS, DIM, DIM)
    expected, _ = _transformers(start, q, k, v, g, beta)
    averaged = g.mean(-1, keepdim=True).expand_as(g)
    assert (chunked_kda(start.clone(), *prepare_qk(q, k), v, averaged, beta) - expected).abs().max() > 1e-2


def test_kimi_linear_logits_match_transformers() -> None:
    path = tiny_checkpoint("kimi_linear")
    hf_config = load_hf_config(path)
    assert hf_config.layer_types == ["linear_attention", "full_attention", "linear_attention"]
    spec = kv_cache_spec(hf_config, 1)
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.kv_parts) == (1, 1, 8 + 32, 1)  # one latent row
    model = load_model(EngineConfig.create(path), hf_config, torch.device("cpu"), torch.float32)
    assert_paged_logits_match_checkpoint(model, path, [12, 72, 11],
                                         [[5, 40, 0], [4, 30, 4], [1, 1, 5], [1, 1, 1], [1, 0, 1]], seed=4)



def test_a_pre_quantized_checkpoint_is_refused_by_name() -> None:
    from asyncllm.models.kimi_linear import KimiLinearForCausalLM

    hf_config = load_hf_config(tiny_checkpoint("kimi_linear"))
    hf_config.quantization_config = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    with pytest.raises(NotBuiltError, match="pre-quantized Kimi-Linear") as info:
        KimiLinearForCausalLM(hf_config)
    assert info.value.field == "quantization_config"
