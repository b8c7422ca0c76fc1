"""AWQ and GPTQ checkpoints written on the fly, and an independent reference for serving them.

Written from the checkpoint formats (AutoAWQ's ``WQLinear_GEMM``, AutoGPTQ / GPTQModel's ``QuantLinear`` and
transformers' integrations of both), not from asyncllm's code:

- AWQ (``version: gemm``, 4 bits): ``qweight`` int32 ``[in, out/8]``; value i of an int32 (bits 4i..4i+3) is output
  column ``8c + ORDER[i]`` with ``ORDER = 0 2 4 6 1 3 5 7``; ``qzeros`` int32 ``[in/group, out/8]`` packed the same
  way; ``scales`` float16 ``[in/group, out]``; ``W[k, n] = (q[k, n] - z[k // group, n]) * s[k // group, n]``.
- GPTQ: ``qweight`` int32 ``[in * bits/32, out]``: row r holds input rows ``r * p + j`` (``p = 32/bits``) at bits
  ``j * bits``; ``qzeros`` int32 ``[groups, out * bits/32]``, value j of column c is output column ``c * p + j``,
  stored as ``(zero - 1) mod 2**bits`` (the v1 format); ``scales`` float16 ``[groups, out]``; ``g_idx`` int32
  ``[in]``, the group of each input row (``k // group`` without act-order, a permutation's with desc_act);
  ``W[k, n] = (q[k, n] - z[g_idx[k], n]) * s[g_idx[k], n]``.

Scales and zero points are drawn at random per group (zero points anywhere in ``[0, 2**bits)``, so top values set
the int32's sign bit and GPTQ v1 stores zero 0 as 15); the values are ``clamp(round(W / s + z), 0, 2**bits - 1)``.
`Int4Reference` is transformers' float32 model holding the dequantized weights.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch

from hf_reference import model_greedy, model_logits

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
               "w1", "w2", "w3",  # Mixtral-named experts (Mixtral, MiniMax-M2)
               "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")  # DeepSeek's latent attention


def to_int32(values: torch.Tensor) -> torch.Tensor:
    """int64 holding 32-bit patterns -> the int32 of the same bits."""
    return torch.where(values >= 2**31, values - 2**32, values).to(torch.int32)


def pack_awq(values: torch.Tensor) -> torch.Tensor:
    """int ``[R, C]`` in [0, 16) -> int32 ``[R, C/8]`` in AWQ's order."""
    out = torch.zeros(values.shape[0], values.shape[1] // 8, dtype=torch.int64)
    for i, column in enumerate(AWQ_ORDER):
        out |= values[:, column::8].long() << (4 * i)
    return to_int32(out)


def pack_gptq_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """int ``[K, N]`` -> int32 ``[K * bits/32, N]``: input row ``r * p + j`` at bits ``j * bits`` of row r."""
    p = 32 // bits
    out = torch.zeros(values.shape[0] // p, values.shape[1], dtype=torch.int64)
    for j in range(p):
        out |= values[j::p].long() << (bits * j)
    return to_int32(out)


def pack_gptq_columns(values: torch.Tensor, bits: int) -> torch.Tensor:
    """int ``[G, N]`` -> int32 ``[G, N * bits/32]``: column ``c * p + j`` at bits ``j * bits`` of column c."""
    p = 32 // bits
    out = torch.zeros(values.shape[0], values.shape[1] // p, dtype=torch.int64)
    for j in range(p):
        out |= values[:, j::p].long() << (bits * j)
    return to_int32(out)


def _draw_groups(wt: torch.Tensor, g_idx: torch.Tensor, num_groups: int, bits: int, gen: torch.Generator):
    """Random float16 scales and integer zero points per group; the values of ``wt [in, out]``."""
    maxq = 2**bits - 1
    spread = torch.stack([wt[g_idx == g].abs().amax(0) for g in range(num_groups)])
    scales = (spread / (maxq / 2) * (0.7 + 0.6 * torch.rand(spread.shape, generator=gen)) + 1e-3).half()
    zeros = torch.randint(0, maxq + 1, spread.shape, generator=gen)
    s, z = scales.float()[g_idx], zeros[g_idx]
    q = torch.clamp(torch.round(wt / s + z), 0, maxq).long()
    return q, scales, zeros, (q - z).float() * s


def quantize_awq(w: torch.Tensor, group: int, gen: torch.Generator) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """``w [out, in]`` -> ({qweight, qzeros, scales}, the dequantized ``[out, in]`` float32)."""
    wt = w.t().float()
    g_idx = torch.arange(wt.shape[0]) // group
    q, scales, zeros, deq = _draw_groups(wt, g_idx, int(g_idx[-1]) + 1, 4, gen)
    return {"qweight": pack_awq(q), "qzeros": pack_awq(zeros), "scales": scales}, deq.t()


def act_order_g_idx(in_features: int, group: int, gen: torch.Generator) -> torch.Tensor:
    """GPTQ's desc_act groups: the i-th input row in a random order belongs to group ``i // group``."""
    perm = torch.randperm(in_features, generator=gen)
    g_idx = torch.empty(in_features, dtype=torch.long)
    g_idx[perm] = torch.arange(in_features) // group
    return g_idx


def quantize_gptq(w: torch.Tensor, group: int, bits: int, g_idx: torch.Tensor, gen: torch.Generator,
                  v1: bool = True) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """``w [out, in]`` -> ({qweight, qzeros, scales, g_idx}, the dequantized ``[out, in]`` float32)."""
    wt = w.t().float()
    q, scales, zeros, deq = _draw_groups(wt, g_idx, -(-wt.shape[0] // group), bits, gen)
    stored = (zeros - 1) % 2**bits if v1 else zeros
    tensors = {"qweight": pack_gptq_rows(q, bits), "qzeros": pack_gptq_columns(stored, bits), "scales": scales,
               "g_idx": g_idx.to(torch.int32)}
    return tensors, deq.t()


def _is_projection(name: str, ignored: tuple[str, ...]) -> bool:
    return (name.startswith("model.layers.") and name.split(".")[-2] in PROJECTIONS and name.endswith(".weight")
            and not any(entry in name for entry in ignored))


def write_int4_checkpoint(src: str, dst: Path, method: str, group: int, bits: int = 4, desc_act: bool = False,
                          ignored: tuple[str, ...] = (), seed: int = 0) -> dict[str, torch.Tensor]:
    """``src``'s checkpoint in ``dst`` with its decoder projections quantized by ``method`` ("awq" or "gptq");
    returns the dequantized weight of every quantized projection (``...weight`` -> ``[out, in]`` float32). With
    ``desc_act`` the q, k and v (gate and up) projections share one act-order ``g_idx``, as GPTQ makes them."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(Path(src).glob("*.safetensors")):
        tensors.update(load_file(file))
    gen, dequantized, shared = torch.Generator().manual_seed(seed), {}, {}
    for name in sorted(n for n in tensors if _is_projection(n, ignored)):
        w, prefix = tensors.pop(name), name.removesuffix(".weight")
        if method == "awq":
            parts, dequantized[name] = quantize_awq(w, group, gen)
        else:
            key = (prefix.rsplit(".", 1)[0], w.shape[1], prefix.endswith(("o_proj", "down_proj")))
            size = w.shape[1] if group == -1 else group  # -1: one group for the whole input
            if key not in shared:
                shared[key] = (act_order_g_idx(w.shape[1], size, gen) if desc_act
                               else torch.arange(w.shape[1]) // size)
            parts, dequantized[name] = quantize_gptq(w, size, bits, shared[key], gen)
        tensors.update({f"{prefix}.{part}": t for part, t in parts.items()})
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = _section(method, group, bits, desc_act, ignored)
    (dst / "config.json").write_text(json.dumps(config))
    return dequantized


def _section(method: str, group: int, bits: int, desc_act: bool, ignored: tuple[str, ...]) -> dict:
    if method == "awq":
        section = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}
    else:
        section = {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": desc_act, "sym": False,
                   "checkpoint_format": "gptq"}
    return {**section, "modules_to_not_convert": list(ignored)} if ignored else section


_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_EXPERT_PART = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
"""An expert's matrix, per expert in the checkpoint, stacked in transformers 5's model."""


class Int4Reference:
    """transformers' float32 model of ``src`` whose quantized projections hold the dequantized weights."""

    def __init__(self, src: str, dequantized: dict[str, torch.Tensor]) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, weight in dequantized.items():
                expert = _EXPERT.match(name)
                if name in params or expert is None:
                    params[name].copy_(weight)
                    continue
                stacked, index = expert.group(1).replace("block_sparse_moe", "mlp"), int(expert.group(2))
                part = _EXPERT_PART.get(expert.group(3), expert.group(3))  # transformers 5's stacked experts
                if part == "down_proj":
                    params[f"{stacked}.down_proj"][index].copy_(weight)
                else:
                    gate_up = params[f"{stacked}.gate_up_proj"][index]
                    inter = gate_up.shape[0] // 2
                    gate_up[(0 if part == "gate_proj" else inter):][:inter].copy_(weight)

    def logits(self, token_ids: list[int]) -> torch.Tensor:
        return model_logits(self.model, token_ids)

    def greedy(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        return model_greedy(self.model, prompt, max_new_tokens)
