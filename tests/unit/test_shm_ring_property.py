"""The multimodal shm ring (asyncllm/mm/shm_ring.py) under drawn programs (hypothesis), against a model of its entries.

Drawn: a ring of 2 to 16 cache lines (the size asked for is not always a multiple of 64: the writer rounds it down),
and a program of writer and reader operations. A put writes a contiguous numpy array (uint8, float16, float32 or
int64; 1-D or 2-D, empty ones too) under one of twelve keys (repeats included), its byte size drawn absolutely or
relative to the ring: exactly the whole ring, one byte past it, exactly up to the end from the head, a byte either
side of that, or a multiple of 64 give or take a byte. A drop forgets a key (the host's `forget`), and a read hands
the reader one of the locations a put returned earlier (many stale by then), as it is or perturbed: another key,
generation, size or offset (unaligned, negative, past the end). After every operation the writer's index is asked
for every key (a never-written one too), so hits are frequent and must not refresh.

The model is the ring's documented rule: a list of live entries (key, offset, generation, data), oldest first, and
the head. An entry takes a 64-byte header plus its data rounded up to 64 bytes, at the head if it fits before the
end, else at offset 0, the skipped tail going with it; it evicts every live entry it (or the skipped tail) overlaps,
which must be the oldest ones (FIFO: a hit does not refresh). A put first forgets the key's old entry; one larger
than the whole ring is refused (None) and takes no generation. Generations count from 1.

Held after every operation: the writer's index holds exactly the model's live entries, at the model's offsets and
generations, with their meta (shape, dtype); each live entry reads back exactly its bytes, and they rebuild its
array. A read returns data only for a live entry's exact (key, offset, generation, size), never another entry's or
stale bytes, and is None otherwise; it raises `InvalidRequestError` (naming its field) exactly for a location that is
unaligned, negative, not inside the ring or of generation 0. At the end every location ever handed out reads as the
model says, and closing removes the segment.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from asyncllm.errors import ConfigError, InvalidRequestError
from asyncllm.mm.shm_ring import HEADER_BYTES, ShmRingReader, ShmRingWriter
from asyncllm.shm_segment import ALIGN, align_up

EXAMPLES = int(os.environ.get("PROP_EXAMPLES", "200"))
SETTINGS = dict(deadline=None, database=None, derandomize="PROP_EXAMPLES" not in os.environ,
                suppress_health_check=[HealthCheck.too_slow])
KEYS = [f"k{i}" for i in range(12)]
UNSEEN = "never-written"
DTYPES = ["uint8", "float16", "float32", "int64"]
FIELD = "mm_items[0]"


def padded(nbytes: int) -> int:
    return HEADER_BYTES + align_up(nbytes)


@dataclass(frozen=True)
class Live:
    """An entry as a put handed it out: where it lies, and what it holds."""

    key: str
    offset: int
    generation: int
    array: np.ndarray

    @property
    def location(self) -> tuple[str, int, int, int]:
        return self.key, self.offset, self.generation, self.array.nbytes

    @property
    def end(self) -> int:
        return self.offset + padded(self.array.nbytes)


class RingModel:
    """Live entries oldest first, the head, and the next generation, by the module docstring's rules."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.live: list[Live] = []
        self.head = 0
        self.next_generation = 1

    def get(self, key: str) -> Live | None:
        found = [entry for entry in self.live if entry.key == key]
        return found[0] if found else None

    def drop(self, key: str) -> None:
        self.live = [entry for entry in self.live if entry.key != key]

    def put(self, key: str, array: np.ndarray) -> Live | None:
        self.drop(key)
        size = padded(array.nbytes)
        if size > self.capacity:
            event("put: larger than the ring")
            return None
        claimed = [(self.head, self.head + size)]
        if self.head + size > self.capacity:  # wraps: the tail from the head on is skipped
            claimed = [(self.head, self.capacity), (0, size)]
            event("put: wrapped")
        elif self.head + size == self.capacity:
            event("put: ends exactly at the end")
        evicted = [e for e in self.live if any(e.offset < end and start < e.end for start, end in claimed)]
        if any(e.offset >= size for e in evicted if len(claimed) == 2):
            event("put: a live entry in the skipped tail evicted")
        assert evicted == self.live[: len(evicted)], "the rule must evict the oldest entries (FIFO)"
        entry = Live(key, claimed[-1][0], self.next_generation, array)
        self.live = self.live[len(evicted) :] + [entry]
        self.head, self.next_generation = entry.end, self.next_generation + 1
        return entry

    def expected_read(self, location: tuple[str, int, int, int]) -> bytes | None:
        found = [entry for entry in self.live if entry.location == location]
        return found[0].array.tobytes() if found else None


def refused(location: tuple[str, int, int, int], size: int) -> bool:
    """The reader's documented refusal: a location that is no entry boundary inside the ring."""
    _, offset, generation, nbytes = location
    return offset < 0 or offset % ALIGN != 0 or offset + HEADER_BYTES + nbytes > size or generation <= 0


def resolve_size(spec: tuple[str, int], model: RingModel) -> int:
    """A drawn size spec in bytes, against the ring's state now (never below 0)."""
    kind, delta = spec
    base = {"bytes": 0, "ring": model.capacity - HEADER_BYTES, "to_end": model.capacity - model.head - HEADER_BYTES}
    if kind.startswith("lines"):
        return max(0, int(kind[5:]) * ALIGN + delta)
    return max(0, base[kind] + delta)


def make_array(nbytes: int, dtype_pick: int, shape_pick: int, seed: int) -> np.ndarray:
    """``nbytes`` bytes that name their put (no 6 zero bytes in a row: never a generation word), as a drawn dtype
    whose item size divides them and a drawn shape."""
    dtype = next((np.dtype(DTYPES[(dtype_pick - i) % 4]) for i in range(4)
                  if nbytes % np.dtype(DTYPES[(dtype_pick - i) % 4]).itemsize == 0), np.dtype("uint8"))
    raw = ((np.arange(nbytes, dtype=np.int64) * 7 + seed * 31 + 1) % 251).astype(np.uint8)
    count = nbytes // dtype.itemsize
    shapes = [(count,), (1, count), (2, count // 2) if count % 2 == 0 else (count, 1)]
    return raw.view(dtype).reshape(shapes[shape_pick % 3])  # an empty one (0,), (1, 0) or (0, 1)


def perturb(location: tuple[str, int, int, int], how: int, size: int) -> tuple[str, int, int, int]:
    key, offset, generation, nbytes = location
    return [location, (key + "'", offset, generation, nbytes), (key, offset, generation + 1, nbytes),
            (key, offset, generation, nbytes + 1), (key, offset, generation, nbytes - 1),
            (key, offset + ALIGN, generation, nbytes), (key, offset - ALIGN, generation, nbytes),
            (key, offset + 1, generation, nbytes), (key, offset, 0, nbytes), (key, size, generation, nbytes),
            (key, offset, generation, size)][how]


def check_read(reader: ShmRingReader, model: RingModel, location: tuple[str, int, int, int]) -> None:
    if refused(location, reader.size):
        with pytest.raises(InvalidRequestError, match=r"^mm_items\[0\]: ring location .* outside the host's ring"):
            reader.read(*location, FIELD)
        event("read: refused")
        return
    expected = model.expected_read(location)
    event("read: hit" if expected is not None else "read: miss")
    assert reader.read(*location, FIELD) == expected, location


def check_ring(writer: ShmRingWriter, reader: ShmRingReader, model: RingModel) -> None:
    """The writer's index is the model's live entries; each reads back as its array."""
    assert len(writer) == len(model.live)
    for key in [*KEYS, UNSEEN]:
        entry, live = writer.get(key), model.get(key)
        if live is None:
            assert entry is None, key
            continue
        assert entry is not None, key
        assert (entry.offset, entry.generation, entry.nbytes) == live.location[1:], (entry, live.location)
        assert entry.meta == (live.array.shape, str(live.array.dtype))
        data = reader.read(*live.location, FIELD)
        assert data is not None
        rebuilt = np.frombuffer(data, dtype=entry.meta[1]).reshape(entry.meta[0])
        assert rebuilt.dtype == live.array.dtype and rebuilt.tobytes() == live.array.tobytes()


def run_op(op: tuple, writer: ShmRingWriter, reader: ShmRingReader, model: RingModel, handed: list[Live]) -> None:
    kind = op[0]
    if kind == "put":
        _, key, size_spec, dtype_pick, shape_pick = op
        array = make_array(resolve_size(size_spec, model), dtype_pick, shape_pick, len(handed))
        entry = writer.put(KEYS[key], memoryview(array), (array.shape, str(array.dtype)))
        live = model.put(KEYS[key], array)
        assert (entry is None) == (live is None), (entry, live)
        if live is not None:
            assert (entry.offset, entry.generation, entry.nbytes) == live.location[1:], (entry, live.location)
            handed.append(live)
    elif kind == "drop":
        writer.drop(KEYS[op[1]])
        model.drop(KEYS[op[1]])
    elif kind == "read" and handed:
        location = handed[-1 - op[1] % len(handed)].location  # the most recent first (small draws): more are live
        check_read(reader, model, perturb(location, op[2], reader.size))
    check_ring(writer, reader, model)


size_specs = (st.tuples(st.sampled_from(["ring", "to_end"]), st.integers(-1, 1))
              | st.tuples(st.sampled_from([f"lines{k}" for k in range(7)]), st.integers(-1, 1))
              | st.tuples(st.just("bytes"), st.integers(0, 4 * ALIGN)))
small_sizes = st.tuples(st.sampled_from(["lines0", "lines1", "lines2"]), st.integers(-1, 1))


def puts(sizes: st.SearchStrategy) -> st.SearchStrategy:
    return st.tuples(st.just("put"), st.integers(0, len(KEYS) - 1), sizes, st.integers(0, 3), st.integers(0, 2))


ops = st.one_of(  # small puts fill the ring with several entries, so a wrap finds older ones in the tail
    puts(size_specs), puts(small_sizes), puts(small_sizes),
    st.tuples(st.just("drop"), st.integers(0, len(KEYS) - 1)),
    st.tuples(st.just("read"), st.integers(0, 63), st.just(0) | st.integers(0, 10)),  # half as handed out
)
programs = st.tuples(st.integers(2, 16), st.integers(0, ALIGN - 1), st.lists(ops, min_size=10, max_size=40))

_WRAP_SKIPS_THE_TAIL = (8, 0, [  # A [0,320), B [320,512); C wraps onto A, then is dropped; D (256 bytes) does not
    ("put", 0, ("lines4", 0), 0, 0), ("put", 1, ("to_end", 0), 2, 1), ("put", 2, ("lines4", 0), 2, 2),  # fit after
    ("drop", 2), ("put", 3, ("lines3", 0), 3, 0), ("read", 2, 0), ("read", 0, 0), ("read", 0, 5)])  # 320: B goes too
_REPUT_AND_REFUSED = (3, 5, [  # a key rewritten (its old location stale), then refused as too large (dropped too)
    ("put", 0, ("lines1", -1), 3, 0), ("put", 0, ("ring", 0), 1, 2), ("read", 1, 0), ("put", 0, ("ring", 1), 0, 0),
    ("read", 0, 0), ("put", 1, ("bytes", 0), 0, 1), ("read", 0, 0), ("read", 0, 9), ("read", 0, 6)])

_DATA_OVER_A_DROPPED_HEADER = (3, 0, [  # k0's empty entry of generation 6 at 128 is dropped by its own re-put; the
    # last put's 65 bytes at [64, 129) write one byte, 6, over that header's zeroed generation: a stale read of
    # (k0, 128, 6, 0) found generation 6, size 0 and k0's digest there and returned b"" (the digest is zeroed now)
    *[("put", 0, ("ring", 0), 0, 0)] * 3, *[("put", 0, ("lines0", 0), 0, 0)] * 5, ("put", 0, ("to_end", 0), 0, 0),
    ("put", 0, ("lines0", 0), 0, 0), ("put", 0, ("lines1", 1), 0, 0)])


@settings(max_examples=EXAMPLES, **SETTINGS)
@given(program=programs)
@example(program=_WRAP_SKIPS_THE_TAIL)
@example(program=_REPUT_AND_REFUSED)
@example(program=_DATA_OVER_A_DROPPED_HEADER)
def test_the_ring_matches_a_fifo_model_and_stale_locations_miss(program) -> None:
    lines, extra, steps = program
    writer: ShmRingWriter[tuple] = ShmRingWriter(lines * ALIGN + extra)
    reader = ShmRingReader(writer.name)
    try:
        assert writer.capacity == reader.size == lines * ALIGN
        model, handed = RingModel(writer.capacity), []
        for op in steps:
            run_op(op, writer, reader, model, handed)
        for live in handed:  # every location ever handed out: its bytes while live, else a miss
            assert reader.read(*live.location, FIELD) == model.expected_read(live.location)
    finally:
        reader.close()
        writer.close()
    assert writer.name not in os.listdir("/dev/shm")


@settings(max_examples=EXAMPLES // 4, **SETTINGS)
@given(capacity=st.integers(0, 3 * ALIGN))
def test_a_ring_below_two_lines_is_a_config_error(capacity: int) -> None:
    if capacity // ALIGN < 2:
        with pytest.raises(ConfigError, match="at least 128 bytes for the shm ring"):
            ShmRingWriter(capacity)
        return
    writer: ShmRingWriter[None] = ShmRingWriter(capacity)
    try:
        assert writer.capacity == capacity // ALIGN * ALIGN
        assert writer.put("k", memoryview(np.zeros(writer.capacity - HEADER_BYTES, np.uint8)), None) is not None
    finally:
        writer.close()
