"""Per-tensor fp8 experts with static activation scales (AutoFP8's ``activation_scheme: "static"``:
Mixtral-8x7B-Instruct-v0.1-FP8; asyncllm/models/fp8_experts.py): tiny Mixtral and Qwen3-MoE checkpoints with every
projection in fp8 with a scalar ``weight_scale`` and ``input_scale``, the experts' input scales different per expert,
loaded through the real loader and compared with the independent reference (tests/fp8_checkpoint_reference.py:
vLLM's one scale per product, the largest of the experts'). Both tensor-parallel ranks' experts against the
reference on their slice; each expert-parallel rank's scales (its own experts' largest); dummy weights. The kernel
path: tests/kernels/test_fused_moe_static_fp8.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from fp8_checkpoint_reference import (
    Fp8Reference,
    _expert_input_scales,
    _fp8_experts_forward,
    dequantized_weights,
    routed_tokens,
    write_fp8_checkpoint,
)
from model_utils import PagedRun

from asyncllm.config import EngineConfig
from asyncllm.models import fp8_checkpoint, fp8_experts
from asyncllm.models.checkpoint import Fp8CheckpointConfig
from asyncllm.models.fp8_checkpoint import DUMMY_INPUT_SCALE
from asyncllm.models.layers import TensorParallel
from asyncllm.models.loader import build_model, load_checkpoint, load_hf_config, load_model
from asyncllm.models.moe import FusedMoE
from asyncllm.models.registry import kv_cache_spec

CPU = torch.device("cpu")
SEQUENCES = [[7, 62, 8, 301, 9, 11, 42, 13, 200, 14, 15], [50, 41, 42]]
VS_REFERENCE = 1e-4
"""|logits - reference|, as test_fp8_tensor_experts.py's (float32 sums in another order, scaled)."""
INPUT_SCALES = {"q_proj": 2 / 448, "k_proj": 4 / 448, "v_proj": 3 / 448, "o_proj": 4 / 448,
                "gate_proj": 3 / 448, "up_proj": 3 / 448, "down_proj": 16 / 448, "w1": 3 / 448, "w3": 3 / 448,
                "w2": 16 / 448}
"""Expert 0's (times 1 + e / 4 for expert e): the experts' inputs reach 3.5 to 4.5 and their activations 12 to 56
(tiny Mixtral and Qwen3-MoE), so the largest scale (the last expert's: x1.75 of 4, x2.75 of 8) saturates fewer of
them than the smallest."""
ARCHS = {"mixtral": ({"hidden_size": 192, "intermediate_size": 160}, "block_sparse_moe"), "qwen3_moe": ({}, "mlp")}


@pytest.fixture(scope="module", params=list(ARCHS))
def checkpoint(request, tmp_path_factory) -> tuple[str, str, dict[str, torch.Tensor], str]:
    """(float source, static per-tensor fp8 copy, its tensors, layer 0's experts' checkpoint prefix)."""
    from safetensors.torch import save_file

    from asyncllm.tiny import tiny_checkpoint

    kwargs, block = ARCHS[request.param]
    src = tiny_checkpoint(request.param, **kwargs)
    path = tmp_path_factory.mktemp("fp8") / "ckpt"
    tensors = write_fp8_checkpoint(src, path, None, input_scales=INPUT_SCALES)
    for name in [n for n in tensors if ".experts." in n and n.endswith(".input_scale")]:
        tensors[name] = tensors[name] * (1 + int(name.split(".experts.")[1].split(".")[0]) / 4)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return src, str(path), tensors, f"model.layers.0.{block}.experts"


def _names(prefix: str) -> dict[str, str]:
    """gate, up, down -> the checkpoint's expert matrix names (Mixtral's w1, w3, w2)."""
    if "block_sparse_moe" in prefix:
        return {"gate": "w1", "up": "w3", "down": "w2"}
    return {part: f"{part}_proj" for part in ("gate", "up", "down")}


def test_a_static_moe_checkpoint_equals_the_reference(checkpoint) -> None:
    src, path, tensors, prefix = checkpoint
    hf_config = load_hf_config(path)
    model = load_model(EngineConfig.create(path), hf_config, CPU, torch.float32)
    experts = model.model.layers[0].mlp.experts
    s13, s2 = _expert_input_scales(tensors, prefix)
    last, names = experts.num_experts - 1, _names(prefix)  # the largest scales: the last expert's
    assert torch.equal(s13, tensors[f"{prefix}.{last}.{names['up']}.input_scale"]) and s13 > INPUT_SCALES["w1"]
    assert torch.equal(s2, tensors[f"{prefix}.{last}.{names['down']}.input_scale"])
    assert torch.equal(experts.w13_input_scale, s13) and torch.equal(experts.w2_input_scale, s2)
    assert not hasattr(experts, "gate_input_scale") and not hasattr(experts, "up_input_scale")  # staging gone
    run = PagedRun(model, SEQUENCES)
    run.new_kv_caches_for(kv_cache_spec(hf_config, 1), torch.float32)
    ref = Fp8Reference(src, tensors, None)
    for seq, logits in zip(SEQUENCES, run.run([[6, 3], [5, 0]])):
        assert float((logits - ref.logits(seq)).abs().max()) < VS_REFERENCE


@pytest.mark.parametrize("rank", [0, 1])
def test_each_tensor_parallel_rank_quantizes_with_the_static_scales(checkpoint, rank: int) -> None:
    """tp=2: a rank holds half of every expert's intermediate rows; every rank reads the input scales whole and
    quantizes both products' inputs with the same largest ones (its down input: its intermediate columns)."""
    _, path, tensors, prefix = checkpoint
    moe = _load_rank(path, rank)
    static = _expert_input_scales(tensors, prefix)
    assert torch.equal(moe.w13_input_scale, static[0]) and torch.equal(moe.w2_input_scale, static[1])

    names = _names(prefix)
    weights = dequantized_weights(tensors, None)
    inter = moe.intermediate
    rows = slice(inter * rank, inter * rank + inter)
    sliced = SimpleNamespace(act_fn=F.silu, gate_up_proj=torch.stack([torch.cat(
        [weights[f"{prefix}.{e}.{names[p]}.weight"][rows] for p in ("gate", "up")]) for e in range(4)]),
        down_proj=torch.stack([weights[f"{prefix}.{e}.{names['down']}.weight"][:, rows] for e in range(4)]))
    x, ids, topk = routed_tokens(moe.hidden_size)
    x = x * 2  # past the gate/up scale's 5.25: some inputs saturate
    moe.tp = TensorParallel()  # this rank's partial sum, not all-reduced
    torch.testing.assert_close(moe(x, topk, ids), _fp8_experts_forward(sliced, x, ids, topk, None, static=static),
                               atol=1e-5, rtol=1e-5)


def _load_rank(path: str, rank: int, **engine) -> FusedMoE:
    """Layer 0's experts of rank ``rank`` of two, loaded through the real loader's fp8 steps."""
    hf_config, cfg = load_hf_config(path), Fp8CheckpointConfig(None, (), True)
    model = build_model(EngineConfig.create(path, **engine), hf_config, CPU, torch.float32, rank, 2)
    fp8_checkpoint.make_fp8_params(model, cfg)
    fp8_experts.make_fp8_expert_params(model, cfg)
    load_checkpoint(model, path)
    fp8_experts.finish_fp8_expert_params(model, cfg)
    return model.model.layers[0].mlp.experts


def test_each_expert_parallel_rank_takes_its_own_experts_largest_scales(checkpoint) -> None:
    """Expert parallelism (two ranks, each half of the experts): each rank keeps the largest scales over its OWN
    experts, as vLLM (its FusedMoE makes the input scales of the local experts only), so the ranks' scales differ
    (rank 0's below the whole layer's: its results differ from one rank's)."""
    _, path, tensors, prefix = checkpoint
    names, whole = _names(prefix), _expert_input_scales(tensors, prefix)
    for rank in (0, 1):
        moe = _load_rank(path, rank, enable_expert_parallel=True, tensor_parallel_size=2)
        local, half = list(moe.local_experts), moe.num_experts // 2
        assert local == list(range(rank * half, rank * half + half))
        scales = {p: torch.stack([tensors[f"{prefix}.{e}.{names[p]}.input_scale"] for e in local]).max()
                  for p in ("gate", "up", "down")}
        assert torch.equal(moe.w13_input_scale, torch.maximum(scales["gate"], scales["up"]))
        assert torch.equal(moe.w2_input_scale, scales["down"])
        assert (moe.w13_input_scale < whole[0] and moe.w2_input_scale < whole[1]) == (rank == 0)


def test_dummy_weights_draw_the_input_scales(checkpoint) -> None:
    _, path, _, _ = checkpoint
    hf_config = load_hf_config(path)
    model = load_model(EngineConfig.create(path, load_format="dummy"), hf_config, CPU, torch.float32)
    experts = model.model.layers[0].mlp.experts
    assert float(experts.w13_input_scale) == float(experts.w2_input_scale) == DUMMY_INPUT_SCALE
    run = PagedRun(model, SEQUENCES)
    run.new_kv_caches_for(kv_cache_spec(hf_config, 1), torch.float32)
    assert all(torch.isfinite(logits).all() for logits in run.run([[6, 3], [5, 0]]))
