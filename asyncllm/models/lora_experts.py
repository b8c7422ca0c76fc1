"""LoRA on a mixture of experts' experts: every expert's gate, up and down products get their slot's ``B (A x)``.

An `ExpertsLoRA` sits on each `FusedMoE` of a model whose experts take adapters (``lora_experts``). It keeps,
per local expert, the dense `LoRALayer` layout: ``a13 [E, slots * 2R, H]`` / ``b13 [E, rows, slots * 2R]`` for
the gate and up rows (a slot's first R columns the gate's A, or the stacked ``gate_up_proj`` adapter's one A over
both, the next R the up's) and ``a2 [E, slots * R, I]`` / ``b2 [E, H, slots * R]`` for down, B already scaled.
An expert's tokens add ``B (mask * A x)`` to its gate/up product before the activation and to its down product
(`delta`, called by `asyncllm.kernels.reference.fused_moe`), so a batch mixes adapters and the base model.

Tensor parallel as the weights: a rank keeps its rows of gate and up (B's rows) and its columns of down (A's
columns) of every expert, or (expert parallel) its experts whole; the ranks' down products add up.

Steps that run an expert adapter go through the reference's expert loop (the Triton kernel has no LoRA input);
steps without one (``LoRAContext.experts`` False) keep the backend's kernel.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from asyncllm.models.lora import LoRAContext, SlotBuffers
from asyncllm.models.moe import FusedMoE

__all__ = ["ExpertsLoRA", "attach_expert_layers", "expert_target"]


class ExpertsLoRA(SlotBuffers):
    """The adapter slots of one layer's experts."""

    buffer_names = ("a13", "b13", "a2", "b2")

    def __init__(self, experts: FusedMoE, num_slots: int, max_rank: int, context: LoRAContext) -> None:
        super().__init__()
        self.experts = [experts]  # a list: not a submodule (the experts own this layer)
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.context = context
        n, inter, hidden = experts.num_local_experts, experts.intermediate, experts.hidden_size
        new = {"dtype": experts.params_dtype, "device": experts.w2_weight.device}
        self.a13 = torch.zeros(n, num_slots * 2 * max_rank, hidden, **new)
        self.b13 = torch.zeros(n, 2 * inter, num_slots * 2 * max_rank, **new)
        self.a2 = torch.zeros(n, num_slots * max_rank, inter, **new)
        self.b2 = torch.zeros(n, hidden, num_slots * max_rank, **new)

    def delta(self, which: int, expert: int, token_idx: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The adapters' addition to local ``expert``'s gate/up (``which`` 0) or down (1) product of ``x``, the
        rows of the step's tokens ``token_idx``."""
        a, b = (self.a13, self.b13) if which == 0 else (self.a2, self.b2)
        mask = self.context.mask[token_idx]
        xa = F.linear(x, a[expert]).view(x.shape[0], self.num_slots, -1) * mask[:, :, None]
        return F.linear(xa.view(x.shape[0], -1), b[expert])

    def clear(self, slot: int) -> None:
        for a, b, width in ((self.a13, self.b13, 2 * self.max_rank), (self.a2, self.b2, self.max_rank)):
            a[:, slot * width:(slot + 1) * width].zero_()
            b[:, :, slot * width:(slot + 1) * width].zero_()

    def set(self, slot: int, part: tuple[str, int | None], lora_a: torch.Tensor, lora_b: torch.Tensor,
            scaling: float) -> None:
        """Write one adapter matrix into a slot: ``part`` is ("gate_up" | "down", None) for PEFT's stacked
        experts (A ``[E * r, in]``, B ``[out, r * E]``), or ("gate" | "up" | "down", expert) for one expert's."""
        kind, expert = part
        experts = self.experts[0]
        start, count = experts.expert_start, experts.num_local_experts
        if expert is None:
            num_experts = experts.num_experts
            rank = lora_a.shape[0] // num_experts
            a = lora_a.view(num_experts, rank, -1)[start:start + count]
            b = lora_b.view(lora_b.shape[0], rank, num_experts).permute(2, 0, 1)[start:start + count]
            if kind == "gate_up" and experts.interleaved_gate_up:  # gpt-oss: gate rows even, up rows odd
                b = torch.cat([b[:, 0::2], b[:, 1::2]], dim=1)
            self._write(slot, kind, slice(None), a, b * scaling)
        elif experts.is_local(expert):
            local = expert - start
            self._write(slot, kind, slice(local, local + 1), lora_a[None], lora_b[None] * scaling)

    def _write(self, slot: int, kind: str, experts: slice, a: torch.Tensor, b: torch.Tensor) -> None:
        """Experts' A ``[n, r, in]`` and scaled B ``[n, out, r]`` (whole, as the checkpoint's) into the slot."""
        moe = self.experts[0]
        inter = moe.intermediate
        first = 0 if moe.expert_parallel else moe.tp.rank * inter  # this rank's rows of gate and up, columns of down
        rank = a.shape[1]
        if kind == "down":
            columns = slice(slot * self.max_rank, slot * self.max_rank + rank)
            self.a2[experts, columns] = a[:, :, first:first + inter]
            self.b2[experts, :, columns] = b
            return
        start = slot * 2 * self.max_rank + (self.max_rank if kind == "up" else 0)
        columns = slice(start, start + rank)
        self.a13[experts, columns] = a
        full = b.shape[1] // 2 if kind == "gate_up" else b.shape[1]
        for offset, src in ((0, 0), (inter, full)) if kind == "gate_up" else ((inter if kind == "up" else 0, 0),):
            self.b13[experts, offset:offset + inter, columns] = b[:, src + first:src + first + inter]


def attach_expert_layers(model: Any, num_slots: int, max_rank: int, context: LoRAContext) -> dict[str, ExpertsLoRA]:
    """An `ExpertsLoRA` on every `FusedMoE` of a model whose experts take adapters; them by module name."""
    if not getattr(model, "lora_experts", False):
        return {}
    layers = {}
    for name, module in model.named_modules():
        if isinstance(module, FusedMoE):
            module.lora = layers[name] = ExpertsLoRA(module, num_slots, max_rank, context)
    return layers


def expert_target(name: str) -> tuple[str, tuple[str, int | None]]:
    """An expert adapter module (``model.layers.L.mlp.experts.gate_up_proj``, ``...experts.3.down_proj``) ->
    (the `FusedMoE` module's name in the model: every MoE block is the layer's ``mlp``, its experts ``experts``,
    the `ExpertsLoRA.set` part)."""
    head, _, path = name.partition(".mlp.experts.")
    expert, _, projection = path.rpartition(".")
    return f"{head}.mlp.experts", (projection.removesuffix("_proj"), int(expert) if expert else None)
