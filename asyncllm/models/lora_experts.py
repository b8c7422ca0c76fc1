"""LoRA on a mixture of experts' experts: every expert's gate, up and down products get their slot's ``B (A x)``.

An `ExpertsLoRA` sits on each `FusedMoE` of a model whose experts take adapters (``lora_experts``). It keeps,
per local expert, the dense `LoRALayer` layout: ``a13 [E, slots * 2R, H]`` (a slot's first R rows the gate's A,
the next R the up's; the stacked ``gate_up_proj`` adapter's one A in both), ``b1 [E, I, slots * R]`` and
``b3 [E, I, slots * R]`` for the gate and up rows, and ``a2 [E, slots * R, I]`` / ``b2 [E, H, slots * R]`` for
down, B already scaled.
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

from asyncllm.models.lora import LoRAContext, SlotBuffers, scaled_b, slot_masked
from asyncllm.models.moe import FusedMoE

__all__ = ["ExpertsLoRA", "attach_expert_layers", "expert_target"]


class ExpertsLoRA(SlotBuffers):
    """The adapter slots of one layer's experts."""

    buffer_names = ("a13", "b1", "b3", "a2", "b2")

    def __init__(self, experts: FusedMoE, num_slots: int, max_rank: int, context: LoRAContext,
                 transposed: bool = False) -> None:
        super().__init__()
        self.experts = [experts]  # a list: not a submodule (the experts own this layer)
        self.transposed = transposed
        """PEFT stores this model's stacked-expert adapters with A and B each in the other's place (its parameters
        are ``[E, in, out]``: Llama 4): A's rows map the output, B's the input."""
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.context = context
        n, inter, hidden = experts.num_local_experts, experts.intermediate, experts.hidden_size
        new = {"dtype": experts.params_dtype, "device": experts.w2_weight.device}
        self.a13 = torch.zeros(n, num_slots * 2 * max_rank, hidden, **new)
        self.b1 = torch.zeros(n, inter, num_slots * max_rank, **new)
        self.b3 = torch.zeros(n, inter, num_slots * max_rank, **new)
        self.a2 = torch.zeros(n, num_slots * max_rank, inter, **new)
        self.b2 = torch.zeros(n, hidden, num_slots * max_rank, **new)

    def delta(self, which: int, expert: int, token_idx: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The adapters' addition to local ``expert``'s gate/up (``which`` 0) or down (1) product of ``x``, the
        rows of the step's tokens ``token_idx``."""
        rows = x.shape[0]
        mask = self.context.mask[token_idx][:, :, None]
        if which == 1:
            xa = slot_masked(F.linear(x, self.a2[expert]).view(rows, self.num_slots, -1), mask)
            return F.linear(xa.view(rows, -1), self.b2[expert])
        xa = slot_masked(F.linear(x, self.a13[expert]).view(rows, self.num_slots, 2, -1), mask[:, :, :, None])
        gate = F.linear(xa[:, :, 0].reshape(rows, -1), self.b1[expert])
        return torch.cat([gate, F.linear(xa[:, :, 1].reshape(rows, -1), self.b3[expert])], dim=1)

    def clear(self, slot: int) -> None:
        rank = self.max_rank
        self.a13[:, 2 * slot * rank:2 * (slot + 1) * rank].zero_()
        self.a2[:, slot * rank:(slot + 1) * rank].zero_()
        for b in (self.b1, self.b3, self.b2):
            b[:, :, slot * rank:(slot + 1) * rank].zero_()

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
            if self.transposed:  # delta = A^T B^T of the stored ones: B's columns act first
                a, b = b.transpose(1, 2), a.transpose(1, 2)
            if kind == "gate_up" and experts.interleaved_gate_up:  # gpt-oss: gate rows even, up rows odd
                b = torch.cat([b[:, 0::2], b[:, 1::2]], dim=1)
            self._write(slot, kind, slice(None), a, scaled_b(b, scaling, self.b2.dtype))
        elif experts.is_local(expert):
            local = expert - start
            self._write(slot, kind, slice(local, local + 1), lora_a[None],
                        scaled_b(lora_b[None], scaling, self.b2.dtype))

    def _write(self, slot: int, kind: str, experts: slice, a: torch.Tensor, b: torch.Tensor) -> None:
        """Experts' A ``[n, r, in]`` and scaled B ``[n, out, r]`` (whole, as the checkpoint's) into the slot."""
        moe = self.experts[0]
        inter = moe.intermediate
        first = moe.intermediate_start  # this rank's rows of gate and up, columns of down
        rank = a.shape[1]
        columns = slice(slot * self.max_rank, slot * self.max_rank + rank)
        if kind == "down":
            self.a2[experts, columns] = a[:, :, first:first + inter]
            self.b2[experts, :, columns] = b
            return
        full = b.shape[1] // 2 if kind == "gate_up" else 0  # a stacked B's up rows follow its gate rows
        for part, target, src in ((0, self.b1, 0), (1, self.b3, full)):
            if kind in ("gate_up", ("gate", "up")[part]):
                a_rows = slice((2 * slot + part) * self.max_rank, (2 * slot + part) * self.max_rank + rank)
                self.a13[experts, a_rows] = a
                target[experts, :, columns] = b[:, src + first:src + first + inter]


def attach_expert_layers(model: Any, num_slots: int, max_rank: int, context: LoRAContext) -> dict[str, ExpertsLoRA]:
    """An `ExpertsLoRA` on every `FusedMoE` of a model whose experts take adapters; them by module name."""
    if not getattr(model, "lora_experts", False):
        return {}
    layers, transposed = {}, bool(getattr(model, "lora_experts_transposed", False))
    for name, module in model.named_modules():
        if isinstance(module, FusedMoE):
            module.lora = layers[name] = ExpertsLoRA(module, num_slots, max_rank, context, transposed)
    return layers


def expert_target(name: str) -> tuple[str, tuple[str, int | None]]:
    """An expert adapter module (``model.layers.L.mlp.experts.gate_up_proj``, ``...experts.3.down_proj``) ->
    (the `FusedMoE` module's name in the model: every MoE block is the layer's ``mlp``, its experts ``experts``,
    the `ExpertsLoRA.set` part)."""
    head, _, path = name.partition(".mlp.experts.")
    expert, _, projection = path.rpartition(".")
    return f"{head}.mlp.experts", (projection.removesuffix("_proj"), int(expert) if expert else None)
