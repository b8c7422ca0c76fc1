"""The multimodal processor cache under drawn traffic (hypothesis), both halves as the engine runs them.

The shm ring (`ShmRingWriter` / `ShmRingReader`) against a model of where its
entries lie: each new entry starts where the last one ended, or at 0 when it
would pass the end (the tail skipped); it evicts exactly the entries whose bytes
it or the skipped tail covers; a location reads back its own bytes while its
entry lives and misses (None) once it is dropped, rewritten or overwritten,
never another entry's bytes.

Then hosts' real `MultiModalProcessor`s (a CLIP image processor, images of a
few shapes) send requests to one core's `CoreProcessorCache`, with the core
forgetting keys (a failed request: `Core.forget_failed`) and shm hosts
reconnecting (a new ring): every request's items reach the core with the bytes
of its images processed uncached; a miss is resent with its data
(`resend_with_data`) and the resend never misses; one lru host whose core
forgets nothing never misses and its mirror holds the store's keys, sizes and
order; an shm host misses exactly the items whose ring entry a later item of
the request overwrote.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from asyncllm.config import MultiModalConfig
from asyncllm.mm.cache import MultiModalCacheMiss
from asyncllm.mm.core_cache import CoreProcessorCache
from asyncllm.mm.host import resend_with_data
from asyncllm.mm.inputs import MultiModalInputs, MultiModalPrompt
from asyncllm.mm.processor import MultiModalProcessor
from asyncllm.mm.shm_ring import HEADER_BYTES, ShmRingReader, ShmRingWriter
from asyncllm.protocol import AddRequest
from asyncllm.sampling import SamplingParams
from asyncllm.shm_segment import align_up

PIL = pytest.importorskip("PIL.Image")

RING_KEYS = [f"k{i}" for i in range(8)]


def _padded(nbytes: int) -> int:
    return HEADER_BYTES + align_up(nbytes)


def _overlaps(start: int, end: int, regions: list[tuple[int, int]]) -> bool:
    return any(start < stop and begin < end for begin, stop in regions)


class RingModel:
    """Where the ring's live entries lie: key -> (offset, padded end, generation, data)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.head = 0
        self.live: dict[str, tuple[int, int, int, bytes]] = {}

    def put(self, key: str, data: bytes, generation: int) -> int | None:
        """The offset the entry must take (None: larger than the ring); evicts what its bytes cover."""
        self.live.pop(key, None)
        size = _padded(len(data))
        if size > self.capacity:
            return None
        start = self.head if self.head + size <= self.capacity else 0
        covered = [(start, start + size)] + ([(self.head, self.capacity)] if start != self.head else [])
        self.live = {k: v for k, v in self.live.items() if not _overlaps(v[0], v[1], covered)}
        self.live[key] = (start, start + size, generation, data)
        self.head = start + size
        return start


@st.composite
def ring_ops(draw: st.DrawFn) -> list[tuple[str, str, int]]:
    sizes = st.one_of(st.integers(0, 4 * HEADER_BYTES), st.integers(0, 16 * HEADER_BYTES))  # mostly a few lines
    op = st.tuples(st.sampled_from(["put"] * 3 + ["drop"]), st.sampled_from(RING_KEYS), sizes)  # a drop: no size
    return draw(st.lists(op, min_size=1, max_size=40))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lines=st.integers(2, 16), ops=ring_ops())
@example(lines=10, ops=[("put", k, 64) for k in RING_KEYS[:5]] + [("put", "k5", 128), ("put", "k6", 192),
                                                                   ("put", "k7", 192)])  # wraps past a live tail
def test_the_ring_places_evicts_and_reads_back_as_its_model(lines: int, ops: list[tuple[str, str, int]]) -> None:
    capacity = lines * HEADER_BYTES
    writer: ShmRingWriter[int] = ShmRingWriter(capacity)
    reader = ShmRingReader(writer.name)
    model = RingModel(capacity)
    issued: list[tuple[str, int, int, bytes]] = []  # every location the writer handed out
    try:
        for step, (kind, key, nbytes) in enumerate(ops):
            if kind == "drop":
                writer.drop(key)
                model.live.pop(key, None)
            else:
                data = np.random.default_rng(step).bytes(nbytes)
                entry = writer.put(key, memoryview(data), nbytes)
                offset = model.put(key, data, entry.generation if entry is not None else 0)
                if offset is None:
                    assert entry is None
                    continue
                assert entry is not None and (entry.offset, entry.nbytes) == (offset, nbytes)
                assert all(entry.generation > generation for _, _, generation, _ in issued)
                issued.append((key, entry.offset, entry.generation, data))
            _check_ring(writer, reader, model, issued)
    finally:
        reader.close()
        writer.close()


def _check_ring(writer: ShmRingWriter[int], reader: ShmRingReader, model: RingModel,
                issued: list[tuple[str, int, int, bytes]]) -> None:
    index = {key: (e.offset, e.end, e.generation) for key in RING_KEYS if (e := writer.get(key)) is not None}
    assert index == {key: v[:3] for key, v in model.live.items()} and len(writer) == len(model.live)
    for key, offset, generation, data in issued:
        live = model.live.get(key)
        expected = data if live is not None and live[2] == generation else None
        assert reader.read(key, offset, generation, len(data), "mm_items[0]") == expected
        if expected is not None:  # the same location under another key or length is not this entry
            assert reader.read(key + "'", offset, generation, len(data), "mm_items[0]") is None
            if offset + HEADER_BYTES + len(data) + 1 <= reader.size:
                assert reader.read(key, offset, generation, len(data) + 1, "mm_items[0]") is None


# ---------------------------------------------------------------------------------------------- hosts and one core

SHAPES = [(4, 4), (4, 8), (8, 4), (4, 12), (12, 4), (4, 20)]
"""Image sizes (h, w): the processor resizes the shortest edge to 4, so items of 192 to 960 bytes."""
PLACEHOLDER = 5


class _Model:
    """What `MultiModalProcessor` reads of a LLaVA-style model class; a placeholder per 2 x 2 pixels."""

    @staticmethod
    def mm_placeholder_token_id(hf_config):
        return PLACEHOLDER

    @staticmethod
    def mm_pixel_values(output):
        return output["pixel_values"][0]

    @staticmethod
    def mm_placeholder_length(hf_config, shape):
        return shape[-1] * shape[-2] // 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("clip")
    (path / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "CLIPImageProcessor", "size": {"shortest_edge": 4},
        "do_center_crop": False, "do_resize": True}))
    return path


def _images(shapes: list[int]) -> list:
    return [PIL.fromarray(np.random.default_rng(i).integers(0, 255, (*SHAPES[s], 3), dtype=np.uint8))
            for i, s in enumerate(shapes)]


def _prompt(images: list[int]) -> list[int]:
    """Text tokens around each image's placeholder."""
    return [token for i in images for token in (10 + i, PLACEHOLDER)] + [9]


@st.composite
def traffic(draw: st.DrawFn) -> tuple[str, int, int, list[int], list[tuple]]:
    cache_type = draw(st.sampled_from(["lru", "shm"]))
    budget = draw(st.integers(2, 24)) * HEADER_BYTES  # from under one item (192 to 960 bytes) to eight
    hosts = draw(st.sampled_from([1, 1, 2, 3]))  # one lru host keeps its mirror equal to the store
    shapes = draw(st.lists(st.integers(0, len(SHAPES) - 1), min_size=2, max_size=6))
    kinds = ["send"] * 6 + ["reconnect"] * (cache_type == "shm") + ["forget"] * draw(st.sampled_from([0, 0, 1, 2]))
    images = st.lists(st.integers(0, len(shapes) - 1), min_size=1, max_size=3)
    op = st.tuples(st.sampled_from(kinds), st.integers(0, hosts - 1), images)  # forget: the core, its images' keys
    return cache_type, budget, hosts, shapes, draw(st.lists(op, min_size=4, max_size=25))


class Traffic:
    """Hosts' processors, the core's cache, and the uncached processing every request must reach the core as."""

    def __init__(self, model_dir: Path, cache_type: str, budget: int, hosts: int, shapes: list[int]) -> None:
        self.cache_type = cache_type
        self.images = _images(shapes)
        self.reference = MultiModalProcessor(str(model_dir), None, _Model, None, 0, 16_777_216)  # no cache
        self.core = CoreProcessorCache(MultiModalConfig(mm_processor_cache_gb=budget / 2**30,
                                                        mm_processor_cache_type=cache_type))
        self.hosts = [MultiModalProcessor(str(model_dir), None, _Model, None, budget, 16_777_216, cache_type)
                      for _ in range(hosts)]
        self.misses = 0
        self.requests = 0
        for host in range(hosts):
            self.connect(host)

    def connect(self, host: int) -> None:
        """A (new) connection of ``host`` to the core: shm hosts make a new ring, which the core maps."""
        mm = self.hosts[host]
        name = mm.open_cache()
        if name:
            assert self.core.attach(self.client(host), name)
            mm.cache_mapped(True)

    @staticmethod
    def client(host: int) -> bytes:
        return b"host-%d" % host

    def keys(self, images: list[int]) -> list[str]:
        return [item.mm_hash for item in self.process(self.reference, images).items]

    def process(self, mm: MultiModalProcessor, images: list[int]) -> MultiModalPrompt:
        return mm.process(_prompt(images), MultiModalInputs([self.images[i] for i in images]), "prompt.images")

    def send(self, host: int, images: list[int]) -> None:
        """One request from ``host``: processed, filled by the core (resent with its data after a miss), checked."""
        mm, client = self.hosts[host], self.client(host)
        prompt = self.process(mm, images)
        self.requests += 1
        message = AddRequest(f"r{self.requests}", prompt.token_ids, SamplingParams(), [1], 0.0,
                             mm_items=list(prompt.items))
        stale = self._stale_ring_items(mm, message)
        try:
            self.core.fill(client, message)
            assert not stale, f"ring entries {stale} were overwritten, yet the core read them"
        except MultiModalCacheMiss as miss:
            self.misses += 1
            named = re.search(r"processor cache: (.*)$", str(miss)).group(1).split(", ")
            if self.cache_type == "shm":
                assert sorted(named) == sorted(stale)
            message = resend_with_data(mm, message, prompt)
            self.core.fill(client, message)  # all its data: a resend never misses
        self._check_filled(message, images)

    def _stale_ring_items(self, mm: MultiModalProcessor, message: AddRequest) -> list[str]:
        """The items sent as a ring location whose entry the host's ring no longer holds (a later item overwrote it)."""
        if self.cache_type != "shm":
            return []
        return [item.mm_hash for item in message.mm_items if item.shm_offset >= 0
                and ((entry := mm.cache.ring.get(item.mm_hash)) is None or entry.generation != item.shm_generation)]

    def _check_filled(self, message: AddRequest, images: list[int]) -> None:
        expected = self.process(self.reference, images)
        assert message.prompt_token_ids == expected.token_ids
        for got, want in zip(message.mm_items, expected.items, strict=True):
            assert (got.mm_hash, got.offset, got.length, got.shape, got.dtype) == \
                   (want.mm_hash, want.offset, want.length, want.shape, want.dtype)
            assert got.data == want.data and got.shm_offset == -1

    def check_mirror(self) -> None:
        """One lru host whose core forgot nothing: its mirror is the store's keys, sizes and order."""
        mirror, store = self.hosts[0].cache.mirror, self.core.store
        assert [(k, size) for k, (size, _) in mirror._entries.items()] == \
               [(k, size) for k, (size, _) in store._entries.items()]
        assert mirror.total_bytes == store.total_bytes <= store.capacity_bytes

    def close(self) -> None:
        for mm in self.hosts:
            mm.close_cache()
        self.core.close()


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(case=traffic())
def test_every_request_reaches_the_core_with_its_images_data(model_dir: Path, case) -> None:
    cache_type, budget, hosts, shapes, ops = case
    run = Traffic(model_dir, cache_type, budget, hosts, shapes)
    forgot = False
    try:
        for kind, host, images in ops:
            if kind == "send":
                run.send(host, images)
            elif kind == "forget":
                keys = run.keys(images)
                run.core.forget(keys)
                assert run.core.store is None or not set(keys) & set(run.core.store._entries)
                forgot = forgot or cache_type == "lru"
            else:
                run.connect(host)
            if cache_type == "lru" and hosts == 1 and not forgot:
                assert run.misses == 0
                run.check_mirror()
    finally:
        run.close()
