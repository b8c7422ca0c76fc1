"""Per-tensor fp8 experts (asyncllm/models/fp8_experts.py): a tiny Mixtral checkpoint with every expert matrix and
attention projection in fp8 with one scalar ``weight_scale`` (the up matrices' scales x3, so gate and up differ
widely) loaded through the real loader and compared with the independent reference
(tests/fp8_checkpoint_reference.py); hidden 192 and intermediate 160 (each product's input wider than 128 columns,
quantized with one scale per token). Both tensor-parallel ranks' experts against the reference on their slice; dummy
weights; a per-tensor scale of more than one value refused. The block-fp8 experts are in
tests/unit/test_fp8_checkpoint.py; static activation scales in tests/unit/test_fp8_static_experts.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from fp8_checkpoint_reference import (
    Fp8Reference,
    _fp8_experts_forward,
    dequantized_weights,
    routed_tokens,
    write_fp8_checkpoint,
)
from model_utils import PagedRun
from served_inputs import ServedInputs, snap_reference

from asyncllm.config import EngineConfig
from asyncllm.models import fp8_checkpoint, fp8_experts
from asyncllm.models.checkpoint import Fp8CheckpointConfig, prequantized_fp8_config
from asyncllm.models.layers import TensorParallel, scalar_weight
from asyncllm.models.loader import build_model, load_checkpoint, load_hf_config, load_model
from asyncllm.models.registry import kv_cache_spec

CPU = torch.device("cpu")
FP8 = torch.float8_e4m3fn
SEQUENCES = [[7, 62, 8, 301, 9, 11, 42, 13, 200, 14, 15], [50, 41, 42]]
"""test_compressed_tensors_fp8_experts.py's: no quantized value within float32 noise of an fp8 rounding midpoint
(``[5, 60, 7, 300, ...]`` has one since the experts' inputs take one scale per token: a logit moves 0.2)."""
VS_REFERENCE = 1e-4
"""|logits - reference|: measured up to 7.9e-6 with 1 and 2 threads (float32 sums in another order, scaled); one
activation's fp8 rounding flipped by that order moves a logit by ~4e-3 (the up scales x4 flip one)."""
UP_SCALE = 3.0
MOE = "model.layers.0.block_sparse_moe.experts"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[str, str, dict[str, torch.Tensor]]:
    """(float source, per-tensor fp8 copy, its tensors): the up (``w3``) scales multiplied by `UP_SCALE`."""
    from safetensors.torch import save_file

    from asyncllm.tiny import tiny_checkpoint

    src = tiny_checkpoint("mixtral", hidden_size=192, intermediate_size=160)
    path = tmp_path_factory.mktemp("fp8") / "ckpt"
    tensors = write_fp8_checkpoint(src, path, None)
    for name in [n for n in tensors if n.endswith(".w3.weight_scale")]:
        tensors[name] = tensors[name] * UP_SCALE
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return src, str(path), tensors


def test_a_per_tensor_moe_checkpoint_equals_the_reference(checkpoint, monkeypatch) -> None:
    src, path, tensors = checkpoint
    hf_config = load_hf_config(path)
    assert prequantized_fp8_config(hf_config, path, None) == Fp8CheckpointConfig(None)
    model = load_model(EngineConfig.create(path), hf_config, CPU, torch.float32)
    run = PagedRun(model, SEQUENCES)
    run.new_kv_caches_for(kv_cache_spec(hf_config, 1), torch.float32)
    served = ServedInputs(model, monkeypatch)
    ref = Fp8Reference(src, tensors, None)
    served_logits = run.run([[6, 3], [5, 0]])
    snap_reference(ref.model, served)
    for seq, logits in zip(SEQUENCES, served_logits):
        assert float((logits - ref.logits(seq)).abs().max()) < VS_REFERENCE
    experts = model.model.layers[0].mlp.experts
    assert experts.w13_weight.dtype == experts.w2_weight.dtype == FP8 and experts.fp8_block == (160, 192)
    assert not hasattr(experts, "gate_weight_scale")  # the staging scalars are gone
    assert model.model.layers[1].self_attn.qkv_proj.weight.dtype == FP8


@pytest.mark.parametrize("rank", [0, 1])
def test_each_tensor_parallel_rank_computes_its_slice(checkpoint, rank: int) -> None:
    """tp=2: a rank holds intermediate rows [80r, 80r+80) of every expert; its block scales are each matrix's scalar
    (w13: the gate's block row, then the up's), and its partial output is the reference's on its slice."""
    src, path, tensors = checkpoint
    hf_config, cfg = load_hf_config(path), Fp8CheckpointConfig(None)
    model = build_model(EngineConfig.create(path), hf_config, CPU, torch.float32, rank, 2)
    fp8_checkpoint.make_fp8_params(model, cfg)
    assert fp8_experts.make_fp8_expert_params(model, cfg) == 2
    load_checkpoint(model, path)
    fp8_experts.finish_fp8_expert_params(model, cfg)
    moe = model.model.layers[0].mlp.experts
    scales = {part: torch.stack([tensors[f"{MOE}.{e}.{part}.weight_scale"] for e in range(4)])
              for part in ("w1", "w3", "w2")}
    assert moe.fp8_block == (80, 192) and moe.w13_weight_scale_inv.shape == (4, 2, 1)  # (I, all of K) blocks
    gate_up = torch.stack([scales["w1"], scales["w3"]], 1)
    assert torch.equal(moe.w13_weight_scale_inv, gate_up[..., None])
    assert moe.w2_weight_scale_inv.shape == (4, 3, 1) and moe.w2_weight_scale_inv.eq(scales["w2"][:, None, None]).all()

    weights = dequantized_weights(tensors, None)
    rows = slice(80 * rank, 80 * rank + 80)
    sliced = SimpleNamespace(act_fn=F.silu, gate_up_proj=torch.stack([
        torch.cat([weights[f"{MOE}.{e}.w1.weight"][rows], weights[f"{MOE}.{e}.w3.weight"][rows]]) for e in range(4)]),
        down_proj=torch.stack([weights[f"{MOE}.{e}.w2.weight"][:, rows] for e in range(4)]))
    x, ids, topk = routed_tokens(192)
    moe.tp = TensorParallel()  # this rank's partial sum, not all-reduced
    got = moe(x, topk, ids)
    want = _fp8_experts_forward(sliced, x, ids, topk, None)  # each input one scale per token
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_dummy_weights_give_per_tensor_experts(checkpoint) -> None:
    _, path, _ = checkpoint
    hf_config = load_hf_config(path)
    model = load_model(EngineConfig.create(path, load_format="dummy"), hf_config, CPU, torch.float32)
    experts = model.model.layers[0].mlp.experts
    w13, scales = experts.w13_weight, experts.w13_weight_scale_inv
    assert w13.dtype == FP8 and scales.shape == (4, 2, 1) and experts.w2_weight_scale_inv.shape == (4, 2, 1)
    largest = w13.float().abs().view(4, 2, -1).amax(-1)  # each matrix by its own scale: its largest value 448
    assert largest.eq(448).all()
    run = PagedRun(model, SEQUENCES)
    run.new_kv_caches_for(kv_cache_spec(hf_config, 1), torch.float32)
    assert all(torch.isfinite(logits).all() for logits in run.run([[6, 3], [5, 0]]))


def test_a_per_tensor_scale_is_one_value() -> None:
    """`layers.scalar_weight`, which every per-tensor scale loader reads through (the experts', compressed-tensors'
    experts', the dense layers'): AutoFP8's ``[1]`` and a 0-d scalar alike; more values refused."""
    assert scalar_weight(torch.tensor([2.5])).shape == () and float(scalar_weight(torch.tensor(2.5))) == 2.5
    with pytest.raises(ValueError, match=r"has shape \(2,\), a per-tensor scale is a scalar"):
        scalar_weight(torch.tensor([1.0, 2.0]))
