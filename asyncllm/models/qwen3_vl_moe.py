"""Qwen3-VL-MoE (Qwen3-VL-30B-A3B, 235B-A22B): Qwen3-VL's tower and deepstack over a Qwen3-MoE decoder.

The decoder's experts are stored fused, one 3-D tensor per layer for all experts'
gate and up projections (``mlp.experts.gate_up_proj``: gate rows, then up rows) and
one for their down projections (``mlp.experts.down_proj``), in either of two
layouts: transformers 4.57's ``[E, hidden, 2I]`` / ``[E, I, hidden]`` (how the
released checkpoints were saved) or transformers 5's transposed ``[E, 2I, hidden]``
/ ``[E, hidden, I]``. The loader tells them apart by shape (no released model has
square expert matrices) and hands each expert's matrices to the fused-MoE loader as
per-expert checkpoint tensors would be (so tensor and expert parallelism, and the
missing-weights check, work unchanged); a model whose matrices are square (``hidden`` equal to
``2I``, or to ``I`` for the down projections) is refused. The router always renormalizes its top-k
weights (transformers' rule for this family).
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import torch

from asyncllm.errors import ConfigError
from asyncllm.models.layers import LoadedWeight
from asyncllm.models.moe import MoESpec, num_experts_of
from asyncllm.models.qwen2_vl import Qwen3VLForConditionalGeneration, Qwen3VLTextModel, _MRopeBuild
from asyncllm.models.qwen3_moe import Qwen3MoeForCausalLM, qwen_moe_layer

__all__ = ["Qwen3VLMoeForConditionalGeneration", "per_expert_weights", "split_fused_experts"]

_FUSED = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")


def per_expert_weights(name: str, tensor: torch.Tensor, hidden: int, inter: int) -> Iterator[tuple[str, torch.Tensor]]:
    """A fused experts tensor -> each expert's ``gate_proj`` / ``up_proj`` ``[I, hidden]`` or ``down_proj``
    ``[hidden, I]`` under its per-expert checkpoint name."""
    prefix = name.rsplit(".", 1)[0]  # "....mlp.experts"
    gate_up = name.endswith("gate_up_proj")
    shape = tuple(tensor.shape[1:])
    new, old = ((2 * inter, hidden), (hidden, 2 * inter)) if gate_up else ((hidden, inter), (inter, hidden))
    if new == old or shape not in (new, old):  # square matrices: the two layouts cannot be told apart
        raise ConfigError("model", name, f"fused experts of shape [E, {new[0]}, {new[1]}] or [E, {old[0]}, {old[1]}] "
                                         f"(hidden_size={hidden}, moe_intermediate_size={inter}), got "
                                         f"{list(tensor.shape)}")
    for expert, matrix in enumerate(tensor):
        matrix = matrix if shape == new else matrix.t()
        if gate_up:
            yield f"{prefix}.{expert}.gate_proj.weight", matrix[:inter]
            yield f"{prefix}.{expert}.up_proj.weight", matrix[inter:]
        else:
            yield f"{prefix}.{expert}.down_proj.weight", matrix


class Qwen3VLMoeLanguageModel(_MRopeBuild, Qwen3MoeForCausalLM):
    model_cls = Qwen3VLTextModel
    interleaved_mrope = True
    default_mrope_section = (24, 20, 20)

    @classmethod
    def moe_spec(cls, hf_config: Any, layer_idx: int) -> MoESpec | None:
        if not qwen_moe_layer(hf_config, layer_idx):
            return None
        return MoESpec(num_experts_of(hf_config), hf_config.num_experts_per_tok, hf_config.moe_intermediate_size,
                       renormalize=True, weights_in_model_dtype=True)

    def __init__(self, hf_config: Any, **kwargs: Any) -> None:
        super().__init__(hf_config, **kwargs)
        self.expert_sizes = (int(hf_config.hidden_size), int(hf_config.moe_intermediate_size))
        """(hidden, I): what tells the fused experts' two layouts apart."""

    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        return super().load_weights(split_fused_experts(weights, *self.expert_sizes))


def split_fused_experts(weights: Iterable[tuple[str, LoadedWeight]], hidden: int,
                        inter: int) -> Iterator[tuple[str, LoadedWeight]]:
    """``weights`` with each fused experts tensor (``mlp.experts.gate_up_proj`` / ``down_proj``, either layout) cut
    into its experts' per-expert matrices (`per_expert_weights`); the rest as given."""
    for name, weight in weights:
        if name.endswith(_FUSED):
            full = weight if isinstance(weight, torch.Tensor) else weight[:]
            yield from per_expert_weights(name, full, hidden, inter)
        else:
            yield name, weight


class Qwen3VLMoeForConditionalGeneration(Qwen3VLForConditionalGeneration):
    """Qwen3-VL over a mixture-of-experts decoder (tensor and expert parallel as Qwen3-MoE)."""

    is_moe = True
    language_model_cls = Qwen3VLMoeLanguageModel
    lora_experts = True
    """Adapters on its experts too, as Qwen3-MoE's (asyncllm/models/lora_experts.py)."""

    @classmethod
    def moe_spec(cls, hf_config: Any, layer_idx: int) -> MoESpec | None:
        """Layer ``layer_idx``'s MoE (``hf_config``: the text config, as the registry's checks pass it)."""
        return Qwen3VLMoeLanguageModel.moe_spec(hf_config, layer_idx)
