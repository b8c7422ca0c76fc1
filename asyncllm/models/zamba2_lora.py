"""LoRA adapters on Zamba2's shared blocks: one set of slots per invocation (asyncllm/models/zamba2.py).

A shared block runs at several hybrid layers with the same weights, but a PEFT adapter of Zamba2 has its own
matrices for each hybrid layer's ``shared_transformer`` (transformers builds a block per hybrid layer and ties only
their base weights). So each projection of a block (``qkv_proj``, ``o_proj``, the MLP's fused ``gate_up_proj`` and
``down_proj``) gets an `InvocationLoRA`: a `LoRALayer` per invocation, named after its hybrid layer
(``model.layers.N.self_attn.qkv_proj``, ``model.layers.N.mlp.gate_up_proj``: the adapter's names as
asyncllm/lora_names.py reads them), the one the block runs now adding its product. Tensor parallel as any
projection's: the attention's by heads, the MLP's by intermediate size.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from asyncllm.models.lora import LoRAContext, LoRALayer

__all__ = ["InvocationLoRA", "attach_shared_block_lora"]


class InvocationLoRA(nn.Module):
    """A shared block projection's adapter slots, one `LoRALayer` per invocation; the block's ``invocation`` (set
    as it runs) picks which one adds its product."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = [block]  # a list: not a submodule
        self.by_invocation = nn.ModuleDict()

    def forward(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return self.by_invocation[str(self.block[0].invocation)](x, out)


def attach_shared_block_lora(model: Any, num_slots: int, max_rank: int, context: LoRAContext) -> dict[str, LoRALayer]:
    """Every invocation's `LoRALayer` of every shared-block projection, by the hybrid layer's projection name."""
    decoder, layers = model.model, {}
    for layer_idx, layer in enumerate(decoder.layers):
        if getattr(layer, "invocation", None) is None:  # a Mamba2 layer, or another pipeline stage's
            continue
        block = decoder.shared_blocks[layer.invocation % len(decoder.shared_blocks)]
        size = block.feed_forward.down_proj.weight.shape[1] * block.feed_forward.down_proj.tp.size
        projections = {"self_attn.qkv_proj": (block.self_attn.qkv_proj, ["q", "k", "v"], None),
                       "self_attn.o_proj": (block.self_attn.o_proj, [None], None),
                       "mlp.gate_up_proj": (block.feed_forward.gate_up_proj, [None], [(0, size), (1, size)]),
                       "mlp.down_proj": (block.feed_forward.down_proj, [None], None)}
        for name, (module, parts, fused_rows) in projections.items():
            if not isinstance(module.lora, InvocationLoRA):
                module.lora = InvocationLoRA(block)
            lora = LoRALayer(module, parts, num_slots, max_rank, context, fused_rows)
            module.lora.by_invocation[str(layer.invocation)] = lora
            layers[f"model.layers.{layer_idx}.{name}"] = lora
    return layers
