"""gpt-oss (asyncllm/models/gpt_oss.py) against transformers' forward over a paged KV cache; its experts split over
two ranks; its MXFP4 checkpoints (asyncllm/models/mxfp4.py) against transformers' own dequantized load.

The tiny checkpoint (asyncllm.tiny "gpt_oss") has random attention sinks, router and expert biases, an 8-token
window on every other layer, YaRN, and the SwiGLU clamp at 2 so that it bites. Requests run as chunked prefills
mixed with decodes, past the window, and every position's float32 logits must match transformers' within 1e-4.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from hf_reference import _hf_model
from model_utils import assert_paged_logits_match_checkpoint
from mxfp4_utils import mxfp4_checkpoints as _mxfp4_checkpoints
from safetensors.torch import load_file
from transformers.integrations.mxfp4 import FP4_VALUES as HF_FP4_VALUES
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from asyncllm.attention.selector import get_attention_backend
from asyncllm.config import EngineConfig
from asyncllm.errors import NotBuiltError
from asyncllm.kernels import reference
from asyncllm.models.checkpoint import prequantized_config
from asyncllm.models.gpt_oss import GptOssForCausalLM
from asyncllm.models.layers import TensorParallel
from asyncllm.models.loader import checkpoint_files, iterate_safetensors, load_hf_config, load_model
from asyncllm.models.mxfp4 import FP4_VALUES, dequantize_mxfp4
from asyncllm.tiny import tiny_checkpoint

ATOL = 1e-4
SEQ_LENS = [12, 20, 27]
SCHEDULE = [[5, 9, 0], [4, 9, 16], [1, 1, 9], [1, 1, 1], [1, 0, 1]]
"""Chunked prefills beside decodes; every sequence outruns the 8-token window."""


def _load(path: str) -> GptOssForCausalLM:
    return load_model(EngineConfig.create(path), load_hf_config(path), torch.device("cpu"), torch.float32)


def test_logits_match_transformers() -> None:
    path = tiny_checkpoint("gpt_oss")
    model = _load(path)
    assert type(model) is GptOssForCausalLM
    windows = [layer.self_attn.attn.sliding_window for layer in model.model.layers]
    assert windows == [8, None]  # sliding, then full attention (layer_types)
    assert_paged_logits_match_checkpoint(model, path, SEQ_LENS, SCHEDULE, seed=1, atol=ATOL)


def _build(path: str, rank: int, tp_size: int, expert_parallel: bool, scales_last: bool = False) -> GptOssForCausalLM:
    """Rank ``rank`` of ``tp_size`` without a process group: its experts are called directly, no all-reduce.
    ``scales_last``: every MXFP4 scale read after every block (as when they lie in a later file)."""
    hf_config = load_hf_config(path)
    backend = get_attention_backend("torch_sdpa", torch.device("cpu"), torch.float32)
    model = GptOssForCausalLM(hf_config, dtype=torch.float32, tp=TensorParallel(rank, tp_size), attn_backend=backend,
                              max_position=64, expert_parallel=expert_parallel)
    weights = list(iterate_safetensors(checkpoint_files(path)))
    if scales_last:
        weights.sort(key=lambda item: item[0].endswith("_scales"))
    assert model.load_weights(weights) == model.checkpoint_weight_names()
    return model


def _partial(experts, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """One rank's experts' output before the all-reduce (what `GptOssExperts.forward` reduces)."""
    w2_bias = experts.w2_bias if experts.adds_w2_bias else None
    return reference.fused_moe(x, experts.w13_weight, experts.w2_weight, weights, experts.local_ids(ids),
                               experts.w13_bias, w2_bias, experts.swiglu)


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_two_ranks_partial_sums_equal_the_whole_layer(expert_parallel: bool) -> None:
    """Each rank's slice of the interleaved gate/up (or its whole experts) and of their biases, the down bias
    added by one rank only (or per expert by its owner): the two partial sums give the one-rank layer."""
    path = tiny_checkpoint("gpt_oss")
    whole = _build(path, 0, 1, False).model.layers[1].mlp.experts
    ranks = [_build(path, rank, 2, expert_parallel).model.layers[1].mlp.experts for rank in range(2)]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(9, 64, generator=gen)
    ids = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(9)])
    weights = torch.rand(9, 2, generator=gen)
    parts = [_partial(r, x, weights, ids) for r in ranks]
    torch.testing.assert_close(parts[0] + parts[1], _partial(whole, x, weights, ids), rtol=1e-5, atol=1e-5)
    assert all(torch.count_nonzero(part) for part in parts)  # both ranks contribute
    assert [r.adds_w2_bias for r in ranks] == ([True, True] if expert_parallel else [True, False])


def test_sinks_load_per_rank() -> None:
    path = tiny_checkpoint("gpt_oss")
    sinks = load_file(f"{path}/model.safetensors")["model.layers.0.self_attn.sinks"]
    for rank in range(2):
        attn = _build(path, rank, 2, False).model.layers[0].self_attn
        assert torch.equal(attn.sinks, sinks[2 * rank:2 * rank + 2])  # 4 heads: 2 per rank


# ---------------------------------------------------------------- MXFP4 checkpoints
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_equals_transformers(dtype: torch.dtype) -> None:
    """Every byte and exponent (0 to 255, both nibbles) dequantized bit for bit as transformers' function, which
    returns the transpose; a hand-made group checks the table, the nibble order and the bias."""
    assert FP4_VALUES == tuple(HF_FP4_VALUES)
    blocks = torch.arange(256, dtype=torch.uint8).reshape(2, 8, 1, 16).repeat(1, 1, 2, 1)
    scales = torch.arange(32, dtype=torch.uint8).reshape(2, 8, 2) * 8
    expected = convert_moe_packed_tensors(blocks, scales, dtype=dtype).transpose(1, 2)
    assert torch.equal(dequantize_mxfp4(blocks, scales, dtype), expected)
    group = torch.tensor([[[0x21] + [0xF9] + [0] * 14]], dtype=torch.uint8)  # nibbles 1, 2; 9 (-0.5), 15 (-6)
    values = dequantize_mxfp4(group, torch.tensor([[128]], dtype=torch.uint8), torch.float32)
    assert values[0, :4].tolist() == [1.0, 2.0, -1.0, -12.0] and not values[0, 4:].any()


def test_mxfp4_checkpoint_loads_as_transformers_dequantizes_it(tmp_path: Path) -> None:
    """Our experts equal transformers' dequantized parameters (gate rows = its columns 0::2, up = 1::2); the
    logits equal those of transformers' model loaded from the same MXFP4 folder."""
    path, _ = _mxfp4_checkpoints(tmp_path)
    model = _load(path)
    assert model.mxfp4 and "model.layers.0.mlp.experts.down_proj_scales" in model.checkpoint_weight_names()
    hf_experts = _hf_model(path).model.layers[0].mlp.experts
    gate_up, down = hf_experts.gate_up_proj.transpose(1, 2), hf_experts.down_proj.transpose(1, 2)
    ours = model.model.layers[0].mlp.experts
    assert torch.equal(ours.w13_weight, torch.cat([gate_up[:, 0::2], gate_up[:, 1::2]], dim=1))
    assert torch.equal(ours.w2_weight, down)
    assert_paged_logits_match_checkpoint(model, path, SEQ_LENS, SCHEDULE, seed=2, atol=ATOL)


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_mxfp4_rank_loads_what_the_float_checkpoint_gives(tmp_path: Path, expert_parallel: bool) -> None:
    """Rank 1 of 2 dequantizes its experts (or its slice of each) as it reads them from a float checkpoint holding
    transformers' dequantized weights (the other tests' rank 0 of 1 covers the rest), even with every scale read
    after every block."""
    path, float_path = _mxfp4_checkpoints(tmp_path)
    from_mxfp4 = _build(path, 1, 2, expert_parallel, scales_last=True).model.layers[1].mlp.experts
    from_float = _build(float_path, 1, 2, expert_parallel).model.layers[1].mlp.experts
    for name in ("w13_weight", "w2_weight", "w13_bias", "w2_bias"):
        assert torch.equal(getattr(from_mxfp4, name), getattr(from_float, name)), name


def test_what_is_not_built_says_so() -> None:
    hf_config = copy.copy(load_hf_config(tiny_checkpoint("gpt_oss")))
    hf_config.quantization_config = {"quant_method": "mxfp4"}
    with pytest.raises(NotBuiltError, match="quantizing a gpt-oss MXFP4 checkpoint"):
        prequantized_config(hf_config, "gpt-oss", "fp8")
    assert prequantized_config(hf_config, "gpt-oss", None) is None  # dequantized as it loads
    hf_config.architectures = ["MixtralForCausalLM"]
    with pytest.raises(NotBuiltError, match="MXFP4 MixtralForCausalLM"):
        prequantized_config(hf_config, "mixtral", None)
