"""`asyncllm.kernels.reference` against straightforward math (float64 loops where it helps)."""

from __future__ import annotations

import math

import pytest
import torch
from model_utils import make_attn_metadata, tiny_hf_config
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from asyncllm.kernels import reference
from asyncllm.models.rotary import compute_inv_freq


def _randn(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def test_rms_norm_float32():
    x, w = _randn(5, 48), _randn(48, seed=1)
    expected = x.double() / torch.sqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()
    torch.testing.assert_close(reference.rms_norm(x, w, 1e-5).double(), expected, atol=1e-6, rtol=1e-6)


def test_rms_norm_half_rounds_like_hf():
    """Statistics in float32, then cast to bfloat16 before the weight (HF's order)."""
    x, w = _randn(3, 64, dtype=torch.bfloat16), _randn(64, seed=1, dtype=torch.bfloat16)
    out = reference.rms_norm(x, w, 1e-6)
    x32 = x.float()
    expected = w * (x32 / torch.sqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected, atol=0, rtol=1e-2)


def test_fused_add_rms_norm():
    x, residual, w = _randn(4, 32), _randn(4, 32, seed=1), _randn(32, seed=2)
    out, new_residual = reference.fused_add_rms_norm(x, residual, w, 1e-6)
    assert torch.equal(new_residual, x + residual)
    assert torch.equal(out, reference.rms_norm(x + residual, w, 1e-6))


def test_silu_and_mul():
    x = _randn(3, 2 * 20)
    gate, up = x[:, :20].double(), x[:, 20:].double()
    expected = gate / (1 + torch.exp(-gate)) * up
    torch.testing.assert_close(reference.silu_and_mul(x).double(), expected, atol=1e-6, rtol=1e-6)


def test_gemma_rms_norm_weight_is_an_offset_from_one():
    x, w = _randn(5, 48), _randn(48, seed=1)
    expected = x.double() / torch.sqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + w.double())
    torch.testing.assert_close(reference.gemma_rms_norm(x, w, 1e-6).double(), expected, atol=1e-6, rtol=1e-6)
    out, new_residual = reference.gemma_fused_add_rms_norm(x, -x / 2, w, 1e-6)
    assert torch.equal(new_residual, x / 2) and torch.equal(out, reference.gemma_rms_norm(x / 2, w, 1e-6))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gemma_rms_norm_half_is_bit_identical_to_transformers(dtype):
    """transformers' Gemma order (float32 throughout, (1 + w), one cast at the end), not Llama's."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    x, w = _randn(3, 64, dtype=dtype) * 4, _randn(64, seed=1, dtype=dtype)
    hf_norm = Gemma3RMSNorm(64, eps=1e-6).to(dtype)
    with torch.no_grad():
        hf_norm.weight.copy_(w)
        assert torch.equal(reference.gemma_rms_norm(x, w, 1e-6), hf_norm(x))


def test_gelu_tanh_and_mul():
    x = _randn(3, 2 * 20) * 3
    gate, up = x[:, :20].double(), x[:, 20:].double()
    expected = 0.5 * gate * (1 + torch.tanh(math.sqrt(2 / math.pi) * (gate + 0.044715 * gate**3))) * up
    torch.testing.assert_close(reference.gelu_tanh_and_mul(x).double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rotary_dim", [16, 8])
def test_apply_rotary_is_a_rotation_of_each_pair(rotary_dim):
    """NeoX layout: features i and i + rotary_dim/2 rotate by position * inv_freq[i]; the rest pass."""
    head_dim, base = 16, 10000.0
    inv_freq = 1.0 / base ** (torch.arange(0, rotary_dim, 2).double() / rotary_dim)
    cache = reference.build_cos_sin_cache(inv_freq.float(), 1.0, 64)
    q, k = _randn(5, 4, head_dim), _randn(5, 2, head_dim, seed=1)
    positions = torch.tensor([0, 3, 17, 63, 5])
    q_out, k_out = reference.apply_rotary(q, k, positions, cache)
    half = rotary_dim // 2
    for x, out in ((q, q_out), (k, k_out)):
        angle = positions.double()[:, None, None] * inv_freq[None, None, :]
        a, b = x[..., :half].double(), x[..., half:rotary_dim].double()
        first, second = out[..., :half].double(), out[..., half:rotary_dim].double()
        torch.testing.assert_close(first, a * angle.cos() - b * angle.sin(), atol=1e-5, rtol=0)
        torch.testing.assert_close(second, b * angle.cos() + a * angle.sin(), atol=1e-5, rtol=0)
        assert torch.equal(out[..., rotary_dim:], x[..., rotary_dim:])


@pytest.mark.parametrize("family", ["llama", "llama3"])
def test_cos_sin_cache_is_bit_identical_to_transformers(family):
    config = tiny_hf_config(family)
    inv_freq, scaling = compute_inv_freq(config, 16)
    cache = reference.build_cos_sin_cache(inv_freq, scaling, 40)
    positions = torch.arange(40)[None]
    cos, sin = LlamaRotaryEmbedding(config)(torch.zeros(1, dtype=torch.float32), positions)
    assert torch.equal(cache[:, :8], cos[0, :, :8]) and torch.equal(cache[:, 8:], sin[0, :, :8])


def test_gemma3_ropes_per_layer_type_are_bit_identical_to_transformers():
    """A hub-style Gemma 3 config (``rope_theta``, ``rope_local_base_freq``, linear ``rope_scaling`` on the
    global layers) gives each layer type transformers' cos/sin."""
    from transformers import Gemma3TextConfig
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

    from asyncllm.models.gemma import rotary_by_layer_type

    config = Gemma3TextConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                              num_hidden_layers=6, intermediate_size=32, vocab_size=300, rope_theta=1e6,
                              rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 8.0})
    ropes = rotary_by_layer_type(config, 40)
    assert set(ropes) == {"sliding_attention", "full_attention"}
    for layer_type, rope in ropes.items():
        cos, sin = Gemma3RotaryEmbedding(config)(torch.zeros(1), torch.arange(40)[None], layer_type)
        assert torch.equal(rope.cos_sin_cache, torch.cat((cos[0, :, :8], sin[0, :, :8]), dim=-1)), layer_type
    assert not torch.equal(ropes["sliding_attention"].cos_sin_cache, ropes["full_attention"].cos_sin_cache)


def test_write_kv_cache_exact_slots_and_padding():
    kv_cache = torch.zeros(2, 3, 4, 2, 8)
    k, v = _randn(4, 2, 8), _randn(4, 2, 8, seed=1)
    slots = torch.tensor([9, 0, -1, 6])  # block 2 offset 1, block 0 offset 0, padding, block 1 offset 2
    reference.write_kv_cache(k, v, kv_cache, slots)
    for token, (block, offset) in {0: (2, 1), 1: (0, 0), 3: (1, 2)}.items():
        assert torch.equal(kv_cache[0, block, offset], k[token])
        assert torch.equal(kv_cache[1, block, offset], v[token])
    assert int((kv_cache.abs().sum(-1).sum(-1) > 0).sum()) == 2 * 3  # nothing else written


def _naive_attention(q, keys, values, scale, window, softcap=None, alibi=None):
    """Loops in float64: query j of a context of n keys sits at n - q_len + j; scores capped to
    ``softcap * tanh(s / softcap)`` when ``softcap``; plus ALiBi's ``alibi[h] * key_pos`` when given (BLOOM's
    absolute form: softmax cannot tell it from the reference's relative one)."""
    q_len, num_heads, _ = q.shape
    n, num_kv_heads, _ = keys.shape
    out = torch.zeros(q_len, num_heads, q.shape[-1], dtype=torch.float64)
    for j in range(q_len):
        pos = n - q_len + j
        visible = [t for t in range(n) if t <= pos and (window is None or t > pos - window)]
        for h in range(num_heads):
            kv_h = h // (num_heads // num_kv_heads)
            scores = torch.tensor([float(q[j, h].double() @ keys[t, kv_h].double()) * scale for t in visible])
            if softcap:
                scores = softcap * torch.tanh(scores / softcap)
            if alibi is not None:
                scores = scores + float(alibi[h]) * torch.tensor(visible, dtype=torch.float64)
            probs = torch.softmax(scores, dim=0)
            out[j, h] = sum(p * values[t, kv_h].double() for p, t in zip(probs, visible))
    return out


@pytest.mark.parametrize("window, softcap, alibi", [(None, None, None), (5, None, None), (None, 0.7, None),
                                                   (5, 0.7, None), (None, None, (0.5, 0.25, 0.125, 0.0625)),
                                                   (5, None, (0.9, 0.3, 0.1, 0.03))])
def test_paged_attention_against_naive_math(window, softcap, alibi):
    """Three requests: a decode, a chunk continuing a prefill, a fresh prefill; 2 padding rows. ALiBi's slopes
    per query head (BLOOM, MPT), alone and with a window."""
    block_size, num_heads, num_kv_heads, head_dim = 4, 4, 2, 8
    num_computed, num_scheduled = [9, 4, 0], [1, 3, 7]
    block_tables = [[5, 1, 7], [2, 6], [3, 0]]
    metadata, _ = make_attn_metadata(num_computed, num_scheduled, block_tables, block_size)
    kv_cache = torch.zeros(2, 8, block_size, num_kv_heads, head_dim)
    contexts = []
    for i, table in enumerate(block_tables):  # each request's whole context, cached at its slots
        n = num_computed[i] + num_scheduled[i]
        keys, values = _randn(n, num_kv_heads, head_dim, seed=10 + i), _randn(n, num_kv_heads, head_dim, seed=20 + i)
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(n)])
        reference.write_kv_cache(keys, values, kv_cache, slots)
        contexts.append((keys, values))
    num_tokens = sum(num_scheduled) + 2
    query = _randn(num_tokens, num_heads, head_dim, seed=3)
    scale = 1 / math.sqrt(head_dim)
    slopes = None if alibi is None else torch.tensor(alibi)
    out = reference.paged_attention(query, kv_cache, metadata, scale, sliding_window=window, softcap=softcap,
                                    alibi_slopes=slopes)
    qsl = metadata.query_start_loc_cpu
    for i, (keys, values) in enumerate(contexts):
        expected = _naive_attention(query[qsl[i] : qsl[i + 1]], keys, values, scale, window, softcap, slopes)
        torch.testing.assert_close(out[qsl[i] : qsl[i + 1]].double(), expected, atol=1e-5, rtol=0)
    assert torch.equal(out[qsl[-1] :], torch.zeros(2, num_heads, head_dim))


def test_gather_kv_follows_the_block_table():
    kv_cache = torch.arange(2 * 4 * 2 * 1 * 1, dtype=torch.float32).view(2, 4, 2, 1, 1)
    key, value = reference.gather_kv(kv_cache, torch.tensor([3, 1, 0], dtype=torch.int32), 3)
    assert key.flatten().tolist() == [6.0, 7.0, 2.0]
    assert value.flatten().tolist() == [14.0, 15.0, 10.0]
