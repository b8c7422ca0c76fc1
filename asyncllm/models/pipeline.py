"""A pipeline stage's model: the layers it holds, placeholders for the rest, and its forward between stages.

With ``pipeline_parallel_size > 1`` (docs/parallelism.md) every rank builds its family's causal LM with a
`PipelineStage` (``LlamaForCausalLM(..., pipeline=stage)``): `LlamaModel` builds the stage's decoder layers
and `PPMissingLayer` placeholders (no parameters) for the others; the embeddings only on the first stage (and
on the last when the LM head is tied to them), the final norm and LM head only on the last. The model's
``load_weights`` skips the checkpoint tensors of the placeholders (`in_missing_part`), unread.

`StageModel` is what the model runner calls instead of the model's own forward: the first stage embeds the
tokens, the others receive ``(hidden, residual)`` from the stage before (`StageChannel`, torch.distributed
send/recv: gloo on CPU, NCCL on CUDA); each runs its layers; every stage but the last sends ``(hidden,
residual)`` on, and the last applies the final norm (then the runner computes logits and samples). The first
and last steps are the decoder's own ``embed`` and ``final`` (GPT-2's and OPT's add learned positions; OPT's
projects in and out).

Hybrids (asyncllm/models/hybrid.py) run in stages too: a stage's KV caches are its attention layers' only
(`uses_kv_cache`), its state layers keep their per-request states by the same worker rows on every stage (each
stage's input batch is built from the same scheduler output), and each stage saves and restores its own state
layers' checkpoints for prefix caching.

A decoder with a ``run_stage`` of its own (Gemma 4 / 3n: asyncllm/models/gemma4_stages.py; Zamba2; DeepSeek-V3.2's,
whose layers read a latent and an indexer cache each) runs a stage itself, and says what crosses a boundary beside
the stream (``stage_widths``: per-layer inputs, the token embeddings). Mamba's (asyncllm/models/mamba.py), with no
attention at all, carries its float32 stream alone, and each of its stages keeps one token-sized cache layer for the
block accounting (`StageModel.attention_free`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from asyncllm import envs
from asyncllm.attention.metadata import AttentionMetadata
from asyncllm.errors import ConfigError, NotBuiltError

if TYPE_CHECKING:
    from asyncllm.models.registry import KVCacheSpec

__all__ = ["PPMissingLayer", "PipelineStage", "StageChannel", "StageModel", "TensorChannel", "in_missing_part",
           "uses_kv_cache"]


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


def uses_kv_cache(layer: nn.Module) -> bool:
    """Whether a decoder layer reads a paged KV cache: every layer but a hybrid's state layers (``is_linear``) and
    its layers without a mixer (Nemotron-H's MLP layers: ``uses_kv_cache`` unset)."""
    return bool(getattr(layer, "uses_kv_cache", not getattr(layer, "is_linear", False)))


class TensorChannel(Protocol):
    """How a stage passes ``(hidden, residual)`` to the next one (a test passes them in memory)."""

    def send(self, hidden: torch.Tensor, residual: torch.Tensor) -> None: ...

    def recv(self, num_tokens: int, widths: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]: ...


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
        if residual.shape[-1]:  # a decoder that carries nothing beside the stream (`StageModel.forward`)
            dist.send(residual.contiguous(), self.next_rank)

    def recv(self, num_tokens: int, widths: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``widths``: what a decoder with its own stage step carries (``stage_widths``); default two hidden-wide."""
        assert self.prev_rank is not None, "the first stage receives nothing"
        hidden_width, residual_width = widths or (self.hidden_size, self.hidden_size)
        hidden = torch.empty(num_tokens, hidden_width, dtype=self.dtype, device=self.device)
        residual = torch.empty(num_tokens, residual_width, dtype=self.dtype, device=self.device)
        dist.recv(hidden, self.prev_rank)
        if residual_width:
            dist.recv(residual, self.prev_rank)
        return hidden, residual


def language_model(causal_lm: nn.Module) -> nn.Module:
    """The causal LM whose decoder runs in stages: an image-text model's ``language_model``, else itself."""
    return getattr(causal_lm, "language_model", causal_lm)


class StageModel(nn.Module):
    """A stage's causal LM (an image-text model's: its decoder's; the first stage alone holds its encoder) as the
    runner calls it (`forward`, `compute_logits`), its layers run between the stages before and after it."""

    def __init__(self, causal_lm: nn.Module, stage: PipelineStage, channel: TensorChannel) -> None:
        super().__init__()
        check_stage_model(language_model(causal_lm), stage.size)
        self.causal_lm = causal_lm
        self.stage = stage
        self.channel = channel
        decoder = language_model(causal_lm).model
        self._layers = list(decoder.layers[stage.start_layer : stage.end_layer])
        self._uses_kv = [uses_kv_cache(layer) for layer in self._layers]
        self.attention_free = hasattr(language_model(causal_lm), "kv_cache_spec_of")
        """Mamba's: no layer reads a KV cache; each stage keeps the model's one token-sized cache layer for the
        scheduler's block accounting (``kv_cache_spec_of``)."""
        if not any(self._uses_kv) and not self.attention_free:
            raise ConfigError("pipeline_parallel_size", stage.size,
                              f"a split whose every stage holds an attention layer (stage {stage.rank} holds "
                              f"layers {stage.start_layer} to {stage.end_layer - 1}, none with a KV cache): set "
                              f"{envs.PP_LAYER_PARTITION.name} to move the boundaries, or use fewer stages")
        deepstack = int(getattr(getattr(causal_lm, "visual", None), "num_deepstack", 0) or 0) if stage.is_first else 0
        if deepstack > len(self._layers):
            raise ConfigError("pipeline_parallel_size", stage.size,
                              f"a split whose first stage holds the {deepstack} layers Qwen3-VL's deepstack "
                              f"features join (it holds {len(self._layers)}): set {envs.PP_LAYER_PARTITION.name} "
                              "to give it more, or use fewer stages")
        self.keeps_request_states = bool(getattr(causal_lm, "keeps_request_states", False))
        """A hybrid's: the runner lists each step's rows for its state layers (workers/input_batch.py)."""
        self.checkpoint_slots = int(getattr(causal_lm, "checkpoint_slots", 0))
        """A hybrid's saved states for prefix caching (the worker tells the core)."""
        self.position_offset = int(getattr(causal_lm, "position_offset", 0))
        """What the model's own forward adds to the positions before its decoder (PaliGemma counts from 1)."""

    @property
    def embeds_inputs(self) -> bool:
        """Whether this stage makes the step's input embeddings (an image-text model's encoder runs here, a prompt
        given as embeddings is written here): the first (the others take hidden states)."""
        return self.stage.is_first

    @property
    def num_kv_layers(self) -> int:
        """The stage's KV caches: one per layer with a KV cache (a hybrid's attention layers; every layer otherwise),
        or as many as the layer's ``num_kv_caches`` (DeepSeek-V3.2's latent and indexer caches); an attention-free
        model's token-sized one."""
        if self.attention_free:
            return 1
        return sum(int(getattr(layer, "num_kv_caches", uses)) for layer, uses in zip(self._layers, self._uses_kv))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: AttentionMetadata, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """As `LlamaModel.forward` (a hybrid's: `HybridModel.forward`) over this stage's layers (``kv_caches``: one
        per layer of the stage that reads one; ``inputs_embeds``: the first stage's, with image features); the
        final hidden states on the last stage, what was sent on elsewhere."""
        if len(kv_caches) != self.num_kv_layers:
            raise ValueError(f"{len(kv_caches)} KV caches for a stage with {self.num_kv_layers} attention layers")
        decoder = language_model(self.causal_lm).model
        if self.position_offset:
            positions = positions + self.position_offset
        if hasattr(decoder, "run_stage"):
            return self._run_own_stage(decoder, input_ids, positions, kv_caches, attn_metadata, inputs_embeds)
        residual: torch.Tensor | None
        deepstack = None  # Qwen3-VL's rows for its first layers' outputs (the first stage holds those layers)
        if self.stage.is_first:
            if hasattr(decoder, "split_deepstack"):
                inputs_embeds, deepstack = decoder.split_deepstack(inputs_embeds)
            hidden, residual = decoder.embed(input_ids, positions, inputs_embeds), None
        else:
            hidden, residual = self.channel.recv(input_ids.shape[0])
        caches = iter(kv_caches)
        scope = getattr(decoder, "step_scope", None)  # ERNIE 4.5 VL's rows by modality
        with (decoder.layer_positions(positions) as rotary,  # M-RoPE's step table
              contextlib.nullcontext() if scope is None else scope(input_ids, attn_metadata)):
            for index, (layer, uses_kv) in enumerate(zip(self._layers, self._uses_kv)):
                hidden, residual = layer(rotary, hidden, residual, next(caches) if uses_kv else None, attn_metadata)
                if deepstack is not None and index < deepstack.shape[1]:
                    hidden, residual = decoder.add_deepstack(index, hidden, residual, deepstack)
        if not self.stage.is_last:  # OPT's post-norm layers leave the stream joined: a zero residual adds nothing
            self.channel.send(hidden, torch.zeros_like(hidden) if residual is None else residual)
            return hidden
        return decoder.final(hidden, residual)

    def _run_own_stage(self, decoder: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor,
                       kv_caches: list[torch.Tensor], attn_metadata: AttentionMetadata,
                       inputs_embeds: torch.Tensor | None) -> torch.Tensor:
        """A decoder that runs a stage itself (``run_stage``: Gemma 4 / 3n, Zamba2): it says what crosses a
        boundary beside the stream (``stage_widths``: per-layer inputs, AltUp's streams, the token embeddings)."""
        received = None
        if not self.stage.is_first:
            received = self.channel.recv(input_ids.shape[0], decoder.stage_widths(self.stage))
        out = decoder.run_stage(self.stage, received, input_ids, positions, kv_caches, attn_metadata, inputs_embeds)
        if self.stage.is_last:
            return out
        self.channel.send(*out)
        return out[0]

    def kv_spec(self, full: KVCacheSpec) -> KVCacheSpec:
        """The unsplit model's KV-cache spec cut to this stage's caches (their shapes, where caches differ:
        Gemma 4's, the decoder's ``caches_before`` says where the stage's begin)."""
        shapes = full.layer_shapes
        if shapes:
            first = language_model(self.causal_lm).model.caches_before(self.stage.start_layer)
            shapes = shapes[first : first + self.num_kv_layers]
        return dataclasses.replace(full, num_layers=self.num_kv_layers, layer_shapes=shapes)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head (last stage only)."""
        assert self.stage.is_last, "only the last stage holds the LM head"
        return self.causal_lm.compute_logits(hidden)


def check_stage_model(causal_lm: nn.Module, pp_size: int) -> None:
    """`NotBuiltError` unless the model's forward is `LlamaForCausalLM`'s over `LlamaModel`'s (GPT-2's and OPT's
    too: their ``embed`` and ``final`` differ), `HybridModel`'s or the M-RoPE decoders' (Qwen2-VL's, Qwen3.5's:
    their ``layer_positions`` differ; Qwen3-VL's, whose deepstack rows `StageModel` adds): what
    `StageModel.forward` runs in pieces."""
    from asyncllm.models.hybrid import HybridModel
    from asyncllm.models.llama import LlamaForCausalLM, LlamaModel
    from asyncllm.models.qwen2_vl import Qwen2VLTextModel, Qwen3VLTextModel
    from asyncllm.models.qwen3_5 import Qwen3_5VLModel

    if hasattr(getattr(causal_lm, "model", None), "run_stage"):
        return  # a decoder that runs a stage itself (`StageModel._run_own_stage`)
    decoder = type(getattr(causal_lm, "model", None))
    stacks = (LlamaModel.forward, HybridModel.forward, Qwen2VLTextModel.forward, Qwen3_5VLModel.forward)
    decodes = (Qwen2VLTextModel.decode, Qwen3VLTextModel.decode)
    plain = decoder.forward in stacks and getattr(decoder, "decode", Qwen2VLTextModel.decode) in decodes
    if type(causal_lm).forward is not LlamaForCausalLM.forward or not plain:
        name = type(causal_lm).__name__
        raise NotBuiltError("pipeline_parallel_size", pp_size, f"pipeline parallelism for {name} (its forward "
                                                               "is not LlamaForCausalLM's decoder stack)")
