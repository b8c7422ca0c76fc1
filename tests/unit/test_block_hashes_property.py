"""Prefix-cache block hashes under drawn requests (hypothesis): two requests' block ``i`` hashes equal exactly when
everything its KV depends on is equal, and hashing in pieces gives the hashes of one call.

What block ``i`` (tokens ``[0, end)``, ``end = (i + 1) * block_size``) depends on, spelled out naively here
without the hashing module's index or encoding: the tokens before ``end``; the cache salt and the LoRA id; for each
block up to ``i``, the multimodal items overlapping it (content hash, offset, length, first row of a piece); and
each both-ways span that reaches past its item's rows (PaliGemma's prefix) and overlaps such a block, with every
token and every item (hash, offset) inside the span, later tokens included, since the span's rows attend to them.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncllm.kv.hashing import extend_block_hashes

SALTS = [None, "", "a", ("prompt_embeds", None), ("prompt_embeds", "a")]


@dataclass(frozen=True)
class Item:
    """`asyncllm.kv.hashing.MultiModalPlaceholder` with the fields the hash reads."""

    mm_hash: str
    offset: int
    length: int
    rows: list[int] = field(default_factory=list)
    bidirectional: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Request:
    tokens: list[int]
    block_size: int
    salt: Any
    lora: int
    items: list[Item]


def _overlaps(offset: int, length: int, start: int, end: int) -> bool:
    return offset < end and offset + length > start


def _spans(request: Request) -> list[tuple[int, int]]:
    """[start, stop) of each span past its item's rows."""
    return [(item.offset + item.bidirectional[0], item.offset + item.bidirectional[1]) for item in request.items
            if item.bidirectional and not (0 <= item.bidirectional[0] and item.bidirectional[1] <= item.length)]


def depends_on(request: Request, index: int) -> tuple:
    """Everything block ``index``'s KV depends on, block by block."""
    bs, tokens = request.block_size, request.tokens
    blocks = []
    for j in range(index + 1):
        start, end = j * bs, (j + 1) * bs
        items = [(item.mm_hash, item.offset, item.length, *item.rows[:1]) for item in request.items
                 if _overlaps(item.offset, item.length, start, end)]
        spans = [(first, stop, tuple(tokens[first:stop]),
                  tuple((other.mm_hash, other.offset) for other in request.items if first <= other.offset < stop))
                 for first, stop in _spans(request) if _overlaps(first, stop - first, start, end)]
        blocks.append((tuple(tokens[start:end]), tuple(items), tuple(spans)))
    return request.salt, request.lora, tuple(blocks)


def hashes(request: Request, cuts: list[int] = ()) -> list[bytes]:
    """The request's full blocks' hashes, the tokens growing to each of ``cuts`` first (a decode's steps)."""
    out: list[bytes] = []
    for cut in [*cuts, len(request.tokens)]:
        tokens = request.tokens[:cut]
        extend_block_hashes(out, tokens, request.block_size, len(tokens) // request.block_size, request.salt,
                            request.items, request.lora)
    return out


@st.composite
def items_of(draw: st.DrawFn, num_tokens: int) -> list[Item]:
    """Items in prompt order, none overlapping the next; some pieces (rows), some with a span."""
    items, position = [], draw(st.integers(0, 3))
    for _ in range(draw(st.integers(0, 4))):
        if position >= num_tokens:
            break
        span_only = draw(st.integers(0, 4)) == 0  # PaliGemma's prefix: an item of no rows, a span alone
        length = 0 if span_only else draw(st.integers(1, min(5, num_tokens - position)))
        rows = draw(st.sampled_from([[], [0, 8], [2, 8]])) if length else []
        span: list[int] = []
        if span_only or draw(st.integers(0, 3)) == 0:
            start = draw(st.integers(-position, 0)) if draw(st.booleans()) else 0
            span = [start, draw(st.integers(max(start + 1, 1), num_tokens - position))]
        items.append(Item(draw(st.sampled_from("AB")), position, length, rows, span))
        position += length + draw(st.integers(0, 4))
    return items


@st.composite
def requests(draw: st.DrawFn) -> Request:
    tokens = draw(st.lists(st.integers(0, 2), min_size=2, max_size=30))
    return Request(tokens, draw(st.integers(1, 4)), draw(st.sampled_from(SALTS)), draw(st.integers(0, 2)),
                   draw(items_of(len(tokens))))


def _room(request: Request, item: Item) -> bool:
    """Whether ``item`` can take one more token without reaching the next item or the prompt's end."""
    end = item.offset + item.length
    return end < len(request.tokens) and all(other.offset != end for other in request.items)


_ITEM_CHANGES = {
    "hash": lambda request, item: True,
    "length": lambda request, item: item.length > 1 or item.length and _room(request, item),
    "rows": lambda request, item: bool(item.rows),
    "move": lambda request, item: item.length > 0 and _room(request, item),
    "span": lambda request, item: (bool(item.bidirectional)
                                   and item.offset + item.bidirectional[1] < len(request.tokens)),
}
"""One item's changes, and the items each can change."""


@st.composite
def variant(draw: st.DrawFn, base: Request) -> Request:
    """``base`` with one thing changed (or none), so that the two often share a prefix."""
    change = draw(st.sampled_from(["none", "token", "append", "salt", "lora", "items"] + list(_ITEM_CHANGES) * 2))
    if change == "token":  # anywhere, or at a span's edge
        edges = [at for first, stop in _spans(base) for at in (first, stop - 1)]
        at = draw(st.sampled_from(edges) if edges and draw(st.booleans()) else st.integers(0, len(base.tokens) - 1))
        return replace(base, tokens=base.tokens[:at] + [(base.tokens[at] + 1) % 3] + base.tokens[at + 1:])
    if change == "append":
        return replace(base, tokens=base.tokens + draw(st.lists(st.integers(0, 2), min_size=1, max_size=6)))
    if change == "salt":
        return replace(base, salt=draw(st.sampled_from(SALTS)))
    if change == "lora":
        return replace(base, lora=draw(st.integers(0, 2)))
    if change == "items":
        return replace(base, items=draw(items_of(len(base.tokens))))
    items = list(base.items)
    changeable = [i for i, item in enumerate(items) if change in _ITEM_CHANGES and _ITEM_CHANGES[change](base, item)]
    if changeable:
        at = draw(st.sampled_from(changeable))
        item = items[at]
        if change == "hash":
            item = replace(item, mm_hash="B" if item.mm_hash == "A" else "A")
        elif change == "length":
            item = replace(item, length=item.length + (1 if _room(base, item) else -1))
        elif change == "move":  # one token later: its rows, and its place in a span, move
            item = replace(item, offset=item.offset + 1)
        elif change == "rows":
            item = replace(item, rows=[2 - item.rows[0], 8])
        else:
            item = replace(item, bidirectional=[item.bidirectional[0], item.bidirectional[1] + 1])
        items[at] = item
    return replace(base, items=items)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_equal_block_hashes_exactly_when_their_kv_depends_on_the_same(data: st.DataObject) -> None:
    base = data.draw(requests(), "base")
    prompt = max((stop for _, stop in _spans(base)), default=0)  # spans lie in the prompt, hashed once it is whole
    cuts = sorted(data.draw(st.lists(st.integers(prompt, len(base.tokens)), max_size=3), "cuts"))
    assert hashes(base, cuts) == hashes(base)  # in pieces as in one call
    drawn = [base] + [data.draw(variant(base), f"variant {i}") for i in range(6)]
    for a, b in itertools.combinations(drawn, 2):  # one change from the base, or two between variants
        ha, hb = hashes(a), hashes(b)
        assert len(ha) == len(a.tokens) // a.block_size
        for index in range(min(len(ha), len(hb))):
            assert (ha[index] == hb[index]) == (depends_on(a, index) == depends_on(b, index)), (a, b, index)


def _prefix(items: list[Item], tokens: list[int] = (0,) * 12) -> Request:
    return Request(list(tokens), 2, None, 0, items)


EDGES = {
    "an empty salt is a salt": (_prefix([]), replace(_prefix([]), salt="")),
    "the span's last token": (_prefix([Item("A", 0, 0, [], [0, 12])]),
                              _prefix([Item("A", 0, 0, [], [0, 12])], [0] * 11 + [1])),
    "an item's place in a span": (_prefix([Item("A", 0, 0, [], [0, 12]), Item("B", 6, 2)]),
                                  _prefix([Item("A", 0, 0, [], [0, 12]), Item("B", 7, 2)])),
    "a span before its item": (_prefix([Item("A", 4, 2, [], [-4, 2])]), _prefix([Item("B", 4, 2, [], [-4, 2])])),
}
"""Pairs whose first block's KV differs (and so must its hash) in what the drawn pairs seldom change alone."""


@pytest.mark.parametrize("name", list(EDGES))
def test_first_blocks_that_differ_only_at_an_edge_hash_apart(name: str) -> None:
    a, b = EDGES[name]
    assert depends_on(a, 0) != depends_on(b, 0) and hashes(a)[0] != hashes(b)[0]
