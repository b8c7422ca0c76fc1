"""IBM Granite 3.x mixtures of experts (granite-3.0 / 3.1 1B-A400M and 3B-A800M, base and instruct):
``GraniteMoeForCausalLM``.

Granite's four multipliers (asyncllm/models/granite.py) over Mixtral-style layers (asyncllm/models/moe.py): a
router scores the experts, the top k run, weighted by the softmax of their logits (renormalised over the k,
rounded to the model dtype, as transformers' ``type_as``). The checkpoint stores each layer's experts fused:
``block_sparse_moe.input_linear`` ``[E, 2I, hidden]`` (gate rows, then up) and ``output_linear``
``[E, hidden, I]`` (transformers 5 names them ``experts.gate_up_proj`` / ``experts.down_proj``, same layout),
and the router as ``router.layer`` (``router``); each is split per expert at load, so tensor and expert
parallelism work as for Mixtral.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import torch

from asyncllm.models.granite import GraniteForCausalLM
from asyncllm.models.layers import LoadedWeight
from asyncllm.models.moe import MoECausalLM, MoESpec, num_experts_of

__all__ = ["GraniteMoeForCausalLM"]

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
