"""`EncoderOutputCache` and its `EncoderCache` under drawn prefills (hypothesis), against a plain-list model.

Drawn: a byte budget (0 to 64), a hidden size (1 to 3) and the encoder's output dtype (float32 or bfloat16); four
item hashes, each with its output rows (1 to 4), so 2 to 48 bytes of features, one of them sometimes refused by the
encoder (it raises; `encode_items` retries the batch item by item and gives that one no rows); one to four request
layouts of 1 to 3 of those items between text tokens (shared between requests, sometimes twice in one), each item
whole or laid out in two pieces (`MultiModalItem.rows`) with the next item between them; and operations: add a
request (from its first token, or past a prefix-cache hit that may end inside an item), run a step of prefill chunks
of drawn sizes for one or two requests (`inputs_embeds` with a `ScheduledSpan` each), finish a request (or abort it
mid-prefill) and preempt one (`remove_request`; it comes back at once from a prefix-cache hit). A request the cache
reports failed (a refused item) is removed, as the core would.

The model states the rules of asyncllm/mm/encoder_cache.py, asyncllm/mm/embeddings.py and docs/multimodal.md ("The
encoder cache"): each held hash's bytes, who pins it, and the unpinned hashes oldest first. A whole item is pinned by
its request from the step that first reaches it to the step that passes it; the pieces of one output by their hash,
from the first piece reached to the last piece passed; a request that leaves releases its pins in the order reached.
In a step every item reached for the first time is looked up (a hit takes the hash out of the LRU), then the misses
run through the encoder in one call, once per hash, and are inserted in that order, then the other copies of a
missed hash are pinned. A last release appends the hash to the LRU (a refused, empty output is dropped); a refused
item is never released before its request leaves. After every call the oldest unpinned go while the bytes exceed the
budget. After every call the real cache must match: the hashes held, the LRU order, each hash's pin count, the bytes
(so exactly the model's evictions), the query and hit counts; the encoder ran on exactly the model's misses; and
every embedding row of the step is the item's encoder row at that position (or the token's own where no item is, or
its item was refused), so a missing or wrong entry shows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from asyncllm.mm.embeddings import EncoderOutputCache, ScheduledSpan, encode_items
from asyncllm.protocol import MultiModalItem

NUM_HASHES = 4


@dataclass(frozen=True)
class Image:
    """One item hash and its encoder output: ``rows`` rows, row r all ``value(r)``, or none when ``refused``."""

    number: int
    rows: int
    refused: bool

    @property
    def mm_hash(self) -> str:
        return f"h{self.number}"

    def value(self, row: int) -> float:
        return 10.0 * self.number + row + 1  # exact in bfloat16

    def item(self, offset: int, rows: range | None = None) -> MultiModalItem:
        """The item at ``offset``: the whole output, or the piece of it ``rows``."""
        pixels = np.array([self.value(r) for r in range(self.rows)], dtype=np.float32)
        piece = {} if rows is None else {"rows": [rows.start, self.rows]}
        length = self.rows if rows is None else len(rows)
        return MultiModalItem(self.mm_hash, offset, length, pixels.tobytes(), [self.rows], "float32", **piece)


class Encoder:
    """The model: a token's embedding is its id; pixel r of an image is its row r (refused pixels raise)."""

    def __init__(self, hidden: int, dtype: torch.dtype, refused: set[float]) -> None:
        self.hidden, self.dtype, self.refused = hidden, dtype, refused
        self.calls: list[list[str]] = []
        """The hashes of each `EncoderOutputCache.encode` call."""

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return input_ids.float().unsqueeze(1).repeat(1, self.hidden)

    def embed_multimodal(self, pixels: torch.Tensor) -> torch.Tensor:
        if any(float(p[0]) in self.refused for p in pixels):
            raise ValueError("refused")
        return pixels.unsqueeze(2).repeat(1, 1, self.hidden).to(self.dtype)

    def encode(self, items: list[MultiModalItem], hidden: int, dtype: torch.dtype) -> list[torch.Tensor]:
        self.calls.append([item.mm_hash for item in items])
        return encode_items(self, items, torch.device("cpu"))


Pin = tuple[str, object]
"""(request id, ("item", index) or ("pieces", hash)): one pin, as the rules above key it."""


@dataclass(eq=False)
class Req:
    req_id: str
    items: list[tuple[Image, MultiModalItem]]
    prompt_len: int
    computed: int
    pins: list[Pin] = field(default_factory=list)
    """The pins it holds, in the order it reached them."""

    def pin(self, index: int) -> Pin:
        item = self.items[index][1]
        return (self.req_id, ("pieces", item.mm_hash) if item.rows else ("item", index))

    def passes(self, index: int) -> bool:
        """Passing item ``index`` releases its pin: a whole item, or the last piece of its hash in this request."""
        mm_hash = self.items[index][1].mm_hash
        return not self.items[index][1].rows or index == max(
            i for i, (_, item) in enumerate(self.items) if item.rows and item.mm_hash == mm_hash)


class Model:
    """Each held hash's bytes and pins, the unpinned hashes oldest first, and the lookups counted."""

    def __init__(self, budget: int, nbytes: dict[str, int]) -> None:
        self.budget, self.size = budget, nbytes
        self.nbytes: dict[str, int] = {}
        self.holders: dict[str, list[Pin]] = {}
        self.lru: list[str] = []
        self.queries = self.hits = 0

    def acquire(self, mm_hash: str, pin: Pin) -> None:
        if mm_hash in self.lru:
            self.lru.remove(mm_hash)
        self.holders.setdefault(mm_hash, []).append(pin)

    def insert(self, mm_hash: str, pin: Pin) -> None:
        self.nbytes[mm_hash] = self.size[mm_hash]
        self.holders[mm_hash] = [pin]
        self.evict()

    def release(self, mm_hash: str, pin: Pin) -> None:
        self.holders[mm_hash].remove(pin)
        if not self.holders[mm_hash]:
            del self.holders[mm_hash]
            if self.nbytes[mm_hash]:
                self.lru.append(mm_hash)
            else:  # a refused output: never kept
                del self.nbytes[mm_hash]
        self.evict()

    def evict(self) -> None:
        while sum(self.nbytes.values()) > self.budget and self.lru:
            del self.nbytes[self.lru.pop(0)]

    def reach(self, touched: list[tuple[Req, int]]) -> list[str]:
        """Pin the items a step reaches for the first time; the hashes to encode, in order."""
        missing: dict[str, Pin] = {}
        repeats: list[tuple[str, Pin]] = []
        for req, index in touched:
            mm_hash, pin = req.items[index][1].mm_hash, req.pin(index)
            if pin in req.pins:  # another piece of an output this request already pins
                continue
            req.pins.append(pin)
            self.queries += 1
            if mm_hash in missing:
                repeats.append((mm_hash, pin))
            elif mm_hash in self.nbytes:
                self.hits += 1
                self.acquire(mm_hash, pin)
            else:
                missing[mm_hash] = pin
        for mm_hash, pin in missing.items():
            self.insert(mm_hash, pin)
        for mm_hash, pin in repeats:  # encoded once, pinned by each copy
            self.hits += 1
            self.acquire(mm_hash, pin)
        return list(missing)

    def view(self) -> tuple:
        return (sorted(self.nbytes), self.lru, {h: len(pins) for h, pins in self.holders.items()},
                sum(self.nbytes.values()), self.queries, self.hits)


def observed(cache: EncoderOutputCache) -> tuple:
    """(hashes held, unpinned oldest first, pin counts, bytes, queries, hits). The LRU order and the pin counts are
    the store's own state: no public method shows them but through later evictions."""
    store = cache.store
    pins = {mm_hash: entry.count for mm_hash, entry in store._pinned.items()}
    return (sorted([*pins, *store._unpinned]), list(store._unpinned), pins, store.total_bytes, cache.num_queries,
            cache.num_hits)


class Harness:
    """The real `EncoderOutputCache` and the model, taking the same calls, checked after each."""

    def __init__(self, budget: int, hidden: int, dtype: torch.dtype, images: list[Image]) -> None:
        self.encoder = Encoder(hidden, dtype, {image.value(0) for image in images if image.refused})
        self.cache = EncoderOutputCache(self.encoder, torch.device("cpu"), budget, encode=self.encoder.encode)
        sizes = {image.mm_hash: 0 if image.refused else image.rows * hidden * dtype.itemsize for image in images}
        self.model = Model(budget, sizes)
        self.reqs: list[Req] = []

    def add(self, req: Req) -> None:
        self.cache.add_request(req.req_id, [item for _, item in req.items])
        self.reqs.append(req)
        self.check()

    def leave(self, req: Req) -> None:
        """Finished, aborted, failed or preempted: every pin released, in the order reached."""
        self.cache.remove_request(req.req_id)
        for pin in req.pins:
            self.model.release(_hash_of(req, pin), pin)
        req.pins = []
        self.reqs.remove(req)
        self.check()

    def step(self, chunks: list[tuple[Req, int]]) -> None:
        spans, flat = [], 0
        for req, size in chunks:
            stop = min(req.computed + size, req.prompt_len)
            spans.append(ScheduledSpan(req.req_id, req.computed, stop - req.computed, flat))
            flat += stop - req.computed
        touched = [(req, i) for req, span in zip([r for r, _ in chunks], spans) for i in reached(req, span)]
        input_ids = torch.cat([-1 - torch.arange(span.start, span.start + span.length) for span in spans])
        calls = len(self.encoder.calls)
        embeds = self.cache.inputs_embeds(input_ids, spans)
        missing = self.model.reach(touched)
        assert self.encoder.calls[calls:] == ([missing] if missing else [])  # exactly the misses, once each
        failed = {req.req_id for req, i in touched if req.items[i][0].refused}
        for req, i in touched:  # passed: released (a refused item fails its request and holds it until it leaves)
            item = req.items[i][1]
            if item.offset + item.length <= _stop(spans, req) and not req.items[i][0].refused and req.passes(i):
                req.pins.remove(req.pin(i))
                self.model.release(item.mm_hash, req.pin(i))
        self.check_rows(embeds, input_ids, [(req, span) for (req, _), span in zip(chunks, spans)])
        assert set(self.cache.failed) == failed, (self.cache.failed, failed)
        self.cache.failed.clear()  # the runner takes them
        for req, span in [(r, s) for (r, _), s in zip(chunks, spans)]:
            req.computed = span.start + span.length
        self.check()
        for req in [req for req in self.reqs if req.req_id in failed]:  # the core ends a failed request
            self.leave(req)

    def check_rows(self, embeds: torch.Tensor | None, input_ids: torch.Tensor, spans: list[tuple[Req, ScheduledSpan]]):
        """Every row: the encoder's row of the item there, else the token's own embedding."""
        expected = input_ids.float().clone()
        for req, span in spans:
            for position in range(span.start, span.start + span.length):
                for image, item in req.items:
                    if item.offset <= position < item.offset + item.length and not image.refused:
                        row = (item.rows[0] if item.rows else 0) + position - item.offset
                        expected[span.flat_offset + position - span.start] = image.value(row)
        if embeds is None:  # no span touched an item
            assert all(not reached(req, span) for req, span in spans)
            return
        assert embeds.shape == (len(input_ids), self.encoder.hidden)
        assert torch.equal(embeds, expected.unsqueeze(1).repeat(1, self.encoder.hidden)), (embeds, expected)

    def check(self) -> None:
        assert observed(self.cache) == self.model.view(), (observed(self.cache), self.model.view())
        held = sorted((_hash_of(req, pin), str(pin)) for req in self.reqs for pin in req.pins)
        assert held == sorted((h, str(pin)) for h, pins in self.model.holders.items() for pin in pins)
        assert len(self.cache.store) == len(self.model.nbytes)
        assert all((f"h{n}" in self.cache.store) == (f"h{n}" in self.model.nbytes) for n in range(NUM_HASHES))


def _hash_of(req: Req, pin: Pin) -> str:
    kind, key = pin[1]
    return key if kind == "pieces" else req.items[key][1].mm_hash


def _stop(spans: list[ScheduledSpan], req: Req) -> int:
    span = next(span for span in spans if span.req_id == req.req_id)
    return span.start + span.length


def reached(req: Req, span: ScheduledSpan) -> list[int]:
    """The indices of the items whose placeholders overlap the span."""
    return [i for i, (_, item) in enumerate(req.items)
            if item.offset < span.start + span.length and item.offset + item.length > span.start]


def lay_out(images: list[Image], layout: tuple[list[tuple[int, int, int]], int]) -> tuple[list, int]:
    """(image, item) pairs and the prompt length of (image index, text tokens before it, split) triples and a tail: a
    split inside the output lays it out in two pieces, the second after the next item."""
    items, position, pending = [], 0, None
    for index, gap, split in layout[0]:
        image = images[index]
        position += gap
        if 0 < split < image.rows:
            items.append((image, image.item(position, range(0, split))))
            position += split
            later = (image, range(split, image.rows))
        else:
            items.append((image, image.item(position)))
            position += image.rows
            later = None
        if pending is not None:
            items.append((pending[0], pending[0].item(position, pending[1])))
            position += len(pending[1])
        pending = later
    if pending is not None:
        items.append((pending[0], pending[0].item(position, pending[1])))
        position += len(pending[1])
    return items, position + layout[1]


KINDS = ["add"] * 3 + ["step"] * 8 + ["finish"] * 2 + ["preempt"] * 2
Op = tuple[str, int, int, int, int]
"""(kind, pick, size, second pick, second size): a step's second chunk only when its size is not 0."""


@st.composite
def scenarios(draw: st.DrawFn) -> tuple:
    budget, hidden = draw(st.integers(0, 64)), draw(st.integers(1, 3))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    refused = draw(st.integers(0, 2 * NUM_HASHES - 1))
    images = [Image(n, draw(st.integers(1, 4)), n == refused) for n in range(NUM_HASHES)]
    item = st.tuples(st.integers(0, NUM_HASHES - 1), st.integers(0, 2), st.integers(0, 3))
    layouts = draw(st.lists(st.tuples(st.lists(item, min_size=1, max_size=3), st.integers(0, 2)),
                            min_size=1, max_size=4))
    op = st.tuples(st.sampled_from(KINDS), st.integers(0, 20), st.integers(1, 6), st.integers(0, 20),
                   st.integers(0, 6))
    return budget, hidden, dtype, images, layouts, draw(st.lists(op, min_size=15, max_size=60))


def run(budget: int, hidden: int, dtype: torch.dtype, images: list[Image], layouts: list, ops: list[Op]) -> None:
    harness = Harness(budget, hidden, dtype, images)
    for n, (kind, pick, size, pick2, size2) in enumerate(ops):
        reqs = harness.reqs
        prefilling = [req for req in reqs if req.computed < req.prompt_len]
        if kind == "add":
            items, prompt_len = lay_out(images, layouts[pick % len(layouts)])
            start = min(size, prompt_len - 1) if pick2 % 3 == 2 else 0  # a prefix-cache hit
            harness.add(Req(f"r{n}", items, prompt_len, start))
        elif kind == "step" and prefilling:
            first, second = prefilling[pick % len(prefilling)], prefilling[pick2 % len(prefilling)]
            harness.step([(first, size)] + ([(second, size2)] if size2 and second is not first else []))
        elif kind in ("finish", "preempt") and reqs:
            req = reqs[pick % len(reqs)]
            harness.leave(req)
            if kind == "preempt":  # back as new, from the prefix-cache hit it kept
                req.computed = size % (req.computed + 1)
                harness.add(req)
    for req in list(harness.reqs):
        harness.leave(req)
    assert harness.model.holders == {} and harness.model.view()[3] <= budget
    assert harness.cache.items == {} and harness.cache._pinned == {}


def images_of(*rows: int) -> list[Image]:
    """Images ``h0, h1, ...`` of these output rows, none refused."""
    return [Image(n, count, False) for n, count in enumerate(rows)]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=scenarios())
# budget of one image: a prefill stopped inside h0 keeps it pinned past the budget while h1 and h2 are encoded and
# evicted; a later request finds h0, and h1 is encoded again
@example(case=(8, 1, torch.float32, images_of(2, 2, 2, 1), [([(0, 0, 0)], 0), ([(1, 0, 0), (2, 0, 0)], 0),
                                                             ([(1, 1, 0)], 0)],
               [("add", 0, 1, 0, 0), ("add", 1, 1, 0, 0), ("step", 0, 1, 0, 0), ("step", 1, 4, 0, 0),
                ("step", 0, 1, 0, 0), ("finish", 0, 1, 0, 0), ("add", 0, 1, 0, 0), ("step", 0, 2, 0, 0),
                ("add", 2, 1, 0, 0), ("step", 0, 3, 0, 0)]))
# no budget: the same image twice in one step (in one request, then in two) is encoded once and pinned by each copy; a
# preempted request releases its pin and finds the image again while another request holds it
@example(case=(0, 1, torch.float32, images_of(2, 1, 1, 1), [([(0, 0, 0), (0, 1, 0)], 0)],
               [("add", 0, 1, 0, 0), ("step", 0, 5, 0, 0), ("add", 0, 1, 0, 0), ("add", 0, 1, 0, 0),
                ("step", 0, 1, 1, 1), ("preempt", 1, 0, 0, 0), ("step", 0, 3, 0, 0)]))
# pieces: h0 in two pieces around h1 (h0 h1 h0'), one token a step under a budget of one output: h0 stays pinned from
# its first piece to its last although h1 is encoded and released between them
@example(case=(12, 1, torch.float32, images_of(3, 2, 1, 1), [([(0, 0, 1), (1, 1, 0)], 1)],
               [("add", 0, 1, 0, 0)] + [("step", 0, 1, 0, 0)] * 8 + [("add", 0, 1, 0, 0), ("step", 0, 2, 0, 0),
                                                                    ("finish", 0, 0, 0, 0)]))
def test_encoder_output_cache_matches_a_model_of_pins_lru_and_budget(case) -> None:
    run(*case)
