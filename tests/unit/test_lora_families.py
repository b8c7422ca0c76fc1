"""LoRA on DBRX, Kimi-Linear and Zamba2 in process, beyond tests/unit/test_lora_models.py (DBRX's and Kimi-Linear's
logits equal PEFT's there): Zamba2's shared blocks take one adapter per invocation, its logits as close to PEFT's
float64 ones as PEFT's own float32 ones are (the tiny Zamba2 amplifies rounding: tests/unit/test_zamba2.py); and
the host refuses, by name, what these models (and MiniMax) cannot adapt. Through the engine:
tests/engine/test_lora_families_engine.py.
"""

from __future__ import annotations

import json

import pytest
import torch
from hf_reference import hf_logits
from lora_utils import make_adapter, peft_logits
from safetensors.torch import save_file
from test_lora_models import masked_logits

from asyncllm import InvalidRequestError, LoRARequest
from asyncllm.config import EngineConfig
from asyncllm.engine.prepare import prepare
from asyncllm.tiny import tiny_checkpoint

ZAMBA2 = r".*shared_transformer\.(self_attn\.[qkvo]_proj|feed_forward\.(gate_up|down)_proj)"


def _peft_float64_logits(path: str, adapter: str, tokens: list[int]) -> torch.Tensor:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
    model = PeftModel.from_pretrained(base, adapter).to(torch.float64).eval()
    with torch.no_grad():
        return model(input_ids=torch.tensor([tokens])).logits[0]


def test_zamba2_adapters_apply_per_invocation(tmp_path) -> None:
    """Every shared-block projection of each hybrid layer (block 0 runs at layers 1 and 4, each with its own
    adapter), beside a sequence on the base model: within 3x PEFT's float32 error of PEFT's float64 logits."""
    path = tiny_checkpoint("zamba2")
    adapter = make_adapter(path, str(tmp_path / "z"), seed=3, rank=4, alpha=8, targets=ZAMBA2)
    sequences, with_adapter, base = masked_logits(path, adapter, 5)
    exact = _peft_float64_logits(path, adapter, sequences[0])
    assert (exact.float() - hf_logits(path, sequences[0])).abs().max() > 0.5  # the adapter changes the logits
    bound = 3 * (peft_logits(path, adapter, sequences[0]).double() - exact).abs().max().item()
    assert (with_adapter.double() - exact).abs().max().item() <= max(1e-4, bound)
    assert (base - hf_logits(path, sequences[1])).abs().max().item() <= 1e-3  # the base model's sequence untouched


def _hand_made(folder, tensors: dict[str, tuple[int, int]], **config) -> str:
    """An adapter folder of random matrices of these shapes (names without PEFT's prefix)."""
    folder.mkdir()
    save_file({f"base_model.model.{name}.lora_{ab}.weight": torch.randn(shape if ab == "A" else shape[::-1])
               for name, shape in tensors.items() for ab in "AB"}, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8, "peft_type": "LORA", **config}))
    return str(folder)


@pytest.mark.parametrize("family, tensors, config, match", [
    ("dbrx", {"transformer.blocks.0.ffn.router.layer": (4, 64)}, {}, r"ffn\.router\.layer.*routers"),
    ("dbrx", {"transformer.blocks.0.ffn.experts.mlp": (4, 64)}, {"target_parameters": ["ffn.experts.mlp.w1"]},
     r"ffn\.experts\.mlp\.w1'\] \(target_parameters\)"),
    ("dbrx", {"model.layers.0.self_attn.q_proj": (4, 64)}, {}, "DbrxForCausalLM has no q_proj to adapt"),
    ("kimi_linear", {"model.layers.1.mlp.gate_proj": (4, 64)}, {}, "layer 1 of KimiLinearForCausalLM has no gate_proj"),
    ("kimi_linear", {"model.layers.1.self_attn.forget_gate.f_a_proj": (4, 64)}, {}, "layer 1 .* has no f_a_proj"),
    ("kimi_linear", {"model.layers.0.self_attn.kv_b_proj": (4, 32)}, {}, "layer 0 .* has no kv_b_proj"),
    ("zamba2", {"model.layers.1.mamba_decoder.mamba.in_proj": (4, 64)}, {}, r"mamba_decoder\.mamba\.in_proj"),
    ("zamba2", {"model.layers.0.mamba.out_proj": (4, 128)}, {}, r"layers\.0\.mamba\.out_proj"),
    ("zamba2", {"model.layers.1.linear": (4, 64)}, {}, r"layers\.1\.linear"),
    ("zamba2", {"model.layers.1.shared_transformer.self_attn.linear_q_adapter_list.0.0": (4, 128)}, {},
     r"linear_q_adapter_list\.0\.0"),
    ("zamba2", {"model.layers.0.self_attn.q_proj": (4, 128)}, {}, "layer 0 of Zamba2ForCausalLM has no q_proj"),
    ("minimax", {"model.layers.0.self_attn.q_proj": (4, 64)}, {}, "layer 0 of MiniMaxForCausalLM has no q_proj"),
], ids=["dbrx-router", "dbrx-experts", "dbrx-separate-q", "kimi-dense-mlp-on-experts", "kimi-kda-name-on-latent",
        "kimi-latent-name-on-kda", "zamba2-mamba-in", "zamba2-mamba-out", "zamba2-linear", "zamba2-builtin-adapter",
        "zamba2-mamba-layer-attention", "minimax-softmax-name-on-lightning"])
def test_the_host_refuses_what_cannot_take_adapters(family: str, tensors, config, match: str, tmp_path) -> None:
    checker = prepare(EngineConfig.create(tiny_checkpoint(family), enable_lora=True)).lora
    with pytest.raises(InvalidRequestError, match=match):
        checker.check(LoRARequest("a", 1, _hand_made(tmp_path / "adapter", tensors, **config)))


@pytest.mark.parametrize("kind, tensors, match", [
    ("mamba2", {"backbone.layers.0.mixer.x_proj": (4, 128)}, "Mamba2ForCausalLM has no x_proj to adapt"),
    ("mamba", {"backbone.layers.0.mixer.conv1d": (4, 4)}, r"mixer\.conv1d.*only LoRA A and B"),
    ("mamba", {"backbone.embeddings": (4, 512)}, r"backbone\.embeddings.*not embeddings"),
    ("mamba", {"model.layers.1.self_attn.q_proj": (4, 64)}, r"has no self_attn layers \(adapt its mixers' mixer\.in"),
    ("nemotron_h", {"backbone.layers.0.mixer.in_proj": (4, 64)}, "the Mamba mixers of NemotronHForCausalLM take no"),
], ids=["mamba2-x_proj", "mamba-conv1d", "mamba-embeddings", "mamba-attention", "nemotron_h-mamba-mixer"])
def test_the_host_refuses_what_the_mamba_models_cannot_adapt(kind: str, tensors, match: str, tmp_path) -> None:
    """Mamba's mixers take adapters on their projections only (tests/unit/test_lora_models.py); a hybrid's Mamba
    mixers take none."""
    from mamba_utils import make_tiny_mamba

    path = tiny_checkpoint(kind) if kind == "nemotron_h" else make_tiny_mamba(tmp_path / "base", kind)
    checker = prepare(EngineConfig.create(path, enable_lora=True)).lora
    with pytest.raises(InvalidRequestError, match=match):
        checker.check(LoRARequest("a", 1, _hand_made(tmp_path / "adapter", tensors)))
