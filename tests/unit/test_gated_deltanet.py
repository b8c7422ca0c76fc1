"""Gated DeltaNet (asyncllm/models/gated_deltanet.py) and Qwen3.5 (asyncllm/models/qwen3_5.py): the blocked delta
rule and the batched decode step equal the token-by-token recurrence, across block edges and from a carried state;
the causal convolution continues across chunks; Qwen3.5's (dense, MoE) and Qwen3-Next's (fused projections cut at
load) logits equal transformers' within 1e-4 over a paged run
(chunked prefills beside decodes, states in rows apart); a reused row starts from zeros."""

from __future__ import annotations

import pytest
import torch
from model_utils import PagedRun, assert_paged_logits_match_checkpoint

from asyncllm.config import EngineConfig
from asyncllm.kernels import reference
from asyncllm.models.gated_deltanet import chunked_delta_rule, prepare_qk
from asyncllm.models.loader import load_hf_config, load_model
from asyncllm.models.qwen3_5 import Qwen3_5ForCausalLM
from asyncllm.models.registry import kv_cache_spec
from asyncllm.models.row_states import DepthwiseConv, causal_conv
from asyncllm.tiny import tiny_checkpoint


def _inputs(tokens: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(tokens, 2, 16, generator=gen) for _ in range(2))
    q, k = prepare_qk(q, k, num_v_heads=4)
    v = torch.randn(tokens, 4, 8, generator=gen)
    g = -torch.rand(tokens, 4, generator=gen) * 0.5
    beta = torch.rand(tokens, 4, generator=gen)
    return q, k, v, g, beta


def _token_by_token(state: torch.Tensor, q, k, v, g, beta) -> torch.Tensor:
    outs = []
    for t in range(q.shape[0]):
        state = state * g[t].exp()[:, None, None]
        delta = (v[t] - torch.einsum("hkv,hk->hv", state, k[t])) * beta[t][:, None]
        state = state + k[t][:, :, None] * delta[:, None, :]
        outs.append(torch.einsum("hkv,hk->hv", state, q[t]))
    return torch.stack(outs), state


@pytest.mark.parametrize("tokens", [1, 5, 64, 150])  # within a block, exactly one, across block edges
def test_blocked_rule_equals_the_recurrence(tokens: int) -> None:
    q, k, v, g, beta = _inputs(tokens)
    start = torch.randn(4, 16, 8, generator=torch.Generator().manual_seed(9))
    expected, expected_state = _token_by_token(start.clone(), q, k, v, g, beta)
    state = start.clone()
    torch.testing.assert_close(chunked_delta_rule(state, q, k, v, g, beta), expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(state, expected_state, atol=1e-4, rtol=1e-4)


def test_batched_decode_step_equals_the_recurrence() -> None:
    q, k, v, g, beta = _inputs(3, seed=1)  # three requests, one token each, their states at rows apart
    states = torch.randn(5, 4, 16, 8, generator=torch.Generator().manual_seed(2))
    rows = torch.tensor([3, 0, 2])
    expected = [_token_by_token(states[r].clone(), q[n:n + 1], k[n:n + 1], v[n:n + 1], g[n:n + 1], beta[n:n + 1])
                for n, r in enumerate(rows.tolist())]
    untouched = states[1].clone()
    out = reference.gated_delta_step(states, rows, q, k, v, g, beta)
    torch.testing.assert_close(out, torch.cat([e[0] for e in expected]), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(states[rows], torch.stack([e[1] for e in expected]), atol=1e-5, rtol=1e-5)
    assert torch.equal(states[1], untouched)


def test_causal_conv_continues_across_chunks() -> None:
    gen = torch.Generator().manual_seed(3)
    x, weight = torch.randn(10, 6, generator=gen), torch.randn(6, 4, generator=gen)
    conv = DepthwiseConv(6, 4, False, torch.float32)
    conv.weight.data.copy_(weight[:, None])
    whole = causal_conv(x, torch.zeros(6, 3), conv)
    state = torch.zeros(6, 3)
    parts = torch.cat([causal_conv(x[:4], state, conv), causal_conv(x[4:5], state, conv),
                       causal_conv(x[5:], state, conv)])
    torch.testing.assert_close(parts, whole)
    expected = torch.nn.functional.conv1d(x.t()[None], weight[:, None], padding=3, groups=6)[0, :, :10]
    torch.testing.assert_close(whole, torch.nn.functional.silu(expected).t())


def _qwen3_5() -> Qwen3_5ForCausalLM:
    path = tiny_checkpoint("qwen3_5")
    return load_model(EngineConfig.create(path), load_hf_config(path), torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def test_qwen3_5_logits_match_transformers(arch: str) -> None:
    path = tiny_checkpoint(arch)
    model = load_model(EngineConfig.create(path), load_hf_config(path), torch.device("cpu"), torch.float32)
    assert kv_cache_spec(load_hf_config(path), 1).num_layers == 1  # the full layer only
    assert_paged_logits_match_checkpoint(model, path, [12, 72, 11],
                                         [[5, 40, 0], [4, 30, 4], [1, 1, 5], [1, 1, 1], [1, 0, 1]], seed=4)


def test_qwen3_5_moe_fused_experts_load_the_same(tmp_path) -> None:
    """Experts saved fused (``mlp.experts.gate_up_proj`` ``[E, 2I, H]``, ``down_proj`` ``[E, H, I]``) load as the
    per-expert matrices do."""
    import shutil

    from safetensors.torch import load_file, save_file

    src = tiny_checkpoint("qwen3_5_moe")
    shutil.copytree(src, tmp_path, dirs_exist_ok=True)
    tensors = load_file(f"{src}/model.safetensors")
    for layer in range(2):
        prefix = f"model.layers.{layer}.mlp.experts"
        experts = range(6)
        gate_up = [torch.cat([tensors.pop(f"{prefix}.{e}.{part}_proj.weight") for part in ("gate", "up")])
                   for e in experts]
        tensors[f"{prefix}.gate_up_proj"] = torch.stack(gate_up)
        tensors[f"{prefix}.down_proj"] = torch.stack([tensors.pop(f"{prefix}.{e}.down_proj.weight") for e in experts])
    save_file(tensors, f"{tmp_path}/model.safetensors", metadata={"format": "pt"})
    fused = load_model(EngineConfig.create(str(tmp_path)), load_hf_config(str(tmp_path)), torch.device("cpu"),
                       torch.float32)
    plain = load_model(EngineConfig.create(src), load_hf_config(src), torch.device("cpu"), torch.float32)
    for (name, a), (_, b) in zip(fused.named_parameters(), plain.named_parameters()):
        assert torch.equal(a, b), name


def test_a_reused_row_starts_from_zeros() -> None:
    """A second request on the same rows (its first chunk: empty context) gives the logits of a fresh model."""
    model = _qwen3_5()
    spec = kv_cache_spec(load_hf_config(tiny_checkpoint("qwen3_5")), 1)
    sequences = [list(range(10, 22)), list(range(40, 49))]
    runs = [PagedRun(model, sequences) for _ in range(2)]
    for run in runs:
        run.new_kv_caches_for(spec, torch.float32)
    first, again = (run.run([[11, 8], [1, 1]]) for run in runs)  # the second on the rows the first left
    for before, after in zip(first, again):
        torch.testing.assert_close(after, before)
    assert model.model.layers[0].linear_attn.states["ssm"][1].abs().sum() > 0  # the rows did hold a state
