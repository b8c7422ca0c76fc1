"""`EncoderCache` under drawn prefills (hypothesis), driven on two ranks as `EncoderOutputCache` drives it, against a
plain-list model.

Drawn: a byte budget (0 to 64); four item hashes, each with its rows (= its placeholders, 1 to 4), hidden size (1 to
3) and dtype (float32 or bfloat16), so 2 to 48 bytes of features, one of them sometimes refused by the encoder (an
empty output); one to four request layouts of 1 to 3 of those items between text tokens (shared between requests,
sometimes twice in one); and operations: add a request (from its first token, or past a prefix-cache hit that may end
inside an image), run a step of prefill chunks of drawn sizes for one or two requests, finish a request (or abort it
mid-prefill), and preempt one (it releases its pins and comes back from a prefix-cache hit: later steps resume it).

A step does what `EncoderOutputCache.inputs_embeds` does: each item a chunk reaches for the first time is looked up
(`acquire`), the misses run through the encoder once each and are inserted, another copy of a missed hash in the
same step is acquired after the inserts; then each chunk reads the rows it covers (`get_pinned`) and releases the
items it passes, except a refused one (its request fails and holds it until it leaves). A request that leaves the
worker releases every pin it holds.

The model follows the module's docstring and docs/multimodal.md ("The encoder cache"): each held hash's bytes and the
(request, item) pins on it, and the unpinned hashes oldest first; an acquire takes a hash out of that list, a last
release appends it (a refused, empty output is dropped), and after every call the oldest go while the bytes exceed
the budget. After every call each rank must match the model and the other rank exactly: the hashes held, the LRU
order, each hash's pin count (equal to the pins the requests hold), the bytes (so the entries each call evicted are
exactly the model's). An acquire hits exactly when the model holds the hash, the encoder runs on exactly the step's
misses, and every row a chunk reads is there, that hash's encoder output.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from asyncllm.mm.encoder_cache import EncoderCache

NUM_RANKS = 2
NUM_HASHES = 4


@dataclass(frozen=True)
class Image:
    """One item hash and what the encoder makes of it: ``rows`` placeholders, ``[rows, hidden]`` of ``dtype``."""

    mm_hash: str
    rows: int
    hidden: int
    dtype: torch.dtype
    refused: bool

    @property
    def nbytes(self) -> int:
        return 0 if self.refused else self.rows * self.hidden * self.dtype.itemsize

    def features(self) -> torch.Tensor:
        """The encoder's output: rows full of the hash's number, or no rows when it refuses the item."""
        if self.refused:
            return torch.empty(0)
        return torch.full((self.rows, self.hidden), float(self.mm_hash[1:]), dtype=self.dtype)


Holder = tuple[str, int]
"""(request id, item index): one pin, as `EncoderOutputCache` keys it."""


@dataclass(eq=False)
class Req:
    """What the runner keeps for a request: its items (image, first placeholder), progress and pins."""

    req_id: str
    items: list[tuple[Image, int]]
    prompt_len: int
    computed: int
    pins: list[int] = field(default_factory=list)
    """Indices of the items whose features it holds, in the order it reached them."""


class Model:
    """Each held hash's bytes and pins, and the unpinned hashes oldest first."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.nbytes: dict[str, int] = {}
        self.holders: dict[str, list[Holder]] = {}
        self.lru: list[str] = []

    def acquire(self, mm_hash: str, holder: Holder) -> bool:
        if mm_hash not in self.nbytes:
            return False
        if mm_hash in self.lru:
            self.lru.remove(mm_hash)
        self.holders.setdefault(mm_hash, []).append(holder)
        return True

    def insert(self, image: Image, holder: Holder) -> None:
        self.nbytes[image.mm_hash] = image.nbytes
        self.holders[image.mm_hash] = [holder]

    def release(self, mm_hash: str, holder: Holder) -> None:
        self.holders[mm_hash].remove(holder)
        if not self.holders[mm_hash]:
            del self.holders[mm_hash]
            if self.nbytes[mm_hash]:
                self.lru.append(mm_hash)
            else:  # a refused output: never kept
                del self.nbytes[mm_hash]

    def evict(self) -> None:
        while sum(self.nbytes.values()) > self.budget and self.lru:
            del self.nbytes[self.lru.pop(0)]

    def view(self) -> tuple:
        return (sorted(self.nbytes), self.lru, {h: len(pins) for h, pins in self.holders.items()},
                sum(self.nbytes.values()))


def observed(cache: EncoderCache) -> tuple:
    """(hashes held, unpinned oldest first, pin counts, bytes). The LRU order and the pin counts are the cache's own
    state: no public method shows them but through later evictions."""
    pins = {mm_hash: entry.count for mm_hash, entry in cache._pinned.items()}
    return sorted([*pins, *cache._unpinned]), list(cache._unpinned), pins, cache.total_bytes


class Ranks:
    """Every rank's cache and the model, taking the same calls in the same order, checked after each."""

    def __init__(self, budget: int, images: list[Image]) -> None:
        self.caches = [EncoderCache(budget) for _ in range(NUM_RANKS)]
        self.model = Model(budget)
        self.images = images

    def acquire(self, image: Image, holder: Holder) -> bool:
        hit = self.model.acquire(image.mm_hash, holder)
        for cache in self.caches:
            features = cache.acquire(image.mm_hash)
            assert (features is not None) == hit, (image.mm_hash, hit)
            if hit:
                assert_features(features, image)
        self.settle()
        return hit

    def encode_and_insert(self, missing: list[tuple[Image, Holder]]) -> None:
        """One encoder run over the step's misses (each rank gets the same output), then one insert each."""
        for image, holder in missing:
            for cache in self.caches:
                cache.insert(image.mm_hash, image.features())
            self.model.insert(image, holder)
            self.settle()

    def release(self, image: Image, holder: Holder) -> None:
        for cache in self.caches:
            cache.release(image.mm_hash)
        self.model.release(image.mm_hash, holder)
        self.settle()

    def settle(self) -> None:
        """Evict in the model, then hold every rank to it."""
        self.model.evict()
        expected = self.model.view()
        for rank, cache in enumerate(self.caches):
            assert observed(cache) == expected, (rank, observed(cache), expected)
            assert len(cache) == len(self.model.nbytes)
            assert [image.mm_hash in cache for image in self.images] == [
                image.mm_hash in self.model.nbytes for image in self.images]
        assert all(observed(cache) == observed(self.caches[0]) for cache in self.caches)


def assert_features(features: torch.Tensor, image: Image) -> None:
    expected = image.features()
    assert features.dtype == expected.dtype and torch.equal(features, expected), (image, features)


def reached(req: Req, start: int, stop: int) -> list[int]:
    """The indices of the items whose placeholders overlap prompt positions ``[start, stop)``."""
    return [i for i, (image, offset) in enumerate(req.items) if offset < stop and offset + image.rows > start]


def pin_reached(ranks: Ranks, touched: list[tuple[Req, int]]) -> None:
    """`EncoderOutputCache._pin_reached`: look up each item reached for the first time, encode the misses once."""
    firsts = [(req, i) for req, i in touched if i not in req.pins]
    expected_misses = list(dict.fromkeys(req.items[i][0].mm_hash for req, i in firsts
                                         if req.items[i][0].mm_hash not in ranks.model.nbytes))
    missing: dict[str, tuple[Image, Holder]] = {}
    repeats: list[tuple[Image, Holder]] = []
    for req, i in firsts:
        image, holder = req.items[i][0], (req.req_id, i)
        req.pins.append(i)
        if image.mm_hash in missing:
            repeats.append((image, holder))
        elif not ranks.acquire(image, holder):
            missing[image.mm_hash] = (image, holder)
    assert list(missing) == expected_misses  # the encoder runs on exactly these
    ranks.encode_and_insert(list(missing.values()))
    for image, holder in repeats:  # the same hash twice in one step: encoded once, pinned by each
        assert ranks.acquire(image, holder)


def step(ranks: Ranks, chunks: list[tuple[Req, int]]) -> None:
    """One step's prefill chunks: pin what they reach, read the rows they cover, release the items they pass."""
    spans = [(req, req.computed, min(req.computed + size, req.prompt_len)) for req, size in chunks]
    touched = [(req, i) for req, start, stop in spans for i in reached(req, start, stop)]
    pin_reached(ranks, touched)
    for req, start, stop in spans:
        for i in reached(req, start, stop):
            image, offset = req.items[i]
            for rank, cache in enumerate(ranks.caches):
                assert image.mm_hash in cache, f"rank {rank}: {req.req_id}'s prefill lost {image.mm_hash}"
                assert_features(cache.get_pinned(image.mm_hash), image)
            if offset + image.rows <= stop and not image.refused:  # passed (a refused item fails its request)
                req.pins.remove(i)
                ranks.release(image, (req.req_id, i))
        req.computed = stop


def leave(ranks: Ranks, req: Req) -> None:
    """Finished, aborted or preempted: every pin it holds released."""
    for i in req.pins:
        ranks.release(req.items[i][0], (req.req_id, i))
    req.pins = []


def check_pins(ranks: Ranks, reqs: list[Req]) -> None:
    """The model's pins are exactly the ones the live requests hold."""
    held = sorted((req.items[i][0].mm_hash, req.req_id, i) for req in reqs for i in req.pins)
    assert held == sorted((h, *holder) for h, holders in ranks.model.holders.items() for holder in holders)


def lay_out(images: list[Image], layout: tuple[list[tuple[int, int]], int]) -> tuple[list[tuple[Image, int]], int]:
    """(items at their first placeholders, prompt length) of (image index, text tokens before it) pairs and a tail."""
    items, position = [], 0
    for index, gap in layout[0]:
        position += gap
        items.append((images[index], position))
        position += images[index].rows
    return items, position + layout[1]


KINDS = ["add"] * 3 + ["step"] * 8 + ["finish"] * 2 + ["preempt"] * 2
Op = tuple[str, int, int, int, int]
"""(kind, pick, size, second pick, second size): a step's second chunk only when its size is not 0."""


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[int, list[Image], list, list[Op]]:
    budget = draw(st.integers(0, 64))
    refused = draw(st.integers(0, 2 * NUM_HASHES - 1))
    images = [Image(f"h{n}", draw(st.integers(1, 4)), draw(st.integers(1, 3)),
                    draw(st.sampled_from([torch.float32, torch.bfloat16])), n == refused) for n in range(NUM_HASHES)]
    item = st.tuples(st.integers(0, NUM_HASHES - 1), st.integers(0, 2))
    layouts = draw(st.lists(st.tuples(st.lists(item, min_size=1, max_size=3), st.integers(0, 2)),
                            min_size=1, max_size=4))
    op = st.tuples(st.sampled_from(KINDS), st.integers(0, 20), st.integers(1, 6), st.integers(0, 20),
                   st.integers(0, 6))
    return budget, images, layouts, draw(st.lists(op, min_size=15, max_size=60))


def run(budget: int, images: list[Image], layouts: list, ops: list[Op]) -> None:
    ranks, reqs = Ranks(budget, images), []
    for n, (kind, pick, size, pick2, size2) in enumerate(ops):
        prefilling = [req for req in reqs if req.computed < req.prompt_len]
        if kind == "add":
            items, prompt_len = lay_out(images, layouts[pick % len(layouts)])
            start = min(size, prompt_len - 1) if pick2 % 3 == 2 else 0  # a prefix-cache hit
            reqs.append(Req(f"r{n}", items, prompt_len, start))
        elif kind == "step" and prefilling:
            first, second = prefilling[pick % len(prefilling)], prefilling[pick2 % len(prefilling)]
            step(ranks, [(first, size)] + ([(second, size2)] if size2 and second is not first else []))
        elif kind in ("finish", "preempt") and reqs:
            req = reqs[pick % len(reqs)]
            leave(ranks, req)
            if kind == "finish":
                reqs.remove(req)
            else:  # back as new, from the prefix-cache hit it kept
                req.computed = size % (req.computed + 1)
        check_pins(ranks, reqs)
    for req in list(reqs):
        leave(ranks, req)
    assert ranks.model.holders == {} and ranks.model.view()[3] <= budget


def images_of(*specs: tuple[int, int]) -> list[Image]:
    """Float32 images ``h0, h1, ...`` of these (rows, hidden), none refused."""
    return [Image(f"h{n}", rows, hidden, torch.float32, False) for n, (rows, hidden) in enumerate(specs)]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=scenarios())
# budget of one image: a prefill stopped inside h0 keeps it pinned past the budget while h1 and h2 are encoded and
# evicted; a later request finds h0, and h1 is encoded again
@example(case=(8, images_of((2, 1), (2, 1), (2, 1), (1, 1)), [([(0, 0)], 0), ([(1, 0), (2, 0)], 0), ([(1, 1)], 0)],
               [("add", 0, 1, 0, 0), ("add", 1, 1, 0, 0), ("step", 0, 1, 0, 0), ("step", 1, 4, 0, 0),
                ("step", 0, 1, 0, 0), ("finish", 0, 1, 0, 0), ("add", 0, 1, 0, 0), ("step", 0, 2, 0, 0),
                ("add", 2, 1, 0, 0), ("step", 0, 3, 0, 0)]))
# no budget: the same image twice in one step (in one request, then in two) is encoded once and pinned by each copy; a
# preempted request releases its pin and finds the image again while another request holds it
@example(case=(0, images_of((2, 1), (1, 1), (1, 1), (1, 1)), [([(0, 0), (0, 1)], 0)],
               [("add", 0, 1, 0, 0), ("step", 0, 5, 0, 0), ("add", 0, 1, 0, 0), ("add", 0, 1, 0, 0),
                ("step", 0, 1, 1, 1), ("preempt", 1, 0, 0, 0), ("step", 0, 3, 0, 0)]))
def test_two_ranks_match_a_model_of_pins_lru_and_budget(case) -> None:
    run(*case)
