"""Pre-quantized compressed-tensors checkpoints (asyncllm/models/compressed_tensors.py), written by the
compressed-tensors library (tests/compressed_tensors_reference.py): the loaded weights against the library's own
decompression, on one rank and both of tensor_parallel_size=2, on the CPU path and in the GPU's packed layout; the
loaded model's logits against transformers' model of the checkpoint, and each W8A8 / FP8_BLOCK layer's output
against compressed-tensors' forward of its module; the fp8 product with per-row weight scales and static input
scales; LoRA adapters over fp8-block and int8 layers. What is refused at load is in
tests/unit/test_compressed_tensors_refusals.py, other families' checkpoints (experts, Gemma 4, Qwen3.5) in
tests/unit/test_compressed_tensors_models.py, the config in tests/unit/test_compressed_tensors_config.py, the
int8 product in tests/unit/test_int8.py, the engine in tests/engine/test_compressed_tensors_engine.py."""

from __future__ import annotations

import pytest
import torch
from compressed_tensors_reference import (
    FP8_BLOCK,
    FP8_DYNAMIC,
    FP8_STATIC,
    INT8_STATIC,
    INT8_W8A8,
    MIXED,
    CtReference,
    int_weights,
    write_ct_checkpoint,
)
from hf_reference import hf_logits
from model_utils import PagedRun

from asyncllm.attention.selector import get_attention_backend
from asyncllm.config import EngineConfig
from asyncllm.kernels import reference
from asyncllm.models.checkpoint import prequantized_config
from asyncllm.models.compressed_tensors import (
    finish_compressed_tensors_params,
    make_compressed_tensors_params,
)
from asyncllm.models.fp8_checkpoint import Fp8BlockLinearMethod
from asyncllm.models.int4_checkpoint import Int4LinearMethod
from asyncllm.models.int8 import Int8LinearMethod
from asyncllm.models.layers import TensorParallel
from asyncllm.models.linear import RowParallelLinear
from asyncllm.models.llama import LlamaForCausalLM
from asyncllm.models.loader import load_hf_config, load_model
from asyncllm.models.quantization import Fp8LinearMethod, attach_fp8_weight, fp8_to_float, quantize_fp8
from asyncllm.models.registry import kv_cache_spec

CPU = torch.device("cpu")
FP8 = torch.float8_e4m3fn
LAYER_1_MLP = "re:.*layers\\.1\\.mlp\\."
CASES = {  # config groups, ignore
    "fp8-dynamic": ({"group_0": FP8_DYNAMIC}, ("lm_head", LAYER_1_MLP)),
    "fp8-static": ({"group_0": FP8_STATIC}, ("lm_head",)),
    "w4a16-g32": ({"group_0": int_weights(4, 32)}, ("lm_head", LAYER_1_MLP)),
    "w4a16-asym-g16": ({"group_0": int_weights(4, 16, symmetric=False)}, ("lm_head",)),
    "w8a16-channel": ({"group_0": int_weights(8, None)}, ("lm_head",)),
    "fp8-block": ({"group_0": FP8_BLOCK}, ("lm_head", LAYER_1_MLP)),  # 16x16 blocks, groups of 16
    "w8a8-int8": ({"group_0": INT8_W8A8}, ("lm_head",)),
    "w8a8-static": ({"group_0": INT8_STATIC}, ("lm_head",)),  # per-tensor weights and inputs
    "mixed": (MIXED, ("lm_head",)),  # layer 0: fp8 and int4; layer 1: int8 and fp8-block
}
_written: dict[str, tuple[str, CtReference]] = {}


@pytest.fixture(scope="module")
def checkpoint(tiny_llama: str, tmp_path_factory):
    """case -> (path, transformers' model of it), each written once."""
    def get(case: str) -> tuple[str, CtReference]:
        if case not in _written:
            groups, ignore = CASES[case]
            path = write_ct_checkpoint(tiny_llama, tmp_path_factory.mktemp("ct") / case, groups, ignore)
            weight_only = all(group.get("input_activations") is None for group in groups.values())
            _written[case] = (str(path), CtReference(path, dequantize=weight_only))
        return _written[case]
    return get


# ------------------------------------------------------------------ the fp8 product
def test_per_row_weight_scales_and_static_input_scales() -> None:
    """The dequantize fallback with a weight scale per output row and a static input scale: the hand computation;
    inputs past ``448 * input_scale`` saturate."""
    gen = torch.Generator().manual_seed(0)
    layer = RowParallelLinear(32, 16, False, TensorParallel(), torch.float32)
    w_scale = torch.rand(16, 1, generator=gen) * 0.01 + 1e-3
    w_q = quantize_fp8(torch.randn(16, 32, generator=gen) * 0.5, w_scale)
    method = attach_fp8_weight(layer, w_q, w_scale, torch.tensor(0.01))
    assert (method.per_channel, method.static_input) == (True, True) and isinstance(method, Fp8LinearMethod)
    x = torch.randn(5, 32, generator=gen)
    x[0, 0] = 100.0  # past 448 * 0.01
    x_dq = (x / 0.01).clamp(-448, 448).to(FP8).float() * 0.01
    assert x_dq[0, 0] == 4.48
    assert torch.equal(layer(x), x_dq @ (w_q.float() * w_scale).t())
    dynamic = RowParallelLinear(32, 16, False, TensorParallel(), torch.float32)
    attach_fp8_weight(dynamic, w_q, w_scale)  # per token: row 0's scale is its own largest value
    x_scale = x.abs().amax(1, keepdim=True) / 448
    assert torch.equal(dynamic(x), ((x / x_scale).to(FP8).float() * x_scale) @ (w_q.float() * w_scale).t())


# ------------------------------------------------------------------ the loaded weights
def _load_ranks(path: str, tp: int, keep_packed: bool = False, changes: dict | None = None) -> list[LlamaForCausalLM]:
    """Every rank's model of the checkpoint at ``path`` (``changes``: tensors replaced; loading needs no process
    group)."""
    from safetensors.torch import load_file

    tensors = {**load_file(f"{path}/model.safetensors"), **(changes or {})}
    hf_config = load_hf_config(path)
    cfg = prequantized_config(hf_config, path, None)
    models = []
    for rank in range(tp):
        model = LlamaForCausalLM(hf_config, dtype=torch.float32, tp=TensorParallel(rank, tp),
                                 attn_backend=get_attention_backend(None, CPU, torch.float32), max_position=128)
        make_compressed_tensors_params(model, cfg)
        assert model.load_weights(tensors.items()) == set(tensors)
        finish_compressed_tensors_params(model, cfg, use_triton=False, keep_packed=keep_packed)
        models.append(model)
    return models


FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj"),
         "o_proj": ("o_proj",), "down_proj": ("down_proj",)}


def _expected(ref: CtReference, layer: int, name: str, rank: int, tp: int) -> torch.Tensor:
    """compressed-tensors' decompressed ``[out, in]`` weight of the fused layer ``name``, rank ``rank``'s part."""
    module = "self_attn" if name in ("qkv_proj", "o_proj") else "mlp"
    parts = [ref.weight(f"model.layers.{layer}.{module}.{part}") for part in FUSED[name]]
    if name in ("o_proj", "down_proj"):
        return parts[0].chunk(tp, dim=1)[rank]
    return torch.cat([part.chunk(tp)[rank] for part in parts])


def _layers(model: LlamaForCausalLM, layer: int) -> dict[str, torch.nn.Module]:
    block = model.model.layers[layer]
    return {"qkv_proj": block.self_attn.qkv_proj, "o_proj": block.self_attn.o_proj,
            "gate_up_proj": block.mlp.gate_up_proj, "down_proj": block.mlp.down_proj}


def _served_weight(layer: torch.nn.Module) -> torch.Tensor:
    if isinstance(layer.quant_method, Fp8LinearMethod):
        return fp8_to_float(layer.weight) * layer.weight_scale  # one scale per row
    if isinstance(layer.quant_method, Fp8BlockLinearMethod):
        return reference.dequantize_fp8_blocks(layer.weight, layer.weight_scale_inv, layer.quant_method.block)
    if isinstance(layer.quant_method, Int8LinearMethod):
        return layer.weight.float() * layer.weight_scale  # one scale per row
    if isinstance(layer.quant_method, Int4LinearMethod):
        return reference.dequantize_int_weight(layer.qweight, layer.scales, layer.zeros, layer.g_idx,
                                               layer.quant_method.bits, layer.quant_method.group_size).t()
    return layer.weight


@pytest.mark.parametrize("case", list(CASES))
def test_loaded_weights_equal_compressed_tensors_own(checkpoint, case: str) -> None:
    """Bit for bit, every projection of layer 0, on one rank and on both of tp=2 (rank r: rows [r*n/2, (r+1)*n/2)
    of each fused shard and their scales, zero points and block rows; input columns [r*k/2, (r+1)*k/2) of o_proj and
    down_proj and their groups or block columns), integer weights dequantized at load (the CPU path) and kept packed
    (the GPU's layout)."""
    path, ref = checkpoint(case)
    for tp, keep_packed in ((1, False), (2, False), (1, True)):
        for rank, model in enumerate(_load_ranks(path, tp, keep_packed)):
            for name, layer in _layers(model, 0).items():
                rows, cols = layer.weight.shape if hasattr(layer, "weight") else (0, 0)
                if isinstance(layer.quant_method, (Fp8LinearMethod, Int8LinearMethod)):
                    dtype = FP8 if isinstance(layer.quant_method, Fp8LinearMethod) else torch.int8
                    assert layer.weight.dtype == dtype and layer.weight_scale.shape == (rows, 1)
                elif isinstance(layer.quant_method, Fp8BlockLinearMethod):
                    assert layer.weight.dtype == FP8 and layer.weight_scale_inv.shape == (rows // 16, cols // 16)
                elif keep_packed:
                    assert isinstance(layer.quant_method, Int4LinearMethod) and layer.g_idx is None
                else:
                    assert layer.quant_method is None and not hasattr(layer, "weight_packed")
                assert torch.equal(_served_weight(layer), _expected(ref, 0, name, rank, tp)), (case, tp, rank, name)


def test_static_input_scales_take_the_fused_shards_largest(checkpoint) -> None:
    """vLLM's rule. Calibrated on their shared input, q, k and v (gate and up) have the same scale; here k's is
    doubled and up's halved."""
    path, ref = checkpoint("fp8-static")
    attn, mlp = "model.layers.1.self_attn", "model.layers.1.mlp"
    k_scale, up_scale = ref.model.get_submodule(f"{attn}.k_proj").input_scale, \
        ref.model.get_submodule(f"{mlp}.up_proj").input_scale
    changes = {f"{attn}.k_proj.input_scale": k_scale * 2, f"{mlp}.up_proj.input_scale": up_scale / 2}
    (model,) = _load_ranks(path, 1, changes=changes)
    layers = _layers(model, 1)
    assert float(layers["qkv_proj"].input_scale) == float(k_scale * 2)
    assert float(layers["gate_up_proj"].input_scale) == float(up_scale)  # gate's, equal to up's before halving
    for layer in layers.values():
        assert layer.quant_method.static_input and layer.input_scale.dim() == 0


# ------------------------------------------------------------------ the loaded model
SEQUENCES = [[5, 60, 7, 300, 9, 10, 41, 12, 200, 14, 15], [40, 41, 42]]
VS_REFERENCE = 1e-4
"""|logits - transformers' model of the checkpoint|: float32 sums in another order (measured up to 5e-6): the weights
are the same bits and the fp8 and int8 activations are quantized by the same arithmetic (per token, per token and
group, or static)."""
VS_REFERENCE_INT8 = 0.1
"""The same with int8 activations per token: a float32 difference upstream (4e-6) can flip one activation's int8
rounding (a step of max|x_row| / 127.5, far coarser than a float32 ulp), which moved the last position's logits of the
first sequence by 0.041 (w8a8-int8: one flip in layer 0's down_proj; a flip reaches the later positions through
attention, so no mean is bounded); elsewhere 3e-6. A scale of max|x_row| / 127 (vLLM's) moves them by 0.35, ties
rounded up by 0.25. `test_each_layer_computes_compressed_tensors_function`, with no such flips, holds every layer to
float32 rounding."""
DYNAMIC_INT8 = ("w8a8-int8", "mixed")
DOWN_PROJ_DTYPE = {"mixed": FP8, "w8a8-int8": torch.int8, "w8a8-static": torch.int8}  # the others': FP8 if fp8


@pytest.mark.parametrize("case", list(CASES))
def test_the_loaded_model_equals_the_reference(checkpoint, tiny_llama: str, case: str) -> None:
    path, ref = checkpoint(case)
    hf_config = load_hf_config(path)
    model = load_model(EngineConfig.create(path, quantization="compressed-tensors"), hf_config, CPU, torch.float32)
    spec = kv_cache_spec(hf_config, 1)
    run = PagedRun(model, SEQUENCES)
    run.new_kv_caches_for(spec, torch.float32)
    bound = VS_REFERENCE_INT8 if case in DYNAMIC_INT8 else VS_REFERENCE
    for seq, logits in zip(SEQUENCES, run.run([[6, 3], [5, 0]])):
        assert float((logits - ref.logits(seq)).abs().max()) < bound
        assert float((logits - hf_logits(tiny_llama, seq)).abs().max()) > 0.1  # it does serve the quantized weights
    down = model.model.layers[1].mlp.down_proj
    if LAYER_1_MLP in CASES[case][1]:  # ignored: loaded as the float weight
        assert down.quant_method is None and torch.equal(down.weight, ref.weight("model.layers.1.mlp.down_proj"))
    else:
        assert torch.equal(_served_weight(down), ref.weight("model.layers.1.mlp.down_proj"))
        assert down.weight.dtype == DOWN_PROJ_DTYPE.get(case, FP8 if case.startswith("fp8") else torch.float32)


LAYER_MODULES = {"qkv_proj": "self_attn", "o_proj": "self_attn", "gate_up_proj": "mlp", "down_proj": "mlp"}
VS_MODULE = 1e-5
"""|a layer's output - compressed-tensors' forward of its modules on the same input| over the output's largest
magnitude: the same quantized input and weights, float32 sums of one fused product against separate ones (measured:
equal, bit for bit)."""


@pytest.mark.parametrize("case", ["fp8-block", "w8a8-int8", "w8a8-static"])
def test_each_layer_computes_compressed_tensors_function(checkpoint, case: str) -> None:
    """Every quantized projection of layer 0 on the same random input (7 tokens; a token of zeros; a token past the
    static input range) as compressed-tensors' own forward of its checkpoint modules (the reference's modules: the
    input fake-quantized per token, per token and group, or with input_scale; the decompressed weight)."""
    path, ref = checkpoint(case)
    (model,) = _load_ranks(path, 1)
    gen = torch.Generator().manual_seed(5)
    for name, layer in _layers(model, 0).items():
        x = torch.randn(7, layer.weight.shape[1], generator=gen)
        x[1] = 0.0
        x[2, 3] = 1e3
        modules = [ref.model.get_submodule(f"model.layers.0.{LAYER_MODULES[name]}.{part}") for part in FUSED[name]]
        with torch.no_grad():
            want = torch.cat([module(x[None])[0] for module in modules], dim=-1)
            got = layer(x)
        assert type(layer.quant_method) is (Fp8BlockLinearMethod if case == "fp8-block" else Int8LinearMethod)
        assert float((got - want).abs().max()) <= VS_MODULE * float(want.abs().max()), (case, name)
        assert torch.equal(got[1], torch.zeros_like(got[1]))


def test_lora_adapters_add_to_int8_and_fp8_block_layers(checkpoint) -> None:
    """As over online fp8 (tests/unit/test_quantization.py): the adapter's product, from the unquantized input in the
    model dtype, adds to the quantized layer's output (the mixed checkpoint's layer 1: int8 gate_up_proj, fp8-block
    o_proj), for the tokens whose mask selects the adapter's slot."""
    from asyncllm.models.lora import LoRAContext, attach_lora_layers

    path, _ = checkpoint("mixed")
    (model,) = _load_ranks(path, 1)
    context = LoRAContext()
    loras = attach_lora_layers(model, num_slots=2, max_rank=4, context=context)
    gen = torch.Generator().manual_seed(4)
    for name, part, method in (("mlp.gate_up_proj", 1, Int8LinearMethod), ("self_attn.o_proj", None,
                                                                          Fp8BlockLinearMethod)):
        layer = model.get_submodule(f"model.layers.1.{name}")
        lora = loras[f"model.layers.1.{name}"]
        assert isinstance(layer.quant_method, method) and lora.a.dtype == lora.b.dtype == torch.float32
        out_features, in_features = layer.weight.shape
        rows = out_features // 2 if part == 1 else out_features  # gate_up_proj's up half
        lora_a, lora_b = torch.randn(4, in_features, generator=gen), torch.randn(rows, 4, generator=gen)
        lora.set(1, part, lora_a, lora_b, scaling=0.5)
        x = torch.randn(3, in_features, generator=gen)
        context.mask = None
        base = layer(x)
        context.mask = torch.tensor([[0.0, 1.0], [0.0, 0.0], [0.0, 1.0]])
        delta = torch.zeros(3, out_features)
        delta[:, out_features - rows:] = 0.5 * (x @ lora_a.T @ lora_b.T) * context.mask[:, 1:]
        torch.testing.assert_close(layer(x), base + delta, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", ["fp8-static", "w4a16-asym-g16", "fp8-block", "w8a8-static"])
def test_dummy_weights_take_the_checkpoints_schemes(checkpoint, case: str) -> None:
    path, _ = checkpoint(case)
    hf_config = load_hf_config(path)
    model = load_model(EngineConfig.create(path, load_format="dummy"), hf_config, CPU, torch.float32)
    spec = kv_cache_spec(hf_config, 1)
    run = PagedRun(model, SEQUENCES)
    run.new_kv_caches_for(spec, torch.float32)
    assert all(torch.isfinite(logits).all() for logits in run.run([[6, 3], [5, 0]]))
    qkv = model.model.layers[0].self_attn.qkv_proj
    if case == "fp8-static":
        assert qkv.weight.dtype == FP8 and qkv.quant_method.static_input and qkv.quant_method.per_channel
    elif case == "fp8-block":
        assert qkv.weight.dtype == FP8 and qkv.weight_scale_inv.shape == (128 // 16, 64 // 16)
        assert isinstance(qkv.quant_method, Fp8BlockLinearMethod) and qkv.quant_method.block == (16, 16)
    elif case == "w8a8-static":
        assert qkv.weight.dtype == torch.int8 and qkv.weight_scale.shape == (128, 1) and qkv.input_scale == 1 / 16
        assert isinstance(qkv.quant_method, Int8LinearMethod) and qkv.quant_method.static_input
    else:  # the CPU path: dequantized at load
        assert qkv.quant_method is None and qkv.weight.dtype == torch.float32 and not hasattr(qkv, "weight_packed")


# ------------------------------------------------------------------ CUDA (skipped without a device)
@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)),
                    reason="needs a CUDA device with fp8 (compute capability >= 8.9)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("static_input", [False, True])
@pytest.mark.parametrize("per_row", [True, False], ids=["row-weights", "tensor-weights"])
def test_scaled_mm_with_per_row_scales_equals_the_fallback(dtype: torch.dtype, static_input: bool,
                                                           per_row: bool) -> None:
    """torch._scaled_mm (row-wise scales in bfloat16; a float32 product scaled after otherwise) with one weight scale
    per output row (or one for the tensor: fp8 checkpoints' AutoFP8 static scheme), per-token or static input
    scales, against the dequantize fallback on the same fp8 tensors."""
    from asyncllm.models.quantization import fp8_linear_fallback

    cuda = torch.device("cuda")
    gen = torch.Generator(device=cuda).manual_seed(0)
    with torch.device(cuda):
        layer = RowParallelLinear(256, 384, True, TensorParallel(), dtype)
        layer.bias.data.copy_(torch.randn(384, generator=gen) * 0.05)
        w_scale = torch.rand(384, 1, generator=gen) * 1e-3 + 1e-4
        w_scale = w_scale if per_row else w_scale.max()
        w_q = quantize_fp8(torch.randn(384, 256, generator=gen) * 0.05, w_scale)
        input_scale = torch.tensor(0.02) if static_input else None
    method = attach_fp8_weight(layer, w_q, w_scale, input_scale)
    assert method.scaled_mm and method.per_channel is per_row and method.rowwise is (dtype == torch.bfloat16)
    for rows in (1, 7, 64):
        x = torch.randn(rows, 256, device=cuda, generator=gen).to(dtype)
        got = layer(x)
        want = fp8_linear_fallback(x, layer.weight, layer.weight_scale, layer.bias, dtype, input_scale)
        tol = 1e-4 if dtype == torch.float32 else 2e-2  # a half type: the two round in different places
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * float(want.abs().max()))
    torch.cuda.synchronize()
