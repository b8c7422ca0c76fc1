"""Mamba2 (asyncllm/models/mamba2.py), Granite 4.0 (asyncllm/models/granite4.py), Bamba (bamba.py) and Nemotron-H
(asyncllm/models/nemotron_h.py): the blocked scan and the batched decode step equal the token-by-token recurrence,
across block edges and from a carried state; Granite 4.0's float32 logits equal transformers' over a paged run (a
72-token request in 40- and 30-token chunks beside decodes) and over two tensor-parallel ranks."""

from __future__ import annotations

import pytest
import torch
from hf_reference import hf_logits
from model_utils import PagedRun, free_port, spawn_ranks, tp_worker

from asyncllm.config import EngineConfig
from asyncllm.kernels import reference
from asyncllm.models.granite4 import GraniteMoeHybridForCausalLM
from asyncllm.models.loader import load_hf_config, load_model
from asyncllm.models.mamba2 import ssd_chunk
from asyncllm.models.registry import kv_cache_spec
from asyncllm.tiny import tiny_checkpoint

SEQ_LENS = [12, 72, 11]
SCHEDULE = [[5, 40, 0], [4, 30, 4], [1, 1, 5], [1, 1, 1], [1, 0, 1]]


def _inputs(tokens: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, 4, 6, generator=gen)
    b, c = (torch.randn(tokens, 4, 5, generator=gen) for _ in range(2))
    dt = torch.rand(tokens, 4, generator=gen) * 0.5
    a = -torch.rand(4, generator=gen) * 2
    return x, b, c, dt, a


def _token_by_token(state: torch.Tensor, x, b, c, dt, a) -> tuple[torch.Tensor, torch.Tensor]:
    outs = []
    for t in range(x.shape[0]):
        state = state * (dt[t] * a).exp()[:, None, None] + (dt[t][:, None] * x[t])[:, :, None] * b[t][:, None, :]
        outs.append(torch.einsum("hps,hs->hp", state, c[t]))
    return torch.stack(outs), state


@pytest.mark.parametrize("tokens", [1, 7, 64, 140])
def test_blocked_scan_equals_the_recurrence(tokens: int) -> None:
    x, b, c, dt, a = _inputs(tokens)
    start = torch.randn(4, 6, 5, generator=torch.Generator().manual_seed(8))
    expected, expected_state = _token_by_token(start.clone(), x, b, c, dt, a)
    state = start.clone()
    torch.testing.assert_close(ssd_chunk(state, x, b, c, dt, a), expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(state, expected_state, atol=1e-4, rtol=1e-4)


def test_batched_step_equals_the_recurrence() -> None:
    x, b, c, dt, a = _inputs(3, seed=2)  # three requests, one token each, their states at rows apart
    states = torch.randn(5, 4, 6, 5, generator=torch.Generator().manual_seed(3))
    rows = torch.tensor([4, 1, 2])
    expected = [_token_by_token(states[r].clone(), x[n:n + 1], b[n:n + 1], c[n:n + 1], dt[n:n + 1], a)
                for n, r in enumerate(rows.tolist())]
    untouched = states[0].clone()
    out = reference.ssd_decode_step(states, rows, x, b, c, dt, a)
    torch.testing.assert_close(out, torch.cat([e[0] for e in expected]), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(states[rows], torch.stack([e[1] for e in expected]), atol=1e-5, rtol=1e-5)
    assert torch.equal(states[0], untouched)


def _assert_logits(path: str, all_logits: list[torch.Tensor], sequences: list[list[int]]) -> None:
    for tokens, logits in zip(sequences, all_logits, strict=True):
        expected = hf_logits(path, tokens)
        assert expected.std() > 0.15  # Granite divides its logits by 8
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)


def _sequences(seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(6, 512, (n,), generator=gen).tolist() for n in SEQ_LENS]


def test_granite4_logits_match_transformers() -> None:
    path = tiny_checkpoint("granitemoehybrid")
    hf_config = load_hf_config(path)
    model = load_model(EngineConfig.create(path), hf_config, torch.device("cpu"), torch.float32)
    assert type(model) is GraniteMoeHybridForCausalLM
    spec = kv_cache_spec(hf_config, 1)
    assert spec.num_layers == 1  # the attention layer only
    sequences = _sequences(4)
    run = PagedRun(model, sequences, block_size=4)
    run.new_kv_caches_for(spec, torch.float32)
    _assert_logits(path, run.run(SCHEDULE), sequences)


def test_bamba_logits_match_transformers() -> None:
    """Bamba: Granite 4.0's Mamba2 layer, then attention rotating half of each head, each with a SwiGLU MLP."""
    from model_utils import assert_paged_logits_match_checkpoint

    path = tiny_checkpoint("bamba")
    model = load_model(EngineConfig.create(path), load_hf_config(path), torch.device("cpu"), torch.float32)
    assert_paged_logits_match_checkpoint(model, path, SEQ_LENS, SCHEDULE, seed=7)


@pytest.mark.parametrize("latent", [None, 32])
def test_nemotron_h_logits_match_transformers(latent: int | None) -> None:
    """Nemotron-H: Mamba2 (its own names, ``dt`` clamped below in prefill), Nemotron 3's experts (grouped sigmoid
    routing, no gate, a shared MLP; with and without the latent projections), attention without positions, a
    squared-ReLU MLP layer; the ``backbone.`` checkpoint names."""
    from model_utils import assert_paged_logits_match_checkpoint

    path = tiny_checkpoint("nemotron_h", **({} if latent is None else {"moe_latent_size": latent}))
    model = load_model(EngineConfig.create(path), load_hf_config(path), torch.device("cpu"), torch.float32)
    assert kv_cache_spec(load_hf_config(path), 1).num_layers == 1
    moe = model.model.layers[1].mixer
    assert moe.experts.w13_weight.shape[1:] == (24, latent or 64)  # the up rows alone
    assert_paged_logits_match_checkpoint(model, path, SEQ_LENS, SCHEDULE, seed=6)


def test_nemotron_h_routing_matters() -> None:
    """The experts' output depends on the score correction and the group limit (dropping either changes it)."""
    path = tiny_checkpoint("nemotron_h")
    model = load_model(EngineConfig.create(path), load_hf_config(path), torch.device("cpu"), torch.float32)
    gate = model.model.layers[1].mixer.gate
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(1))
    _, ids = gate(x)
    gate.topk_group = gate.groups
    assert not torch.equal(gate(x)[1].sort(-1)[0], ids.sort(-1)[0])


@pytest.mark.slow
def test_granite4_over_two_ranks(tmp_path) -> None:
    """The attention layer, the shared MLP and the experts split over two gloo ranks, the Mamba2 layer whole on
    each: every rank's logits equal transformers'."""
    path = tiny_checkpoint("granitemoehybrid")
    sequences = _sequences(5)
    spawn_ranks(tp_worker, (2, free_port(), [path], str(tmp_path), sequences, SCHEDULE))
    for rank in range(2):
        _assert_logits(path, torch.load(tmp_path / f"rank{rank}_0.pt"), sequences)
