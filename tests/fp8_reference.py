"""An independent reference for ``quantization="fp8"``: transformers' Llama with fake-quantized weights and
activations, emulating what each tensor-parallel rank of asyncllm quantizes.

Written from the documented semantics (docs/quantization.md), not from asyncllm's code:
- a weight is split as the TP ranks split it (q/k/v and gate/up by output rows, o/down by input
  columns); each rank's part of a fused projection (its q, k and v rows together, or its gate and up
  rows) gets one scale ``max|W| / 448``, and is replaced by ``fp8(W / scale) * scale``;
- an activation gets one scale per token ``max|x| / 448`` over the features a rank sees (all of them
  for q/k/v and gate/up; the rank's slice for o_proj and down_proj), and is replaced likewise.
"""

from __future__ import annotations

import functools

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
MIN_SCALE = 1.0 / (448.0 * 512.0)


def fake_quant(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``fp8(x / scale) * scale`` in float32 (round to nearest even, saturated at +-448)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * scale


def _tensor_scale(*parts: torch.Tensor) -> torch.Tensor:
    amax = torch.stack([p.abs().max() for p in parts]).max()
    return (amax.float() / FP8_MAX).clamp(min=MIN_SCALE)


def fake_quant_tokens(x: torch.Tensor, groups: int) -> torch.Tensor:
    """Per-token fake quantization of ``x [..., K]`` over ``groups`` equal slices of K, each with its own scale."""
    out = []
    for part in x.chunk(groups, dim=-1):
        scale = (part.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX).clamp(min=MIN_SCALE)
        out.append(fake_quant(part, scale))
    return torch.cat(out, dim=-1).to(x.dtype)


@torch.no_grad()
def _quantize_column_group(linears: list[torch.nn.Linear], tp_size: int) -> None:
    """Rows of each projection split in ``tp_size`` chunks; chunk r of every projection shares rank r's scale."""
    chunks = [lin.weight.data.chunk(tp_size, dim=0) for lin in linears]
    for rank in range(tp_size):
        scale = _tensor_scale(*(c[rank] for c in chunks))
        for c in chunks:
            c[rank].copy_(fake_quant(c[rank], scale))


@torch.no_grad()
def _quantize_row(linear: torch.nn.Linear, tp_size: int) -> None:
    for part in linear.weight.data.chunk(tp_size, dim=1):
        part.copy_(fake_quant(part, _tensor_scale(part)))


def _act_hook(groups: int):
    def hook(module, args):
        return (fake_quant_tokens(args[0], groups),) + tuple(args[1:])

    return hook


@functools.lru_cache(maxsize=None)
def fp8_hf_model(path: str, tp_size: int = 1, adapter: str | None = None):
    """transformers' float32 model of ``path`` as asyncllm's fp8 engine at ``tp_size`` computes it; with a PEFT
    ``adapter``, only the base layers are quantized (the adapter's product reads the unquantized input)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    cfg = model.config
    assert cfg.num_key_value_heads % tp_size == 0, "KV heads replicated across ranks are not emulated"
    layers = model.model.layers
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter).eval()
        layers = model.base_model.model.model.layers

    def base(module: torch.nn.Module) -> torch.nn.Linear:
        return getattr(module, "base_layer", module)

    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        q, k, v, o = base(attn.q_proj), base(attn.k_proj), base(attn.v_proj), base(attn.o_proj)
        gate, up, down = base(mlp.gate_proj), base(mlp.up_proj), base(mlp.down_proj)
        _quantize_column_group([q, k, v], tp_size)
        _quantize_column_group([gate, up], tp_size)
        _quantize_row(o, tp_size)
        _quantize_row(down, tp_size)
        for lin in (q, k, v, gate, up):
            lin.register_forward_pre_hook(_act_hook(1))
        for lin in (o, down):
            lin.register_forward_pre_hook(_act_hook(tp_size))
    return model


@torch.no_grad()
def fake_quant_experts(experts: torch.nn.Module, tp_size: int) -> None:
    """transformers 5's stacked experts (``gate_up_proj [E, 2I, H]``: gate rows, then up rows; ``down_proj [E, H,
    I]``): each expert's gate and up split by rows, its down by columns, as the ranks split them; every part its
    own scale."""
    inter = experts.gate_up_proj.shape[1] // 2
    for gate_up, down in zip(experts.gate_up_proj.data, experts.down_proj.data):
        parts = [*gate_up[:inter].chunk(tp_size, 0), *gate_up[inter:].chunk(tp_size, 0), *down.chunk(tp_size, 1)]
        for part in parts:
            part.copy_(fake_quant(part, _tensor_scale(part)))


def _quantize_moe_attention(model) -> None:
    """One rank's online fp8 attention of a transformers mixture of experts (each layer's ``self_attn``)."""
    for layer in model.model.layers:
        attn = layer.self_attn
        _quantize_column_group([attn.q_proj, attn.k_proj, attn.v_proj], 1)
        _quantize_row(attn.o_proj, 1)
        for lin in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj):
            lin.register_forward_pre_hook(_act_hook(1))


@functools.lru_cache(maxsize=None)
def fp8_moe_hf_model(path: str):
    """transformers' float32 mixture of experts (every layer's MLP one: Mixtral, Qwen3-MoE) of ``path`` as
    asyncllm's online fp8 computes it on one rank: the attention as `fp8_hf_model`'s, each expert's gate, up and
    down matrix by its own scale, each expert product's input per token (one scale per token's row); routers,
    norms and the LM head float."""
    from fp8_checkpoint_reference import _fp8_experts_forward
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    _quantize_moe_attention(model)
    for layer in model.model.layers:
        experts = layer.mlp.experts
        fake_quant_experts(experts, 1)
        experts.forward = functools.partial(_fp8_experts_forward, experts, group=None)
    return model


def fp8_hf_greedy(path: str, prompt_ids: list[int], max_new_tokens: int, tp_size: int = 1,
                  adapter: str | None = None) -> list[int]:
    model = fp8_hf_model(path, tp_size, adapter)
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                             attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long))
    return out[0, len(prompt_ids):].tolist()


def fp8_hf_logits(path: str, token_ids: list[int], tp_size: int = 1, adapter: str | None = None) -> torch.Tensor:
    model = fp8_hf_model(path, tp_size, adapter)
    with torch.no_grad():
        out = model(input_ids=torch.tensor([token_ids]),
                    attention_mask=torch.ones(1, len(token_ids), dtype=torch.long))
    return out.logits[0].float()
