"""Gemma 4's and Gemma 3n's decoders in pipeline stages (docs/parallelism.md, docs/gemma.md): the layers' loop
that the unsplit forward and each stage run, and what crosses a stage boundary.

- **Per-layer inputs** are made on the first stage (they need the token embeddings, image features included, and
  the per-layer table, which only the first stage holds) and sent on: a boundary carries the later layers' part,
  ``[T, (layers after it) x P]``, beside the stream (nothing when the model has none: 31B, 26B-A4B).
- **AltUp streams** (Gemma 3n): the ``[n, T, H]`` streams cross as one ``[T, n x H]`` tensor; the first stage
  spreads the embedding into them, the last merges them back.
- **KV sharing**: a stage holds the KV caches of its own layers that compute keys and values, and a sharing layer
  must be on the stage of the layer whose cache it reads (`check_kv_sharing_split`, on the host and here).
"""

from __future__ import annotations

from typing import Any

import torch

from asyncllm.attention.metadata import AttentionMetadata
from asyncllm.models.gemma4_config import check_kv_sharing_split
from asyncllm.models.pipeline import PipelineStage

__all__ = ["Gemma4Stages", "check_stage_kv_sharing"]


def check_stage_kv_sharing(cfg: Any, stage: PipelineStage | None) -> None:
    """A worker's check of its own stage (the host checks the whole split first): the layers before it, its own
    and those after it as three parts."""
    if stage is None or stage.size == 1:
        return
    layers = cfg.num_hidden_layers
    parts = (stage.start_layer, stage.num_layers, layers - stage.end_layer)
    check_kv_sharing_split(cfg, [count for count in parts if count])


class Gemma4Stages:
    """Mixin of `Gemma4Model`: its layer loop, and ``run_stage`` / ``stage_widths`` / ``caches_before`` for
    `StageModel` (asyncllm/models/pipeline.py)."""

    layers: Any
    cache_of_layer: tuple[int, ...]
    per_layer_size: int
    stream_width: int
    """What the stream is as one ``[T, stream_width]`` tensor: the hidden size (Gemma 3n: times its streams)."""

    def _spread(self, embeds: torch.Tensor) -> torch.Tensor:
        """The first layer's stream from the embeddings (Gemma 3n: its AltUp streams)."""
        return embeds

    def _merge(self, stream: torch.Tensor) -> torch.Tensor:
        """The last layer's stream as one hidden state (Gemma 3n: its streams merged)."""
        return stream

    def _pack(self, stream: torch.Tensor) -> torch.Tensor:
        """The stream as ``[T, stream_width]`` (Gemma 3n: its streams side by side)."""
        return stream

    def _unpack(self, flat: torch.Tensor) -> torch.Tensor:
        return flat

    def caches_before(self, layer: int) -> int:
        """The KV caches of the layers before ``layer``: where a stage starting there finds its first."""
        return len(set(self.cache_of_layer[:layer]))

    def stage_widths(self, stage: PipelineStage) -> tuple[int, int]:
        """What ``stage`` receives: the stream, and its own and later layers' per-layer inputs."""
        return self.stream_width, (len(self.layers) - stage.start_layer) * self.per_layer_size

    def embed_stream(self, input_ids: torch.Tensor, inputs_embeds: torch.Tensor | None
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The first layer's stream and every layer's per-layer input (``[T, layers, P]``; None without)."""
        model: Any = self
        embeds = model.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        per_layer = model.per_layer_inputs(input_ids, embeds) if self.per_layer_size else None
        return self._spread(embeds), per_layer

    def run_layers(self, layers: range, stream: torch.Tensor, per_layer: torch.Tensor | None, first_input: int,
                   positions: torch.Tensor, kv_caches: list[torch.Tensor], metadata: AttentionMetadata
                   ) -> torch.Tensor:
        """``layers`` over ``stream``; ``per_layer[:, i - first_input]`` is layer i's input, ``kv_caches`` the
        caches from ``caches_before(layers.start)`` on."""
        first_cache = self.caches_before(layers.start)
        for i in layers:
            layer_input = None if per_layer is None else per_layer[:, i - first_input]
            cache = kv_caches[self.cache_of_layer[i] - first_cache]
            stream = self.layers[i](positions, stream, cache, metadata, layer_input)
        return stream

    def run_stage(self, stage: PipelineStage, received: tuple[torch.Tensor, torch.Tensor] | None,
                  input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                  metadata: AttentionMetadata, inputs_embeds: torch.Tensor | None
                  ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The stage's layers: the final hidden states on the last stage, else (the stream, the later layers'
        per-layer inputs) to send on."""
        tokens, first_input = input_ids.shape[0], stage.start_layer
        if received is None:
            stream, per_layer = self.embed_stream(input_ids, inputs_embeds)
            first_input = 0
        else:
            stream = self._unpack(received[0])
            per_layer = received[1].view(tokens, -1, self.per_layer_size) if self.per_layer_size else None
        layers = range(stage.start_layer, stage.end_layer)
        stream = self.run_layers(layers, stream, per_layer, first_input, positions, kv_caches, metadata)
        if stage.is_last:
            return self.norm(self._merge(stream))  # type: ignore[attr-defined]
        if per_layer is None:
            return self._pack(stream), stream.new_empty(tokens, 0)
        return self._pack(stream), per_layer[:, stage.end_layer - first_input :].reshape(tokens, -1)
