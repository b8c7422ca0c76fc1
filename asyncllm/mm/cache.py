"""The multimodal processor cache, key-replicated (``lru``): keys and sizes on the host, data in the core.

Both sides run the same LRU over the same byte budget (``mm_processor_cache_gb``)
and see the same sequence of operations (the host records an item when it sends
it; the core when it receives it, in the same order over one socket), so the
host knows which items the core holds without asking: a repeated image crosses
the socket as its hash only. When the two drift anyway (another host attached to
a standalone core, or a budget too small for an item), the core answers
`CacheMiss` and the host resends the request with data (docs/multimodal.md).
`fill_mm_items` also takes items from a host's shared-memory ring (``shm``,
asyncllm/mm/shm_ring.py).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

import msgspec
import numpy as np

from asyncllm.errors import InvalidRequestError
from asyncllm.mm.audios import audio_output_length, qwen3_asr_output_length
from asyncllm.protocol import AddRequest, MultiModalItem

if TYPE_CHECKING:
    from asyncllm.mm.shm_ring import ShmRingReader

__all__ = [
    "CACHE_MISS_ERROR", "LRUBudget", "MultiModalCacheMiss", "ProcessorCacheMirror", "ProcessorCacheStore",
    "data_bytes", "fill_mm_items",
]

_ITEM_DTYPES = {"float32": 4, "float16": 2}


V = TypeVar("V")


class LRUBudget(Generic[V]):
    """An LRU map whose entries have byte sizes; inserting evicts the oldest until the total fits."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.total_bytes = 0
        self._entries: OrderedDict[str, tuple[int, V]] = OrderedDict()

    def get(self, key: str) -> V | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        return entry[1]

    def put(self, key: str, size: int, value: V) -> None:
        """Insert (or refresh) ``key``; an entry larger than the whole budget is not kept."""
        self.drop(key)
        if size > self.capacity_bytes:
            return
        while self.total_bytes + size > self.capacity_bytes:
            _, (old_size, _) = self._entries.popitem(last=False)
            self.total_bytes -= old_size
        self._entries[key] = (size, value)
        self.total_bytes += size

    def drop(self, key: str) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.total_bytes -= entry[0]

    def __len__(self) -> int:
        return len(self._entries)


@dataclass(frozen=True)
class MirrorEntry:
    """What the host needs to send an item as its key only: its placeholder count and data shape (the placeholder
    tokens of some models follow from it: Mistral 3's row breaks)."""

    length: int
    shape: tuple[int, ...] = ()


class ProcessorCacheMirror(LRUBudget[MirrorEntry]):
    """The host's half: hashes -> placeholder counts, sized as the data the core holds."""


class ProcessorCacheStore(LRUBudget[MultiModalItem]):
    """The core's half: hashes -> processed items (with data)."""

    def fill(self, items: list[MultiModalItem]) -> list[str]:
        """Record items that carry data; fill key-only items in place. Returns the hashes not found."""
        missing = []
        for i, item in enumerate(items):
            if item.data is not None:
                self.put(item.mm_hash, len(item.data), item)
                continue
            cached = self.get(item.mm_hash)
            if cached is None:
                missing.append(item.mm_hash)
            else:
                items[i] = msgspec.structs.replace(item, data=cached.data, shape=cached.shape, dtype=cached.dtype)
        return missing


class MultiModalCacheMiss(InvalidRequestError):
    """The core's store lacks a key the host sent without data; the host resends (never user-facing)."""


CACHE_MISS_ERROR = MultiModalCacheMiss.__name__


def _check_item(item: MultiModalItem, index: int, num_prompt_tokens: int, previous_end: int) -> int:
    field = f"mm_items[{index}]"
    span = item.bidirectional  # an item of no rows is a span alone (PaliGemma's prefix)
    rows_or_span = item.length > 0 or bool(span)
    if not (previous_end <= item.offset and rows_or_span and item.offset + item.length <= num_prompt_tokens):
        raise InvalidRequestError(field, f"placeholders [{item.offset}, {item.offset + item.length}) must be in "
                                  f"the prompt, after the previous item's, in order")
    if span and not (len(span) == 2 and 0 <= item.offset + span[0] < item.offset + span[1] <= num_prompt_tokens):
        raise InvalidRequestError(f"{field}.bidirectional", f"{span} must be [start, stop) of the prompt's tokens, "
                                                            "relative to the item's offset")
    if not (math.isfinite(item.time_interval) and item.time_interval >= 0):
        raise InvalidRequestError(f"{field}.time_interval", f"a finite number >= 0, got {item.time_interval!r}")
    if item.data is not None or _in_ring(item):
        nbytes = len(item.data) if item.data is not None else data_bytes(item)
        itemsize = _ITEM_DTYPES.get(item.dtype)
        if itemsize is None or nbytes != itemsize * math.prod(item.shape) or not item.shape:
            raise InvalidRequestError(field, f"data of {nbytes} bytes does not match shape {item.shape} "
                                      f"and dtype {item.dtype!r} (one of {', '.join(_ITEM_DTYPES)})")
    return item.offset + item.length


def _in_ring(item: MultiModalItem) -> bool:
    return item.data is None and item.shm_offset >= 0


def data_bytes(item: MultiModalItem) -> int:
    """The byte size of an item's data, from its shape and dtype."""
    return _ITEM_DTYPES.get(item.dtype, 0) * math.prod(item.shape)


def _fill_from_ring(ring: ShmRingReader | None, items: list[MultiModalItem]) -> list[str]:
    """Copy the items that carry a ring location out of the host's ring; the hashes whose entry is gone."""
    missing = []
    for i, item in enumerate(items):
        if not _in_ring(item):
            continue
        data = None
        if ring is not None:
            data = ring.read(item.mm_hash, item.shm_offset, item.shm_generation, data_bytes(item), f"mm_items[{i}]")
        if data is None:
            missing.append(item.mm_hash)
        else:
            items[i] = msgspec.structs.replace(item, data=data, shm_offset=-1, shm_generation=0)
    return missing


def _check_pieces(items: list[MultiModalItem], piece_merge: int, audio_window: int, prompt_len: int) -> None:
    """`InvalidRequestError` unless the items' ``rows`` (`MultiModalItem.rows`) are a layout the workers can take:
    only for a model that lays a video with its audio in pieces (``piece_merge``: its vision tower's spatial merge,
    0: it takes none), each ``[start, whole]``, each run of adjacent pieces between two start and two end tokens of
    the ``prompt_len`` (no item's placeholders), every item of a hash a piece of one
    ``whole`` (a video's: its grid's placeholders; an audio's: its frames' rows, by ``audio_window``: `_whole_rows`),
    tiling it in prompt order (again from row 0 for a repeat), each run of adjacent pieces all the rows of one video
    and at most one audio (Qwen2.5-Omni's time chunks and Qwen3-Omni's time-ordered runs alike)."""
    pieces = {item.mm_hash for item in items if item.rows}
    if pieces and not piece_merge:
        raise InvalidRequestError("mm_items", "rows: this model takes no pieces of an item (only Qwen-Omni's "
                                              "use_audio_in_video)")
    wholes: dict[str, int] = {}
    reached: dict[str, int] = {}
    group: dict[str, int] = {}  # the run's hashes -> their data's dimensions
    previous_end = 0
    for index, item in enumerate(items + [MultiModalItem("", prompt_len, 0)]):
        if group and (not item.rows or item.offset != previous_end or index == len(items)):
            _check_group(group, reached, wholes, index, item.offset - previous_end)
            group = {}
        if index == len(items):
            break
        first_of_run = not group
        previous_end, gap = item.offset + item.length, item.offset - previous_end
        if item.mm_hash not in pieces:
            continue
        whole = item.rows[1] if len(item.rows) == 2 else -1
        start = reached.get(item.mm_hash, 0) % max(whole, 1)  # a repeat starts again at row 0
        if (whole < 1 or wholes.setdefault(item.mm_hash, whole) != whole or (first_of_run and gap < 2)
                or item.rows[0] != start or start + item.length > whole
                or _whole_rows(item, piece_merge, audio_window) not in (None, whole)):
            raise InvalidRequestError(f"mm_items[{index}].rows", f"{item.rows} must be [{start}, whole]: the next "
                                      "rows of its hash's one whole (a video's: its grid's; an audio's: its "
                                      "frames'), after two start tokens")
        reached[item.mm_hash] = start + item.length
        group[item.mm_hash] = len(item.shape)


def _check_group(group: dict[str, int], reached: dict[str, int], wholes: dict[str, int], index: int,
                 after: int) -> None:
    """The run of pieces before item ``index``, ``after`` tokens before the next item's (or the prompt's end): one
    video (data of 4 dimensions) and at most one audio, whole, then two end tokens."""
    dims = sorted(group.values())
    if dims not in ([4], [3, 4]) or any(reached[h] != wholes[h] for h in group) or after < 2:
        raise InvalidRequestError(f"mm_items[{index - 1}].rows", "a run of pieces must take all the rows of one "
                                                                 "video and at most one audio, then two end tokens")


def _follows(item: MultiModalItem) -> bool:
    """A piece after the first of its output (`MultiModalItem.rows` past row 0): it crosses key-only, its data
    the first piece's (one cache operation each output, as the host's one lookup)."""
    return bool(item.rows) and item.rows[0] != 0


def _fill_pieces(items: list[MultiModalItem]) -> None:
    """Give each following piece (`_follows`) the data of the last first piece of its hash before it."""
    firsts: dict[str, MultiModalItem] = {}
    for index, item in enumerate(items):
        if not _follows(item):
            firsts[item.mm_hash] = item
        elif item.mm_hash in firsts:
            first = firsts[item.mm_hash]
            items[index] = msgspec.structs.replace(item, data=first.data, shape=first.shape, dtype=first.dtype,
                                                   shm_offset=-1, shm_generation=0)
        else:
            raise InvalidRequestError(f"mm_items[{index}].rows", f"{item.rows}: a piece after no first piece (row 0) "
                                                                 f"of {item.mm_hash}")


def _whole_rows(item: MultiModalItem, merge: int, audio_window: int = 0) -> int | None:
    """The encoder rows of a piece's whole output: a video's ``(t, h, w, features)`` patches merged ``merge`` x
    ``merge``; an audio's ``[1, mel + 1, frames]`` values (the last row its frames' mask) as Qwen2.5-Omni's encoder
    pools them (``audio_window`` 0), or as Qwen3-Omni's chunks them (``audio_window``: its ``n_window``); None when
    its data is not here."""
    shape = item.shape
    if len(shape) == 4 and merge:
        return shape[0] * (shape[1] // merge) * (shape[2] // merge)
    if len(shape) == 3 and item.data is not None and shape[0] == 1 and shape[1] >= 1:
        values = np.frombuffer(item.data, np.dtype(item.dtype)).reshape(shape)
        frames = int(values[0, -1].sum())
        return qwen3_asr_output_length(frames, audio_window) if audio_window else audio_output_length(frames)
    return None


def fill_mm_items(store: ProcessorCacheStore | None, message: AddRequest, ring: ShmRingReader | None = None,
                  piece_merge: int = 0, piece_audio_window: int = 0) -> None:
    """Check the request's items and give each its data: from ``ring`` (an shm location), the store (a key only)
    or the message itself; `MultiModalCacheMiss` naming the items none of them has. ``piece_merge`` and
    ``piece_audio_window``: the model's (`_check_pieces`)."""
    end = 0
    for index, item in enumerate(message.mm_items):
        end = _check_item(item, index, len(message.prompt_token_ids), end)
    items = message.mm_items
    heads = [i for i, item in enumerate(items) if not _follows(item)]  # a piece after the first: its first's data
    plain = [i for i in heads if not _in_ring(items[i])]  # with data, or a key for the lru store
    subset = [items[i] for i in plain]
    missing = store.fill(subset) if store is not None else [item.mm_hash for item in subset if item.data is None]
    for i, item in zip(plain, subset):
        items[i] = item
    missing += _fill_from_ring(ring, items)
    if missing:
        raise MultiModalCacheMiss("mm_items", f"not in the core's processor cache: {', '.join(missing)}")
    _fill_pieces(items)
    _check_pieces(items, piece_merge, piece_audio_window, len(message.prompt_token_ids))  # after the fill: a key-only item's shape is the cached data's
