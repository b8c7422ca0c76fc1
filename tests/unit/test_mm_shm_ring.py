"""The shm processor cache without an engine: the ring's FIFO index, verified reads, a racing writer, uuids."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from asyncllm.config import MultiModalConfig
from asyncllm.errors import ConfigError, InvalidRequestError
from asyncllm.mm.cache import MultiModalCacheMiss, fill_mm_items
from asyncllm.mm.core_cache import CoreProcessorCache
from asyncllm.mm.images import check_uuids, image_hash, uuid_key
from asyncllm.mm.inputs import split_chat_media
from asyncllm.mm.shm_ring import HEADER_BYTES, ShmRingReader, ShmRingWriter
from asyncllm.protocol import AddRequest, MultiModalItem
from asyncllm.sampling import SamplingParams

ENTRY = 1024
"""Data bytes of the test entries (256 float32)."""


def _data(value: float) -> np.ndarray:
    return np.full((256,), value, dtype=np.float32)


def _segments() -> list[str]:
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"asyncllm-{os.getpid()}-mm-")]


@pytest.fixture
def ring():
    writer: ShmRingWriter[str] = ShmRingWriter(3 * (HEADER_BYTES + ENTRY))  # room for exactly three entries
    reader = ShmRingReader(writer.name)
    yield writer, reader
    reader.close()
    writer.close()


def _read(reader: ShmRingReader, key: str, entry) -> np.ndarray | None:
    data = reader.read(key, entry.offset, entry.generation, entry.nbytes, "mm_items[0]")
    return None if data is None else np.frombuffer(data, dtype=np.float32)


def test_an_entry_reads_back_only_under_its_own_key_and_generation(ring):
    writer, reader = ring
    entry = writer.put("a", memoryview(_data(1.5)), "meta-a")
    assert (entry.offset, entry.nbytes, entry.generation, writer.get("a").meta) == (0, ENTRY, 1, "meta-a")
    assert np.array_equal(_read(reader, "a", entry), _data(1.5))
    assert reader.read("b", entry.offset, entry.generation, ENTRY, "f") is None  # another key's location
    assert reader.read("a", entry.offset, entry.generation + 1, ENTRY, "f") is None  # a generation never written
    assert reader.read("a", entry.offset, entry.generation, ENTRY - 4, "f") is None  # not the size written


def test_the_oldest_entries_are_overwritten_and_their_readers_miss(ring):
    writer, reader = ring
    entries = {key: writer.put(key, memoryview(_data(i)), key) for i, key in enumerate("abc")}
    assert [e.offset for e in entries.values()] == [0, HEADER_BYTES + ENTRY, 2 * (HEADER_BYTES + ENTRY)]
    assert writer.get("a") is not None  # a hit does not refresh: "a" stays the oldest
    entries["d"] = writer.put("d", memoryview(_data(3)), "d")
    assert entries["d"].offset == 0  # wrapped onto "a"
    assert writer.get("a") is None and _read(reader, "a", entries["a"]) is None
    assert np.array_equal(_read(reader, "b", entries["b"]), _data(1))  # the others are intact
    assert np.array_equal(_read(reader, "d", entries["d"]), _data(3))
    big = writer.put("big", memoryview(np.zeros(512, dtype=np.float32)), "big")  # two slots' worth: skips the tail
    assert big.offset == HEADER_BYTES + ENTRY and writer.get("b") is None and writer.get("c") is None
    assert _read(reader, "c", entries["c"]) is None and len(writer) == 2


def test_a_dropped_entry_misses_and_a_location_outside_the_ring_is_refused(ring):
    writer, reader = ring
    entry = writer.put("a", memoryview(_data(2)), "a")
    writer.drop("a")
    assert writer.get("a") is None and _read(reader, "a", entry) is None
    assert writer.put("huge", memoryview(np.zeros(4 * ENTRY, dtype=np.float32)), "h") is None  # larger than the ring
    with pytest.raises(InvalidRequestError, match=r"mm_items\[0\]: ring location .* outside the host's ring"):
        reader.read("a", reader.size, 1, ENTRY, "mm_items[0]")
    with pytest.raises(InvalidRequestError, match="outside"):
        reader.read("a", 3, 1, ENTRY, "mm_items[0]")  # not on an entry boundary


def test_an_empty_array_of_any_shape_is_an_entry(ring):
    writer, reader = ring
    writer.put("a", memoryview(_data(1)), "a")
    entry = writer.put("a", memoryview(np.zeros((1, 0), dtype=np.float32)), "empty")  # memoryview cannot cast it
    assert (entry.nbytes, writer.get("a").meta) == (0, "empty")
    assert reader.read("a", entry.offset, entry.generation, 0, "f") == b""


def test_a_ring_larger_than_dev_shm_is_a_config_error():
    free = os.statvfs("/dev/shm").f_bavail * os.statvfs("/dev/shm").f_frsize
    with pytest.raises(ConfigError, match=r"mm_processor_cache_gb=.* at most /dev/shm's free space"):
        ShmRingWriter(free + 2**30)
    assert _segments() == []


def test_the_segment_is_gone_once_unlinked_and_mapped_views_still_work():
    writer: ShmRingWriter[str] = ShmRingWriter(4096)
    reader = ShmRingReader(writer.name)
    writer.unlink()
    assert writer.name.lstrip("/") not in os.listdir("/dev/shm")
    entry = writer.put("a", memoryview(_data(7)), "a")
    assert np.array_equal(_read(reader, "a", entry), _data(7))
    with pytest.raises(FileNotFoundError):
        ShmRingReader(writer.name)  # nobody else can map it any more
    reader.close()
    writer.close()
    writer.close()  # idempotent


_WRITER = textwrap.dedent("""
    import sys
    import numpy as np
    from asyncllm.mm.shm_ring import ShmRingWriter

    nbytes, puts = int(sys.argv[1]), int(sys.argv[2])
    writer = ShmRingWriter(4 * (64 + nbytes))
    print(writer.name, flush=True)
    sys.stdin.readline()  # the reader has mapped the ring
    for _ in range(puts):  # entry g holds the value g % 251, under the key "k<g>"
        generation = writer._next_generation
        writer.put(f"k{generation}", memoryview(np.full(nbytes // 4, generation % 251, np.float32)), 0)
    writer.close()
""")


def _race(reader: ShmRingReader, nbytes: int, writing) -> tuple[int, int, int]:
    """Read whatever entry each slot holds right now, while ``writing()``; (hits, misses, torn)."""
    hits = misses = torn = 0
    slots = [i * (HEADER_BYTES + nbytes) for i in range(4)]
    while writing():
        for offset in slots:
            generation = reader._view.generation(offset)
            if generation == 0:
                continue
            data = reader.read(f"k{generation}", offset, generation, nbytes, "f")
            if data is None:
                misses += 1
                continue
            hits += 1
            torn += int(not (np.frombuffer(data, dtype=np.float32) == generation % 251).all())
    return hits, misses, torn


def test_a_reader_racing_the_writer_gets_whole_entries_or_misses():
    """The writer (another process) overwrites the ring while we copy entries out: never a torn entry."""
    nbytes = 256 * 1024
    child = subprocess.Popen([sys.executable, "-c", _WRITER, str(nbytes), "3000"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    assert child.stdin is not None and child.stdout is not None
    try:
        reader = ShmRingReader(child.stdout.readline().strip())
        child.stdin.write("go\n")
        child.stdin.flush()
        hits, _, torn = _race(reader, nbytes, lambda: child.poll() is None)
        reader.close()
    finally:
        child.wait(timeout=120)
    assert child.returncode == 0
    assert torn == 0  # without the check after the copy, about 1 read in 500 here is torn
    assert hits > 100


def _add(items: list[MultiModalItem]) -> AddRequest:
    return AddRequest("r", [5] * 8, SamplingParams(), [1], 0.0, mm_items=items)


def test_the_core_fills_ring_items_per_host_and_misses_without_its_ring():
    writer: ShmRingWriter[str] = ShmRingWriter(8192)
    core = CoreProcessorCache(MultiModalConfig(mm_processor_cache_type="shm"))
    try:
        assert core.store is None  # shm: no lru store in the core
        assert core.attach(b"host-1", writer.name) and not core.attach(b"host-2", "asyncllm-0-mm-0badc0de")
        assert not core.attach(b"host-3", "psm_core_ring") and set(core.rings) == {b"host-1"}  # not an asyncllm ring
        entry = writer.put("img", memoryview(_data(4)), "img")
        ring_item = MultiModalItem("img", 1, 2, None, [256], "float32", entry.offset, entry.generation)
        message = _add([ring_item])
        core.fill(b"host-1", message)
        filled = message.mm_items[0]
        assert filled.data == _data(4).tobytes() and filled.shm_offset == -1  # the workers get plain data
        with pytest.raises(MultiModalCacheMiss, match="img"):
            core.fill(b"host-2", _add([ring_item]))  # not this host's ring
        writer.put("img", memoryview(_data(5)), "img")  # rewritten: the old location is stale
        with pytest.raises(MultiModalCacheMiss, match="not in the core's processor cache: img"):
            core.fill(b"host-1", _add([ring_item]))
        with pytest.raises(InvalidRequestError, match="does not match shape"):
            fill_mm_items(None, _add([MultiModalItem("x", 1, 2, None, [], "float32", 0, 1)]))
    finally:
        core.close()
        writer.close()
    assert core.rings == {}


def test_uuids_replace_content_hashes_and_bad_ones_name_their_field():
    assert uuid_key("cat-1") == uuid_key("cat-1") != uuid_key("cat-2")
    assert uuid_key("cat-1") != image_hash(b"cat-1")  # a uuid never collides with a content hash
    assert check_uuids(None, 2, "prompt.image_uuids") == [None, None]
    assert check_uuids(["a", None], 2, "prompt.image_uuids") == ["a", None]
    with pytest.raises(InvalidRequestError, match=r"^prompt.image_uuids: .* 2 images, got 1 uuids"):
        check_uuids(["a"], 2, "prompt.image_uuids")
    with pytest.raises(InvalidRequestError, match=r"^prompt.image_uuids: .* got a str"):
        check_uuids("a", 1, "prompt.image_uuids")
    with pytest.raises(InvalidRequestError, match=r"^prompt.image_uuids\[1\]: a uuid must be a non-empty str"):
        check_uuids(["a", 7], 2, "prompt.image_uuids")
    messages = [{"role": "user", "content": [{"type": "image", "image": b"A", "uuid": "u-a"},
                                             {"type": "image_url", "image_url": {"url": b"B"}},
                                             {"type": "image_pil", "image_pil": b"C"}]}]  # vLLM's PIL part
    rendered, inputs = split_chat_media(messages)
    assert inputs.images == [b"A", b"B", b"C"] and inputs.image_uuids == ["u-a", None, None]
    assert rendered[0]["content"] == [{"type": "image"}] * 3  # the uuid is not for the template
    messages[0]["content"][1]["uuid"] = ""
    with pytest.raises(InvalidRequestError, match=r"^messages\[0\].content\[1\].uuid: "):
        split_chat_media(messages)
