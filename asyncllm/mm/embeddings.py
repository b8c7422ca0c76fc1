"""Worker side: encoder outputs for the placeholder ranges a step reaches, scattered into the embeddings.

A step may cover only part of an image's placeholder range (chunked prefill, or a
prefix-cache hit that ends inside it). When a request's prefill first reaches an
image, its features are looked up by item hash in the `EncoderCache`
(asyncllm/mm/encoder_cache.py) and encoded only when missing (every image a step
misses in one encoder call, images of one shape batched); the entry stays pinned
until the prefill has passed the range (or the request leaves the worker), then it
stays cached for later requests while the byte budget allows. Each step copies
the rows it covers into the text embeddings at those positions, except rows whose
tokens keep their own embeddings inside an item (the model's ``mm_text_rows``:
Mistral 3's row breaks).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from asyncllm.mm.encoder_cache import EncoderCache
from asyncllm.protocol import MultiModalItem

__all__ = ["EncodeFn", "EncoderOutputCache", "ScheduledSpan", "encode_items", "encoded_rows"]

logger = logging.getLogger(__name__)

EncodeFn = Callable[[list[MultiModalItem], int, torch.dtype], list[torch.Tensor]]
"""(items, hidden size, dtype) -> one ``[item.length, hidden]`` tensor per item, in order."""


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


def encoded_rows(item: MultiModalItem) -> int:
    """The rows the encoder outputs for ``item``'s data: its placeholders', or the whole of a piece's
    (`MultiModalItem.rows`)."""
    return item.rows[1] if item.rows else item.length


def encode_items(model: Any, items: list[MultiModalItem], device: torch.device) -> list[torch.Tensor]:
    """Run ``model.embed_multimodal`` over ``items`` on this rank (batched by pixel shape); features in item order.

    Items the encoder refuses (it raises: a client's item of a shape or values the model cannot take; a batch that
    raises is encoded again item by item, so only those) get no rows, the log says why, and `EncoderOutputCache`
    fails their requests. Running out of memory or a device error is the workers' failure, as anywhere."""
    by_shape: dict[tuple[int, ...], list[int]] = {}
    for i, item in enumerate(items):
        by_shape.setdefault(tuple(item.shape), []).append(i)
    out: list[torch.Tensor] = [torch.empty(0)] * len(items)
    for indices in by_shape.values():
        features = _encode(model, items, indices, device)
        if features is None and len(indices) > 1:  # again one by one: only the refused items get no rows
            alone = [_encode(model, items, [i], device) for i in indices]
            features = [torch.empty(0) if one is None else one[0] for one in alone]
        for i, rows in zip(indices, () if features is None else features):
            out[i] = rows
    return out


_DEVICE_FAILURES = tuple(getattr(torch, name) for name in ("OutOfMemoryError", "AcceleratorError") if hasattr(torch, name))


def _encode(model: Any, items: list[MultiModalItem], indices: list[int], device: torch.device) -> Any:
    """``model.embed_multimodal`` of ``indices``' items (one shape) in one batch; None when the encoder refuses them
    (logged)."""
    try:
        return model.embed_multimodal(torch.stack([_pixels(items[i], device) for i in indices]))
    except _DEVICE_FAILURES:
        raise
    except (RuntimeError, ValueError, IndexError) as exc:
        logger.error("the encoder refused %d item(s) of shape %s: %s", len(indices), items[indices[0]].shape, exc)
        return None


def _misfit(index: int, item: MultiModalItem, rows: int) -> str:
    """The error of a request whose item ``index`` encodes to ``rows`` rows, not its placeholders' count."""
    if not rows:
        return f"mm_items[{index}]: the encoder refused its data of shape {item.shape} (the workers' log says why)"
    return (f"mm_items[{index}]: its data encodes to {rows} rows, not its {encoded_rows(item)} placeholders (or its "
            "key, a caller's uuid, was given to other content before: a uuid must identify its content)")


class EncoderOutputCache:
    """Per-request multimodal items, the cached encoder outputs they pin, and the scatter into embeddings."""

    def __init__(self, model: Any, device: torch.device, budget_bytes: int = 0, encode: EncodeFn | None = None) -> None:
        self.model = model
        self.items: dict[str, list[MultiModalItem]] = {}
        self.ends: dict[str, int] = {}
        """request id -> the prompt position its items' rows and spans end at: a step past it reaches none."""
        self.store = EncoderCache(budget_bytes)
        self.encode: EncodeFn = encode or (lambda items, hidden, dtype: encode_items(model, items, device))
        self._pinned: dict[str, dict[int | str, None]] = {}
        """request id -> the pins (`_pin_key`) of the features it holds (reached, not yet passed), in the order
        reached: a dict, not a set, so `remove_request` releases them in the same order on every rank (a set of
        str keys iterates by the interpreter's hash seed, and the release order decides the eviction order)."""
        self._last_piece: dict[str, dict[str, int]] = {}
        """request id -> each hash of its pieces (`MultiModalItem.rows`) -> the index of its last piece, which
        releases the features its first pinned."""
        self.num_queries = 0
        """Items looked up when a prefill first reached them."""
        self.num_hits = 0
        """Of those, items whose features were already cached (or encoded once for another item of the same step)."""
        self.failed: dict[str, str] = {}
        """Requests with an item whose placeholders disagree with its data's encoder rows, with the error (the core
        ends them: `ModelRunnerOutput.failed_requests`); taken by the runner after each step."""

    @property
    def num_encoded(self) -> int:
        """Images run through the encoder so far."""
        return self.num_queries - self.num_hits

    def clear(self) -> None:
        """Forget every request and every cached output, pinned or not."""
        self.items.clear()
        self.ends.clear()
        self._pinned.clear()
        self._last_piece.clear()
        self.store = EncoderCache(self.store.budget_bytes)

    def add_request(self, req_id: str, items: list[MultiModalItem]) -> None:
        self.items[req_id] = items
        self.ends[req_id] = max(item.offset + max(item.length, *item.bidirectional[1:2], 0) for item in items)
        last = {item.mm_hash: index for index, item in enumerate(items) if item.rows}
        if last:
            self._last_piece[req_id] = last

    def remove_request(self, req_id: str) -> None:
        items = self.items.pop(req_id, [])
        self.ends.pop(req_id, None)
        self._last_piece.pop(req_id, None)
        for key in self._pinned.pop(req_id, ()):
            self.store.release(key if isinstance(key, str) else items[key].mm_hash)

    @staticmethod
    def _pin_key(index: int, item: MultiModalItem) -> int | str:
        """What holds an item's features: the item (its index), or for the pieces of one output (a video's or
        audio's chunks, `MultiModalItem.rows`) their hash, from the first piece reached to the last passed."""
        return item.mm_hash if item.rows else index

    def _unpin_passed(self, req_id: str, index: int, item: MultiModalItem) -> None:
        """The prefill has passed ``item``: release its features, a piece's only after its hash's last piece."""
        if item.rows and self._last_piece.get(req_id, {}).get(item.mm_hash) != index:
            return
        self._pinned[req_id].pop(self._pin_key(index, item), None)
        self.store.release(item.mm_hash)

    def inputs_embeds(self, input_ids: torch.Tensor, spans: list[ScheduledSpan]) -> torch.Tensor | None:
        """The step's input embeddings with image features in place; None when no span touches an image."""
        touched = [(span, index, item) for span in spans for index, item in enumerate(self.items.get(span.req_id, ()))
                   if item.offset < span.start + span.length and item.offset + item.length > span.start]
        if not touched:
            return None
        embeds = self.model.embed_input_ids(input_ids)
        self._pin_reached([(span.req_id, index, item) for span, index, item in touched], embeds.shape[-1], embeds.dtype)
        for span, index, item in touched:
            lo, hi = max(span.start, item.offset), min(span.start + span.length, item.offset + item.length)
            features = self.store.get_pinned(item.mm_hash)
            if features.shape[0] != encoded_rows(item):  # a client's item: its request fails, not the engine
                self.failed[span.req_id] = _misfit(index, item, features.shape[0])
                continue
            dst = span.flat_offset + lo - span.start
            kept = self._text_rows(item, lo, hi, embeds.device)
            text = None if kept is None else embeds[kept + dst]
            first = (item.rows[0] if item.rows else 0) - item.offset  # a piece's rows start inside the output
            embeds[dst : dst + hi - lo] = features[lo + first : hi + first].to(embeds.dtype)
            if kept is not None:
                embeds[kept + dst] = text
            if hi == item.offset + item.length:  # the prefill has passed this image
                self._unpin_passed(span.req_id, index, item)
        return embeds

    def _text_rows(self, item: MultiModalItem, lo: int, hi: int, device: torch.device) -> torch.Tensor | None:
        """The prompt positions in ``[lo, hi)`` of ``item`` whose tokens keep their own embeddings (Mistral 3's
        row breaks: ``mm_text_rows``), relative to ``lo``; None when there are none (the other models)."""
        layout = getattr(self.model, "mm_text_rows", None)
        if layout is None:
            return None
        rows = layout(tuple(item.shape)) + item.offset
        rows = rows[(rows >= lo) & (rows < hi)] - lo
        return torch.from_numpy(rows).to(device) if len(rows) else None

    def whole_outputs(self, req_ids: list[str], hidden: int, dtype: torch.dtype) -> list[torch.Tensor]:
        """Each request's one item's whole encoder output, encoded where not cached (the cross-attention input of an
        encoder-decoder model: Whisper), pinned only while it is read."""
        return self.read_whole([(req_id, 0, self.items[req_id][0]) for req_id in req_ids], hidden, dtype)

    def read_whole(self, wanted: list[tuple[str, int, MultiModalItem]], hidden: int,
                   dtype: torch.dtype) -> list[torch.Tensor]:
        """The whole encoder outputs of these (request, item index, item), encoded where not cached, pinned only
        while they are read (`whole_outputs`; Mllama's images: every item of a request)."""
        self._pin_reached(wanted, hidden, dtype)
        outputs = []
        for req_id, index, item in wanted:
            outputs.append(self.store.get_pinned(item.mm_hash))
            if not len(outputs[-1]):  # the encoder refused it: the caller leaves the request without its states
                self.failed[req_id] = _misfit(index, item, 0)
            self._pinned[req_id].pop(index, None)
            self.store.release(item.mm_hash)
        return outputs

    def _pin_reached(self, wanted: list[tuple[str, int, MultiModalItem]], hidden: int, dtype: torch.dtype) -> None:
        """Pin the features of every item reached for the first time, encoding the ones not cached (once each)."""
        missing: dict[str, MultiModalItem] = {}
        repeats: list[str] = []
        for req_id, index, item in wanted:
            pinned = self._pinned.setdefault(req_id, {})
            if self._pin_key(index, item) in pinned:
                continue
            pinned[self._pin_key(index, item)] = None
            self.num_queries += 1
            if item.mm_hash in missing:
                repeats.append(item.mm_hash)
            elif self.store.acquire(item.mm_hash) is None:
                missing[item.mm_hash] = item
            else:
                self.num_hits += 1
        if missing:
            features = self.encode(list(missing.values()), hidden, dtype)
            for mm_hash, rows in zip(missing, features):
                self.store.insert(mm_hash, rows.clone())  # a copy: a view would keep the whole batch alive
        for mm_hash in repeats:  # the same image twice in one step: encoded once, pinned by each
            self.store.acquire(mm_hash)
            self.num_hits += 1
