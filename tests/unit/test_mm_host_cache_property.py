"""The host's half of the processor cache (`LruHostCache`, `ShmHostCache`) against the core's half, model-based.

tests/unit/test_mm_processor_cache_property.py drives real image processors and
fills each request at once; here the host cache classes are driven directly
(hypothesis.stateful) with drawn numpy items (float32 / float16, 1 to 3
dimensions, C-ordered, transposed or strided views, some larger than the whole
cache), requests of several items (a key twice in one request too), and the
host running ahead of the core: a processed request waits in the one socket's
queue and the core fills it later, in order, as the engine does.

lru: each side is checked against a plain LRU over byte sizes (the documented
policy: a hit or a put refreshes, a put evicts the least recently used until
the total fits, an item larger than the budget is not kept). While nothing
drifted (no key forgotten on one side only, no request processed and never
sent) the core never misses and, after filling a request, holds exactly what
the host's mirror held once it processed it. Whatever drifted, a key-only item
is filled with its key's data or named in the `MultiModalCacheMiss` (exactly
the keys the core's model lacks), and the resend (`resend_with_data`'s steps)
never misses.

shm: a location the core reads gives the bytes written under its key (equal
to the array) or a miss exactly when the host's ring no longer holds that
entry (overwritten by a later item, the ring wrapped, forgotten, or the host
reconnected with a new ring); an item larger than the ring crosses inline and
is not cached; hits do not refresh (FIFO); live entries never overlap and fit
the ring; the inline resend never misses; every segment is unlinked.
"""

from __future__ import annotations

import os
import re
from collections import deque
from dataclasses import dataclass

import numpy as np
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from asyncllm.config import MultiModalConfig
from asyncllm.mm.cache import LRUBudget, MultiModalCacheMiss
from asyncllm.mm.core_cache import CoreProcessorCache
from asyncllm.mm.host_cache import LruHostCache, ShmHostCache, inline_item
from asyncllm.mm.shm_ring import HEADER_BYTES
from asyncllm.protocol import AddRequest, MultiModalItem
from asyncllm.sampling import SamplingParams
from asyncllm.shm_segment import align_up

NUM_KEYS = 6
CLIENT = b"host-0"
TEXT, PLACEHOLDER = 7, 5


# ----------------------------------------------------------------------------------------------- drawn items

@dataclass(frozen=True)
class Spec:
    dtype: str
    shape: tuple[int, ...]
    layout: str  # "c", "transposed" (a .T view) or "strided" (every other row of a larger array)
    length: int  # placeholder tokens


@st.composite
def specs(draw: st.DrawFn) -> Spec:
    dims = st.one_of(st.integers(1, 8), st.integers(1, 24))  # mostly small, some past a small cache
    return Spec(draw(st.sampled_from(["float32", "float16"])), tuple(draw(st.lists(dims, min_size=1, max_size=3))),
                draw(st.sampled_from(["c", "transposed", "strided"])), draw(st.integers(1, 3)))


def make_array(spec: Spec, seed: int) -> np.ndarray:
    """The processed item of a key (a key is its content: always the same array)."""
    rng = np.random.default_rng(seed)
    if spec.layout == "transposed":
        array = rng.standard_normal(spec.shape[::-1]).astype(spec.dtype).T
    elif spec.layout == "strided":
        array = rng.standard_normal((2 * spec.shape[0], *spec.shape[1:])).astype(spec.dtype)[::2]
    else:
        array = rng.standard_normal(spec.shape).astype(spec.dtype)
    assert array.shape == spec.shape
    array.flags.writeable = False
    return array


def key_of(index: int) -> str:
    return f"img-{index}"


requests = st.lists(st.integers(0, NUM_KEYS - 1), min_size=1, max_size=5)  # repeats within a request too


def add_request(number: int, items: list[MultiModalItem]) -> AddRequest:
    """A prompt of one text token before each item's placeholders (at the items' offsets), and one after."""
    prompt: list[int] = []
    for item in items:
        prompt.append(TEXT)
        assert item.offset == len(prompt)
        prompt += [PLACEHOLDER] * item.length
    return AddRequest(f"r{number}", prompt + [TEXT], SamplingParams(), [1], 0.0, mm_items=items)


def offsets(specs_: list[Spec]) -> list[int]:
    result, position = [], 0
    for spec in specs_:
        result.append(position + 1)
        position += 1 + spec.length
    return result


def missed_keys(miss: MultiModalCacheMiss) -> list[str]:
    return re.search(r"processor cache: (.*)$", str(miss)).group(1).split(", ")


@dataclass
class Queued:
    message: AddRequest
    keys: list[int]
    resend: bool
    host_view: list[tuple[str, int]] | None  # lru: the mirror once the host processed it


# ----------------------------------------------------------------------------------------------- lru reference

class PlainLRU:
    """The documented policy over sizes, as a list (least recently used first)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.entries: list[tuple[str, int]] = []

    def _index(self, key: str) -> int | None:
        return next((i for i, (k, _) in enumerate(self.entries) if k == key), None)

    def get(self, key: str) -> bool:
        i = self._index(key)
        if i is None:
            return False
        self.entries.append(self.entries.pop(i))
        return True

    def put(self, key: str, size: int) -> None:
        self.drop(key)
        if size > self.capacity:
            return
        while sum(s for _, s in self.entries) + size > self.capacity:
            self.entries.pop(0)
        self.entries.append((key, size))

    def drop(self, key: str) -> None:
        i = self._index(key)
        if i is not None:
            self.entries.pop(i)


def budget_view(budget: LRUBudget) -> list[tuple[str, int]]:
    """An `LRUBudget`'s keys and sizes, oldest first, after checking its byte accounting."""
    view = [(key, size) for key, (size, _) in budget._entries.items()]
    assert budget.total_bytes == sum(size for _, size in view) <= budget.capacity_bytes
    assert len(budget) == len(view)
    return view


@settings(max_examples=300, deadline=None)
@given(capacity=st.integers(0, 64), ops=st.lists(st.tuples(st.sampled_from(["get", "put", "put", "drop"]),
                                                          st.sampled_from("abcde"), st.integers(0, 80)), max_size=40))
def test_the_lru_budget_is_the_documented_policy(capacity: int, ops: list[tuple[str, str, int]]) -> None:
    """`LRUBudget` (mirror and store alike) under puts of changing sizes (a key re-put larger than the budget)."""
    budget: LRUBudget[int] = LRUBudget(capacity)
    model = PlainLRU(capacity)
    for kind, key, size in ops:
        if kind == "get":
            assert (budget.get(key) is not None) == model.get(key)
        elif kind == "put":
            budget.put(key, size, size)
            model.put(key, size)
        else:
            budget.drop(key)
            model.drop(key)
        assert budget_view(budget) == model.entries
        assert all(value == size for _, (size, value) in budget._entries.items())


# ----------------------------------------------------------------------------------------------- lru: both halves

class LruHalves(RuleBasedStateMachine):
    """One host's `LruHostCache`, one core's lru store, the socket between them a FIFO queue."""

    @initialize(capacity=st.integers(4, 1200), drawn=st.lists(specs(), min_size=NUM_KEYS, max_size=NUM_KEYS))
    def setup(self, capacity: int, drawn: list[Spec]) -> None:
        self.specs = drawn
        self.arrays = [make_array(spec, i) for i, spec in enumerate(drawn)]
        self.host = LruHostCache(capacity)
        self.core = CoreProcessorCache(MultiModalConfig(mm_processor_cache_gb=capacity / 2**30,
                                                        mm_processor_cache_type="lru"))
        assert self.core.store is not None and self.core.store.capacity_bytes == capacity
        self.host_model, self.core_model = PlainLRU(capacity), PlainLRU(capacity)
        self.queue: deque[Queued] = deque()
        self.drifted = False
        self.sent = 0
        self.misses = 0

    def process(self, keys: list[int]) -> list[MultiModalItem]:
        """The processor's per-item steps: a lookup, on a miss the item processed and recorded."""
        items = []
        for index, offset in zip(keys, offsets([self.specs[i] for i in keys])):
            key, spec, array = key_of(index), self.specs[index], self.arrays[index]
            item = self.host.lookup(key, offset)
            assert (item is not None) == self.host_model.get(key)
            if item is not None:  # key only: what the mirror kept of it
                event("lru: key-only item" + (" (repeat within its request)" if index in keys[:len(items)] else ""))
                assert (item.mm_hash, item.offset, item.length, item.data, item.shape, item.shm_offset) == \
                       (key, offset, spec.length, None, list(spec.shape), -1)
            else:
                item = self.host.record(key, offset, spec.length, array)
                self.host_model.put(key, array.nbytes)
                assert (item.mm_hash, item.offset, item.length, item.shape, item.dtype) == \
                       (key, offset, spec.length, list(spec.shape), spec.dtype)
                assert item.data == array.tobytes() and item.shm_offset == -1
            items.append(item)
        return items

    def send(self, keys: list[int], resend: bool = False) -> None:
        self.sent += 1
        message = add_request(self.sent, self.process(keys))
        self.queue.append(Queued(message, keys, resend, list(self.host_model.entries)))

    @rule(keys=requests)
    def request(self, keys: list[int]) -> None:
        self.send(keys)

    @rule(keys=requests)
    def host_refuses_after_processing(self, keys: list[int]) -> None:
        """Processed (and recorded) but never sent: the documented drift."""
        self.process(keys)
        self.drifted = True

    @rule(keys=requests)
    def core_forgets(self, keys: list[int]) -> None:
        """`Core.forget_failed`: keys dropped from the store only."""
        self.core.forget([key_of(i) for i in keys])
        for i in keys:
            self.core_model.drop(key_of(i))
        self.drifted = True

    @rule(keys=requests)
    def host_forgets(self, keys: list[int]) -> None:
        self.host.forget([key_of(i) for i in keys])
        for i in keys:
            self.host_model.drop(key_of(i))
        self.drifted = True  # the two sides now evict differently

    @rule()
    def deliver(self) -> None:
        """The core fills the oldest request in flight; a miss is resent with data (after the ones in flight)."""
        if not self.queue:
            return
        queued = self.queue.popleft()
        message = queued.message
        expected_missing = []
        for item in message.mm_items:  # the store's steps, in the items' order
            if item.data is not None:
                self.core_model.put(item.mm_hash, len(item.data))
            elif not self.core_model.get(item.mm_hash):
                expected_missing.append(item.mm_hash)
        assert not (expected_missing and (queued.resend or not self.drifted)), \
            "the model says the core lacks a key the host sent without data, with no drift or in a resend"
        try:
            self.core.fill(CLIENT, message)
        except MultiModalCacheMiss as miss:
            assert missed_keys(miss) == expected_missing
            event("lru: a miss after drift, resent")
            self.misses += 1
            self.host.forget([item.mm_hash for item in message.mm_items])  # resend_with_data
            for item in message.mm_items:
                self.host_model.drop(item.mm_hash)
            self.send(queued.keys, resend=True)
        else:
            assert not expected_missing, f"the core filled {expected_missing} it should not hold"
            self.check_filled(message, queued.keys)
        if not self.drifted:
            assert self.core_model.entries == queued.host_view

    def check_filled(self, message: AddRequest, keys: list[int]) -> None:
        for item, index, offset in zip(message.mm_items, keys, offsets([self.specs[i] for i in keys]), strict=True):
            spec, array = self.specs[index], self.arrays[index]
            assert (item.mm_hash, item.offset, item.length, item.shape, item.dtype, item.shm_offset) == \
                   (key_of(index), offset, spec.length, list(spec.shape), spec.dtype, -1)
            assert item.data == array.tobytes()
            np.testing.assert_array_equal(np.frombuffer(item.data, item.dtype).reshape(item.shape), array)

    @invariant()
    def both_halves_follow_the_plain_lru(self) -> None:
        if getattr(self, "host", None) is None:
            return
        assert budget_view(self.host.mirror) == self.host_model.entries
        assert budget_view(self.core.store) == self.core_model.entries
        if not self.drifted:
            assert self.misses == 0
            if not self.queue:
                assert self.host_model.entries == self.core_model.entries

    def teardown(self) -> None:
        if getattr(self, "host", None) is None:
            return
        for _ in range(100):  # every request in flight (and its resend) reaches the core
            if not self.queue:
                break
            self.deliver()
        assert not self.queue
        self.host.close()
        self.core.close()


LruHalves.TestCase.settings = settings(max_examples=150, stateful_step_count=30, deadline=None,
                                       suppress_health_check=[HealthCheck.too_slow])
TestLruHalves = LruHalves.TestCase


# ----------------------------------------------------------------------------------------------- shm: the ring

def padded(nbytes: int) -> int:
    return HEADER_BYTES + align_up(nbytes)


def segments() -> set[str]:
    return set(os.listdir("/dev/shm"))


class ShmHalves(RuleBasedStateMachine):
    """One host's `ShmHostCache` (a new ring per connection), one core's ring reader, a FIFO socket between them."""

    @initialize(lines=st.integers(2, 24), drawn=st.lists(specs(), min_size=NUM_KEYS, max_size=NUM_KEYS))
    def setup(self, lines: int, drawn: list[Spec]) -> None:
        self.capacity = lines * HEADER_BYTES
        self.specs = drawn
        self.arrays = [make_array(spec, i) for i, spec in enumerate(drawn)]
        self.core = CoreProcessorCache(MultiModalConfig(mm_processor_cache_gb=self.capacity / 2**30,
                                                        mm_processor_cache_type="shm"))
        assert self.core.store is None
        self.names: list[str] = []
        self.host: ShmHostCache | None = None
        self.queue: deque[Queued] = deque()
        self.sent = 0
        self.connect()

    def connect(self) -> None:
        """A (new) connection: a new ring, mapped by the core, then unlinked (`MultiModalProcessor.cache_mapped`)."""
        if self.host is not None:
            self.host.close()
            assert self.host.name not in segments()
        self.host = ShmHostCache(self.capacity)
        self.names.append(self.host.name)
        assert self.host.ring.capacity == self.capacity and len(self.host.ring) == 0
        assert self.core.attach(CLIENT, self.host.name)
        self.host.ring.unlink()
        assert self.host.name not in segments()

    @rule()
    def reconnect(self) -> None:
        """Requests still in flight name the old ring's locations: they read their own key's data or miss."""
        self.connect()

    def index(self) -> list[tuple[str, int, int, int]]:
        ring = self.host.ring
        return [(key, e.offset, e.nbytes, e.generation) for key, e in ring._index.items()]

    def process(self, keys: list[int], inline: bool = False) -> list[MultiModalItem]:
        items = []
        for index, offset in zip(keys, offsets([self.specs[i] for i in keys])):
            key, spec, array = key_of(index), self.specs[index], self.arrays[index]
            if inline:  # the resend: data in the message, the ring untouched
                items.append(inline_item(key, offset, spec.length, array))
                continue
            before = self.index()
            live = self.host.ring.get(key)
            item = self.host.lookup(key, offset)
            assert self.index() == before, "a lookup must not refresh or move an entry (FIFO)"
            if live is not None:
                assert item is not None and item.data is None
                assert (item.mm_hash, item.offset, item.length, item.shape, item.dtype) == \
                       (key, offset, spec.length, list(spec.shape), spec.dtype)
                assert (item.shm_offset, item.shm_generation) == (live.offset, live.generation)
            else:
                assert item is None
                item = self.host.record(key, offset, spec.length, array)
                assert (item.mm_hash, item.offset, item.length, item.shape, item.dtype) == \
                       (key, offset, spec.length, list(spec.shape), spec.dtype)
                entry = self.host.ring.get(key)
                if padded(array.nbytes) > self.capacity:  # larger than the ring: inline, not cached
                    event("shm: an item larger than the ring")
                    assert entry is None and self.host.lookup(key, offset) is None
                    assert item.data == array.tobytes() and item.shm_offset == -1
                else:
                    assert entry is not None and item.data is None
                    if before and entry.offset < before[-1][1]:
                        event("shm: the ring wrapped")
                    assert (item.shm_offset, item.shm_generation) == (entry.offset, entry.generation)
                    assert entry.nbytes == array.nbytes and self.index()[-1][0] == key  # the newest entry
                    assert all(generation < entry.generation for *_, generation in before) and entry.generation >= 1
            items.append(item)
        return items

    def send(self, keys: list[int], resend: bool = False) -> None:
        self.sent += 1
        self.queue.append(Queued(add_request(self.sent, self.process(keys, inline=resend)), keys, resend, None))

    @rule(keys=requests)
    def request(self, keys: list[int]) -> None:
        self.send(keys)

    @rule(keys=requests)
    def host_refuses_after_processing(self, keys: list[int]) -> None:
        self.process(keys)

    @rule(keys=requests)
    def host_forgets(self, keys: list[int]) -> None:
        """Dropped from the index and invalidated: a request in flight with that location misses."""
        self.host.forget([key_of(i) for i in keys])
        assert all(self.host.lookup(key_of(i), 0) is None for i in keys)

    @rule()
    def deliver(self) -> None:
        if not self.queue:
            return
        queued = self.queue.popleft()
        message = queued.message
        stale = [item.mm_hash for item in message.mm_items if item.shm_offset >= 0 and not self.holds(item)]
        assert not (stale and queued.resend)
        try:
            self.core.fill(CLIENT, message)
        except MultiModalCacheMiss as miss:
            assert stale and missed_keys(miss) == stale
            event("shm: a stale location missed, resent inline")
            self.host.forget([item.mm_hash for item in message.mm_items])  # resend_with_data, inline in shm
            self.send(queued.keys, resend=True)
        else:
            assert not stale, f"the core read {stale} whose ring entries the host no longer holds"
            for item, index in zip(message.mm_items, queued.keys, strict=True):
                spec, array = self.specs[index], self.arrays[index]
                assert (item.mm_hash, item.shape, item.dtype, item.shm_offset) == \
                       (key_of(index), list(spec.shape), spec.dtype, -1)
                assert item.data == array.tobytes()
                np.testing.assert_array_equal(np.frombuffer(item.data, item.dtype).reshape(item.shape), array)

    def holds(self, item: MultiModalItem) -> bool:
        """Whether the current ring still has this item's entry (its key at its location and generation)."""
        entry = self.host.ring.get(item.mm_hash)
        return entry is not None and (entry.offset, entry.generation) == (item.shm_offset, item.shm_generation)

    @invariant()
    def live_entries_fit_the_ring_and_read_back(self) -> None:
        if getattr(self, "host", None) is None:
            return
        reader = self.core.rings[CLIENT]
        spans = sorted((offset, offset + padded(nbytes)) for _, offset, nbytes, _ in self.index())
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:])), "entries overlap"
        assert all(0 <= start and end <= self.capacity for start, end in spans)
        generations = [g for *_, g in self.index()]
        assert generations == sorted(set(generations)), "the index is oldest first (FIFO by generation)"
        for key, offset, nbytes, generation in self.index():
            array = self.arrays[int(key.rsplit("-", 1)[1])]
            data = reader.read(key, offset, generation, nbytes, "mm_items[0]")
            assert data == array.tobytes()

    def teardown(self) -> None:
        if getattr(self, "host", None) is None:
            return
        try:
            for _ in range(100):
                if not self.queue:
                    break
                self.deliver()
            assert not self.queue
        finally:
            self.core.close()
            self.host.close()
            left = segments() & set(self.names)
            assert not left, f"segments left in /dev/shm: {left}"


ShmHalves.TestCase.settings = settings(max_examples=120, stateful_step_count=30, deadline=None,
                                       suppress_health_check=[HealthCheck.too_slow])
TestShmHalves = ShmHalves.TestCase
