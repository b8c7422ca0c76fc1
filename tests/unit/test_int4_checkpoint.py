"""Pre-quantized AWQ / GPTQ checkpoints (asyncllm/models/int4_checkpoint.py): the config and what is refused, the
loaded weights against the test's own dequantization (tests/int4_reference.py, written from the formats), both
tensor-parallel ranks' slices, and the loaded model's logits against transformers holding the dequantized weights.
The engine is in tests/engine/test_int4_checkpoint_engine.py, the kernel in tests/kernels/test_w4a16_kernel.py."""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import pytest
import torch
from int4_reference import Int4Reference, act_order_g_idx, quantize_gptq, write_int4_checkpoint
from model_utils import PagedRun, tiny_hf_config

from asyncllm.attention.selector import get_attention_backend
from asyncllm.config import EngineConfig
from asyncllm.errors import ConfigError, NotBuiltError
from asyncllm.kernels import reference
from asyncllm.models.checkpoint import prequantized_config
from asyncllm.models.int4_checkpoint import Int4LinearMethod, finish_int4_params, make_int4_params
from asyncllm.models.int4_config import Int4CheckpointConfig
from asyncllm.models.layers import TensorParallel
from asyncllm.models.llama import LlamaForCausalLM
from asyncllm.models.loader import load_hf_config, load_model
from asyncllm.models.registry import kv_cache_spec

CPU = torch.device("cpu")
LLAMA = ["LlamaForCausalLM"]


def _hf(section: dict, arch: list[str] = LLAMA) -> SimpleNamespace:
    return SimpleNamespace(architectures=arch, quantization_config=section)


AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True, "sym": True}


# ------------------------------------------------------------------ the config
def test_the_quantization_config_is_read() -> None:
    assert prequantized_config(_hf({**AWQ, "modules_to_not_convert": ["visual"]}), "m", "awq_marlin") == \
        Int4CheckpointConfig("awq", 4, 128, ignored_layers=("visual",))
    assert prequantized_config(_hf({"quant_method": "awq", "w_bit": 4, "q_group_size": 64, "version": "GEMM"}),
                               "m", None) == Int4CheckpointConfig("awq", 4, 64)
    assert prequantized_config(_hf(GPTQ), "m", "gptq") == Int4CheckpointConfig("gptq", 4, 128, True, 1)
    assert prequantized_config(_hf({**GPTQ, "bits": 8, "group_size": -1, "desc_act": False,
                                    "checkpoint_format": "gptq_v2"}), "m", "gptq_marlin") == \
        Int4CheckpointConfig("gptq", 8, -1, False, 0)


@pytest.mark.parametrize("hf_config, quantization, error, message", [
    (_hf({**AWQ, "version": "gemv"}), None, NotBuiltError, "AWQ quantization_config.version 'gemv'"),
    (_hf({**AWQ, "version": "exllama"}), "awq", NotBuiltError, "version 'exllama'"),
    (_hf({**AWQ, "bits": 3}), None, NotBuiltError, "AWQ quantization_config.bits 3"),
    (_hf({**AWQ, "zero_point": False}), None, NotBuiltError, "zero_point false"),
    (_hf({**GPTQ, "bits": 3}), None, NotBuiltError, "GPTQ quantization_config.bits 3"),
    (_hf({**GPTQ, "checkpoint_format": "marlin"}), None, NotBuiltError, "checkpoint_format 'marlin'"),
    (_hf({**GPTQ, "dynamic": {"-:.*mlp.*": {}}}), None, NotBuiltError, "dynamic"),
    (_hf({**GPTQ, "lm_head": True}), None, NotBuiltError, "lm_head"),
    (_hf({**GPTQ, "group_size": 0}), None, ConfigError, "group_size is a positive int or -1"),
    (_hf(AWQ), "gptq", ConfigError, "None or one of 'awq', 'awq_marlin'"),
    (_hf(GPTQ), "fp8", ConfigError, "pre-quantized with 'gptq'"),
    (_hf({"quant_method": "fp8"}), "awq", ConfigError, "pre-quantized with 'fp8'"),
    (SimpleNamespace(architectures=LLAMA), "gptq", ConfigError, "this one has none"),
    (_hf(AWQ, ["GptOssForCausalLM"]), None, NotBuiltError, "experts are stored fused"),
    (_hf(GPTQ, ["LlavaForConditionalGeneration"]), None, NotBuiltError, "gptq LlavaForConditionalGeneration"),
    (_hf(AWQ, ["Qwen2_5_VLForConditionalGeneration"]), None, NotBuiltError, "with a quantized vision tower"),
    (_hf({"quant_method": "bitsandbytes"}), None, NotBuiltError, "pre-quantized 'bitsandbytes' checkpoint"),
])
def test_refused_configs(hf_config, quantization, error, message) -> None:
    with pytest.raises(error, match=message) as info:
        prequantized_config(hf_config, "m", quantization)
    assert error is NotBuiltError or not isinstance(info.value, NotBuiltError)


def test_engine_config_accepts_the_method_names() -> None:
    for name in ("awq", "gptq", "awq_marlin", "gptq_marlin"):
        assert EngineConfig.create("m", quantization=name).quantization == name
    with pytest.raises(NotBuiltError, match="'bitsandbytes' weight quantization"):
        EngineConfig.create("m", quantization="bitsandbytes")


# ------------------------------------------------------------------ the loaded weights
def _model(tp: TensorParallel, **overrides) -> LlamaForCausalLM:
    """hidden 64, 4 heads of 16, 2 KV heads, intermediate 96 (unless overridden)."""
    return LlamaForCausalLM(tiny_hf_config("llama", **overrides), dtype=torch.float32, tp=tp,
                            attn_backend=get_attention_backend(None, CPU, torch.float32), max_position=128)


def _load_ranks(path, cfg: Int4CheckpointConfig, tp: int, keep_packed: bool = False) -> list[LlamaForCausalLM]:
    """Every rank's model of the tiny Llama checkpoint at ``path`` (loading needs no process group)."""
    from safetensors.torch import load_file

    tensors = load_file(str(path / "model.safetensors"))
    config = load_hf_config(str(path))
    models = []
    for rank in range(tp):
        model = LlamaForCausalLM(config, dtype=torch.float32, tp=TensorParallel(rank, tp),
                                 attn_backend=get_attention_backend(None, CPU, torch.float32), max_position=128)
        make_int4_params(model, cfg)
        model.load_weights(tensors.items())
        finish_int4_params(model, cfg, use_triton=False, keep_packed=keep_packed)
        models.append(model)
    return models


def _expected(dequantized: dict[str, torch.Tensor], layer: int) -> dict[str, torch.Tensor]:
    """Layer ``layer``'s fused ``[out, in]`` weights from the test's dequantization."""
    d = {name.split(".")[-2]: w for name, w in dequantized.items() if f"layers.{layer}." in name}
    return {"qkv_proj": torch.cat([d["q_proj"], d["k_proj"], d["v_proj"]]), "o_proj": d["o_proj"],
            "gate_up_proj": torch.cat([d["gate_proj"], d["up_proj"]]), "down_proj": d["down_proj"]}


def _layers(model: LlamaForCausalLM, layer: int) -> dict[str, torch.nn.Module]:
    block = model.model.layers[layer]
    return {"qkv_proj": block.self_attn.qkv_proj, "o_proj": block.self_attn.o_proj,
            "gate_up_proj": block.mlp.gate_up_proj, "down_proj": block.mlp.down_proj}


CASES = {  # method, group, bits, desc_act
    "awq-g16": ("awq", 16, 4, False),
    "gptq-g32": ("gptq", 32, 4, False),
    "gptq-act-order-g16": ("gptq", 16, 4, True),
    "gptq-8bit-g32": ("gptq", 32, 8, True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_dequantized_weights_equal_the_tests_own(tiny_llama: str, tmp_path, case: str) -> None:
    """Exactly, on one rank and on both of tp=2 (rank r: rows [r*n/2, (r+1)*n/2) of each fused shard, input columns
    [r*k/2, (r+1)*k/2) of o_proj and down_proj), dequantized at load (the CPU path) and kept packed (the GPU's
    layout, dequantized by `reference.dequantize_int_weight`)."""
    method, group, bits, desc_act = CASES[case]
    dequantized = write_int4_checkpoint(tiny_llama, tmp_path / case, method, group, bits, desc_act)
    cfg = prequantized_config(load_hf_config(str(tmp_path / case)), "m", None)
    whole = _expected(dequantized, 1)
    (one,) = _load_ranks(tmp_path / case, cfg, 1)
    for name, layer in _layers(one, 1).items():
        assert torch.equal(layer.weight, whole[name]), name
    (packed,) = _load_ranks(tmp_path / case, cfg, 1, keep_packed=True)
    for name, layer in _layers(packed, 1).items():
        assert isinstance(layer.quant_method, Int4LinearMethod) and layer.qweight.dtype == torch.int32
        assert (layer.g_idx is not None) == desc_act, name
        w = reference.dequantize_int_weight(layer.qweight, layer.scales, layer.zeros, layer.g_idx, bits,
                                            layer.quant_method.group_size)
        assert torch.equal(w.t(), whole[name]), name
    for rank, model in enumerate(_load_ranks(tmp_path / case, cfg, 2)):
        for name, layer in _layers(model, 1).items():
            assert torch.equal(layer.weight, _rank_slice(whole[name], name, rank, dequantized)), (name, rank)


def _rank_slice(weight: torch.Tensor, name: str, rank: int, dequantized: dict[str, torch.Tensor]) -> torch.Tensor:
    if name in ("o_proj", "down_proj"):
        return weight.chunk(2, dim=1)[rank]
    d = {n.split(".")[-2]: w for n, w in dequantized.items() if "layers.1." in n}
    parts = ("q_proj", "k_proj", "v_proj") if name == "qkv_proj" else ("gate_proj", "up_proj")
    return torch.cat([d[part].chunk(2)[rank] for part in parts])


# ------------------------------------------------------------------ refusals at load
@pytest.mark.parametrize("cfg, overrides, layer, what", [
    (Int4CheckpointConfig("awq", 4, 16), dict(num_attention_heads=16), "model.layers.0.self_attn.qkv_proj",
     "[32, 4, 4] output features"),  # head_dim 4: a rank's KV head is half an int32 of AWQ's packing
    (Int4CheckpointConfig("gptq", 4, 64), {}, "model.layers.0.self_attn.o_proj", "not a multiple of the group_size 64"),
    (Int4CheckpointConfig("gptq", 8, 16, True), dict(intermediate_size=100), "model.layers.0.mlp.gate_up_proj",
     "[50, 50] is not a multiple of the 4 8-bit values"),
])
def test_a_split_through_a_pack_or_a_group_is_refused(cfg, overrides, layer: str, what: str) -> None:
    with pytest.raises(ConfigError, match="split on whole packs and groups") as info:
        make_int4_params(_model(TensorParallel(0, 2), **overrides), cfg)
    assert layer in str(info.value) and what in str(info.value), str(info.value)
    assert info.value.field == "tensor_parallel_size" and not isinstance(info.value, NotBuiltError)


def _gptq_layer(g_idx_q: torch.Tensor, g_idx_k: torch.Tensor, desc_act: bool) -> None:
    model = _model(TensorParallel(0, 1))
    cfg = Int4CheckpointConfig("gptq", 4, 16, desc_act, 1)
    make_int4_params(model, cfg)
    gen = torch.Generator().manual_seed(0)
    ckpt = {}
    for part, rows, g_idx in (("q_proj", 64, g_idx_q), ("k_proj", 32, g_idx_k), ("v_proj", 32, g_idx_q)):
        tensors, _ = quantize_gptq(torch.randn(rows, 64, generator=gen), 16, 4, g_idx, gen)
        ckpt.update({f"model.layers.0.self_attn.{part}.{k}": v for k, v in tensors.items()})
    model.load_weights(ckpt.items())
    qkv = model.model.layers[0].self_attn.qkv_proj
    finish_int4_params(SimpleNamespace(named_modules=lambda: [("model.layers.0.self_attn.qkv_proj", qkv)]), cfg,
                       use_triton=False)


def test_inconsistent_g_idx_is_refused() -> None:
    gen = torch.Generator().manual_seed(1)
    act_order, trivial = act_order_g_idx(64, 16, gen), torch.arange(64) // 16
    _gptq_layer(act_order, act_order, desc_act=True)
    with pytest.raises(ConfigError, match="the same g_idx in every checkpoint tensor fused in .*qkv_proj"):
        _gptq_layer(act_order, trivial, desc_act=True)
    with pytest.raises(ConfigError, match="as its quantization_config's desc_act false says"):
        _gptq_layer(act_order, act_order, desc_act=False)


def test_float_weights_under_an_awq_config_miss_their_tensors(tiny_llama: str, tmp_path) -> None:
    import json

    path = tmp_path / "mislabelled"
    shutil.copytree(tiny_llama, path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "quantization_config": {**AWQ, "group_size": 32}}))
    with pytest.raises(ConfigError, match="unexpected weights: .*_proj.weight"):
        load_model(EngineConfig.create(str(path)), load_hf_config(str(path)), CPU, torch.float32)


# ------------------------------------------------------------------ the loaded model
SEQUENCES = [[5, 60, 7, 300, 9, 10, 41, 12, 200, 14, 15], [40, 41, 42]]
VS_REFERENCE = 1e-4
"""|logits - transformers with the dequantized weights|: float32 sums in another order (measured up to 4e-6)."""


@pytest.mark.parametrize("case, ignored", [("awq-g16", ("layers.1.mlp",)), ("gptq-act-order-g16", ())])
def test_the_loaded_model_equals_the_reference(tiny_llama: str, tmp_path, case: str, ignored) -> None:
    method, group, bits, desc_act = CASES[case]
    path = tmp_path / case
    dequantized = write_int4_checkpoint(tiny_llama, path, method, group, bits, desc_act, ignored)
    hf_config = load_hf_config(str(path))
    model = load_model(EngineConfig.create(str(path), quantization=method), hf_config, CPU, torch.float32)
    spec = kv_cache_spec(hf_config, 1)
    run = PagedRun(model, SEQUENCES)
    run.new_kv_caches_for(spec, torch.float32)
    ref, unquantized = Int4Reference(tiny_llama, dequantized), Int4Reference(tiny_llama, {})
    for seq, logits in zip(SEQUENCES, run.run([[6, 3], [5, 0]])):
        assert float((logits - ref.logits(seq)).abs().max()) < VS_REFERENCE
        assert float((logits - unquantized.logits(seq)).abs().max()) > 0.1  # it does serve the int4 weights
    if ignored:
        down = model.model.layers[1].mlp.down_proj
        assert not hasattr(down, "qweight") and torch.equal(down.weight, unquantized.model.model.layers[1].mlp
                                                            .down_proj.weight)


def test_extra_zero_biases_are_dropped_and_dummy_weights_load(tiny_llama: str, tmp_path) -> None:
    """Some GPTQ packers wrote a zero ``bias`` for bias-free projections: dropped, as vLLM does. With
    ``load_format="dummy"`` the layers get random packed values of the checkpoint's format."""
    from asyncllm.models.int4_checkpoint import drop_extra_biases

    model = _model(TensorParallel(0, 1))
    names = ["model.layers.0.self_attn.q_proj.bias", "model.layers.0.mlp.down_proj.bias", "model.norm.weight",
             "model.layers.0.self_attn.q_proj.qweight"]
    assert [n for n, _ in drop_extra_biases(model, ((n, None) for n in names))] == names[2:]
    write_int4_checkpoint(tiny_llama, tmp_path / "gptq", "gptq", 32)
    hf_config = load_hf_config(str(tmp_path / "gptq"))
    dummy = load_model(EngineConfig.create(str(tmp_path / "gptq"), load_format="dummy"), hf_config, CPU,
                       torch.float32)
    spec = kv_cache_spec(hf_config, 1)
    run = PagedRun(dummy, SEQUENCES)
    run.new_kv_caches_for(spec, torch.float32)
    assert all(torch.isfinite(logits).all() for logits in run.run([[6, 3], [5, 0]]))
    assert not hasattr(dummy.model.layers[0].mlp.down_proj, "qweight")  # the CPU path: dequantized at load


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_a_gemma4_checkpoint_equals_the_reference(tmp_path, method: str) -> None:
    """Gemma 4 (the tiny E2B-style decoder) in int4: the global layers' k projection loaded as their values' too, the
    KV-sharing layers' own q projection; the per-layer-input matrices float."""
    from asyncllm.tiny import tiny_checkpoint

    src, path = tiny_checkpoint("gemma4"), tmp_path / method
    dequantized = write_int4_checkpoint(src, path, method, 16)
    hf_config = load_hf_config(str(path))
    model = load_model(EngineConfig.create(str(path)), hf_config, CPU, torch.float32)
    run = PagedRun(model, SEQUENCES)
    run.new_kv_caches_for(kv_cache_spec(hf_config, 1), torch.float32)
    ref, unquantized = Int4Reference(src, dequantized), Int4Reference(src, {})
    assert "model.layers.3.self_attn.q_proj.weight" in dequantized
    for seq, logits in zip(SEQUENCES, run.run([[6, 3], [5, 0]])):
        assert float((logits - ref.logits(seq)).abs().max()) < VS_REFERENCE
        assert float((logits - unquantized.logits(seq)).abs().max()) > 0.05  # it does serve the int4 weights


@pytest.mark.parametrize("arch, method, group, desc_act", [
    ("qwen3_moe", "gptq", 16, False), ("qwen3_moe", "awq", 16, False), ("qwen2_moe", "gptq", 16, False),
    ("mixtral", "awq", 8, False), ("deepseek_v3", "gptq", 8, False), ("mixtral", "gptq", 16, True)])
def test_a_moe_checkpoint_with_int4_experts_equals_the_reference(tmp_path, arch: str, method: str, group: int,
                                                                 desc_act: bool) -> None:
    """AWQ / GPTQ mixtures of experts (Qwen3-30B-A3B-AWQ's layout: every expert's gate, up and down quantized,
    the router float; Qwen2-MoE's shared expert; Mixtral's w1 / w3 / w2; DeepSeek-V3's latent attention too; GPTQ
    act-order, each expert's matrices with their own shuffled ``g_idx``): the experts dequantized at load compute as
    the reference's dequantized weights."""
    from asyncllm.tiny import tiny_checkpoint

    src, path = tiny_checkpoint(arch), tmp_path / method
    dequantized = write_int4_checkpoint(src, path, method, group, 4, desc_act)
    assert any(".experts.0." in name for name in dequantized)
    hf_config = load_hf_config(str(path))
    model = load_model(EngineConfig.create(str(path)), hf_config, CPU, torch.float32)
    run = PagedRun(model, SEQUENCES)
    run.new_kv_caches_for(kv_cache_spec(hf_config, 1), torch.float32)
    ref, unquantized = Int4Reference(src, dequantized), Int4Reference(src, {})
    for seq, logits in zip(SEQUENCES, run.run([[6, 3], [5, 0]])):
        assert float((logits - ref.logits(seq)).abs().max()) < VS_REFERENCE
        assert float((logits - unquantized.logits(seq)).abs().max()) > 0.1  # it does serve the int4 weights
    experts = next(m for m in model.modules() if hasattr(m, "w13_weight"))
    assert experts.w13_weight.dtype == torch.float32 and not hasattr(experts, "gate_qweight")


def test_int4_experts_dummy(tmp_path) -> None:
    """Dummy weights stage and dequantize experts too."""
    from asyncllm.tiny import tiny_checkpoint

    src, path = tiny_checkpoint("qwen3_moe"), tmp_path / "awq"
    write_int4_checkpoint(src, path, "awq", 16)
    model = load_model(EngineConfig.create(str(path), load_format="dummy"), load_hf_config(str(path)), CPU,
                       torch.float32)
    experts = model.model.layers[0].mlp.experts
    assert torch.isfinite(experts.w13_weight).all() and 0 < float(experts.w13_weight.abs().max()) < 0.1


def test_a_qwen3_5_gptq_checkpoint_equals_the_reference(tmp_path) -> None:
    """Qwen3.5's hybrid with its attention and MLP projections in GPTQ int4 and its Gated DeltaNet left float."""
    from asyncllm.tiny import tiny_checkpoint

    src, path = tiny_checkpoint("qwen3_5"), tmp_path / "gptq"
    dequantized = write_int4_checkpoint(src, path, "gptq", 16, 4, False, ("linear_attn",))
    hf_config = load_hf_config(str(path))
    model = load_model(EngineConfig.create(str(path)), hf_config, CPU, torch.float32)
    spec = kv_cache_spec(hf_config, 1)
    run = PagedRun(model, SEQUENCES)
    run.new_kv_caches_for(spec, torch.float32)
    ref, unquantized = Int4Reference(src, dequantized), Int4Reference(src, {})
    assert "model.layers.0.mlp.down_proj.weight" in dequantized and not any("linear_attn" in n for n in dequantized)
    for seq, logits in zip(SEQUENCES, run.run([[6, 3], [5, 0]])):
        assert float((logits - ref.logits(seq)).abs().max()) < VS_REFERENCE
        assert float((logits - unquantized.logits(seq)).abs().max()) > 0.1  # it does serve the int4 weights


def staged_int4_moe_model(path, tp_rank: int = 0, tp_size: int = 1):
    """(a quantized MoE model of rank ``tp_rank`` (no process group), its checkpoint config), its experts staged."""
    from asyncllm.models.int4_experts import make_int4_expert_params
    from asyncllm.models.loader import build_model, load_checkpoint

    hf_config, config = load_hf_config(str(path)), EngineConfig.create(str(path))
    cfg = prequantized_config(hf_config, str(path), None)
    model = build_model(config, hf_config, CPU, torch.float32, tp_rank, tp_size)
    make_int4_params(model, cfg)
    make_int4_expert_params(model, cfg)
    load_checkpoint(model, str(path), "auto")
    finish_int4_params(model, cfg, use_triton=False)
    return model, cfg


def int4_moe_model(path, keep_packed: bool, tp_rank: int = 0, tp_size: int = 1):
    """`staged_int4_moe_model`'s model, its experts kept packed (the GPU's layout) or dequantized."""
    from asyncllm.models.int4_experts import finish_int4_experts

    model, cfg = staged_int4_moe_model(path, tp_rank, tp_size)
    finish_int4_experts(model, cfg, keep_packed=keep_packed)
    return model


def paged_logits(model, path) -> list[torch.Tensor]:
    run = PagedRun(model, SEQUENCES)
    run.new_kv_caches_for(kv_cache_spec(load_hf_config(str(path)), 1), torch.float32)
    return run.run([[6, 3], [5, 0]])


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_moe_experts_kept_packed_equal_the_dequantized_ones(tmp_path, method: str) -> None:
    """On a GPU the experts stay packed (`reference.IntExperts`' layout) for the fused-MoE kernel's integer path:
    here through the torch reference of that path, the same logits as the experts dequantized at load."""
    from asyncllm.tiny import tiny_checkpoint

    src, path = tiny_checkpoint("qwen3_moe"), tmp_path / method
    write_int4_checkpoint(src, path, method, 16)
    model = int4_moe_model(path, keep_packed=True)
    experts = model.model.layers[0].mlp.experts
    assert experts.w13_weight.dtype == torch.int32 and experts.int_experts == (4, 16)
    assert experts.w13_weight.shape == (8, 64, 64 // 8) and experts.w2_weight.shape == (8, 64, 32 // 8)
    dequantized = load_model(EngineConfig.create(str(path)), load_hf_config(str(path)), CPU, torch.float32)
    for packed, plain in zip(paged_logits(model, path), paged_logits(dequantized, path)):
        torch.testing.assert_close(packed, plain, atol=1e-5, rtol=0)
