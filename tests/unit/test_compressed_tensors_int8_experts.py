"""Compressed-tensors W8A8 int8 experts (asyncllm/models/compressed_tensors_experts.py; RedHatAI's
``*-quantized.w8a8`` mixtures of experts): the reference's expert MLP equal to compressed-tensors' own forward of
quantized linears; tiny Qwen3-MoE and Mixtral checkpoints whose experts are written in the format
(tests/compressed_tensors_reference.py: int8 weights, bfloat16 scales per row; the rest float) loaded through the real
loader and compared with transformers' model holding the dequantized experts, each product's input fake-quantized to
int8 per token (`int8.quantize_int8_per_token`, compressed-tensors' own: tests/unit/test_int8.py); both
tensor-parallel splits; dummy weights. Static int8 activation scales on experts are refused
(tests/unit/test_compressed_tensors_fp8_experts.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from compressed_tensors_reference import INT8_W8A8, write_ct_fp8_experts
from fp8_checkpoint_reference import _fp8_experts_forward, routed_tokens
from model_utils import PagedRun
from served_inputs import ServedInputs, snap_reference
from test_compressed_tensors_fp8_experts import ExpertsReference

from asyncllm.config import EngineConfig
from asyncllm.kernels import reference
from asyncllm.models.checkpoint import prequantized_config
from asyncllm.models.compressed_tensors_experts import finish_ct_w8a8_experts, make_ct_w8a8_expert_params
from asyncllm.models.int8 import quantize_int8, quantize_int8_per_token
from asyncllm.models.layers import TensorParallel
from asyncllm.models.loader import build_model, load_checkpoint, load_hf_config, load_model
from asyncllm.models.registry import kv_cache_spec

CPU = torch.device("cpu")
SEQUENCES = [[5, 60, 7, 300, 9, 10, 41, 12], [12, 99, 4, 250, 31, 77, 8, 19, 3]]
"""The reference's experts quantize the served model's inputs (tests/served_inputs.py): a value within float32 noise
of an int8 rounding midpoint would otherwise round apart on some machines, a logit moving up to 0.06."""
VS_REFERENCE = 1e-4
"""|logits - reference|, float32: the same products of dequantized values, in another order."""
ARCHS = {"qwen3_moe": "model.layers.0.mlp.experts", "mixtral": "model.layers.0.block_sparse_moe.experts"}
_PARTS = {"qwen3_moe": ("gate_proj", "up_proj", "down_proj"), "mixtral": ("w1", "w3", "w2")}


def _int8_fake_quant(x: torch.Tensor) -> torch.Tensor:
    q, scale = quantize_int8_per_token(x.reshape(-1, x.shape[-1]))
    return (q.float() * scale).view(x.shape)


def _int8_forward(experts, hidden, ids, weights):
    return _fp8_experts_forward(experts, hidden, ids, weights, None, _int8_fake_quant)


_written: dict[tuple[str, str], tuple[str, str, dict[str, torch.Tensor]]] = {}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(arch, weight strategy) -> (float source, int8-experts copy, its dequantized experts), each written once."""
    from asyncllm.tiny import tiny_checkpoint

    def get(arch: str, strategy: str = "channel") -> tuple[str, str, dict[str, torch.Tensor]]:
        if (arch, strategy) not in _written:
            src, path = tiny_checkpoint(arch), tmp_path_factory.mktemp("ct") / f"{arch}-{strategy}"
            _written[arch, strategy] = (src, str(path), write_ct_fp8_experts(src, path, strategy, int8=True))
        return _written[arch, strategy]
    return get


def test_the_reference_experts_are_compressed_tensors_forward() -> None:
    """One expert's MLP as compressed-tensors computes it over three W8A8 linears (weights per row, inputs per token,
    fake-quantized) against `reference.fused_moe` on their int8 weights and scales: equal to float32 rounding."""
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus, apply_quantization_config
    from compressed_tensors.quantization.utils import calculate_qparams

    gen = torch.Generator().manual_seed(0)
    mlp = torch.nn.ModuleDict({name: torch.nn.Linear(*shape, bias=False) for name, shape in
                               (("gate", (40, 24)), ("up", (40, 24)), ("down", (24, 40)))})
    for linear in mlp.values():
        linear.weight.data = torch.randn(linear.weight.shape, generator=gen) * 0.2
    config = QuantizationConfig(config_groups={"g": {"targets": ["Linear"], **INT8_W8A8}})
    apply_quantization_config(mlp, config)
    q, s = {}, {}
    for name, linear in mlp.items():
        weight = linear.weight.data
        scale, _ = calculate_qparams(weight.amin(1, keepdim=True), weight.amax(1, keepdim=True),
                                     linear.quantization_scheme.weights)
        linear.weight_scale.data.copy_(scale)
        linear.quantization_status = QuantizationStatus.FROZEN
        q[name], s[name] = quantize_int8(weight, scale), scale.float()
    x = torch.randn(1, 5, 40, generator=gen)
    with torch.no_grad():
        want = mlp["down"](F.silu(mlp["gate"](x)) * mlp["up"](x))[0]
    int8 = reference.Fp8Experts(torch.cat([s["gate"], s["up"]])[None], s["down"][None], (1, 40))
    ids, weights = torch.zeros(5, 1, dtype=torch.long), torch.ones(5, 1)
    got = reference.fused_moe(x[0], torch.cat([q["gate"], q["up"]])[None], q["down"][None], weights, ids, fp8=int8)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    assert not torch.allclose(got, (mlp["down"].weight @ (F.silu(mlp["gate"].weight @ x[0].T)
                                                          * (mlp["up"].weight @ x[0].T))).T, atol=1e-4)


@pytest.mark.parametrize("arch, strategy", [("qwen3_moe", "channel"), ("mixtral", "channel"), ("qwen3_moe", "tensor")])
def test_int8_experts_equal_the_reference(checkpoint, arch: str, strategy: str, monkeypatch) -> None:
    """Per row (W8A8) and per matrix (``strategy: tensor`` weights, served as `(I, K)` blocks)."""
    src, path, dequantized = checkpoint(arch, strategy)
    hf_config = load_hf_config(path)
    model = load_model(EngineConfig.create(path), hf_config, CPU, torch.float32)
    run = PagedRun(model, SEQUENCES)
    run.new_kv_caches_for(kv_cache_spec(hf_config, 1), torch.float32)
    served = ServedInputs(model, monkeypatch)
    ref = ExpertsReference(src, dequantized, None)
    for module in ref.model.modules():
        if hasattr(module, "gate_up_proj"):
            module.forward = lambda hidden, ids, weights, m=module: _int8_forward(m, hidden, ids, weights)
    served_logits = run.run([[5, 4], [3, 5]])
    snap_reference(ref.model, served)
    for seq, logits in zip(SEQUENCES, served_logits):
        assert float((logits - ref.logits(seq)).abs().max()) < VS_REFERENCE
    experts = model.model.layers[0].mlp.experts
    assert experts.w13_weight.dtype == experts.w2_weight.dtype == torch.int8
    rows = 1 if strategy == "channel" else experts.intermediate
    assert experts.fp8_block == (rows, max(experts.w13_weight.shape[2], experts.w2_weight.shape[2]))
    assert not hasattr(experts, "gate_weight_scale")  # the staging scales are gone


@pytest.mark.parametrize("arch, expert_parallel, rank", [("qwen3_moe", False, 1), ("mixtral", False, 0),
                                                         ("mixtral", True, 1)])
def test_each_rank_computes_its_slice(checkpoint, arch: str, expert_parallel: bool, rank: int) -> None:
    """tp=2: a rank holds the gate and up rows [I r, I r + I) of every expert (their per-row scales) and the down's
    columns (every row's scale), or under expert parallelism half the experts whole; its partial output is the
    reference's on its slice."""
    src, path, dequantized = checkpoint(arch)
    hf_config = load_hf_config(path)
    cfg = prequantized_config(hf_config, path, None)
    config = EngineConfig.create(path, enable_expert_parallel=expert_parallel)
    model = build_model(config, hf_config, CPU, torch.float32, rank, 2)
    assert make_ct_w8a8_expert_params(model, cfg) == 2
    load_checkpoint(model, path)
    finish_ct_w8a8_experts(model, cfg)
    moe = model.model.layers[0].mlp.experts
    num_experts, inter, hidden = moe.num_experts, moe.intermediate, moe.w2_weight.shape[1]
    rows = slice(0, inter) if expert_parallel else slice(inter * rank, inter * rank + inter)
    gate, up, down = (f"{ARCHS[arch]}.{{}}.{part}.weight" for part in _PARTS[arch])
    sliced = SimpleNamespace(act_fn=F.silu, gate_up_proj=torch.stack([torch.cat(
        [dequantized[gate.format(e)][rows], dequantized[up.format(e)][rows]]) for e in range(num_experts)]),
        down_proj=torch.stack([dequantized[down.format(e)][:, rows] for e in range(num_experts)]))
    x, ids, topk = routed_tokens(hidden)
    local = torch.tensor([moe.is_local(e) for e in range(num_experts)])[ids]
    assert local.any() and (expert_parallel == (not local.all()))
    moe.tp = TensorParallel()  # this rank's partial sum, not all-reduced
    torch.testing.assert_close(moe(x, topk, ids), _int8_forward(sliced, x, ids, topk * local), atol=1e-5, rtol=1e-5)


def test_dummy_weights_give_int8_experts(checkpoint) -> None:
    """Drawn experts quantized per row by ``max / 127.5`` (a row's largest magnitude 127, or 128 when negative), and
    served as the reference computes on their dequantized values."""
    _, path, _ = checkpoint("qwen3_moe")
    model = load_model(EngineConfig.create(path, load_format="dummy"), load_hf_config(path), CPU, torch.float32)
    experts = model.model.layers[0].mlp.experts
    w13, s13, w2, s2 = experts.w13_weight, experts.w13_weight_scale_inv, experts.w2_weight, experts.w2_weight_scale_inv
    assert w13.dtype == w2.dtype == torch.int8 and s13.shape == (8, 64, 1) and s2.shape == (8, 64, 1)
    assert w13.int().abs().amax(-1).ge(127).all() and w2.int().abs().amax(-1).ge(127).all()
    dequantized = SimpleNamespace(act_fn=F.silu, gate_up_proj=w13.float() * s13, down_proj=w2.float() * s2)
    x, ids, topk = routed_tokens(64)
    torch.testing.assert_close(experts(x, topk, ids), _int8_forward(dequantized, x, ids, topk), atol=1e-5, rtol=1e-5)
