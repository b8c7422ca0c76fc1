"""Content hashes of full KV-cache blocks, for prefix caching.

A full block's hash chains its parent block's hash, its token ids and its
extra keys, so equal hashes mean equal prefixes (everything before the block
included), not just equal blocks.

Why sha256 and not ``hash()`` of a tuple: the manager lives in one process, so
``hash()`` would be stable enough, but Python's hash of int tuples is not
seeded and is only 64 bits wide, so a client could craft two different token
blocks with the same hash. A hit re-checks the block's own token ids, but it
cannot re-check the whole chain of parents, so a crafted collision on a parent
could make a later block hit KV computed after different tokens. sha256 makes
that infeasible and costs about 1.5 us per full block (one block every
``block_size`` tokens of a request), which is small next to a model step. The
encoding is pickle-free (little-endian int64 tokens, msgpack extra keys), so a
digest is also stable across processes and Python versions.
"""

from __future__ import annotations

import bisect
import hashlib
import struct
from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

import msgspec

__all__ = ["BlockHash", "CacheSalt", "MultiModalPlaceholder", "ROOT_PARENT_HASH", "hash_block_tokens", "block_extra_keys", "extend_block_hashes"]

BlockHash = bytes
"""A 32-byte sha256 digest naming a full block and everything before it."""

ROOT_PARENT_HASH: BlockHash = hashlib.sha256(b"asyncllm.prefix-cache.root.v1").digest()
"""The parent hash of a request's first block."""

_ENCODER = msgspec.msgpack.Encoder()
_sha256 = hashlib.sha256
_PACKERS: dict[int, tuple[bytes, struct.Struct]] = {}
"""Token count -> (its 4-byte little-endian prefix, a little-endian int64 packer); in practice one entry."""


def _packer(num_tokens: int) -> tuple[bytes, struct.Struct]:
    entry = _PACKERS[num_tokens] = (num_tokens.to_bytes(4, "little"), struct.Struct(f"<{num_tokens}q"))
    return entry


CacheSalt = str | tuple[str, str | None] | None
"""A request's salt (`Request.cache_salt`): a prompt-embeds request's is ``("prompt_embeds", salt)``."""


def hash_block_tokens(
    parent_hash: BlockHash, token_ids: Sequence[int], extra_keys: tuple[Any, ...] = ()
) -> BlockHash:
    """Hash of one full block given its parent's hash, its tokens and its extra keys.

    The digest reads ``parent (32 bytes) | token count (4 bytes) | tokens
    (int64 each) | msgpack(extra keys)``: the count makes the token bytes
    self-delimiting, so no two (tokens, extra keys) pairs share an encoding.
    The bytes are hashed in one call: a decoding request hashes a block every
    `block_size` steps, so this is on the hot path.
    """
    prefix, packer = _PACKERS.get(len(token_ids)) or _packer(len(token_ids))
    if extra_keys:
        return _sha256(parent_hash + prefix + packer.pack(*token_ids) + _ENCODER.encode(extra_keys)).digest()
    return _sha256(parent_hash + prefix + packer.pack(*token_ids)).digest()


class MultiModalPlaceholder(Protocol):
    """What the hash reads of a multimodal item (`asyncllm.protocol.MultiModalItem` has it)."""

    mm_hash: str
    offset: int
    length: int


def block_extra_keys(
    block_index: int, cache_salt: CacheSalt, mm_keys: tuple[tuple[str | int, ...], ...] = (), lora_id: int = 0
) -> tuple[Any, ...]:
    """Extra keys of block `block_index` of a request, beyond its token ids.

    The cache salt and the LoRA adapter id go into the first block only: the
    chain carries them into every later block, so requests with different
    salts, or under different adapters (whose KV differs for the same tokens),
    never share a block.

    Each multimodal item overlapping the block adds ``(mm_hash, offset of the
    item relative to the block start)`` (`mm_keys`): its placeholder tokens are
    equal for every image, so the content hash must be part of the key.
    """
    keys: tuple[Any, ...] = ()
    if block_index == 0:
        keys = (("salt", cache_salt) if cache_salt is not None else ()) + (("lora", lora_id) if lora_id else ())
    return keys + (("mm", mm_keys),) if mm_keys else keys


def _mm_keys(mm_items: Sequence[MultiModalPlaceholder], start: int, end: int) -> tuple[tuple[str | int, ...], ...]:
    """``(mm_hash, offset - start, length)`` of the items overlapping tokens ``[start, end)`` (a piece's first row
    too: `asyncllm.protocol.MultiModalItem.rows`). The length keeps an item laid over the wrong number of
    placeholders (which its workers fail) from sharing blocks with the same item laid right."""
    return tuple((item.mm_hash, item.offset - start, item.length, *getattr(item, "rows", ())[:1])
                 for item in mm_items if item.offset < end and item.offset + item.length > start)


class _ItemIndex:
    """A request's items (in prompt order, none overlapping the next: the core checks it) and its long spans, to
    find the ones overlapping a block without scanning them all (a long video's pieces are thousands of items)."""

    def __init__(self, items: Sequence[MultiModalPlaceholder], spans: list["_Span"]) -> None:
        self.items = items
        self.spans = spans
        self.offsets = [item.offset for item in items]
        self.ends = [item.offset + item.length for item in items]

    def keys(self, start: int, end: int) -> tuple[tuple[str | int, ...], ...]:
        """`_mm_keys` of tokens ``[start, end)``: the items', then the spans'."""
        lo, hi = bisect.bisect_right(self.ends, start), bisect.bisect_left(self.offsets, end)
        return _mm_keys(self.items[lo:hi], start, end) + (_mm_keys(self.spans, start, end) if self.spans else ())


class _Span(NamedTuple):
    """A bidirectional span that reaches past its item's rows, keyed like an item (`_span_keys`)."""

    mm_hash: str
    offset: int
    length: int


def _span_keys(mm_items: Sequence[MultiModalPlaceholder], token_ids: Sequence[int], first: int) -> list[_Span]:
    """The items' bidirectional spans that reach past their own rows and end after token ``first`` (PaliGemma's
    prefix: the whole prompt), each keyed by a digest of its tokens and the items in it: a block's KV inside such a
    span depends on the span's later tokens too, so it may serve only a prompt with the same span. A span within its
    item's rows (Gemma 3's image) needs none: the item's hash already says what they hold."""
    spans = []
    for item in mm_items:
        span = getattr(item, "bidirectional", None)
        if not span or 0 <= span[0] and span[1] <= item.length or item.offset + span[1] <= first:
            continue
        start, stop = item.offset + span[0], item.offset + span[1]
        inside = [(other.mm_hash, other.offset - start) for other in mm_items if start <= other.offset < stop]
        digest = _sha256(_ENCODER.encode((list(token_ids[start:stop]), inside))).hexdigest()
        spans.append(_Span("span:" + digest, start, stop - start))
    return spans


def extend_block_hashes(
    block_hashes: list[BlockHash],
    token_ids: Sequence[int],
    block_size: int,
    num_blocks: int,
    cache_salt: CacheSalt,
    mm_items: Sequence[MultiModalPlaceholder] = (),
    lora_id: int = 0,
) -> None:
    """Append hashes to `block_hashes` until it covers `num_blocks` full blocks.

    Incremental: blocks already hashed are not hashed again, so a decoding
    request costs one hash per `block_size` generated tokens.
    """
    num_blocks = min(num_blocks, len(token_ids) // block_size)
    start_index = len(block_hashes)
    if start_index >= num_blocks:
        return
    parent = block_hashes[-1] if block_hashes else ROOT_PARENT_HASH
    index_of = _ItemIndex(mm_items, _span_keys(mm_items, token_ids, start_index * block_size)) if mm_items else None
    prefix, packer = _PACKERS.get(block_size) or _packer(block_size)
    pack, append = packer.pack, block_hashes.append
    for index in range(start_index, num_blocks):
        start = index * block_size
        block_tokens = token_ids[start : start + block_size]
        if mm_items or (index == 0 and (cache_salt is not None or lora_id)):
            mm_keys = index_of.keys(start, start + block_size) if index_of is not None else ()
            parent = hash_block_tokens(parent, block_tokens, block_extra_keys(index, cache_salt, mm_keys, lora_id))
        else:  # no extra keys: `hash_block_tokens` inlined (one full block per `block_size` decode steps)
            parent = _sha256(parent + prefix + pack(*block_tokens)).digest()
        append(parent)
