"""mm_processor_cache_type="shm" end to end, and caller-given image uuids (docs/multimodal.md).

The shm engine's ring holds exactly two processed images of the tiny LLaVA, so a
third one overwrites the oldest: drift is easy to provoke.
"""

from __future__ import annotations

import os

import pytest
import pytest_asyncio
from mm_utils import NUM_IMAGE_TOKENS, hf_llava_greedy, make_image, make_tiny_llava, sent_requests

from asyncllm import AsyncEngine, SamplingParams
from asyncllm.errors import InvalidRequestError
from asyncllm.mm.processor import MultiModalProcessor
from asyncllm.mm.shm_ring import HEADER_BYTES

pytestmark = pytest.mark.asyncio(loop_scope="module")

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
IMAGE_BYTES = 3 * 56 * 56 * 4
TWO_IMAGES_GB = 2 * (HEADER_BYTES + IMAGE_BYTES) / 2**30
SHM = {"mm_processor_cache_type": "shm", "mm_processor_cache_gb": TWO_IMAGES_GB}
COMMON = {"disable_log_stats": True, "block_size": 4, "max_num_batched_tokens": 6, "max_num_seqs": 4,
          "enable_prefix_caching": True}


def _host_segments() -> list[str]:
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"asyncllm-{os.getpid()}-mm-")]


@pytest.fixture(scope="module")
def tiny_llava(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_llava(tmp_path_factory.mktemp("llava"))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tiny_llava: str):
    engine = AsyncEngine(tiny_llava, **COMMON, **SHM)
    await engine.start()
    sent_requests(engine)
    yield engine
    await engine.aclose()
    assert _host_segments() == []


async def test_shm_lru_and_no_cache_give_transformers_tokens(engine, tiny_llava):
    images = [make_image(40, 30, seed=31), make_image(90, 70, seed=32), make_image(40, 30, seed=31)]
    prompt = {"prompt": "<image> then <image> and again <image>", "images": images}
    shm = await engine.generate(prompt, GREEDY)
    sent = sent_requests(engine)[-1][0]
    assert [item.data for item in sent.mm_items] == [None] * 3  # pixels travel through the ring, not the socket
    assert sent.mm_items[2].shm_offset == sent.mm_items[0].shm_offset >= 0  # the repeat is the same entry
    hf_prompt, hf_tokens = hf_llava_greedy(tiny_llava, prompt["prompt"], images, GREEDY.max_tokens)
    assert shm.prompt_token_ids == hf_prompt and shm.outputs[0].token_ids == hf_tokens
    for options in ({"mm_processor_cache_type": "lru"}, {"mm_processor_cache_gb": 0}):
        async with AsyncEngine(tiny_llava, **COMMON, **options) as other:
            out = await other.generate(prompt, GREEDY)
            assert out.outputs[0].token_ids == hf_tokens, options
            assert other.stats().mm_cache_queries == (3 if options.get("mm_processor_cache_type") else 0)


async def test_a_repeated_image_crosses_as_its_ring_location_and_hits(engine):
    image = make_image(80, 60, seed=33)
    prompt = {"prompt": "Look: <image> what?", "images": [image]}
    first = await engine.generate(prompt, GREEDY)
    before = engine.stats()
    second = await engine.generate(prompt, GREEDY)
    (msg1, size1), (msg2, size2) = sent_requests(engine)[-2:]
    item1, item2 = msg1.mm_items[0], msg2.mm_items[0]
    assert item1.data is None and item2.data is None and size1 < 400 and size2 < 400  # vs 37,632 bytes of pixels
    assert (item2.mm_hash, item2.shm_offset, item2.shm_generation) == (item1.mm_hash, item1.shm_offset, item1.shm_generation)
    after = engine.stats()
    assert (after.mm_cache_queries, after.mm_cache_hits) == (before.mm_cache_queries + 1, before.mm_cache_hits + 1)
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    assert second.num_cached_tokens >= (item1.offset + item1.length) // 4 * 4  # the prefix cache covers the image


async def test_an_entry_overwritten_before_the_core_read_it_is_resent_with_data(engine, tiny_llava):
    images = [make_image(50, 50, seed=s) for s in (34, 35, 36)]  # the third overwrites the first in the ring
    text = "<image> <image> <image> which?"
    out = await engine.generate({"prompt": text, "images": images}, GREEDY)
    (sent, _), (resent, _) = sent_requests(engine)[-2:]
    assert sent.request_id == resent.request_id
    offsets = [i.shm_offset for i in sent.mm_items]
    assert offsets[0] == offsets[2] != offsets[1] and all(i.data is None for i in sent.mm_items)
    assert all(item.data is not None and item.shm_offset == -1 for item in resent.mm_items)  # inline this time
    assert out.outputs[0].token_ids == hf_llava_greedy(tiny_llava, text, images, GREEDY.max_tokens)[1]


async def test_an_entry_clobbered_between_two_requests_is_resent_with_data(engine):
    image = make_image(70, 40, seed=37)
    prompt = {"prompt": "Once <image> more", "images": [image]}
    first = await engine.generate(prompt, GREEDY)
    item = sent_requests(engine)[-1][0].mm_items[0]
    ring = engine._processor._mm.cache.ring  # type: ignore[union-attr]
    ring._view.buf[item.shm_offset : item.shm_offset + HEADER_BYTES + IMAGE_BYTES] = b"\xff" * (HEADER_BYTES + IMAGE_BYTES)
    second = await engine.generate(prompt, GREEDY)
    (miss, _), (resent, _) = sent_requests(engine)[-2:]
    assert miss.request_id == resent.request_id and miss.mm_items[0].shm_generation == item.shm_generation
    assert miss.mm_items[0].data is None and resent.mm_items[0].data is not None
    assert second.outputs[0].token_ids == first.outputs[0].token_ids


async def test_a_caller_uuid_replaces_the_content_hash(engine):
    image, other = make_image(60, 60, seed=38), make_image(60, 60, seed=39)
    text = "With uuid <image> ok"
    first = await engine.generate({"prompt": text, "images": [image], "image_uuids": ["photo-1"]}, GREEDY)
    before = engine.stats()
    # The caller's contract: the same uuid is the same image, so ``other`` is never even decoded.
    second = await engine.generate({"prompt": text, "images": [other], "image_uuids": ["photo-1"]}, GREEDY)
    (msg1, _), (msg2, _) = sent_requests(engine)[-2:]
    assert msg2.mm_items[0].mm_hash == msg1.mm_items[0].mm_hash and msg2.mm_items[0].shm_offset >= 0
    assert engine.stats().mm_cache_hits == before.mm_cache_hits + 1
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    assert second.num_cached_tokens >= (msg1.mm_items[0].offset + NUM_IMAGE_TOKENS) // 4 * 4  # prefix cache: same key
    plain = await engine.generate({"prompt": text, "images": [image]}, GREEDY)  # no uuid: its content hash
    msg3 = sent_requests(engine)[-1][0]
    assert msg3.mm_items[0].mm_hash != msg1.mm_items[0].mm_hash
    assert plain.num_cached_tokens <= msg1.mm_items[0].offset and plain.outputs[0].token_ids == first.outputs[0].token_ids
    messages = [{"role": "user", "content": [{"type": "text", "text": "chat "},
                                             {"type": "image", "image": other, "uuid": "photo-1"}]}]
    hits = engine.stats().mm_cache_hits
    [d async for d in engine.chat(messages, GREEDY)]
    assert engine.stats().mm_cache_hits == hits + 1 and sent_requests(engine)[-1][0].mm_items[0].mm_hash == msg1.mm_items[0].mm_hash


async def test_bad_uuids_are_typed_errors_naming_the_field(engine):
    image = make_image(20, 20, seed=40)
    with pytest.raises(InvalidRequestError, match=r"^prompt.image_uuids: .*1 images, got 2 uuids") as info:
        await engine.generate({"prompt": "x <image>", "images": [image], "image_uuids": ["a", "b"]}, GREEDY)
    assert info.value.field == "prompt.image_uuids"
    with pytest.raises(InvalidRequestError, match=r"^prompt.image_uuids\[0\]: a uuid must be a non-empty str"):
        await engine.generate({"prompt": "x <image>", "images": [image], "image_uuids": [12]}, GREEDY)
    bad_chat = [{"role": "user", "content": [{"type": "image", "image": image, "uuid": {"id": 1}}]}]
    with pytest.raises(InvalidRequestError, match=r"^messages\[0\].content\[0\].uuid: "):
        [d async for d in engine.chat(bad_chat, GREEDY)]
    out = await engine.generate({"prompt": "still <image>", "images": [image], "image_uuids": [None]}, GREEDY)
    assert len(out.outputs[0].token_ids) == 8


async def test_the_ring_is_unlinked_once_the_core_mapped_it(engine):
    mm = engine._processor._mm  # type: ignore[union-attr]
    assert mm.cache is not None and mm.cache.ring.capacity == int(TWO_IMAGES_GB * 2**30) // 64 * 64
    assert _host_segments() == []  # mapped by both sides, gone from /dev/shm: no crash can leak it


async def test_other_hosts_attached_to_the_core_keep_their_own_cache(engine, tiny_llava, monkeypatch):
    image = make_image(45, 35, seed=41)
    prompt = {"prompt": "Guest <image> here", "images": [image]}
    expected = (await engine.generate(prompt, GREEDY)).outputs[0].token_ids
    address = engine._core.address  # type: ignore[union-attr]
    async with AsyncEngine.connect(address, disable_log_stats=True, **SHM) as guest:  # its own ring
        sent = sent_requests(guest)
        outs = [await guest.generate(prompt, GREEDY) for _ in range(2)]
        assert [m.mm_items[0].data for m, _ in sent] == [None, None] and guest.stats().mm_cache_hits == 1
        assert [o.outputs[0].token_ids for o in outs] == [expected, expected]
    lru = {"mm_processor_cache_type": "lru"}  # a host-side field: not given, the guest would take the core's shm
    async with AsyncEngine.connect(address, disable_log_stats=True, **lru) as lru_guest:  # shm core: no store
        sent = sent_requests(lru_guest)
        outs = [await lru_guest.generate(prompt, GREEDY) for _ in range(2)]
        assert [o.outputs[0].token_ids for o in outs] == [expected, expected]
        assert sent[1][0].mm_items[0].data is None and sent[2][0].mm_items[0].data is not None  # missed, resent
    real_open = MultiModalProcessor.open_cache
    monkeypatch.setattr(MultiModalProcessor, "open_cache", lambda self: real_open(self) and "asyncllm-0-mm-0badc0de")
    async with AsyncEngine.connect(address, disable_log_stats=True, **SHM) as unmapped:  # the core cannot map it
        sent = sent_requests(unmapped)
        outs = [await unmapped.generate(prompt, GREEDY) for _ in range(2)]
        assert [o.outputs[0].token_ids for o in outs] == [expected, expected]
        assert all(m.mm_items[0].data is not None for m, _ in sent) and unmapped.stats().mm_cache_queries == 0
    assert _host_segments() == []


async def test_a_resend_that_cannot_read_the_image_again_fails_only_its_request(engine):
    image = make_image(30, 50, seed=42)
    first = await engine.generate({"prompt": "u <image>", "images": [image], "image_uuids": ["photo-9"]}, GREEDY)
    item = sent_requests(engine)[-1][0].mm_items[0]
    ring = engine._processor._mm.cache.ring  # type: ignore[union-attr]
    ring._view.words[item.shm_offset // 8] = 0  # the entry is gone before the core reads it again
    stand_in = {"prompt": "u <image>", "images": [b"not an image"], "image_uuids": ["photo-9"]}  # hit: not decoded
    with pytest.raises(InvalidRequestError, match=r"images\[0\]: cannot decode the image"):
        await engine.generate(stand_in, GREEDY)  # the core missed, the resend must decode the stand-in
    again = await engine.generate({"prompt": "u <image>", "images": [image], "image_uuids": ["photo-9"]}, GREEDY)
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
