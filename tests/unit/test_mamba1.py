"""Mamba (v1) and Jamba (asyncllm/models/mamba1.py, jamba.py): the chunked scan equals the token-by-token recurrence
and continues across chunks from a carried state, the batched decode step equals it; Jamba's float32 logits equal
transformers' within 1e-4 over a paged run (a 72-token request in 40- and 30-token chunks beside decodes)."""

from __future__ import annotations

import torch
from model_utils import assert_paged_logits_match_checkpoint

from asyncllm.config import EngineConfig
from asyncllm.models.jamba import JambaForCausalLM
from asyncllm.models.loader import load_hf_config, load_model
from asyncllm.models.mamba1 import selective_scan, selective_step
from asyncllm.models.registry import kv_cache_spec
from asyncllm.tiny import tiny_checkpoint

I, S = 6, 4


def _inputs(tokens: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    x, dt = torch.randn(tokens, I, generator=gen), torch.rand(tokens, I, generator=gen)
    a = -torch.rand(I, S, generator=gen) * 2
    b, c = torch.randn(tokens, S, generator=gen), torch.randn(tokens, S, generator=gen)
    return x, dt, a, b, c


def _recurrence(state: torch.Tensor, x, dt, a, b, c) -> tuple[torch.Tensor, torch.Tensor]:
    outs = []
    for t in range(x.shape[0]):
        state = torch.exp(dt[t][:, None] * a) * state + (dt[t] * x[t])[:, None] * b[t][None, :]
        outs.append(state @ c[t])
    return torch.stack(outs), state


def test_the_scan_in_chunks_equals_the_recurrence() -> None:
    x, dt, a, b, c = _inputs(9)
    start = torch.randn(I, S, generator=torch.Generator().manual_seed(3))
    expected, expected_state = _recurrence(start.clone(), x, dt, a, b, c)
    state = start.clone()
    parts = [selective_scan(state, x[s], dt[s], a, b[s], c[s]) for s in (slice(0, 4), slice(4, 5), slice(5, 9))]
    torch.testing.assert_close(torch.cat(parts), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, expected_state, atol=1e-5, rtol=1e-5)


def test_the_batched_step_equals_the_recurrence() -> None:
    x, dt, a, b, c = _inputs(3, seed=1)  # three requests, one token each
    states = torch.randn(3, I, S, generator=torch.Generator().manual_seed(2))
    expected = [_recurrence(states[n].clone(), x[n:n + 1], dt[n:n + 1], a, b[n:n + 1], c[n:n + 1]) for n in range(3)]
    out = selective_step(states, x, dt, a, b, c)
    torch.testing.assert_close(out, torch.cat([e[0] for e in expected]), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(states, torch.stack([e[1] for e in expected]), atol=1e-5, rtol=1e-5)


def test_jamba_logits_match_transformers() -> None:
    path = tiny_checkpoint("jamba")
    model = load_model(EngineConfig.create(path), load_hf_config(path), torch.device("cpu"), torch.float32)
    assert type(model) is JambaForCausalLM
    assert kv_cache_spec(load_hf_config(path), 1).num_layers == 1  # the attention layer only
    assert_paged_logits_match_checkpoint(model, path, [12, 72, 11],
                                         [[5, 40, 0], [4, 30, 4], [1, 1, 5], [1, 1, 1], [1, 0, 1]], seed=4)
