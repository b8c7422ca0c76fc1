"""LoRA on the worker: every adapted projection computes ``W x + sum over slots of mask * B_s (A_s x)``.

Each projection of every decoder layer gets a `LoRALayer` holding the A and
B matrices of ``max_loras`` adapter slots, stacked: A is ``[slots * width,
in]`` and B ``[out, slots * width]``, where ``width`` is ``max_lora_rank``
times the projection's parts (q, k, v for ``qkv_proj``; gate, up for
``gate_up_proj``). B is stored already multiplied by the adapter's scaling,
and its unused rows and columns are zeros. A step's `LoRAContext.mask`
(``[tokens, slots]``, one 1 per token whose request has an adapter) selects
each token's own slot's intermediate values and sets every other slot's to 0 (`slot_masked`: a select, so an
overflow in another adapter's product never becomes a NaN here), so one pair of matrix products serves
a batch that mixes adapters and the base model, with shapes that do not
depend on which adapters are in it. Steps without an adapter skip it all
(``mask`` None): the base model's computation, unchanged.

Tensor parallel: a column-parallel projection keeps A whole and this rank's
rows of B (the rows its weight keeps); a row-parallel one keeps this rank's
columns of A and all of B, and adds its partial product before the all-reduce.

A model whose rotary turns interleaved pairs reorders its q and k rows at load (`InterleavedRotaryLoading`): the
rows of those projections' B are reordered the same way (ERNIE 4.5, Command R, Helium).

Fused checkpoints (Phi-3: ``qkv_proj``, ``gate_up_proj``; the model's
``fused_parts``): their adapters hold one A and one B over the fused rows, as
vLLM's packed modules. The projection then has one part (``width`` is
``max_lora_rank``): A goes in whole, and B is cut by the fused rows' parts
(q, k, v; gate, up), each part's rows landing where the projection's weight
keeps that part, so a rank keeps its heads of q, of k and of v.
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from asyncllm.lora import Adapter
from asyncllm.models.linear import ColumnParallelLinear, RowParallelLinear, _ColumnParallelLinear

__all__ = ["LoRAContext", "LoRALayer", "attach_lora_layers", "load_adapter_tensors", "scaled_b", "slot_masked"]


class LoRAContext:
    """The step's adapter mask, shared by every `LoRALayer` of a model.

    The runner writes its fields only through `set_step`, all of them at once (a step without adapters
    too): no field of an earlier step outlives it (asyncllm/models/whisper_lora.py swaps the mask within a step).
    """

    def __init__(self) -> None:
        self.set_step(None)

    def set_step(self, mask: torch.Tensor | None, experts: bool = False) -> None:
        """The step's fields; ``set_step(None)``: a step without adapters (the layers add nothing)."""
        self.mask: torch.Tensor | None = mask
        """``[tokens, slots]`` in the model's dtype: 1 where the token's request uses the slot's adapter."""
        self.experts = experts and mask is not None
        """Whether a request of the step runs an adapter of the experts (asyncllm/models/lora_experts.py)."""


def scaled_b(lora_b: torch.Tensor, scaling: float, dtype: torch.dtype) -> torch.Tensor:
    """``scaling * lora_b`` in float32 at least (or the slots' `dtype`, if wider), rounded once into the slots; never
    in a half-precision file's dtype: a bfloat16 adapter's B times 16 / 6 rounded to bfloat16 changes a float32
    model's tokens (PEFT upcasts the adapter's matrices; vLLM scales them in the model's dtype)."""
    wide = torch.promote_types(torch.promote_types(lora_b.dtype, dtype), torch.float32)
    return lora_b.to(wide) * scaling


def slot_masked(products: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each token's products of its own request's slot, 0 in every other: a select, not a multiply, so another
    adapter's product that overflowed (inf in fp16) or went NaN on this token's input never reaches it (inf * 0
    is NaN). `mask` broadcasts against `products`."""
    return products.masked_fill(mask == 0, 0)


class SlotBuffers(nn.Module):
    """Adapter slots kept in buffers (`buffer_names`) whose memory sleep mode gives back."""

    buffer_names: tuple[str, ...] = ()

    def __init__(self) -> None:
        super().__init__()
        self.shapes: dict[str, tuple[int, ...]] | None = None
        """While released (sleep mode): each buffer's shape."""

    def release(self) -> None:
        """Sleep mode: give the slots' memory back (`reallocate` takes it back, every slot empty)."""
        if self.shapes is None:  # not released already
            self.shapes = {name: tuple(getattr(self, name).shape) for name in self.buffer_names}
            for name in self.buffer_names:
                setattr(self, name, getattr(self, name).new_empty(0))

    def reallocate(self) -> None:
        if self.shapes is not None:
            for name in self.buffer_names:
                setattr(self, name, getattr(self, name).new_zeros(self.shapes[name]))
            self.shapes = None


class LoRALayer(SlotBuffers):
    """The adapter slots of one projection (`attach_lora_layers` puts one on every projection)."""

    buffer_names = ("a", "b")

    def __init__(self, base: nn.Module, parts: list[object], num_slots: int, max_rank: int,
                 context: LoRAContext, fused_rows: list[tuple[object, int]] | None = None) -> None:
        super().__init__()
        weight = base.weight
        self.row_parallel = isinstance(base, RowParallelLinear)
        self.base = [base]  # a list: not a submodule (the projection owns this layer, not the reverse)
        self.parts = parts
        """The shard ids of the checkpoint matrices stacked in the projection (``[None]`` when unfused)."""
        self.fused_rows = fused_rows
        """A fused checkpoint matrix's parts in its row order, (shard id, rows); None when not fused."""
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.width = max_rank * len(parts)
        self.context = context
        out_features, in_features = weight.shape
        dtype = base.params_dtype  # the model dtype, also over an fp8 weight (quantization="fp8")
        self.register_buffer("a", weight.new_zeros(num_slots * self.width, in_features, dtype=dtype),
                             persistent=False)
        self.register_buffer("b", weight.new_zeros(out_features, num_slots * self.width, dtype=dtype),
                             persistent=False)

    def forward(self, x: torch.Tensor, out: torch.Tensor, tokens: slice | torch.Tensor | None = None) -> torch.Tensor:
        """``out`` (the projection's output for ``x``) plus the step's adapters' products; ``tokens``: which of the
        step's tokens ``x`` holds, where not all (Mamba's ``x_proj`` / ``dt_proj``, run request by request)."""
        mask = self.context.mask
        if mask is None:
            return out
        if tokens is not None:
            mask = mask[tokens]
        num_tokens = x.shape[0]
        xa = slot_masked(F.linear(x, self.a).view(num_tokens, self.num_slots, self.width), mask[:, :, None])
        return out + F.linear(xa.view(num_tokens, -1), self.b)

    def clear(self, slot: int) -> None:
        columns = slice(slot * self.width, (slot + 1) * self.width)
        self.a[columns].zero_()
        self.b[:, columns].zero_()

    def set(self, slot: int, part: object, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float) -> None:
        """Write one checkpoint matrix's adapter (``lora_a`` ``[r, in]``, ``lora_b`` ``[out, r]``) into a slot."""
        base = self.base[0]
        rank = lora_a.shape[0]
        start = slot * self.width + self.parts.index(part) * self.max_rank
        columns = slice(start, start + rank)
        lora_b = scaled_b(lora_b, scaling, self.b.dtype)
        if self.row_parallel:
            width = base.input_size_per_rank
            self.a[columns].copy_(lora_a[:, base.tp.rank * width:(base.tp.rank + 1) * width])
            self.b[:, columns].copy_(lora_b)
            return
        assert isinstance(base, _ColumnParallelLinear)
        self.a[columns].copy_(lora_a)
        assert self.fused_rows is None or part is None, part
        fused_start = 0  # where the part's rows start in lora_b: a fused adapter's B stacks every part
        for shard_id, fused_length in self.fused_rows or [(part, 0)]:
            dst, src, length = base._shard_rows(shard_id)
            self.b[dst:dst + length, columns].copy_(lora_b[fused_start + src:fused_start + src + length])
            fused_start += fused_length


_ADAPTABLE = re.compile(
    r"\.layers\.\d+\.((self_attn|mlp|linear_attn|encoder_attn)\.|mixer\.(qkv_proj|o_proj|up_proj|down_proj)$)")
"""Where adapters go: a decoder layer's attention (Whisper's cross-attention too), MLP (its shared expert) and Gated
DeltaNet, the blocks an adapter
may name (asyncllm/lora.py; Nemotron-H's attention and MLP ``mixer``); not a state layer's own linears (Mamba's,
run over each request's rows apart)."""


def attach_lora_layers(model: Any, num_slots: int, max_rank: int, context: LoRAContext) -> dict[str, SlotBuffers]:
    """Give every projection named in the model's checkpoint a `LoRALayer`, and the experts of a model whose
    experts take adapters an `ExpertsLoRA`; them by module name."""
    from asyncllm.models.lora_experts import attach_expert_layers

    layers: dict[str, SlotBuffers] = attach_expert_layers(model, num_slots, max_rank, context)
    packed = model.packed_modules
    fused_parts: dict[str, list[tuple[object, int]]] = getattr(model, "fused_parts", {})
    towered = hasattr(model, "language_model")  # an image-text model: its tower's layers take no adapters
    for name, module in model.named_modules():
        if not isinstance(module, (_ColumnParallelLinear, RowParallelLinear)) or not _ADAPTABLE.search(name):
            continue
        if towered and not name.startswith("language_model."):
            continue
        fused = name.rsplit(".", 1)[-1]
        # one A for a projection whose adapters come fused (Phi-3's, GPT-NeoX's qkv_proj) or that is one matrix
        # under a packed name (MiniMax's lightning qkv_proj), else one per part
        stacked = fused in packed and fused not in fused_parts and not isinstance(module, ColumnParallelLinear)
        parts = [shard for _, shard in packed[fused]] if stacked else [None]
        module.lora = layers[name] = LoRALayer(module, parts, num_slots, max_rank, context, fused_parts.get(fused))
    if hasattr(model, "attach_lora"):  # projections that serve several layers (Zamba2's shared blocks)
        layers.update(model.attach_lora(num_slots, max_rank, context))
    decoder = getattr(model, "language_model", model)  # an image-text model's decoder holds the layers
    for layer in getattr(getattr(decoder, "model", None), "layers", []):
        layer.fused_decode_rows = 0  # the fused decode path reads the weights directly, past the LoRA layers
    return layers


def load_adapter_tensors(adapter: Adapter, model: Any) -> list[tuple[str, object, torch.Tensor, torch.Tensor, float]]:
    """The adapter's matrices as (projection module name, part, A, B, scaling), on the CPU, in memory of their own:
    not mapped from the file, so one rewritten in place while they are cached (or pinned) is never read again."""
    from safetensors.torch import load

    with open(adapter.weights_path, "rb") as f:
        tensors = load(f.read())
    loaded = []
    also = getattr(model, "lora_also_parts", lambda param_name, part: ())
    reordered = getattr(model, "lora_b_rows", lambda name, weight: weight)  # B's rows as the weight's are laid out
    scale_of = getattr(model, "lora_b_scale", lambda name: 1.0)  # multipliers folded into the weights (Falcon-H1)
    for name, module in adapter.modules.items():
        if ".mlp.experts." in name:
            from asyncllm.models.lora_experts import expert_target

            target, expert_part = expert_target(name)
            if hasattr(model, "language_model"):  # an image-text model's decoder: its modules' names
                target = "language_model." + target
            loaded.append((target, expert_part, _tensor(tensors, module.key or name, "A"),
                           _tensor(tensors, module.key or name, "B"), module.scaling))
            continue
        param_name, part = model._packed(f"{name}.weight")
        lora_a = _tensor(tensors, module.key or name, "A")
        lora_b = reordered(f"{name}.weight", _tensor(tensors, module.key or name, "B"))
        if (scale := scale_of(f"{name}.weight")) != 1.0:  # the product the weight's multiplier scales, scaled too
            lora_b = (lora_b.float() * scale).to(lora_b.dtype)
        for each in (part, *also(param_name, part)):  # Gemma 4's global layers: the k adapter is the v's too
            loaded.append((param_name[: -len(".weight")], each, lora_a, lora_b, module.scaling))
    return loaded


def _tensor(tensors: dict[str, torch.Tensor], name: str, which: str) -> torch.Tensor:
    key = f"{name}.lora_{which}.weight"
    return tensors[key] if key in tensors else tensors[f"base_model.model.{key}"]
