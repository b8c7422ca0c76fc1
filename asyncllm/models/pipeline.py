"""A pipeline stage's model: the layers it holds, placeholders for the rest, and its forward between stages.

With ``pipeline_parallel_size > 1`` (docs/parallelism.md) every rank builds its family's causal LM with a
`PipelineStage` (``LlamaForCausalLM(..., pipeline=stage)``): `LlamaModel` builds the stage's decoder layers
and `PPMissingLayer` placeholders (no parameters) for the others; the embeddings only on the first stage (and
on the last when the LM head is tied to them), the final norm and LM head only on the last. The model's
``load_weights`` skips the checkpoint tensors of the placeholders (`in_missing_part`), unread.

`StageModel` is what the model runner calls instead of the model's own forward: the first stage embeds the
tokens, the others receive ``(hidden, residual)`` from the stage before (`StageChannel`, torch.distributed
send/recv: gloo on CPU, NCCL on CUDA); each runs its layers; every stage but the last sends ``(hidden,
residual)`` on, and the last applies the final norm (then the runner computes logits and samples).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from asyncllm.attention.metadata import AttentionMetadata
from asyncllm.errors import NotBuiltError

__all__ = ["PPMissingLayer", "PipelineStage", "StageChannel", "StageModel", "TensorChannel", "in_missing_part"]


@dataclass(frozen=True)
class PipelineStage:
    """Which part of the model this rank holds: stage ``rank`` of ``size``, decoder layers ``[start_layer,
    end_layer)``."""

    rank: int
    size: int
    start_layer: int
    end_layer: int
    tp_group: Any = field(default=None, compare=False, repr=False)
    """The process group of this stage's tensor-parallel ranks (None: one rank per stage)."""

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    @property
    def num_layers(self) -> int:
        return self.end_layer - self.start_layer

    def owns_layer(self, layer_idx: int) -> bool:
        return self.start_layer <= layer_idx < self.end_layer

    def holds_embeddings(self, tied: bool) -> bool:
        """The first stage embeds the tokens; the last one holds them too when its LM head is tied to them."""
        return self.is_first or (tied and self.is_last)


class PPMissingLayer(nn.Module):
    """Stands for a part of the model another stage holds: no parameters, never called."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a pipeline stage called a part of the model that another stage holds")


def in_missing_part(model: nn.Module, name: str) -> bool:
    """Whether the parameter ``name`` (dotted) lies under a `PPMissingLayer` of ``model``: another stage's."""
    module: Any = model
    for part in name.split(".")[:-1]:
        module = getattr(module, part, None)
        if module is None:
            return False
        if isinstance(module, PPMissingLayer):
            return True
    return False


class TensorChannel(Protocol):
    """How a stage passes ``(hidden, residual)`` to the next one (a test passes them in memory)."""

    def send(self, hidden: torch.Tensor, residual: torch.Tensor) -> None: ...

    def recv(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]: ...


class StageChannel:
    """torch.distributed send/recv of ``(hidden, residual)`` between the same TP rank of neighbouring stages."""

    def __init__(self, prev_rank: int | None, next_rank: int | None, hidden_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.prev_rank = prev_rank
        self.next_rank = next_rank
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.device = device

    def send(self, hidden: torch.Tensor, residual: torch.Tensor) -> None:
        assert self.next_rank is not None, "the last stage sends nothing"
        dist.send(hidden.contiguous(), self.next_rank)
        dist.send(residual.contiguous(), self.next_rank)

    def recv(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.prev_rank is not None, "the first stage receives nothing"
        hidden = torch.empty(num_tokens, self.hidden_size, dtype=self.dtype, device=self.device)
        residual = torch.empty_like(hidden)
        dist.recv(hidden, self.prev_rank)
        dist.recv(residual, self.prev_rank)
        return hidden, residual


class StageModel(nn.Module):
    """A stage's causal LM as the runner calls it (`forward`, `compute_logits`), its layers run between the
    stages before and after it."""

    def __init__(self, causal_lm: nn.Module, stage: PipelineStage, channel: TensorChannel) -> None:
        super().__init__()
        check_stage_model(causal_lm, stage.size)
        self.causal_lm = causal_lm
        self.stage = stage
        self.channel = channel
        decoder = causal_lm.model
        self._layers = list(decoder.layers[stage.start_layer : stage.end_layer])
        self._embed = decoder.embed_tokens if stage.is_first else None
        self._norm = decoder.norm if stage.is_last else None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        """As `LlamaModel.forward` over this stage's layers (``kv_caches``: one per layer of the stage); the
        final hidden states on the last stage, what was sent on elsewhere."""
        if self._embed is not None:
            hidden, residual = self._embed(input_ids), None
        else:
            hidden, residual = self.channel.recv(input_ids.shape[0])
        for layer, kv_cache in zip(self._layers, kv_caches, strict=True):
            hidden, residual = layer(positions, hidden, residual, kv_cache, attn_metadata)
        if self._norm is None:
            assert residual is not None, "every stage runs at least one layer"
            self.channel.send(hidden, residual)
            return hidden
        hidden, _ = self._norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head (last stage only)."""
        assert self.stage.is_last, "only the last stage holds the LM head"
        return self.causal_lm.compute_logits(hidden)


def check_stage_model(causal_lm: nn.Module, pp_size: int) -> None:
    """`NotBuiltError` unless the model's forward is `LlamaForCausalLM`'s over `LlamaModel`'s (what
    `StageModel.forward` runs in pieces)."""
    from asyncllm.models.llama import LlamaForCausalLM, LlamaModel

    decoder = getattr(causal_lm, "model", None)
    if type(causal_lm).forward is not LlamaForCausalLM.forward or type(decoder).forward is not LlamaModel.forward:
        name = type(causal_lm).__name__
        raise NotBuiltError("pipeline_parallel_size", pp_size, f"pipeline parallelism for {name} (its forward "
                                                               "is not LlamaForCausalLM's decoder stack)")
