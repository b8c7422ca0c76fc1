"""Online fp8 experts (``quantization="fp8"`` on a float mixture of experts: asyncllm/models/fp8_online_experts.py):
tiny Qwen3-MoE and Mixtral (hidden 192, intermediate 160: partial last 128-column K steps in each product)
through the real loader against the independent fake-quant reference (tests/fp8_reference.py); each
tensor-parallel rank's (and an expert-parallel rank's) experts against the reference on their part, the float
experts freed; live weight updates requantize each expert matrix in place; gpt-oss's experts, and experts on a GPU
without fp8 compute, stay float."""

from __future__ import annotations

import gc
import weakref
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from fp8_checkpoint_reference import _fp8_experts_forward, _group_fake_quant, routed_tokens
from fp8_reference import fake_quant, fake_quant_experts, fp8_moe_hf_model
from hf_reference import model_logits
from model_utils import PagedRun
from step_driver import StepDriver

from asyncllm import protocol
from asyncllm.config import EngineConfig
from asyncllm.engine.sleep import sleep_error
from asyncllm.engine.weight_tensors import pack_tensors
from asyncllm.models.layers import TensorParallel
from asyncllm.models.lora import LoRAContext
from asyncllm.models.lora_experts import ExpertsLoRA
from asyncllm.models.loader import build_model, load_checkpoint, load_hf_config, load_model
from asyncllm.models.quantization import fp8_to_float, quantize_model
from asyncllm.models.registry import kv_cache_spec
from asyncllm.sampling import SamplingParams
from asyncllm.tiny import tiny_checkpoint
from asyncllm.workers import cuda_graphs
from asyncllm.workers.model_runner import ModelRunner
from asyncllm.workers.sleep import RunnerSleep
from asyncllm.workers.weight_update import update_weights

CPU = torch.device("cpu")
FP8 = torch.float8_e4m3fn
SEQUENCES = [[5, 60, 7, 300, 9, 10, 41, 12, 200, 14, 15], [40, 41, 42]]
VS_REFERENCE = 1e-4
"""|logits - reference| (float32): measured up to 1e-5 (sums in another order); one activation's fp8 rounding
flipped by that order moves a logit by ~4e-3."""
MIXTRAL = {"hidden_size": 192, "intermediate_size": 160}


def _load(path: str, **fields) -> torch.nn.Module:
    return load_model(EngineConfig.create(path, quantization="fp8", **fields), load_hf_config(path), CPU,
                      torch.float32)


@pytest.mark.parametrize("arch, shape", [("qwen3_moe", {}), ("mixtral", MIXTRAL)])
def test_logits_equal_the_fake_quant_reference(arch: str, shape: dict) -> None:
    path = tiny_checkpoint(arch, **shape)
    model = _load(path)
    run = PagedRun(model, SEQUENCES)
    run.new_kv_caches_for(kv_cache_spec(load_hf_config(path), 1), torch.float32)
    ref = fp8_moe_hf_model(path)
    for seq, logits in zip(SEQUENCES, run.run([[6, 3], [5, 0]])):
        assert float((logits - model_logits(ref, seq)).abs().max()) < VS_REFERENCE
    for layer in model.model.layers:
        experts = layer.mlp.experts
        assert {name: p.dtype for name, p in experts.named_parameters()} == {"w13_weight": FP8, "w2_weight": FP8}
        assert experts.fp8_block == (experts.intermediate, max(experts.hidden_size, experts.intermediate))
        assert layer.self_attn.qkv_proj.weight.dtype == FP8


def _rank_model(path: str, rank: int, expert_parallel: bool) -> torch.nn.Module:
    config = EngineConfig.create(path, quantization="fp8", enable_expert_parallel=expert_parallel)
    model = build_model(config, load_hf_config(path), CPU, torch.float32, rank, 2)
    load_checkpoint(model, path)
    return model


@pytest.mark.parametrize("rank, expert_parallel", [(0, False), (1, False), (1, True)])
def test_each_rank_quantizes_its_part_and_frees_the_float_experts(rank: int, expert_parallel: bool) -> None:
    """tp=2: a rank holds intermediate rows [80r, 80r+80) of the 4 experts, each of its gate, up and down parts by
    its own scale (expert parallel: experts 2 and 3 whole); its partial output is the reference's on its part."""
    from transformers import AutoModelForCausalLM

    path = tiny_checkpoint("mixtral", **MIXTRAL)
    model = _rank_model(path, rank, expert_parallel)
    moe = model.model.layers[0].mlp.experts
    float_w13 = weakref.ref(moe.w13_weight)
    quantize_model(model, "fp8")
    gc.collect()
    assert float_w13() is None and moe.w13_weight.dtype == FP8  # the float experts are gone
    inter, experts = (160, [2, 3]) if expert_parallel else (80, [0, 1, 2, 3])
    assert moe.w13_weight_scale_inv.shape == (len(experts), 2, 1) and moe.fp8_block == (inter, 192)

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).model.layers[0].mlp.experts
    fake_quant_experts(hf, 1 if expert_parallel else 2)
    rows = slice(0, 160) if expert_parallel else slice(80 * rank, 80 * rank + 80)
    gate_up, down = hf.gate_up_proj.data[experts], hf.down_proj.data[experts]
    sliced = SimpleNamespace(act_fn=F.silu, gate_up_proj=torch.cat([gate_up[:, rows], gate_up[:, 160:][:, rows]], 1),
                             down_proj=down[:, :, rows])
    x, ids, topk = routed_tokens(192)
    moe.tp = TensorParallel()  # this rank's partial sum, not all-reduced
    got = moe(x, topk, ids)
    local = ids - experts[0]
    here = (local >= 0) & (local < len(experts))  # other ranks' experts: weight 0 on a local one
    want = _fp8_experts_forward(sliced, x, torch.where(here, local, 0), torch.where(here, topk, 0), None)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def _expert_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every expert layer's fp8 weights (as bytes) and block scales."""
    state = {}
    for name, module in model.named_modules():
        if name.endswith("mlp.experts"):
            state.update({f"{name}.{key}": (t.view(torch.uint8) if t.dtype == FP8 else t).clone()
                          for key, t in [*module.named_parameters(), *module.named_buffers()]})
    return state


def test_an_update_requantizes_each_expert_matrix_in_place() -> None:
    a, b = tiny_checkpoint("qwen3_moe"), tiny_checkpoint("qwen3_moe", seed=1)
    runner = SimpleNamespace(config=EngineConfig.create(a, quantization="fp8"), hf_config=load_hf_config(a),
                             model=_load(a), device=CPU, dtype=torch.float32, rank=0, tp_size=1)
    moe = runner.model.model.layers[0].mlp.experts
    addresses = {name: t.data_ptr() for name, t in [*moe.named_parameters(), *moe.named_buffers()]}
    assert update_weights(runner, protocol.UpdateWeights("u", b)) == protocol.WeightsUpdated("u")
    fresh, got = _expert_state(_load(b)), _expert_state(runner.model)
    assert fresh.keys() == got.keys() and len(fresh) == 8
    for name, tensor in fresh.items():
        assert torch.equal(got[name], tensor), name
    assert addresses == {name: t.data_ptr() for name, t in [*moe.named_parameters(), *moe.named_buffers()]}

    up = torch.randn(moe.intermediate, moe.hidden_size) * 5  # expert 1's up alone: its rows and scale, no others
    before = _expert_state(runner.model)
    packed = pack_tensors({"model.layers.0.mlp.experts.1.up_proj.weight": up})
    try:
        update_weights(runner, protocol.UpdateWeights("t", "", segment=packed.segment.name, tensors=packed.tensors))
    finally:
        packed.close()
    after = _expert_state(runner.model)
    scale = (up.abs().max() / 448).float()
    inter = moe.intermediate
    assert torch.equal(moe.w13_weight_scale_inv[1, 1], scale.expand(moe.w13_weight_scale_inv.shape[2]))
    assert torch.equal(fp8_to_float(moe.w13_weight.data[1, inter:]) * scale, fake_quant(up, scale))
    changed = {name for name in before if not torch.equal(before[name], after[name])}
    assert changed == {"model.layers.0.mlp.experts.w13_weight", "model.layers.0.mlp.experts.w13_weight_scale_inv"}
    w13 = after["model.layers.0.mlp.experts.w13_weight"]
    w13[1, inter:] = before["model.layers.0.mlp.experts.w13_weight"][1, inter:]
    assert torch.equal(w13, before["model.layers.0.mlp.experts.w13_weight"])  # only expert 1's up rows moved


def test_a_level_2_sleep_comes_back_through_update_weights(monkeypatch) -> None:
    """Sleep level 2 drops the fp8 experts (their block scales, buffers, stay); `update_weights` from the float
    checkpoint quantizes them again, byte for byte, and the greedy tokens are those before."""
    monkeypatch.setattr(cuda_graphs, "capture_decode_graphs", lambda r: None)
    path = tiny_checkpoint("qwen3_moe")
    runner = ModelRunner(EngineConfig.create(path, max_model_len=64, max_num_seqs=4, quantization="fp8"), rank=0,
                         tp_size=1, device=CPU)
    runner.load_model()
    runner.init_cache(16)
    driver, params = StepDriver(runner, 16), SamplingParams(temperature=0.0, max_tokens=4)
    driver.add("a", [5, 9, 31, 7, 100, 3], 4, params)
    before, state = driver.run()["a"].outputs, _expert_state(runner.model)
    sleeper = RunnerSleep(runner)
    assert sleep_error(sleeper.handle(protocol.Sleep("s", 2), rank=0)) is None
    sleeper.wake_up(["weights", "kv_cache"])
    assert update_weights(runner, protocol.UpdateWeights("u", path)) == protocol.WeightsUpdated("u")
    after = _expert_state(runner.model)
    assert [name for name in state if not torch.equal(after[name], state[name])] == []
    driver.add("b", [5, 9, 31, 7, 100, 3], 4, params)
    assert driver.run()["b"].outputs == before


def test_an_expert_adapter_adds_its_product_of_the_unquantized_activation() -> None:
    """LoRA on online fp8 experts: an adapter of expert 1's down projection adds ``w * B (A act)`` to the fp8
    output, ``act`` the fp8 gate/up product's activation (as over the dense fp8 layers: from the unquantized input)."""
    moe = _load(tiny_checkpoint("qwen3_moe")).model.layers[0].mlp.experts
    gen = torch.Generator().manual_seed(1)
    x, topk = torch.randn(5, moe.hidden_size, generator=gen), torch.rand(5, 2, generator=gen)
    ids = torch.tensor([[1, 0], [2, 3], [4, 1], [1, 5], [6, 7]])
    base = moe(x, topk, ids)
    context = LoRAContext()
    moe.lora = ExpertsLoRA(moe, 1, 2, context)
    a, b = torch.randn(2, moe.intermediate, generator=gen), torch.randn(moe.hidden_size, 2, generator=gen)
    moe.lora.set(0, ("down", 1), a, b, 0.5)
    context.mask, context.experts = torch.ones(5, 1), True
    scales = moe.w13_weight_scale_inv[1].repeat_interleave(moe.intermediate, 0)  # the gate's, the up's
    w13 = fp8_to_float(moe.w13_weight.data[1]) * scales
    gate, up = F.linear(_group_fake_quant(x, x.shape[-1]), w13).chunk(2, dim=-1)
    token, slot = torch.where(ids == 1)
    want = base.clone()
    want[token] += topk[token, slot, None] * F.linear(F.linear((F.silu(gate) * up)[token], a), b) * 0.5
    torch.testing.assert_close(moe(x, topk, ids), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch, no_fp8, logged", [
    ("gpt_oss", False, "GptOssExperts experts kept in the model dtype"),  # biases, clamped SwiGLU: their own forward
    ("qwen3_moe", True, "this GPU has no fp8 compute"),  # before Ada: the reference's loop (a host sync, no graphs)
])
def test_experts_left_in_the_model_dtype(caplog, monkeypatch, arch: str, no_fp8: bool, logged: str) -> None:
    """gpt-oss's experts, and any experts on a GPU without fp8 compute, are left float and the log says why; the
    dense layers still quantize."""
    from asyncllm.models import fp8_online_experts

    if no_fp8:
        monkeypatch.setattr(fp8_online_experts, "_computes_fp8", lambda device: False)  # a CUDA device before 8.9
    with caplog.at_level("INFO", logger="asyncllm.models"):
        model = _load(tiny_checkpoint(arch))
    experts = model.model.layers[0].mlp.experts
    assert experts.w13_weight.dtype == torch.float32 and experts.fp8_block is None
    assert model.model.layers[0].self_attn.qkv_proj.weight.dtype == FP8
    assert logged in caplog.text
    assert "linear layers quantized" in caplog.text and "expert layers quantized" not in caplog.text  # none were
