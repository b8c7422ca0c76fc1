"""LoRA adapters on a mixture of experts' experts (asyncllm/models/lora_experts.py), in process: every position's
logits equal PEFT's (fp32, 1e-4) for PEFT's ``target_parameters`` adapters of the stacked experts (with the
attention's and the shared experts' projections) on every family that takes them (gpt-oss: interleaved gate and up,
biases, clamped SwiGLU; the DeepSeek-style ``shared_experts``), batched with a sequence on the base model; the
same adapter written per expert (vLLM's format, Mixtral's w1/w2/w3 names) gives the same logits; the host's check
refuses what does not fit. Through the engine, on two ranks split by rows or by experts:
tests/engine/test_moe_engine.py."""

from __future__ import annotations

import json
import os

import pytest
import torch
from hf_reference import hf_logits
from lora_utils import make_expert_adapter, peft_logits, per_expert_copy
from model_utils import MaskedRun
from safetensors.torch import save_file

from asyncllm import InvalidRequestError, LoRARequest
from asyncllm.config import EngineConfig
from asyncllm.engine.prepare import prepare
from asyncllm.lora import read_adapter
from asyncllm.models.loader import load_hf_config, load_model
from asyncllm.models.lora import LoRAContext, attach_lora_layers, load_adapter_tensors
from asyncllm.models.moe import num_experts_of
from asyncllm.models.registry import kv_cache_spec
from asyncllm.tiny import tiny_checkpoint

ATOL = 1e-4
SLOTS, MAX_RANK, SLOT = 2, 8, 1
ATTENTION = ["q_proj", "v_proj"]
FAMILIES = {"qwen3_moe": ATTENTION, "qwen2_moe": [*ATTENTION, "shared_expert.gate_proj", "shared_expert.down_proj"],
            "mixtral": ATTENTION, "olmoe": ATTENTION, "qwen3_5_moe": ["out_proj"], "phimoe": ["k_proj"],
            "gpt_oss": ATTENTION, "glm4_moe": ["q_proj", "shared_experts.gate_proj", "shared_experts.up_proj"],
            "dots1": ATTENTION, "ernie4_5_moe": ["o_proj", "shared_experts.gate_proj", "shared_experts.up_proj", "shared_experts.down_proj"], "hunyuan_v1_moe": ATTENTION,
            "minimax_m2": ATTENTION, "exaone_moe": ATTENTION, "solar_open": ATTENTION, "sarvam_moe": ATTENTION,
            "afmoe": ATTENTION,
            "deepseek_v3": ["kv_b_proj", "shared_experts.gate_proj", "shared_experts.up_proj"],
            "mistral4": ["q_b_proj", "kv_b_proj"], "deepseek_v2": ["kv_b_proj"],
            "flex_olmo": ATTENTION, "llama4": ["q_proj", "feed_forward.gate_proj", "feed_forward.up_proj",
                                               "shared_expert.gate_proj", "shared_expert.up_proj"]}
PARAMETERS = {"llama4": ["feed_forward.experts.gate_up_proj", "feed_forward.experts.down_proj"]}
"""target_parameters where the experts are not ``mlp.experts`` (Llama 4's ``feed_forward.experts``)."""


def _logits_with(path: str, adapter: str, sequences: list[list[int]]) -> list[torch.Tensor]:
    model = load_model(EngineConfig.create(path, max_model_len=64), load_hf_config(path), torch.device("cpu"),
                       torch.float32)
    context = LoRAContext()
    layers = attach_lora_layers(model, SLOTS, MAX_RANK, context)
    for module_name, part, lora_a, lora_b, scaling in load_adapter_tensors(read_adapter(adapter), model):
        layers[module_name].set(SLOT, part, lora_a, lora_b, scaling)
    run = MaskedRun(model, sequences, block_size=4)
    run.context, run.slots, run.num_slots = context, [SLOT, -1], SLOTS
    run.new_kv_caches_for(kv_cache_spec(load_hf_config(path), 1), torch.float32)
    return run.run([[9, 7], [6, 1], [1, 1], [1, 9], [6, 1]])  # chunks, one-token steps


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_expert_adapters_equal_peft_beside_the_base_model(family: str, tmp_path) -> None:
    path = tiny_checkpoint(family)
    adapter = make_expert_adapter(path, str(tmp_path / "adapter"), seed=len(family), targets=FAMILIES[family],
                                  **({"parameters": PARAMETERS[family]} if family in PARAMETERS else {}))
    prepare(EngineConfig.create(path, enable_lora=True)).lora.check(LoRARequest("a", 1, adapter))  # the host's too
    gen = torch.Generator().manual_seed(len(family))
    sequences = [torch.randint(6, 512, (n,), generator=gen).tolist() for n in (23, 19)]
    with_adapter, base = _logits_with(path, adapter, sequences)
    expected = peft_logits(path, adapter, sequences[0])
    assert (expected - hf_logits(path, sequences[0])).abs().max() > 0.5  # the adapter changes the logits
    torch.testing.assert_close(with_adapter, expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(base, hf_logits(path, sequences[1]), atol=ATOL, rtol=0)
    if family in ("mixtral", "qwen3_moe"):  # the experts alone change the logits, and per-expert files read the same
        experts_only = make_expert_adapter(path, str(tmp_path / "experts"), seed=5, targets=[])
        config = load_hf_config(path)
        names, block = (("w1", "w3", "w2"), "block_sparse_moe") if family == "mixtral" else (
            ("gate_proj", "up_proj", "down_proj"), "mlp")
        per_expert = per_expert_copy(experts_only, str(tmp_path / "per_expert"), config.hidden_size,
                                     num_experts_of(config), block, names)
        expected = peft_logits(path, experts_only, sequences[0])
        assert (expected - hf_logits(path, sequences[0])).abs().max() > 0.5
        torch.testing.assert_close(_logits_with(path, per_expert, sequences)[0], expected, atol=ATOL, rtol=0)


def _hand_made(folder, tensors: dict[str, tuple[int, int]], **config) -> str:
    """An adapter folder of random matrices of these shapes (names without PEFT's prefix)."""
    os.makedirs(folder)
    save_file({f"base_model.model.{name}": torch.randn(shape) for name, shape in tensors.items()},
              str(folder / "adapter_model.safetensors"))
    with open(folder / "adapter_config.json", "w") as f:
        json.dump({"r": 4, "lora_alpha": 8, "peft_type": "LORA", **config}, f)
    return str(folder)


@pytest.mark.parametrize("family, tensors, config, match", [
    ("qwen3_moe", {"model.layers.0.mlp.gate_proj.lora_A.weight": (4, 64),
                   "model.layers.0.mlp.gate_proj.lora_B.weight": (32, 4)}, {}, "is a mixture of experts"),
    ("qwen3_moe", {"model.layers.0.mlp.experts.8.up_proj.lora_A.weight": (4, 64),
                   "model.layers.0.mlp.experts.8.up_proj.lora_B.weight": (32, 4)}, {}, "has 8 experts"),
    ("qwen3_moe", {"model.layers.0.mlp.experts.1.down_proj.lora_A.weight": (4, 64),
                   "model.layers.0.mlp.experts.1.down_proj.lora_B.weight": (64, 4)}, {}, "maps 32 -> 64"),
    ("qwen3_moe", {"model.layers.0.mlp.shared_expert.up_proj.lora_A.weight": (4, 64),
                   "model.layers.0.mlp.shared_expert.up_proj.lora_B.weight": (32, 4)}, {}, "has no shared expert"),
    ("qwen3_moe", {"model.layers.0.mlp.experts.lora_A.weight": (24, 32),
                   "model.layers.0.mlp.experts.lora_B.weight": (64, 24)},
     {"target_parameters": ["mlp.experts.down_proj"]}, "has 8 experts, the adapter's A holds 6"),
    ("qwen3_moe", {"model.layers.0.mlp.experts.lora_A.weight": (32, 32)},
     {"target_parameters": ["mlp.experts.down_proj"]}, "without its partner"),
    ("qwen3_moe", {"model.layers.0.self_attn.q_proj.lora_A.weight": (4, 64),
                   "model.layers.0.self_attn.q_proj.lora_B.weight": (64, 4)},
     {"target_parameters": ["self_attn.q_proj.weight"]}, "only a mixture of experts' experts"),
    ("qwen3_moe", {"model.layers.0.mlp.gate.lora_A.weight": (4, 64), "model.layers.0.mlp.gate.lora_B.weight": (8, 4)},
     {}, "not embeddings, lm_head or routers"),
    ("granitemoe", {"model.layers.0.mlp.experts.0.gate_proj.lora_A.weight": (4, 64),
                    "model.layers.0.mlp.experts.0.gate_proj.lora_B.weight": (128, 4)}, {}, "are not built"),
], ids=["dense-mlp-names", "expert-index", "expert-shape", "no-shared-expert", "stacked-experts-count",
        "partner", "other-parameters", "router", "family-not-built"])
def test_the_host_refuses_what_does_not_fit(family: str, tensors, config, match: str, tmp_path) -> None:
    checker = prepare(EngineConfig.create(tiny_checkpoint(family), enable_lora=True)).lora
    folder = _hand_made(tmp_path / "adapter", tensors, **config)
    with pytest.raises(InvalidRequestError, match=match):
        checker.check(LoRARequest("a", 1, folder))


def test_the_host_accepts_both_formats_and_names_the_stacked_parameters(tmp_path) -> None:
    path = tiny_checkpoint("qwen2_moe")
    stacked = make_expert_adapter(path, str(tmp_path / "stacked"), seed=1, targets=["shared_expert.up_proj"])
    modules = read_adapter(stacked).modules
    gate_up, down = modules["model.layers.1.mlp.experts.gate_up_proj"], modules["model.layers.1.mlp.experts.down_proj"]
    assert (gate_up.num_experts, gate_up.rank, gate_up.in_features, gate_up.out_features) == (6, 4, 64, 64)
    assert (down.num_experts, down.rank, down.in_features, down.out_features) == (6, 4, 32, 64)
    assert gate_up.scaling == 2.0
    checker = prepare(EngineConfig.create(path, enable_lora=True)).lora
    checker.check(LoRARequest("stacked", 1, stacked))
    config = load_hf_config(path)
    one = per_expert_copy(stacked, str(tmp_path / "per_expert"), config.hidden_size, 6, "mlp",
                          ("gate_proj", "up_proj", "down_proj"))
    checker.check(LoRARequest("per_expert", 2, one))
    assert "model.layers.0.mlp.experts.5.down_proj" in read_adapter(one).modules
