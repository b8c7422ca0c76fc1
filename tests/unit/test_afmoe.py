"""Arcee AFMoE (``AfmoeForCausalLM``, Trinity; asyncllm/models/afmoe.py) against transformers' forward over a paged KV
cache: a sliding-window layer (rotating, 8 tokens, shorter than the prompts) with a dense MLP, then a global layer
without positions with experts (sigmoid scores, a random expert bias choosing, renormalized, times ``route_scale``)
and a shared expert, gated attention with per-head q/k norms, four norms per layer, muP-scaled embeddings. Every
position's float32 logits equal transformers' within 1e-4 in chunked prefills beside decodes, alone, from stacked
experts and over two tensor-parallel ranks (split by rows; by experts: tests/engine/test_afmoe_engine.py); the
norms round as transformers' in bfloat16; routing settings transformers does not run are refused."""

from __future__ import annotations

import pytest
import torch
from model_utils import assert_paged_logits_match_checkpoint, free_port, spawn_ranks, tp_worker

from asyncllm.config import EngineConfig
from asyncllm.errors import NotBuiltError
from asyncllm.models.afmoe import AfmoeForCausalLM
from asyncllm.models.loader import load_hf_config, load_model
from asyncllm.tiny import tiny_checkpoint

SEQ_LENS = [12, 20, 11]
SCHEDULE = [[5, 9, 0], [4, 9, 4], [1, 1, 5], [1, 1, 1], [1, 0, 1]]
"""Prefill chunks beside decodes, then decode-only steps."""


def _load(path: str, **engine_kwargs: object) -> AfmoeForCausalLM:
    model = load_model(EngineConfig.create(path, **engine_kwargs), load_hf_config(path), torch.device("cpu"),
                       torch.float32)
    assert type(model) is AfmoeForCausalLM
    return model


@pytest.mark.parametrize("overrides", [{}, {"num_dense_layers": 0, "num_shared_experts": 2, "mup_enabled": False,
                                            "global_attn_every_n_layers": 1, "attention_bias": True}],
                         ids=["trinity", "all-experts-global-biased"])
def test_logits_match_transformers(overrides: dict) -> None:
    """The tiny Trinity, and one with experts in every layer, two shared experts, only global layers, biases."""
    path = tiny_checkpoint("afmoe", **overrides)
    assert_paged_logits_match_checkpoint(_load(path), path, SEQ_LENS, SCHEDULE, seed=len(overrides))


def test_the_layers_are_built_as_their_kinds() -> None:
    """Layer 0: sliding window, rotating, dense; layer 1: global, no rotation (cos 1, sin 0), experts."""
    model = _load(tiny_checkpoint("afmoe"))
    sliding, full = (layer.self_attn for layer in model.model.layers)
    assert (sliding.attn.sliding_window, full.attn.sliding_window) == (8, None)
    assert not torch.equal(sliding.rotary_emb.cos_sin_cache, full.rotary_emb.cos_sin_cache)
    cos, sin = full.rotary_emb.cos_sin_cache.chunk(2, dim=-1)
    assert torch.equal(cos, torch.ones_like(cos)) and torch.equal(sin, torch.zeros_like(sin))
    assert model.model.layers[1].mlp.router.gate.weight.abs().sum() > 0  # loaded, not left at zero
    assert model.model.embed_scale == 8.0  # sqrt(64)


def test_stacked_experts_load_as_the_per_expert_ones(tmp_path) -> None:
    """transformers 5 holds the experts stacked (``experts.gate_up_proj`` / ``down_proj``): a checkpoint saved that
    way gives transformers' logits too."""
    import shutil

    from safetensors.torch import load_file, save_file

    src = tiny_checkpoint("afmoe")
    stacked = tmp_path / "stacked"
    shutil.copytree(src, stacked)
    tensors = load_file(stacked / "model.safetensors")
    prefix, experts = "model.layers.1.mlp.experts", range(8)
    gate_up = [torch.cat([tensors.pop(f"{prefix}.{e}.gate_proj.weight"), tensors.pop(f"{prefix}.{e}.up_proj.weight")])
               for e in experts]
    tensors[f"{prefix}.gate_up_proj"] = torch.stack(gate_up)
    tensors[f"{prefix}.down_proj"] = torch.stack([tensors.pop(f"{prefix}.{e}.down_proj.weight") for e in experts])
    save_file(tensors, stacked / "model.safetensors", metadata={"format": "pt"})
    assert_paged_logits_match_checkpoint(_load(str(stacked)), src, SEQ_LENS, SCHEDULE, seed=3)


def test_norms_round_as_transformers_in_bfloat16() -> None:
    """transformers keeps AFMoE's norms in float32 and rounds once after the weight: the served norms do too (Llama's
    rounds before it, which differs in bfloat16)."""
    from transformers.models.afmoe.modeling_afmoe import AfmoeRMSNorm

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(32, 64, generator=gen).to(torch.bfloat16)
    hf_norm = AfmoeRMSNorm(64, eps=1e-5)  # float32, as from_pretrained keeps it; the tiny model's width and eps
    with torch.no_grad():
        hf_norm.weight.copy_((1 + torch.randn(64, generator=gen)).to(torch.bfloat16))
        expected = hf_norm(x)
    path = tiny_checkpoint("afmoe")
    model = load_model(EngineConfig.create(path), load_hf_config(path), torch.device("cpu"), torch.bfloat16)
    norm = model.model.layers[0].pre_mlp_layernorm
    norm.weight.data.copy_(hf_norm.weight)
    assert torch.equal(norm(x), expected)


@pytest.mark.parametrize(("field", "value"), [("score_func", "softmax"), ("route_norm", False),
                                              ("topk_group", 1), ("hidden_act", "gelu")])
def test_routing_transformers_does_not_run_is_refused(field: str, value: object) -> None:
    hf_config = load_hf_config(tiny_checkpoint("afmoe"))
    setattr(hf_config, field, value)
    if field == "topk_group":
        hf_config.n_group = 2
    with pytest.raises(NotBuiltError) as info:
        load_model(EngineConfig.create(tiny_checkpoint("afmoe")), hf_config, torch.device("cpu"), torch.float32)
    assert info.value.field == field


@pytest.mark.slow
def test_tp2_logits_match_transformers(tmp_path) -> None:
    """Two gloo ranks, each holding half the heads (and their rows of the output gate) and half of every expert's
    intermediate rows: every rank's logits equal transformers'."""
    from hf_reference import hf_logits

    path = tiny_checkpoint("afmoe")
    gen = torch.Generator().manual_seed(2)
    sequences = [torch.randint(6, 512, (n,), generator=gen).tolist() for n in SEQ_LENS]
    spawn_ranks(tp_worker, (2, free_port(), [path], str(tmp_path), sequences, SCHEDULE))
    for rank in range(2):
        for tokens, logits in zip(sequences, torch.load(tmp_path / f"rank{rank}_0.pt"), strict=True):
            torch.testing.assert_close(logits, hf_logits(path, tokens), atol=1e-4, rtol=0)


def test_an_adapter_of_the_attentions_gate_goes_to_the_gate(tmp_path) -> None:
    """An adapter naming ``self_attn.gate_proj`` (what PEFT writes for transformers 4's remote-code AFMoE; PEFT on
    transformers 5 takes any ``gate_proj`` for the experts') changes the attention's output gate, not the MLPs'
    fused ``gate_up_proj``: the logits equal transformers' with ``W + (alpha / r) B A`` merged into that gate, for a
    sequence beside one on the base model."""
    import json
    import shutil

    from model_utils import MaskedRun
    from safetensors.torch import load_file, save_file

    from asyncllm.lora import LoRARequest, read_adapter
    from asyncllm.lora_checker import AdapterChecker
    from asyncllm.models.lora import LoRAContext, attach_lora_layers, load_adapter_tensors
    from asyncllm.models.registry import kv_cache_spec
    from hf_reference import hf_logits

    path, rank, alpha = tiny_checkpoint("afmoe"), 4, 8
    gen = torch.Generator().manual_seed(9)
    adapter, merged = tmp_path / "adapter", tmp_path / "merged"
    adapter.mkdir()
    shutil.copytree(path, merged)
    weights, tensors = load_file(merged / "model.safetensors"), {}
    for layer in range(2):
        name = f"model.layers.{layer}.self_attn.gate_proj"
        a, b = torch.randn(rank, 64, generator=gen) * 0.3, torch.randn(64, rank, generator=gen) * 0.3
        tensors |= {f"base_model.model.{name}.lora_A.weight": a, f"base_model.model.{name}.lora_B.weight": b}
        weights[f"{name}.weight"] = weights[f"{name}.weight"] + alpha / rank * b @ a
    save_file(tensors, adapter / "adapter_model.safetensors")
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": alpha,
                                                             "target_modules": ["gate_proj"]}))
    save_file(weights, merged / "model.safetensors", metadata={"format": "pt"})
    checked = AdapterChecker(load_hf_config(path), max_lora_rank=8).check(LoRARequest("gate", 1, str(adapter)))
    assert checked.lora_path == str(adapter)  # the host's check takes it (the gate's shape, not the MLP's)
    model = _load(path, max_model_len=64)
    context = LoRAContext()
    layers = attach_lora_layers(model, 2, 8, context)
    loaded = load_adapter_tensors(read_adapter(str(adapter)), model)
    assert [(name, part) for name, part, *_ in loaded] == [(f"model.layers.{i}.self_attn.gate_proj", None)
                                                           for i in range(2)]
    for name, part, lora_a, lora_b, scaling in loaded:
        layers[name].set(1, part, lora_a, lora_b, scaling)
    sequences = [torch.randint(6, 512, (n,), generator=gen).tolist() for n in (23, 19)]
    run = MaskedRun(model, sequences, block_size=4)
    run.context, run.slots, run.num_slots = context, [1, -1], 2
    run.new_kv_caches_for(kv_cache_spec(load_hf_config(path), 1), torch.float32)
    with_adapter, base = run.run([[9, 7], [6, 1], [1, 1], [1, 9], [6, 1]])
    expected = hf_logits(str(merged), sequences[0])
    assert (expected - hf_logits(path, sequences[0])).abs().max() > 0.5  # the adapter changes the logits
    torch.testing.assert_close(with_adapter, expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(base, hf_logits(path, sequences[1]), atol=1e-4, rtol=0)
