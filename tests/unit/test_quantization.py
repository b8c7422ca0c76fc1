"""Online fp8 weight quantization (quantization="fp8"): the math by hand, which layers are quantized, memory,
tensor-parallel scales, LoRA over a quantized layer, and what is refused (other methods, pre-quantized
checkpoints). The whole engine is in tests/engine/test_quantization_engine.py."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from asyncllm.cli_args import _field_docs
from asyncllm.config import EngineConfig
from asyncllm.config_model import QUANTIZATIONS
from asyncllm.errors import ConfigError, NotBuiltError
from asyncllm.models.checkpoint import checkpoint_quantization
from asyncllm.models.layers import TensorParallel
from asyncllm.models.linear import (
    ColumnParallelLinear,
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from asyncllm.models.loader import load_hf_config, load_model
from asyncllm.models.lora import LoRAContext, LoRALayer
from asyncllm.models.quantization import (
    FP8_DTYPE,
    MIN_SCALE,
    dequantize_fp8,
    fp8_linear_fallback,
    fp8_to_float,
    quantize_fp8,
    quantize_fp8_linear,
    quantize_fp8_linears,
    quantize_fp8_per_tensor,
    quantize_fp8_per_token,
)

CPU = torch.device("cpu")


def _model_bytes(model: nn.Module) -> int:
    tensors = list(model.parameters()) + list(model.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)


# ------------------------------------------------------------------ the math
def test_per_tensor_scale_maps_the_largest_weight_to_448() -> None:
    w = torch.randn(48, 32, generator=torch.Generator().manual_seed(0))
    q, scale = quantize_fp8_per_tensor(w)
    assert q.dtype == FP8_DTYPE and q.shape == w.shape and scale.dtype == torch.float32 and scale.dim() == 0
    assert scale.item() == (w.abs().max() / 448.0).item()
    assert q.float().abs().max().item() == 448.0
    err = (dequantize_fp8(q, scale, torch.float32) - w).abs()
    normal = w.abs() >= 2.0**-6 * scale  # e4m3's normal range: 3 mantissa bits, half an ulp <= 1/16 relative
    assert bool((err[normal] <= w.abs()[normal] / 16).all())
    assert bool((err[~normal] <= 2.0**-10 * scale).all())  # subnormals: spacing 2^-9


def test_values_past_the_range_saturate() -> None:
    """Clamped before the cast: a bare cast's overflow (NaN or saturation) differs between torch builds."""
    x = torch.tensor([500.0, -1000.0, 448.0, 464.0, 1e-4])
    assert quantize_fp8(x, torch.tensor(1.0)).float().tolist() == [448.0, -448.0, 448.0, 448.0, 0.0]


def test_the_cpu_table_lookup_is_torchs_cast() -> None:
    every = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).view(16, 16).t()  # non-contiguous too
    torch.testing.assert_close(fp8_to_float(every), every.float(), rtol=0, atol=0, equal_nan=True)  # 2 NaNs


def test_zero_rows_and_tensors_quantize_to_zero_not_nan() -> None:
    q, scale = quantize_fp8_per_tensor(torch.zeros(4, 4))
    assert scale.item() == pytest.approx(MIN_SCALE) and q.float().abs().sum().item() == 0.0
    x = torch.tensor([[0.0, 0.0], [1.0, -2.0]])
    q, scales = quantize_fp8_per_token(x)
    assert scales.shape == (2, 1) and not torch.isnan(q.float()).any()
    assert q.float().tolist() == [[0.0, 0.0], [224.0, -448.0]]


def test_dequantized_product_equals_the_hand_computation() -> None:
    # max|W| = 7: scale 7/448 = 2^-6 and every W/scale (224, -64, 16, 448, 128, 0, -448, 96) is an e4m3 value
    w = torch.tensor([[3.5, -1.0, 0.25, 7.0], [2.0, 0.0, -7.0, 1.5]])
    w_q, w_scale = quantize_fp8_per_tensor(w)
    assert w_scale.item() == 2.0**-6
    assert dequantize_fp8(w_q, w_scale, torch.float32).tolist() == w.tolist()
    # x's row scale s = 3.3/448; x/s = 135.76, 271.52, -448, 67.88 round to 128, 256 (spacing 16 and 32), -448, 64
    x = torch.tensor([[1.0, 2.0, -3.3, 0.5]])
    x_q, x_scale = quantize_fp8_per_token(x)
    assert x_q.float().tolist() == [[128.0, 256.0, -448.0, 64.0]]
    s = x_scale.item()
    # 128*3.5 - 256*1 - 448*0.25 + 64*7 = 528 ; 128*2 + 0 + 448*7 + 64*1.5 = 3488
    expected = torch.tensor([[528.0 * s, 3488.0 * s]]) + torch.tensor([0.5, -1.0])
    got = fp8_linear_fallback(x, w_q, w_scale, torch.tensor([0.5, -1.0]), torch.float32)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)


def test_per_token_scales_are_per_row() -> None:
    x = torch.tensor([[1.0, -4.0], [0.5, 0.25], [100.0, 1.0]])
    q, scales = quantize_fp8_per_token(x)
    assert scales.flatten().tolist() == pytest.approx([4 / 448, 0.5 / 448, 100 / 448])
    assert q.float().abs().amax(dim=1).tolist() == [448.0, 448.0, 448.0]


# ------------------------------------------------------------------ layers
def _filled(layer: LinearBase, seed: int) -> LinearBase:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in layer.parameters():
            param.copy_(torch.randn(param.shape, generator=gen))
    return layer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_quantized_layer_keeps_its_bias_and_computes_the_fallback(dtype: torch.dtype) -> None:
    layer = _filled(ColumnParallelLinear(32, 48, True, TensorParallel(), dtype), seed=1)
    weight, bias = layer.weight.detach().clone(), layer.bias
    quantize_fp8_linear(layer)
    assert layer.weight.dtype == FP8_DTYPE and layer.bias is bias and layer.bias.dtype == dtype
    assert layer.weight_scale.item() == (weight.float().abs().max() / 448).item()
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(2)).to(dtype)
    out = layer(x)
    assert out.dtype == dtype
    x_q, x_scale = quantize_fp8_per_token(x)
    by_hand = F.linear(dequantize_fp8(x_q, x_scale, dtype), dequantize_fp8(layer.weight, layer.weight_scale, dtype),
                       bias)
    assert torch.equal(out, by_hand)
    exact = F.linear(x.float(), weight.float(), bias.float())
    assert (out.float() - exact).abs().max() < 0.1 * exact.abs().max()  # fp8 rounding, a few per cent


def test_fused_projections_get_one_scale_per_rank() -> None:
    """vLLM's online fp8: one scale over the rank's whole fused weight (q, k and v rows together)."""
    q = torch.full((8, 4), 1.0)
    k = torch.full((4, 4), 2.0)
    v = torch.full((4, 4), 3.0)
    v[0:2] = 30.0  # KV head 0's v rows (rank 0 of 2): only rank 0's scale sees it
    scales = []
    for rank in range(2):
        layer = QKVParallelLinear(4, 2, 4, 2, False, TensorParallel(rank, 2), torch.float32)
        for shard_id, full in (("q", q), ("k", k), ("v", v)):
            layer.weight.weight_loader(layer.weight, full, shard_id)
        quantize_fp8_linear(layer)
        scales.append(layer.weight_scale.item())
    assert scales == [pytest.approx(30.0 / 448), pytest.approx(3.0 / 448)]
    row = RowParallelLinear(4, 2, False, TensorParallel(1, 2), torch.float32)
    row.weight.weight_loader(row.weight, torch.tensor([[1.0, 50.0, 2.0, -6.0], [0.0, 0.0, 1.0, 1.0]]))
    quantize_fp8_linear(row)
    assert row.weight_scale.item() == pytest.approx(6.0 / 448)  # rank 1's columns only


def test_lora_adapters_add_to_a_quantized_layer() -> None:
    layer = _filled(MergedColumnParallelLinear(16, [8, 8], False, TensorParallel(), torch.float32), seed=3)
    quantize_fp8_linear(layer)
    context = LoRAContext()
    layer.lora = LoRALayer(layer, [0, 1], num_slots=2, max_rank=4, context=context)
    assert layer.lora.a.dtype == layer.lora.b.dtype == torch.float32  # the model dtype, not the weight's fp8
    gen = torch.Generator().manual_seed(4)
    lora_a, lora_b = torch.randn(4, 16, generator=gen), torch.randn(8, 4, generator=gen)
    layer.lora.set(1, 1, lora_a, lora_b, scaling=0.5)  # slot 1, the "up" half
    x = torch.randn(3, 16, generator=gen)
    base = layer(x)
    context.mask = torch.tensor([[0.0, 1.0], [0.0, 0.0], [0.0, 1.0]])
    out = layer(x)
    delta = torch.zeros(3, 16)
    delta[:, 8:] = 0.5 * (x @ lora_a.T @ lora_b.T) * context.mask[:, 1:]
    torch.testing.assert_close(out, base + delta, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------ whole models
def test_only_the_decoders_parallel_linears_are_quantized_and_memory_shrinks(tiny_llama: str) -> None:
    hf_config = load_hf_config(tiny_llama)
    plain = load_model(EngineConfig.create(tiny_llama), hf_config, CPU, torch.float32)
    model = load_model(EngineConfig.create(tiny_llama, quantization="fp8"), hf_config, CPU, torch.float32)
    linears = {name for name, m in model.named_modules() if isinstance(m, LinearBase)}
    assert len(linears) == 4 * hf_config.num_hidden_layers
    assert {name.rsplit(".", 1)[1] for name in linears} == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    linear_elements = 0
    for name, param in model.named_parameters():
        module = name.rsplit(".", 1)[0]
        if module in linears and name.endswith(".weight"):
            assert param.dtype == FP8_DTYPE, name
            linear_elements += param.numel()
        else:  # embeddings, lm_head, norms (and biases)
            assert param.dtype == torch.float32, name
    # float32 -> fp8 saves 3 bytes per element; each layer gains a 4-byte scale
    assert _model_bytes(plain) - _model_bytes(model) == 3 * linear_elements - 4 * len(linears)
    assert _model_bytes(model) < 0.75 * _model_bytes(plain)


def test_other_modules_are_left_alone() -> None:
    """A mixture of experts' stacked expert weights or a router are no parallel linears: not quantized."""

    class Experts(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w13_weight = nn.Parameter(torch.randn(4, 16, 8), requires_grad=False)
            self.weight = nn.Parameter(torch.randn(4, 8), requires_grad=False)

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.experts = Experts()
            self.gate = nn.Linear(8, 4)
            self.shared = RowParallelLinear(16, 8, False, TensorParallel(), torch.float32)

    block = Block()
    summary = quantize_fp8_linears(block)
    assert summary.num_layers == 1 and block.shared.weight.dtype == FP8_DTYPE
    assert block.experts.w13_weight.dtype == block.experts.weight.dtype == block.gate.weight.dtype == torch.float32


def _dtypes(model: nn.Module, needle: str) -> dict[str, str]:
    return {name: str(p.dtype).removeprefix("torch.") for name, p in model.named_parameters() if needle in name}


def test_moe_router_stays_in_the_model_dtype() -> None:
    """Qwen2-MoE: attention and the shared expert's projections are parallel linears (fp8), the stacked experts fp8
    per expert matrix (tests/unit/test_fp8_online_experts.py); the router and the shared expert's gate stay float."""
    from asyncllm.tiny import TINY_ARCHS, tiny_checkpoint

    if "qwen2_moe" not in TINY_ARCHS:
        pytest.skip("no tiny MoE checkpoint")
    path = tiny_checkpoint("qwen2_moe")
    model = load_model(EngineConfig.create(path, quantization="fp8"), load_hf_config(path), CPU, torch.float32)
    assert _dtypes(model, "layers.0.") == {
        "model.layers.0.input_layernorm.weight": "float32",
        "model.layers.0.self_attn.qkv_proj.weight": "float8_e4m3fn",
        "model.layers.0.self_attn.qkv_proj.bias": "float32",
        "model.layers.0.self_attn.o_proj.weight": "float8_e4m3fn",
        "model.layers.0.post_attention_layernorm.weight": "float32",
        "model.layers.0.mlp.gate.weight": "float32",
        "model.layers.0.mlp.experts.w13_weight": "float8_e4m3fn",
        "model.layers.0.mlp.experts.w2_weight": "float8_e4m3fn",
        "model.layers.0.mlp.shared_expert.gate_up_proj.weight": "float8_e4m3fn",
        "model.layers.0.mlp.shared_expert.down_proj.weight": "float8_e4m3fn",
        "model.layers.0.mlp.shared_expert_gate.weight": "float32",
    }


def test_llava_quantizes_its_language_model_only(tmp_path) -> None:
    from mm_utils import make_tiny_llava

    path = make_tiny_llava(tmp_path / "llava")
    model = load_model(EngineConfig.create(path, quantization="fp8"), load_hf_config(path), CPU, torch.float32)
    fp8 = {name for name, dtype in _dtypes(model, "").items() if dtype == "float8_e4m3fn"}
    assert fp8 and all(name.startswith("language_model.model.layers.") for name in fp8)
    assert set(_dtypes(model, "vision_tower.").values()) == set(_dtypes(model, "multi_modal_projector.").values()) == {
        "float32"}


def test_dummy_weights_quantize_and_run(tiny_llama: str) -> None:
    hf_config = load_hf_config(tiny_llama)
    config = EngineConfig.create(tiny_llama, quantization="fp8", load_format="dummy")
    model = load_model(config, hf_config, CPU, torch.float32)
    layer = model.model.layers[0].mlp.down_proj
    assert layer.weight.dtype == FP8_DTYPE and layer.weight.float().abs().max().item() == 448.0
    from model_utils import PagedRun
    from asyncllm.models.registry import kv_cache_spec

    spec = kv_cache_spec(hf_config, 1)
    run = PagedRun(model, [[5, 6, 7, 8, 9]])
    run.new_kv_caches_for(spec, torch.float32)
    assert torch.isfinite(run.run([[5]])[0]).all()


# ------------------------------------------------------------------ refusals
def test_quantization_values() -> None:
    assert EngineConfig.create("m", quantization="fp8").quantization == "fp8"
    for method in ("awq", "gptq", "awq_marlin", "gptq_marlin", "compressed-tensors"):  # pre-quantized checkpoints
        assert EngineConfig.create("m", quantization=method).quantization == method  # (test_int4_checkpoint.py, ...)
    for method in ("bitsandbytes", "fp4", "FP8"):
        with pytest.raises(NotBuiltError, match=f"'{method}' weight quantization"):
            EngineConfig.create("m", quantization=method)
    with pytest.raises(ConfigError, match="None or one of 'fp8', ") as info:
        EngineConfig.create("m", quantization=8)
    assert not isinstance(info.value, NotBuiltError)
    documented = _field_docs()["quantization"]  # --help and docs/cli.md
    assert [m for m in QUANTIZATIONS if f"'{m}'" not in str(info.value) or m not in documented] == []


@pytest.mark.parametrize("section", [  # fp8: test_fp8_checkpoint.py, AWQ / GPTQ: test_int4_checkpoint.py,
    {"quant_method": "quark", "global_quant_config": {}},  # compressed-tensors: test_compressed_tensors*.py
    {"quant_method": "bitsandbytes", "load_in_4bit": True},
])
def test_a_pre_quantized_checkpoint_is_refused(tiny_llama: str, tmp_path, section: dict) -> None:
    path = tmp_path / "quantized"
    shutil.copytree(tiny_llama, path)
    config_json = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config_json, "quantization_config": section}))
    hf_config = load_hf_config(str(path))
    assert checkpoint_quantization(hf_config) == section["quant_method"]
    message = f"pre-quantized '{section['quant_method']}' checkpoint"
    for quantization in (None, "fp8"):  # the worker's loader refuses it, with or without quantization
        with pytest.raises(NotBuiltError, match=message):
            load_model(EngineConfig.create(str(path), quantization=quantization), hf_config, CPU, torch.float32)
    from asyncllm.engine.prepare import prepare

    with pytest.raises(NotBuiltError, match=message):  # and so does the host, before any process starts
        prepare(EngineConfig.create(str(path)))


def test_a_float_checkpoint_names_no_quantization(tiny_llama: str) -> None:
    assert checkpoint_quantization(load_hf_config(tiny_llama)) is None


_CT_SECTION = {"format": "float-quantized", "ignore": ["lm_head"], "config_groups": {"g": {
    "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True},
    "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}}}


@pytest.mark.parametrize("quant_method, extra, method, config", [
    ("AWQ", {"bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}, "awq", "Int4CheckpointConfig"),
    ("GPTQ", {"bits": 4, "group_size": 128, "desc_act": False}, "gptq", "Int4CheckpointConfig"),
    ("FP8", {"activation_scheme": "dynamic"}, "fp8", "Fp8CheckpointConfig"),
    ("compressed_tensors", _CT_SECTION, "compressed-tensors", "CompressedTensorsCheckpointConfig"),
])
def test_quant_method_is_read_as_vllm_reads_it(quant_method: str, extra: dict, method: str, config: str) -> None:
    """vLLM lower-cases ``quant_method`` and reads ``compressed_tensors`` as ``compressed-tensors``."""
    from types import SimpleNamespace

    from asyncllm.models.checkpoint import prequantized_config

    hf_config = SimpleNamespace(architectures=["LlamaForCausalLM"], model_type="llama",
                                quantization_config={"quant_method": quant_method, **extra})
    assert checkpoint_quantization(hf_config) == method
    assert type(prequantized_config(hf_config, "m", None)).__name__ == config


# ------------------------------------------------------------------ CUDA (skipped without a device)
def _has_scaled_mm() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.gpu
@pytest.mark.skipif(not _has_scaled_mm(), reason="needs a CUDA device of compute capability >= 8.9")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("bias", [False, True])
def test_scaled_mm_path_equals_the_fallback(dtype: torch.dtype, bias: bool) -> None:
    """torch._scaled_mm (fp8 x fp8, float32 accumulation, scales after) vs the dequantize fallback on the same
    fp8 tensors: the same function up to rounding; a shape _scaled_mm refuses (K=40) runs the fallback."""
    cuda = torch.device("cuda")
    gen = torch.Generator(device=cuda).manual_seed(0)
    for in_features, out_features, expect_scaled_mm in ((256, 384, True), (40, 64, False)):
        with torch.device(cuda):
            layer = RowParallelLinear(in_features, out_features, bias, TensorParallel(), dtype)
        with torch.no_grad():
            for param in layer.parameters():
                param.copy_(torch.randn(param.shape, device=cuda, generator=gen) * 0.05)
        method = quantize_fp8_linear(layer)
        assert method.scaled_mm is expect_scaled_mm
        for rows in (1, 7, 64):  # decode-sized and prefill-sized steps; rows need not divide by 16
            x = torch.randn(rows, in_features, device=cuda, generator=gen).to(dtype)
            got = layer(x)
            want = fp8_linear_fallback(x, layer.weight, layer.weight_scale, layer.bias, dtype)
            assert got.dtype == want.dtype == dtype and got.shape == (rows, out_features)
            tol = 1e-4 if dtype == torch.float32 else 2e-2  # a half type: the two round in different places
            torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * float(want.abs().max()))
    torch.cuda.synchronize()
