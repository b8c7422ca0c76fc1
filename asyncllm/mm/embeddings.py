"""Worker side: encoder outputs for the placeholder ranges a step reaches, scattered into the embeddings.

A step may cover only part of an image's placeholder range (chunked prefill, or a
prefix-cache hit that ends inside it). The encoder runs once per image, when its
range is first reached, and its output stays cached for the request until the
prefill has passed the range (or the request leaves the worker); each step
copies the rows it covers into the text embeddings at those positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from asyncllm.protocol import MultiModalItem

__all__ = ["EncoderOutputCache", "ScheduledSpan"]


@dataclass(frozen=True)
class ScheduledSpan:
    """One request's tokens in this step: prompt positions ``[start, start + length)`` at ``flat_offset``."""

    req_id: str
    start: int
    length: int
    flat_offset: int


def _pixels(item: MultiModalItem, device: torch.device) -> torch.Tensor:
    assert item.data is not None, "the core fills every item's data before the workers see it"
    array = np.frombuffer(item.data, dtype=np.dtype(item.dtype)).reshape(item.shape)
    return torch.from_numpy(array.copy()).to(device)


class EncoderOutputCache:
    """Per-request multimodal items and the encoder outputs still needed by their prefill."""

    def __init__(self, model: Any, device: torch.device) -> None:
        self.model = model
        self.device = device
        self.items: dict[str, list[MultiModalItem]] = {}
        self.outputs: dict[tuple[str, int], torch.Tensor] = {}
        """(request id, item index) -> ``[length, hidden]`` features."""
        self.num_encoded = 0
        """Images encoded so far (tests check that a prefix-cache hit skips the encoder)."""

    def add_request(self, req_id: str, items: list[MultiModalItem]) -> None:
        self.items[req_id] = items

    def remove_request(self, req_id: str) -> None:
        items = self.items.pop(req_id, None)
        for index in range(len(items or ())):
            self.outputs.pop((req_id, index), None)

    def inputs_embeds(self, input_ids: torch.Tensor, spans: list[ScheduledSpan]) -> torch.Tensor | None:
        """The step's input embeddings with image features in place; None when no span touches an image."""
        touched = [(span, index, item) for span in spans for index, item in enumerate(self.items.get(span.req_id, ()))
                   if item.offset < span.start + span.length and item.offset + item.length > span.start]
        if not touched:
            return None
        self._encode_missing([(span.req_id, index, item) for span, index, item in touched])
        embeds = self.model.embed_input_ids(input_ids)
        for span, index, item in touched:
            lo, hi = max(span.start, item.offset), min(span.start + span.length, item.offset + item.length)
            features = self.outputs[(span.req_id, index)]
            dst = span.flat_offset + lo - span.start
            embeds[dst : dst + hi - lo] = features[lo - item.offset : hi - item.offset].to(embeds.dtype)
            if hi == item.offset + item.length:
                del self.outputs[(span.req_id, index)]  # the prefill has passed this image
        return embeds

    def _encode_missing(self, wanted: list[tuple[str, int, MultiModalItem]]) -> None:
        """Run the encoder once over every needed image not cached yet (batched by pixel shape)."""
        by_shape: dict[tuple[int, ...], list[tuple[str, int, MultiModalItem]]] = {}
        for req_id, index, item in wanted:
            if (req_id, index) not in self.outputs:
                by_shape.setdefault(tuple(item.shape), []).append((req_id, index, item))
        for group in by_shape.values():
            pixels = torch.stack([_pixels(item, self.device) for _, _, item in group])
            features = self.model.embed_multimodal(pixels)
            self.num_encoded += len(group)
            for (req_id, index, item), rows in zip(group, features):
                if rows.shape[0] != item.length:
                    raise ValueError(f"image {index} of {req_id}: {rows.shape[0]} features for {item.length} placeholders")
                self.outputs[(req_id, index)] = rows
