"""Pre-quantized fp8 checkpoints written on the fly, and an independent reference for serving them.

Written from the checkpoint format (transformers' FineGrainedFP8, DeepSeek-V3 and Qwen3-FP8 checkpoints: a
float8_e4m3fn ``weight`` and a float32 ``weight_scale_inv`` per 2-D block, the multiplier; or one scalar
``weight_scale`` per tensor, and with AutoFP8's static activations one scalar ``input_scale``) and
docs/quantization.md, not from asyncllm's code:

- `write_fp8_checkpoint` quantizes a float checkpoint's decoder projections block by block (or per tensor),
  in plain loops, and writes safetensors plus a config.json with its ``quantization_config``;
- `Fp8Reference` is transformers' float32 model of the float checkpoint whose quantized projections hold the
  dequantized weights (per tensor: the fused shards requantized to their largest scale, as vLLM serves them)
  and fake-quantize their input per token: in groups of ``bk`` features (block-wise), or whole (per tensor);
  with static scales, with the largest ``input_scale`` of the projections fused with it instead.
  DeepSeek's ``kv_b_proj`` is the exception: a latent-attention server absorbs its dequantized matrix into the
  queries and outputs (docs/deepseek.md), so its input, the cached latent, is never quantized.
  A mixture of experts' experts (per expert in the checkpoint, stacked in transformers 5's model) likewise:
  the dequantized matrices stacked, each product's input fake-quantized per token group (per tensor: each
  expert matrix dequantized with its own scalar, each input whole per token; with static scales, vLLM's one scale
  per product: the largest ``input_scale`` of the layer's experts' gate and up matrices, and of their downs).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch

from hf_reference import model_greedy, model_logits

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
MIN_SCALE = 1.0 / (448.0 * 512.0)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
               "in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj",  # Qwen3.5's linear attention
               "in_proj_qkvz", "in_proj_ba",  # Qwen3-Next's fused ones
               "w1", "w2", "w3",  # Mixtral-named experts (MiniMax-M2)
               "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")  # DeepSeek's latent attention
FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def _scale(t: torch.Tensor) -> torch.Tensor:
    return (t.abs().max().float() / FP8_MAX).clamp(min=MIN_SCALE)


def _to_fp8(t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (t.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def quantize_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight, float32 ``weight_scale_inv``): each ``block`` cell its own ``max|cell| / 448``."""
    bn, bk = block
    q = torch.empty(w.shape, dtype=FP8)
    scale = torch.empty(-(-w.shape[0] // bn), -(-w.shape[1] // bk))
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            cell = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk]
            scale[i, j] = _scale(cell)
            q[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = _to_fp8(cell, scale[i, j])
    return q, scale


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    bn, bk = block
    out = q.float()
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            out[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] *= scale[i, j]
    return out


def _is_projection(name: str) -> bool:
    """A decoder projection's weight (an image-text checkpoint's language model in transformers 5's layout too)."""
    return (name.startswith(("model.layers.", "model.language_model.layers.")) and name.split(".")[-2] in PROJECTIONS
            and name.endswith(".weight"))


def write_fp8_checkpoint(src: str, dst: Path, block: tuple[int, int] | None, ignored: tuple[str, ...] = (),
                         extra_config: dict | None = None,
                         input_scales: dict[str, float] | None = None) -> dict[str, torch.Tensor]:
    """``src``'s checkpoint in ``dst`` with its decoder projections in fp8 (those containing an ``ignored`` entry
    stay float); ``input_scales`` (per tensor): each projection's static ``input_scale`` by its name (``q_proj``),
    with ``activation_scheme: "static"``. Returns the checkpoint tensors."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(Path(src).glob("*.safetensors")):
        tensors.update(load_file(file))
    for name in [n for n in tensors if _is_projection(n) and not any(entry in n for entry in ignored)]:
        w = tensors.pop(name)
        if block is None:
            tensors[name + "_scale"] = _scale(w)
            tensors[name] = _to_fp8(w, tensors[name + "_scale"])
            if input_scales is not None:
                tensors[name.removesuffix("weight") + "input_scale"] = torch.tensor(input_scales[name.split(".")[-2]])
        else:
            tensors[name], tensors[name + "_scale_inv"] = quantize_blocks(w, block)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    section = {"quant_method": "fp8", "activation_scheme": "dynamic" if input_scales is None else "static",
               **(extra_config or {})}
    if block is not None:
        section["weight_block_size"] = list(block)
    if ignored:
        section["modules_to_not_convert"] = list(ignored)
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, "quantization_config": section}))
    return tensors


def _group_fake_quant(x: torch.Tensor, group: int) -> torch.Tensor:
    out = torch.empty_like(x, dtype=torch.float32)
    for start in range(0, x.shape[-1], group):
        part = x[..., start:start + group].float()
        scale = (part.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
        out[..., start:start + group] = _to_fp8(part, scale).float() * scale
    return out.to(x.dtype)


def _static_fake_quant(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (_to_fp8(x, scale).float() * scale).to(x.dtype)


def _fused_with(name: str) -> list[str]:
    """The checkpoint names of the projections fused with ``name``'s (itself included), by their ``weight``."""
    part = name.split(".")[-2]
    group = next((g for g in FUSED if part in g), (part,))
    return [name.replace(f".{part}.", f".{other}.") for other in group]


def _static_input_scale(tensors: dict[str, torch.Tensor], name: str) -> torch.Tensor | None:
    """The largest ``input_scale`` of the projections fused with ``name``'s; None when the checkpoint has none."""
    scales = [tensors.get(n.removesuffix("weight") + "input_scale") for n in _fused_with(name)]
    return None if scales[0] is None else torch.stack(scales).max()


def _requantized(tensors: dict[str, torch.Tensor], names: list[str]) -> dict[str, torch.Tensor]:
    """Per tensor: the dequantized weights after requantizing each fused group to its largest scale."""
    max_scale = torch.stack([tensors[n + "_scale"] for n in names]).max()
    out = {}
    for n in names:
        value = tensors[n].float() * tensors[n + "_scale"]
        out[n] = _to_fp8(value, max_scale).float() * max_scale
    return out


def dequantized_weights(tensors: dict[str, torch.Tensor], block: tuple[int, int] | None) -> dict[str, torch.Tensor]:
    """Every fp8 projection's weight as the engine computes with it."""
    fp8_names = [n for n in tensors if _is_projection(n) and tensors[n].dtype == FP8]
    if block is not None:
        return {n: dequantize_blocks(tensors[n], tensors[n + "_scale_inv"], block) for n in fp8_names}
    out: dict[str, torch.Tensor] = {}
    for name in fp8_names:
        if _EXPERT.match(name):  # each expert matrix by its own scale: nothing fused, nothing requantized
            out[name] = tensors[name].float() * tensors[name + "_scale"]
            continue
        out.update(_requantized(tensors, _fused_with(name)))
    return out


class Fp8Reference:
    """transformers' float32 model of ``src`` computing as a server of the fp8 checkpoint ``tensors`` does."""

    def __init__(self, src: str, tensors: dict[str, torch.Tensor], block: tuple[int, int] | None,
                 auto_class=None) -> None:
        from transformers import AutoModelForCausalLM

        self.model = (auto_class or AutoModelForCausalLM).from_pretrained(src, dtype=torch.float32).eval()
        modules = dict(self.model.named_modules())
        group = block[1] if block is not None else None
        with torch.no_grad():
            for name, weight in dequantized_weights(tensors, block).items():
                expert = _EXPERT.match(name)
                if expert is not None:
                    part = _EXPERT_PART.get(expert.group(3), expert.group(3))
                    experts = modules.get(expert.group(1)) or modules[expert.group(1).replace("block_sparse_moe", "mlp")]
                    _set_expert(experts, int(expert.group(2)), part, weight, group,
                                _expert_input_scales(tensors, expert.group(1)))
                    continue
                linear = modules[name.removesuffix(".weight")]
                linear.weight.copy_(weight)
                if name.endswith(".kv_b_proj.weight"):  # latent attention absorbs it: its input is never quantized
                    continue
                static = _static_input_scale(tensors, name)
                linear.register_forward_pre_hook(lambda m, args, s=static: (_fake_quant_input(m, args[0], group, s),)
                                                 + tuple(args[1:]))

    def logits(self, token_ids: list[int]) -> torch.Tensor:
        return model_logits(self.model, token_ids)

    def greedy(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        return model_greedy(self.model, prompt, max_new_tokens)


def _fake_quant_input(linear, x: torch.Tensor, group: int | None, static: torch.Tensor | None) -> torch.Tensor:
    """A quantized projection's input fake-quantized per token group, or with its ``static`` scale; the served model's
    values where ``linear.served`` is set (tests/served_inputs.py)."""
    x = getattr(linear, "served", lambda rows: rows)(x)
    return _group_fake_quant(x, group or x.shape[-1]) if static is None else _static_fake_quant(x, static)


_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_EXPERT_PART = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def _expert_input_scales(tensors: dict[str, torch.Tensor], prefix: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The static input scales of the experts ``prefix`` (``...experts``) as vLLM serves them: (the largest gate or
    up ``input_scale``, the largest down one); None when the checkpoint has none."""
    scales: dict[bool, list[torch.Tensor]] = {True: [], False: []}
    for name, value in tensors.items():
        match = _EXPERT.match(name.removesuffix("input_scale") + "weight")
        if name.endswith(".input_scale") and match is not None and match.group(1) == prefix:
            scales[match.group(3) in ("down_proj", "w2")].append(value)
    return (torch.stack(scales[False]).max(), torch.stack(scales[True]).max()) if scales[True] else None


def _set_expert(experts, index: int, part: str, weight: torch.Tensor, group: int | None,
                static: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """One expert's dequantized matrix into transformers' stacked ``gate_up_proj`` / ``down_proj``; the module then
    computes with its products' inputs fake-quantized (per token, or with the ``static`` scales)."""
    if part == "down_proj":
        experts.down_proj[index].copy_(weight)
    else:
        inter = experts.gate_up_proj.shape[1] // 2
        experts.gate_up_proj[index, (0 if part == "gate_proj" else inter):][:inter].copy_(weight)
    experts.forward = lambda hidden, ids, weights: _fp8_experts_forward(experts, hidden, ids, weights, group,
                                                                        static=static)


def routed_tokens(hidden: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x ``[6, hidden]``, expert ids ``[6, 2]`` over 4 experts, routing weights ``[6, 2]``): seeded inputs for one
    layer's experts."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, hidden, generator=gen)
    return x, torch.tensor([[0, 1], [2, 3], [1, 3], [0, 2], [3, 0], [1, 2]]), torch.rand(6, 2, generator=gen)


def _fp8_experts_forward(experts, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                         group: int | None, fake_quant=None,
                         static: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """transformers' experts with each product's input fake-quantized: fp8 per token in groups of ``group`` (None:
    whole), or by ``fake_quant`` (int8 W8A8 experts), or fp8 with the ``static`` scales (gate/up's, down's); the
    values quantized are the served model's where ``experts.served`` is set (tests/served_inputs.py)."""
    fake_quant = fake_quant or (lambda t: _group_fake_quant(t, group or t.shape[-1]))
    quant_in, quant_act = (fake_quant, fake_quant) if static is None else (
        lambda t: _static_fake_quant(t, static[0]), lambda t: _static_fake_quant(t, static[1]))
    served = getattr(experts, "served", lambda which, rows: rows)  # tests/served_inputs.py
    out = torch.zeros_like(hidden)
    x = quant_in(served(0, hidden))
    for e in ids.unique().tolist():
        token, slot = torch.where(ids == e)
        gate, up = torch.nn.functional.linear(x[token], experts.gate_up_proj[e]).chunk(2, dim=-1)
        act = quant_act(served(1, experts.act_fn(gate) * up))
        out.index_add_(0, token, torch.nn.functional.linear(act, experts.down_proj[e]) * weights[token, slot, None])
    return out

