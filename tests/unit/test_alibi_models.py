"""BLOOM, MPT and Falcon-RW (asyncllm/models/bloom.py, mpt.py, falcon.py: ALiBi attention, asyncllm/models/alibi.py)
against transformers' forward over a paged KV cache, alone and over two tensor-parallel ranks.

The tiny BLOOM runs 4 heads (the power-of-two slopes) and 6 (BLOOM's extra odd slopes); the tiny MPT clamps q, k and
v (``clip_qkv`` 1.5) and scales its scores by 0.3, at 4 and 6 heads (MPT's odd-then-even slopes; transformers reads
no ``alibi_bias_max``, so its other values are checked on the slopes alone); the tiny Falcon-RW runs 6 heads
in sequential layers (its slopes, rounded to bfloat16 and scaled, checked for every head count). Requests run as
chunked prefills over cached prefixes mixed with decodes; every position's float32 logits must match transformers'
within 1e-4. Over two ranks each holds half the heads and their slopes."""

from __future__ import annotations

import pytest
import torch
from model_utils import PagedRun, free_port, spawn_ranks, tp_worker
from test_granite_olmo2_models import _assert_match_transformers  # within 1e-4, argmax equal, far from uniform

from asyncllm.config import EngineConfig
from asyncllm.errors import NotBuiltError
from asyncllm.models.alibi import bloom_alibi_slopes, falcon_alibi_slopes, mpt_alibi_slopes
from asyncllm.models.bloom import BloomForCausalLM
from asyncllm.models.falcon import FalconForCausalLM
from asyncllm.models.loader import load_hf_config, load_model
from asyncllm.models.mpt import MptForCausalLM
from asyncllm.models.registry import kv_cache_spec
from asyncllm.tiny import tiny_checkpoint

SEQ_LENS = [12, 40, 11]
SCHEDULE = [[5, 17, 0], [4, 17, 4], [1, 5, 5], [1, 1, 1], [1, 0, 1]]
"""Prefill chunks over cached prefixes beside decodes, then decode-only steps (the 40-token prompt in three chunks,
so its later chunks see keys far behind them: ALiBi's bias there is tens of units)."""
SIX_HEADS = dict(num_heads=6, num_kv_heads=6, hidden_size=96)
FALCON_RW = dict(SIX_HEADS, alibi=True, new_decoder_architecture=False, parallel_attn=False, multi_query=False)
"""falcon-rw-1b's layout: ALiBi, sequential layers, a KV head per head (each head's q, k, v together)."""


def _sequences(seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(6, 512, (n,), generator=gen).tolist() for n in SEQ_LENS]


@pytest.mark.parametrize("arch, model_cls, shape", [("bloom", BloomForCausalLM, {}),
                                                    ("bloom", BloomForCausalLM, SIX_HEADS),
                                                    ("mpt", MptForCausalLM, {}), ("mpt", MptForCausalLM, SIX_HEADS),
                                                    ("falcon", FalconForCausalLM, FALCON_RW)])
def test_logits_match_transformers(arch: str, model_cls: type, shape: dict) -> None:
    path = tiny_checkpoint(arch, **shape)
    hf_config = load_hf_config(path)
    model = load_model(EngineConfig.create(path), hf_config, torch.device("cpu"), torch.float32)
    assert type(model) is model_cls
    sequences = _sequences(len(arch) + len(shape))
    run = PagedRun(model, sequences, block_size=4)
    run.new_kv_caches_for(kv_cache_spec(hf_config, 1), torch.float32)
    _assert_match_transformers(path, sequences, run.run(SCHEDULE))


@pytest.mark.parametrize("num_heads", [1, 2, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64, 112])
def test_slopes_equal_transformers(num_heads: int) -> None:
    """BLOOM's slopes for any head count (bloom-176b: 112), MPT's at its default and another ``alibi_bias_max``,
    Falcon's (falcon-rw-1b: 32 heads of 64) times ``sqrt(head_dim)``: transformers' bias one position on."""
    from transformers.models.bloom.modeling_bloom import _get_alibi_slopes
    from transformers.models.falcon.modeling_falcon import build_alibi_tensor
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    bloom = torch.tensor(bloom_alibi_slopes(num_heads))
    torch.testing.assert_close(bloom, _get_alibi_slopes(num_heads, torch.device("cpu")), atol=0, rtol=1e-6)
    for bias_max in (8, 4):
        mpt = torch.tensor(mpt_alibi_slopes(num_heads, bias_max))
        hf = build_mpt_alibi_tensor(num_heads, 2, bias_max)[:, 0, 0]  # the bias one position back: -slope
        torch.testing.assert_close(mpt, -hf, atol=0, rtol=1e-6)
    assert len(set(bloom.tolist())) == num_heads  # each head its own slope
    falcon = torch.tensor(falcon_alibi_slopes(num_heads, 64), dtype=torch.float32) * 8
    one_on = build_alibi_tensor(torch.ones(1, 2, dtype=torch.long), num_heads, torch.float32)[:, 0, 1]
    assert torch.equal(falcon, one_on)


def test_bloom_checkpoints_without_the_transformer_prefix_load(tmp_path) -> None:
    """The bigscience releases name their weights ``h.0...``, ``word_embeddings...`` (the bare model's)."""
    import shutil

    from safetensors.torch import load_file, save_file

    src = tiny_checkpoint("bloom")
    bare = tmp_path / "bloom-bare"
    shutil.copytree(src, bare)
    tensors = load_file(bare / "model.safetensors")
    save_file({k.removeprefix("transformer."): v for k, v in tensors.items()}, bare / "model.safetensors",
              metadata={"format": "pt"})
    hf_config = load_hf_config(str(bare))
    model = load_model(EngineConfig.create(str(bare)), hf_config, torch.device("cpu"), torch.float32)
    sequences = _sequences(9)
    run = PagedRun(model, sequences, block_size=4)
    run.new_kv_caches_for(kv_cache_spec(hf_config, 1), torch.float32)
    _assert_match_transformers(src, sequences, run.run(SCHEDULE))


@pytest.mark.parametrize("arch, overrides, field", [
    ("mpt", {"attn_config": {"alibi": False}}, "attn_config.alibi"),
    ("mpt", {"attn_config": {"qk_ln": True}}, "attn_config.qk_ln"),
    ("mpt", {"attn_config": {"prefix_lm": True}}, "attn_config.prefix_lm"),
    ("mpt", {"attn_config": {"attn_type": "multiquery_attention"}}, "attn_config.attn_type"),
    ("mpt", {"no_bias": False}, "no_bias"),
    ("mpt", {"logit_scale": 0.5}, "logit_scale"),
    ("bloom", {"apply_residual_connection_post_layernorm": True}, "apply_residual_connection_post_layernorm"),
    ("bloom", {"slow_but_exact": True}, "slow_but_exact"),
    ("bloom", {"quantization_config": {"quant_method": "awq", "bits": 4}}, "pre-quantized BLOOM"),
    ("mpt", {"quantization_config": {"quant_method": "gptq", "bits": 4}}, "pre-quantized MPT"),
    ("falcon", {"alibi": True}, "new_decoder_architecture"),  # ALiBi in falcon-rw's layout only
])
def test_unbuilt_variants_are_refused_by_name(arch: str, overrides: dict, field: str) -> None:
    path = tiny_checkpoint(arch)
    hf_config = load_hf_config(path)
    for name, value in overrides.items():
        if name == "attn_config":
            for key, attr in value.items():
                setattr(hf_config.attn_config, key, attr)
        else:
            setattr(hf_config, name, value)
    with pytest.raises(NotBuiltError, match=field.replace(".", r"\.")):
        load_model(EngineConfig.create(path), hf_config, torch.device("cpu"), torch.float32)


def test_mpt_max_model_len_is_its_max_seq_len() -> None:
    from asyncllm.models.architectures import max_positions

    hf_config = load_hf_config(tiny_checkpoint("mpt"))
    hf_config.max_seq_len = 96
    assert max_positions(hf_config) == 96


@pytest.mark.slow
def test_tp2_logits_match_transformers(tmp_path) -> None:
    """Two gloo ranks, each holding 3 of the 6 heads and their slopes (BLOOM's heads cut from the per-head fused
    q/k/v, MPT's from q's, k's, then v's rows, Falcon-RW's as BLOOM's): every rank's logits equal transformers'."""
    paths = [tiny_checkpoint("bloom", **SIX_HEADS), tiny_checkpoint("mpt", **SIX_HEADS),
             tiny_checkpoint("falcon", **FALCON_RW)]
    sequences = _sequences(2)
    spawn_ranks(tp_worker, (2, free_port(), paths, str(tmp_path), sequences, SCHEDULE))
    for index, path in enumerate(paths):
        for rank in range(2):
            _assert_match_transformers(path, sequences, torch.load(tmp_path / f"rank{rank}_{index}.pt"))
