"""IBM Granite 3.x mixtures of experts (granite-3.0 / 3.1 1B-A400M and 3B-A800M, base and instruct):
``GraniteMoeForCausalLM``.

Granite's four multipliers (asyncllm/models/granite.py) over Mixtral-style layers (asyncllm/models/moe.py): a
router scores the experts, the top k run, weighted by the softmax of their logits (renormalised over the k,
rounded to the model dtype, as transformers' ``type_as``). The checkpoint stores each layer's experts fused:
``block_sparse_moe.input_linear`` ``[E, 2I, hidden]`` (gate rows, then up) and ``output_linear``
``[E, hidden, I]`` (transformers 5 names them ``experts.gate_up_proj`` / ``experts.down_proj``, same layout),
and the router as ``router.layer`` (``router``); each is split per expert at load, so tensor and expert
parallelism work as for Mixtral.

Granite MoE with a shared MLP (``GraniteMoeSharedForCausalLM``: granite-3.x MoE "shared" variants, IBM's
PowerMoE-style checkpoints): the same layers with a dense ``shared_mlp`` (its gate and up rows stored fused as
``input_linear``, cut at load) beside the experts, the two outputs summed before the residual multiplier.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import torch

from asyncllm.attention.metadata import AttentionMetadata
from asyncllm.models.granite import GraniteForCausalLM, GraniteModel
from asyncllm.models.layers import LoadedWeight, norm_in
from asyncllm.models.llama import DecoderBuild, LlamaDecoderLayer, LlamaMLP
from asyncllm.models.moe import MoECausalLM, MoESpec, num_experts_of

__all__ = ["GraniteMoeForCausalLM", "GraniteMoeSharedForCausalLM", "shared_mlp_parts"]

_GATE_UP = (".block_sparse_moe.input_linear.weight", ".block_sparse_moe.experts.gate_up_proj")
_DOWN = (".block_sparse_moe.output_linear.weight", ".block_sparse_moe.experts.down_proj")
_ROUTER = (".block_sparse_moe.router.layer.weight", ".block_sparse_moe.router.weight")


class GraniteMoeForCausalLM(MoECausalLM, GraniteForCausalLM):
    """Granite's multipliers; an MoE in every layer, its fused experts split per expert at load."""

    moe_module = "block_sparse_moe"

    @classmethod
    def moe_spec(cls, hf_config: Any, layer_idx: int) -> MoESpec:
        return MoESpec(num_experts_of(hf_config), hf_config.num_experts_per_tok, hf_config.intermediate_size,
                       renormalize=True, weights_in_model_dtype=True)

    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        return super().load_weights(self._per_expert(weights))

    def _per_expert(self, weights: Iterable[tuple[str, LoadedWeight]]) -> Iterator[tuple[str, LoadedWeight]]:
        """The router under Mixtral's name (``block_sparse_moe.gate``), the fused experts as per-expert matrices."""
        for name, weight in weights:
            prefix = name.split(".block_sparse_moe.", 1)[0] + ".block_sparse_moe"
            if name.endswith(_ROUTER):
                yield f"{prefix}.gate.weight", weight
            elif name.endswith(_GATE_UP + _DOWN):
                full = weight if isinstance(weight, torch.Tensor) else weight[:]
                inter = full.shape[1] // 2 if name.endswith(_GATE_UP) else full.shape[2]
                for expert, matrix in enumerate(full):
                    if name.endswith(_DOWN):
                        yield f"{prefix}.experts.{expert}.down_proj.weight", matrix
                    else:
                        yield f"{prefix}.experts.{expert}.gate_proj.weight", matrix[:inter]
                        yield f"{prefix}.experts.{expert}.up_proj.weight", matrix[inter:]
            else:
                yield name, weight


def shared_mlp_parts(weights: Iterable[tuple[str, LoadedWeight]]) -> Iterator[tuple[str, LoadedWeight]]:
    """The shared MLP's fused ``input_linear`` (gate rows, then up) cut into ``gate_proj`` / ``up_proj``, its
    ``output_linear`` as ``down_proj``."""
    for name, weight in weights:
        if name.endswith(".shared_mlp.input_linear.weight"):
            full = weight if isinstance(weight, torch.Tensor) else weight[:]
            prefix = name.removesuffix("input_linear.weight")
            gate, up = full.chunk(2, dim=0)
            yield prefix + "gate_proj.weight", gate
            yield prefix + "up_proj.weight", up
        elif name.endswith(".shared_mlp.output_linear.weight"):
            yield name.removesuffix("output_linear.weight") + "down_proj.weight", weight
        else:
            yield name, weight


class GraniteMoeSharedLayer(LlamaDecoderLayer):
    """Granite MoE's layer with the shared MLP's output added to the experts' (none when its size is 0)."""

    def __init__(self, b: DecoderBuild, layer_idx: int) -> None:
        super().__init__(b, layer_idx)
        size = int(b.hf_config.shared_intermediate_size)
        self.shared_mlp = LlamaMLP(b, size) if size else None

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: torch.Tensor, metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = norm_in(self.input_layernorm, hidden, residual)
        hidden = self.to_residual(self.self_attn(positions, hidden, kv_cache, metadata))
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        out = self.mlp(hidden)
        if self.shared_mlp is not None:
            out = out + self.shared_mlp(hidden)
        return self.to_residual(out), residual


class GraniteMoeSharedModel(GraniteModel):
    layer_cls = GraniteMoeSharedLayer


class GraniteMoeSharedForCausalLM(GraniteMoeForCausalLM):
    """Granite MoE with a shared MLP beside the experts in every layer."""

    model_cls = GraniteMoeSharedModel

    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        return super().load_weights(shared_mlp_parts(weights))
