"""Pre-quantized compressed-tensors checkpoints of other families than Llama (asyncllm/models/compressed_tensors.py):
W4A16 experts (Qwen3-MoE, Mixtral) packed or dequantized, Gemma 4 and Qwen3.5 in FP8_DYNAMIC, each model's logits
against the dequantized reference; the Llama cases are in tests/unit/test_compressed_tensors.py."""

from __future__ import annotations

import pytest
import torch
from compressed_tensors_reference import FP8_DYNAMIC, CtReference, write_ct_checkpoint
from model_utils import PagedRun

from asyncllm.config import EngineConfig
from asyncllm.models.checkpoint import prequantized_config
from asyncllm.models.loader import load_hf_config, load_model
from asyncllm.models.registry import kv_cache_spec
from test_compressed_tensors import CPU, FP8, SEQUENCES, VS_REFERENCE


@pytest.mark.parametrize("arch, symmetric", [("qwen3_moe", True), ("qwen3_moe", False), ("mixtral", True)])
def test_pack_quantized_experts_equal_the_dequantized_reference(tmp_path, arch: str, symmetric: bool) -> None:
    """A mixture of experts whose experts are W4A16 (RedHatAI's ``*-quantized.w4a16`` of Qwen3-30B-A3B; symmetric,
    or with packed zero points; Mixtral's w1 / w3 / w2 names), the rest float: the experts staged and dequantized at
    load (the CPU), or kept packed through the reference of the fused-MoE kernel's integer path (the GPU's layout),
    compute as transformers over the dequantized weights."""
    from compressed_tensors_reference import write_ct_int_experts
    from int4_reference import Int4Reference

    from asyncllm.models.compressed_tensors import _expert_format
    from asyncllm.models.int4_experts import finish_int4_experts, make_int4_expert_params
    from asyncllm.models.loader import build_model, load_checkpoint
    from asyncllm.tiny import tiny_checkpoint

    src, path = tiny_checkpoint(arch), tmp_path / "ct"
    dequantized = write_ct_int_experts(src, path, 4, 16, symmetric)
    hf_config = load_hf_config(str(path))
    config = EngineConfig.create(str(path))
    packed = build_model(config, hf_config, CPU, torch.float32)
    cfg = prequantized_config(hf_config, str(path), None)
    experts = _expert_format(packed, cfg)
    make_int4_expert_params(packed, experts)
    load_checkpoint(packed, str(path), "auto")
    finish_int4_experts(packed, experts, keep_packed=True)
    ref, unquantized = Int4Reference(src, dequantized), Int4Reference(src, {})
    for model in (load_model(config, hf_config, CPU, torch.float32), packed):
        run = PagedRun(model, SEQUENCES)
        run.new_kv_caches_for(kv_cache_spec(hf_config, 1), torch.float32)
        for seq, logits in zip(SEQUENCES, run.run([[6, 3], [5, 0]])):
            assert float((logits - ref.logits(seq)).abs().max()) < VS_REFERENCE
            assert float((logits - unquantized.logits(seq)).abs().max()) > 0.1
    moe = next(m for m in packed.modules() if hasattr(m, "int_experts"))
    assert moe.int_experts == (4, 16) and moe.w13_weight.dtype == torch.int32


def test_a_gemma4_fp8_dynamic_checkpoint_equals_compressed_tensors(tmp_path) -> None:
    """Gemma 4 (the tiny E2B-style decoder) in FP8_DYNAMIC, its per-layer-input matrices left float: the global
    layers' k projection (and scale) loaded as their values' too, the KV-sharing layers' own q projection."""
    from asyncllm.tiny import tiny_checkpoint

    src = tiny_checkpoint("gemma4")
    path = write_ct_checkpoint(src, tmp_path / "ct", {"group_0": FP8_DYNAMIC}, ("lm_head", "re:.*per_layer.*"))
    ref = CtReference(path, dequantize=False)
    hf_config = load_hf_config(str(path))
    model = load_model(EngineConfig.create(str(path)), hf_config, CPU, torch.float32)
    run = PagedRun(model, SEQUENCES)
    run.new_kv_caches_for(kv_cache_spec(hf_config, 1), torch.float32)
    for seq, logits in zip(SEQUENCES, run.run([[6, 3], [5, 0]])):
        assert float((logits - ref.logits(seq)).abs().max()) < VS_REFERENCE
    layers = model.model.layers
    assert layers[1].self_attn.qkv_proj.weight.dtype == layers[3].self_attn.q_proj.weight.dtype == FP8


def test_a_qwen3_5_fp8_dynamic_checkpoint_equals_compressed_tensors(tmp_path) -> None:
    """The community Qwen3.5 recipe (llm-compressor's FP8_DYNAMIC, ``re:.*linear_attn.*`` left float): the gated
    attention's and the MLPs' projections in fp8 with per-row scales, the Gated DeltaNet's float."""
    from asyncllm.tiny import tiny_checkpoint

    src = tiny_checkpoint("qwen3_5")
    path = write_ct_checkpoint(src, tmp_path / "ct", {"group_0": FP8_DYNAMIC}, ("lm_head", "re:.*linear_attn.*"))
    ref = CtReference(path, dequantize=False)
    hf_config = load_hf_config(str(path))
    model = load_model(EngineConfig.create(str(path)), hf_config, CPU, torch.float32)
    spec = kv_cache_spec(hf_config, 1)
    run = PagedRun(model, SEQUENCES)
    run.new_kv_caches_for(spec, torch.float32)
    for seq, logits in zip(SEQUENCES, run.run([[6, 3], [5, 0]])):
        assert float((logits - ref.logits(seq)).abs().max()) < VS_REFERENCE
    layers = model.model.layers
    assert layers[0].linear_attn.in_proj_qkv.weight.dtype == torch.float32
    assert layers[0].mlp.down_proj.weight.dtype == layers[1].self_attn.o_proj.weight.dtype == FP8
