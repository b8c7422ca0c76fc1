"""Pre-quantized fp8 checkpoints (asyncllm/models/fp8_checkpoint.py): where each tensor's weight and scales land
(fused layers, both TP ranks, replicated KV heads), what is refused, and the loaded model against an
independent reference (tests/fp8_checkpoint_reference.py). The engine is in
tests/engine/test_fp8_checkpoint_engine.py, the kernels in tests/kernels/test_block_fp8_kernel.py."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest
import torch
from asyncllm.kernels import reference
from fp8_checkpoint_reference import Fp8Reference, quantize_blocks, write_fp8_checkpoint
from hf_reference import hf_logits
from model_utils import PagedRun, tiny_hf_config
from served_inputs import ServedInputs, snap_reference

from asyncllm.attention.selector import get_attention_backend
from asyncllm.config import EngineConfig
from asyncllm.errors import ConfigError, NotBuiltError
from asyncllm.models.checkpoint import Fp8CheckpointConfig, prequantized_fp8_config
from asyncllm.models.fp8_checkpoint import (
    DUMMY_INPUT_SCALE,
    Fp8BlockLinearMethod,
    finish_fp8_params,
    make_fp8_params,
    quantize_fp8_blocks,
)
from asyncllm.models.layers import TensorParallel
from asyncllm.models.llama import LlamaForCausalLM
from asyncllm.models.loader import load_hf_config, load_model
from asyncllm.models.quantization import MIN_SCALE, Fp8LinearMethod
from asyncllm.models.registry import kv_cache_spec

CPU = torch.device("cpu")
FP8 = torch.float8_e4m3fn
PROJECTIONS = {"q_proj": 1, "k_proj": 2, "v_proj": 3, "o_proj": 4, "gate_proj": 5, "up_proj": 6, "down_proj": 7}
"""Each projection's code: its scale of block (i, j) is ``100 * code + 10 * i + j``."""


def _section(**fields) -> SimpleNamespace:
    return SimpleNamespace(architectures=["LlamaForCausalLM"], quantization_config={"quant_method": "fp8", **fields})


def _model(tp: TensorParallel, **overrides) -> LlamaForCausalLM:
    """hidden 64, 4 heads of 16, 2 KV heads (unless overridden), intermediate 96."""
    return LlamaForCausalLM(tiny_hf_config("llama", **overrides), dtype=torch.float32, tp=tp,
                            attn_backend=get_attention_backend(None, CPU, torch.float32), max_position=128)


# ------------------------------------------------------------------ the config
def test_the_quantization_config_is_read() -> None:
    cfg = prequantized_fp8_config(_section(weight_block_size=[128, 128], modules_to_not_convert=["lm_head"],
                                           ignored_layers=["layers.3.mlp"]), "m", None)
    assert cfg == Fp8CheckpointConfig((128, 128), ("lm_head", "layers.3.mlp"))
    assert cfg.is_ignored("model.layers.3.mlp.down_proj") and not cfg.is_ignored("model.layers.2.mlp.down_proj")
    assert prequantized_fp8_config(_section(), "m", "fp8") == Fp8CheckpointConfig(None)
    assert prequantized_fp8_config(_section(activation_scheme="static"), "m", None) == Fp8CheckpointConfig(None, (), True)
    moe = SimpleNamespace(architectures=["Qwen3MoeForCausalLM"], quantization_config={  # per-tensor experts take them
        "quant_method": "fp8", "activation_scheme": "static"})
    assert prequantized_fp8_config(moe, "m", None) == Fp8CheckpointConfig(None, (), True)
    assert prequantized_fp8_config(SimpleNamespace(architectures=["LlamaForCausalLM"]), "m", "fp8") is None
    assert MIN_SCALE == reference.FP8_MIN_SCALE  # the online and the checkpoint paths share the floor


@pytest.mark.parametrize("hf_config, quantization, error, message", [
    (_section(weight_block_size=[128, 128], activation_scheme="static"), None, NotBuiltError,
     r"static fp8 activation scales .* over block-wise weights \(weight_block_size \[128, 128\]\)"),
    (_section(activation_scheme="per-token"), None, ConfigError, "activation_scheme is 'dynamic' or 'static', not "),
    (SimpleNamespace(architectures=["MiniCPM3ForCausalLM"], kv_lora_rank=256, quantization_config={
        "quant_method": "fp8", "activation_scheme": "static"}), None, NotBuiltError,
     "static fp8 activation scales .* on the latent attention of MiniCPM3ForCausalLM"),
    (_section(weight_block_size=[128]), None, ConfigError, "weight_block_size is two positive integers"),
    (_section(), "awq", ConfigError, "pre-quantized with 'fp8'"),
    (SimpleNamespace(architectures=["LlamaForCausalLM"], quantization_config={"quant_method": "gptq"}), "fp8",
     NotBuiltError, "pre-quantized 'gptq' checkpoint"),
    (SimpleNamespace(architectures=["GptOssForCausalLM"], quantization_config={
        "quant_method": "fp8", "weight_block_size": [128, 128]}), None, NotBuiltError, "fp8 experts of GptOss"),
    *[(SimpleNamespace(architectures=[arch], quantization_config={"quant_method": "fp8"}), None, NotBuiltError,
       f"fp8 experts of {arch}") for arch in ("DbrxForCausalLM", "GraniteMoeSharedForCausalLM")],  # stored fused
    (SimpleNamespace(architectures=["LlavaForConditionalGeneration"], quantization_config={"quant_method": "fp8"}),
     None, NotBuiltError, "fp8 LlavaForConditionalGeneration"),
])
def test_refused_configs(hf_config, quantization, error, message) -> None:
    with pytest.raises(error, match=message) as info:
        prequantized_fp8_config(hf_config, "m", quantization)
    assert error is NotBuiltError or not isinstance(info.value, NotBuiltError)


# ------------------------------------------------------------------ where the tensors land
def _checkpoint_layer(shapes: dict[str, tuple[int, int]], block: tuple[int, int]) -> dict[str, torch.Tensor]:
    """Layer 0's fp8 projections: row r of every weight has the bit pattern r + 1, scales coded (see PROJECTIONS)."""
    tensors = {}
    for part, (rows, cols) in shapes.items():
        module = "mlp" if part in ("gate_proj", "up_proj", "down_proj") else "self_attn"
        name = f"model.layers.0.{module}.{part}.weight"
        bits = torch.arange(1, rows + 1, dtype=torch.uint8)[:, None].expand(rows, cols).contiguous()
        tensors[name] = bits.view(FP8)
        i, j = torch.meshgrid(torch.arange(-(-rows // block[0])), torch.arange(-(-cols // block[1])), indexing="ij")
        tensors[name + "_scale_inv"] = (100 * PROJECTIONS[part] + 10 * i + j).float()
    return tensors


def _rows(t: torch.Tensor) -> list[int]:
    return t.view(torch.uint8)[:, 0].tolist()


@pytest.mark.parametrize("rank, kv_heads, kv_block", [(0, 2, 0), (1, 2, 1), (1, 1, 0)],
                         ids=["rank0", "rank1", "rank1-replicated-kv"])
def test_block_scales_and_weights_land_on_this_ranks_rows(rank: int, kv_heads: int, kv_block: int) -> None:
    """tp=2, 16x16 blocks: rank r holds q rows [32r, 32r+32) (scale rows 2r, 2r+1), one KV head (scale row
    ``kv_block``), gate and up rows [48r, 48r+48) (scale rows 3r..3r+2), and o/down's input columns
    [32r, +32) / [48r, +48) (scale columns 2r.. / 3r..)."""
    model = _model(TensorParallel(rank, 2), num_key_value_heads=kv_heads)
    cfg = Fp8CheckpointConfig((16, 16))
    assert make_fp8_params(model, cfg) == 8  # 4 projections x 2 layers
    shapes = {"q_proj": (64, 64), "k_proj": (16 * kv_heads, 64), "v_proj": (16 * kv_heads, 64), "o_proj": (64, 64),
              "gate_proj": (96, 64), "up_proj": (96, 64), "down_proj": (64, 96)}
    ckpt = _checkpoint_layer(shapes, (16, 16))
    assert model.load_weights(ckpt.items()) == set(ckpt)
    layer = model.model.layers[0]
    s = {part: ckpt[name + "_scale_inv"] for name in ckpt if not name.endswith("_inv")
         for part in [name.split(".")[-2]]}
    qkv, gate_up = layer.self_attn.qkv_proj, layer.mlp.gate_up_proj
    r, kv = rank, kv_block
    assert torch.equal(qkv.weight_scale_inv, torch.cat([s["q_proj"][2 * r:2 * r + 2], s["k_proj"][kv:kv + 1],
                                                        s["v_proj"][kv:kv + 1]]))
    assert torch.equal(gate_up.weight_scale_inv, torch.cat([s["gate_proj"][3 * r:3 * r + 3],
                                                            s["up_proj"][3 * r:3 * r + 3]]))
    assert torch.equal(layer.self_attn.o_proj.weight_scale_inv, s["o_proj"][:, 2 * r:2 * r + 2])
    assert torch.equal(layer.mlp.down_proj.weight_scale_inv, s["down_proj"][:, 3 * r:3 * r + 3])
    kv_rows = list(range(16 * kv + 1, 16 * kv + 17))
    assert _rows(qkv.weight) == list(range(32 * r + 1, 32 * r + 33)) + kv_rows + kv_rows
    assert _rows(gate_up.weight) == 2 * list(range(48 * r + 1, 48 * r + 49))
    assert layer.mlp.down_proj.weight.dtype == FP8 and layer.mlp.down_proj.weight.shape == (64, 48)


def test_per_tensor_scales_requantize_to_the_largest() -> None:
    """q, k, v scales 1, 2, 4: one scale 4 for the fused layer; the weight value 8 becomes 2 (q), 4 (k), 8 (v)."""
    model = _model(TensorParallel(0, 1))
    cfg = Fp8CheckpointConfig(None)
    make_fp8_params(model, cfg)
    attn = "model.layers.0.self_attn"
    ckpt = {}
    for part, scale, rows in (("q_proj", 1.0, 64), ("k_proj", 2.0, 32), ("v_proj", 4.0, 32)):
        ckpt[f"{attn}.{part}.weight"] = torch.full((rows, 64), 8.0).to(FP8)
        ckpt[f"{attn}.{part}.weight_scale"] = torch.tensor(scale)
    model.load_weights(ckpt.items())
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight_scale.tolist() == [1.0, 2.0, 4.0]
    for other in [m for m in model.modules() if hasattr(m, "weight_scale") and m is not qkv]:
        other.weight_scale.data.fill_(1.0)  # the rest of the model, never loaded here
    finish_fp8_params(model, cfg)
    assert float(qkv.weight_scale) == 4.0 and isinstance(qkv.quant_method, Fp8LinearMethod)
    assert qkv.weight.float()[:, 0].unique_consecutive().tolist() == [2.0, 4.0, 8.0]
    assert qkv.weight.float()[64:96].eq(4.0).all()


def test_static_input_scales_take_the_fused_shards_largest() -> None:
    """q, k, v input scales 0.5, 2, 1 and gate, up 3, 0.25: one static scale per layer, 2 and 3; o and down their
    own; the activations are quantized with it (no per-token scale)."""
    model = _model(TensorParallel(0, 1), num_hidden_layers=1)
    cfg = Fp8CheckpointConfig(None, (), True)
    make_fp8_params(model, cfg)
    scales = {"q_proj": 0.5, "k_proj": 2.0, "v_proj": 1.0, "o_proj": 0.125, "gate_proj": 3.0, "up_proj": 0.25,
              "down_proj": 4.0}
    ckpt = {}
    for name in model.checkpoint_weight_names():
        if name.endswith(".weight_scale"):
            ckpt[name] = torch.tensor(1.0)
        elif name.endswith(".input_scale"):
            ckpt[name] = torch.tensor([scales[name.split(".")[-2]]])  # AutoFP8's [1] and the 0-d scalars alike
    assert len([n for n in ckpt if n.endswith(".input_scale")]) == 7
    model.load_weights(ckpt.items())
    finish_fp8_params(model, cfg)
    layer = model.model.layers[0]
    got = [float(m.input_scale) for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                                          layer.mlp.down_proj)]
    assert got == [2.0, 0.125, 3.0, 4.0]
    assert layer.self_attn.qkv_proj.quant_method.static_input


# ------------------------------------------------------------------ refusals
@pytest.mark.parametrize("tp, block, layer, sizes", [
    (2, (32, 32), "model.layers.0.self_attn.qkv_proj", "[32, 16, 16] output rows"),  # a KV head is half a block
    (1, (64, 16), "model.layers.0.self_attn.qkv_proj", "[64, 32, 32] output rows"),  # k and v share a block
    (2, (16, 64), "model.layers.0.self_attn.o_proj", "[32] input features"),  # a rank's columns: half a block
])
def test_a_split_through_a_block_is_refused(tp: int, block: tuple[int, int], layer: str, sizes: str) -> None:
    model = _model(TensorParallel(0, tp))
    with pytest.raises(ConfigError, match="split on whole fp8 weight blocks") as info:
        make_fp8_params(model, Fp8CheckpointConfig(block))
    message = str(info.value)
    assert layer in message and sizes in message and str(list(block)) in message, message
    assert info.value.field == "tensor_parallel_size" and not isinstance(info.value, NotBuiltError)


def test_a_fused_layer_ignored_in_part_is_refused() -> None:
    with pytest.raises(ConfigError, match="ignores all the projections fused in model.layers.1.self_attn.qkv_proj"):
        make_fp8_params(_model(TensorParallel(0, 1)), Fp8CheckpointConfig((16, 16), ("layers.1.self_attn.k_proj",)))


def test_an_fp8_config_over_float_weights_misses_its_scales(tiny_llama: str, tmp_path) -> None:
    path = tmp_path / "mislabelled"
    shutil.copytree(tiny_llama, path)
    config = json.loads((path / "config.json").read_text())
    section = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32]}
    (path / "config.json").write_text(json.dumps({**config, "quantization_config": section}))
    with pytest.raises(ConfigError, match="missing: .*weight_scale_inv"):
        load_model(EngineConfig.create(str(path)), load_hf_config(str(path)), CPU, torch.float32)


def test_a_static_scheme_without_an_input_scale_is_refused(tiny_llama: str, tmp_path) -> None:
    from safetensors.torch import save_file

    path = tmp_path / "fp8"
    tensors = write_fp8_checkpoint(tiny_llama, path, None, input_scales=STATIC_INPUT_SCALES)
    del tensors["model.layers.1.self_attn.k_proj.input_scale"]
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=r"missing: model\.layers\.1\.self_attn\.k_proj\.input_scale$"):
        load_model(EngineConfig.create(str(path)), load_hf_config(str(path)), CPU, torch.float32)


# ------------------------------------------------------------------ the loaded model
def _logits(path: str, sequences: list[list[int]], monkeypatch=None,
            **config) -> tuple[list[torch.Tensor], torch.nn.Module]:
    """The served logits and model; with ``monkeypatch``, ``model.served``: its quantized products' inputs, for
    `snap_reference` (tests/served_inputs.py)."""
    hf_config = load_hf_config(path)
    model = load_model(EngineConfig.create(path, **config), hf_config, CPU, torch.float32)
    spec = kv_cache_spec(hf_config, 1)
    run = PagedRun(model, sequences)
    run.new_kv_caches_for(spec, torch.float32)
    if monkeypatch is not None:
        model.served = ServedInputs(model, monkeypatch)
    return run.run([[6, 3], [5, 0]]), model


SEQUENCES = [[5, 60, 7, 300, 9, 10, 41, 12, 200, 14, 15], [40, 41, 42]]
# |logits - reference|: measured up to 4e-6 (float32 sums in another order); the same model unquantized is ~1 away
VS_REFERENCE = 1e-4
STATIC_INPUT_SCALES = {"q_proj": 2 / 448, "k_proj": 4 / 448, "v_proj": 3 / 448, "o_proj": 4 / 448,
                       "gate_proj": 3 / 448, "up_proj": 5 / 448, "down_proj": 24 / 448}
"""The tiny Llama's projection inputs reach 3.2 to 4.9 (31 for layer 0's down_proj, which saturates): q's scale alone
would saturate q/k/v's inputs past 2, gate's gate/up's past 3."""


@pytest.mark.parametrize("block, ignored, quantization, input_scales", [
    ((32, 48), ("layers.1.mlp",), None, None),  # K = 64 and 128: a partial last group; layer 1's MLP stays float32
    (None, (), "fp8", None),  # per tensor, with quantization="fp8" asked explicitly
    (None, ("layers.1.mlp",), None, STATIC_INPUT_SCALES),  # per tensor, static activation scales (AutoFP8's)
], ids=["block-32x48-ignored", "per-tensor", "per-tensor-static"])
def test_the_loaded_model_equals_the_reference(tiny_llama: str, tmp_path, block, ignored, quantization,
                                               input_scales, monkeypatch) -> None:
    path = tmp_path / "fp8"
    tensors = write_fp8_checkpoint(tiny_llama, path, block, ignored, input_scales=input_scales)
    got, model = _logits(str(path), SEQUENCES, monkeypatch, quantization=quantization)
    ref = Fp8Reference(tiny_llama, tensors, block)
    snap_reference(ref.model, model.served)
    for seq, logits in zip(SEQUENCES, got):
        assert float((logits - ref.logits(seq)).abs().max()) < VS_REFERENCE
        assert float((logits - hf_logits(tiny_llama, seq)).abs().max()) > 0.1  # it does compute in fp8
    method = Fp8BlockLinearMethod if block else Fp8LinearMethod
    layers = model.model.layers
    assert isinstance(layers[1].self_attn.qkv_proj.quant_method, method) and layers[0].mlp.down_proj.weight.dtype == FP8
    assert getattr(layers[1].self_attn.qkv_proj.quant_method, "static_input", False) is (input_scales is not None)
    if ignored:
        assert layers[1].mlp.down_proj.quant_method is None and layers[1].mlp.down_proj.weight.dtype == torch.float32


def test_dummy_weights_take_the_checkpoints_format(tiny_llama: str, tmp_path) -> None:
    w = torch.randn(40, 70, generator=torch.Generator().manual_seed(0)) * 3
    q, scale = quantize_fp8_blocks(w, (16, 32))  # the library's, against the test helper's loops
    ref_q, ref_scale = quantize_blocks(w, (16, 32))
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(scale, ref_scale)
    path = tmp_path / "fp8"
    write_fp8_checkpoint(tiny_llama, path, (32, 32))
    got, model = _logits(str(path), SEQUENCES, load_format="dummy")
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == FP8 and qkv.weight_scale_inv.shape == (4, 2)
    assert all(torch.isfinite(logits).all() for logits in got)
    write_fp8_checkpoint(tiny_llama, tmp_path / "static", None, input_scales=STATIC_INPUT_SCALES)
    got, model = _logits(str(tmp_path / "static"), SEQUENCES, load_format="dummy")
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.quant_method.static_input and float(qkv.input_scale) == DUMMY_INPUT_SCALE
    assert all(torch.isfinite(logits).all() for logits in got)


@pytest.mark.parametrize("ignored", [(), ("linear_attn",)], ids=["all", "linear-attention-float"])
def test_a_qwen3_5_checkpoint_equals_the_reference(tmp_path, ignored, monkeypatch) -> None:
    """Qwen3.5's hybrid: the gated attention's and the MLPs' projections in block fp8, and the Gated DeltaNet's
    (``in_proj_qkv`` / ``z`` / ``a`` / ``b``, ``out_proj``) too or left float (the community checkpoints' choice)."""
    from asyncllm.tiny import tiny_checkpoint

    src, path = tiny_checkpoint("qwen3_5"), tmp_path / "fp8"
    tensors = write_fp8_checkpoint(src, path, (16, 16), ("lm_head", *ignored))
    got, model = _logits(str(path), SEQUENCES, monkeypatch)
    ref = Fp8Reference(src, tensors, (16, 16))
    snap_reference(ref.model, model.served)
    for seq, logits in zip(SEQUENCES, got):
        assert float((logits - ref.logits(seq)).abs().max()) < VS_REFERENCE
    linear_dtype = torch.float32 if ignored else FP8
    layers = model.model.layers
    assert layers[0].linear_attn.in_proj_qkv.weight.dtype == layers[0].linear_attn.out_proj.weight.dtype == linear_dtype
    assert layers[0].mlp.down_proj.weight.dtype == layers[1].self_attn.o_proj.weight.dtype == FP8


def test_a_gemma4_checkpoint_equals_the_reference(tmp_path, monkeypatch) -> None:
    """Gemma 4 (the tiny E2B-style decoder): the sliding and global layers' projections in block fp8 (the global
    layers' k projection loaded as their values' too), the KV-sharing layers' q and o, the MLPs; the per-layer-input
    matrices float."""
    from asyncllm.tiny import tiny_checkpoint

    src, path = tiny_checkpoint("gemma4"), tmp_path / "fp8"
    tensors = write_fp8_checkpoint(src, path, (16, 16), ("lm_head",))
    got, model = _logits(str(path), SEQUENCES, monkeypatch)
    ref = Fp8Reference(src, tensors, (16, 16))
    snap_reference(ref.model, model.served)
    for seq, logits in zip(SEQUENCES, got):
        assert float((logits - ref.logits(seq)).abs().max()) < VS_REFERENCE
        assert float((logits - hf_logits(src, seq)).abs().max()) > 0.05  # it does compute in fp8
    layers = model.model.layers
    assert layers[1].self_attn.qkv_proj.weight.dtype == layers[3].self_attn.q_proj.weight.dtype == FP8
    assert layers[0].per_layer_input_gate.weight.dtype == torch.float32


@pytest.mark.parametrize("arch, tp_block", [("qwen3_moe", (16, 16)), ("qwen3_moe", (32, 16)),
                                            ("qwen3_5_moe", (8, 16)), ("minimax_m2", (16, 16)),
                                            ("glm4_moe", (8, 16)), ("dots1", (8, 16)), ("deepseek_v2", (8, 16)),
                                            ("deepseek_v3", (8, 8)), ("qwen3_next", (8, 16))])
def test_a_moe_checkpoint_with_block_fp8_experts_equals_the_reference(tmp_path, arch, tp_block, monkeypatch) -> None:
    """Block-fp8 mixtures of experts (Qwen3-MoE, Qwen3.5-MoE, MiniMax-M2, GLM-4.5, dots.llm1, DeepSeek-V2 / V3 with
    their latent attention's projections, Qwen3-Next with its fused in_proj_qkvz cut by block rows and in_proj_ba
    left float): every expert's gate, up and down in block fp8 with its scales (the router left float), stacked per
    layer; the experts' products on per-token-group fp8 inputs."""
    from asyncllm.tiny import tiny_checkpoint

    src, path = tiny_checkpoint(arch), tmp_path / "fp8"
    tensors = write_fp8_checkpoint(src, path, tp_block, ("lm_head", "shared_expert_gate", "in_proj_ba"))
    got, model = _logits(str(path), SEQUENCES, monkeypatch)
    ref = Fp8Reference(src, tensors, tp_block)
    snap_reference(ref.model, model.served)
    bound = 2 * VS_REFERENCE if arch == "deepseek_v2" else VS_REFERENCE  # measured 1.1e-4: its 192-wide heads' sums
    for seq, logits in zip(SEQUENCES, got):
        assert float((logits - ref.logits(seq)).abs().max()) < bound
        assert float((logits - hf_logits(src, seq)).abs().max()) > 0.05  # it does compute in fp8
    experts = next(layer.mlp.experts for layer in model.model.layers if hasattr(layer.mlp, "experts"))
    assert experts.w13_weight.dtype == FP8 and experts.fp8_block == tp_block
    num_experts, rows, hidden = experts.w13_weight.shape
    assert experts.w13_weight_scale_inv.shape == (num_experts, rows // tp_block[0], hidden // tp_block[1])


def test_dummy_weights_give_block_fp8_experts(tmp_path) -> None:
    from asyncllm.tiny import tiny_checkpoint

    path = tmp_path / "fp8"
    write_fp8_checkpoint(tiny_checkpoint("qwen3_moe"), path, (16, 16), ("lm_head",))
    got, model = _logits(str(path), SEQUENCES, load_format="dummy")
    experts = model.model.layers[0].mlp.experts
    assert experts.w2_weight.dtype == FP8 and experts.w2_weight_scale_inv.shape == (8, 4, 2)
    assert all(torch.isfinite(logits).all() for logits in got)


def test_qwen3_next_with_an_fp8_in_proj_ba_is_refused(tmp_path) -> None:
    from asyncllm.tiny import tiny_checkpoint

    write_fp8_checkpoint(tiny_checkpoint("qwen3_next"), tmp_path / "fp8", (8, 16), ("lm_head", "shared_expert_gate"))
    with pytest.raises(NotBuiltError, match="in_proj_ba in fp8"):
        _logits(str(tmp_path / "fp8"), SEQUENCES)
