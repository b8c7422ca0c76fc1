"""LLaVA end to end: parity with transformers, placeholders split by chunked prefill, both caches, bad images, and
new weights (a checkpoint, a sleep, tensors from memory) with the encoder cache forgotten."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import pytest_asyncio
from mm_utils import NUM_IMAGE_TOKENS, hf_llava_greedy, items_altered, make_image, make_tiny_llava, sent_requests

from asyncllm import AsyncEngine, SamplingParams
from asyncllm.errors import InvalidRequestError
from asyncllm.mm.cache import MirrorEntry
from asyncllm.mm.images import image_hash

pytestmark = pytest.mark.asyncio(loop_scope="module")

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
BUDGET = 6
"""max_num_batched_tokens: smaller than an image's 16 placeholders, so every image is split across steps."""


@pytest.fixture(scope="module")
def tiny_llava(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_llava(tmp_path_factory.mktemp("llava"))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tiny_llava: str):
    engine = AsyncEngine(tiny_llava, disable_log_stats=True, block_size=4, max_num_batched_tokens=BUDGET,
                         max_num_seqs=4, enable_prefix_caching=True, mm_max_image_pixels=200 * 200,
                         enable_sleep_mode=True)
    await engine.start()
    sent_requests(engine)  # records every AddRequest from now on
    yield engine
    await engine.aclose()


async def _core_stats(engine: AsyncEngine, queries_at_least: int):
    """The core's stats once they count ``queries_at_least`` prefix-cache lookups (they ride on outputs)."""
    for _ in range(100):
        stats = engine.stats()
        if stats.prefix_cache_queries >= queries_at_least:
            return stats
        await asyncio.sleep(0.02)
    return engine.stats()


async def test_one_image_matches_transformers_with_the_image_split_across_chunks(engine, tiny_llava):
    image = make_image(40, 30, seed=1)
    out = await engine.generate({"prompt": "Describe <image> please", "images": [image]}, GREEDY)
    hf_prompt, hf_tokens = hf_llava_greedy(tiny_llava, "Describe <image> please", [image], 8)
    assert out.prompt_token_ids == hf_prompt
    assert hf_prompt.count(hf_prompt[hf_prompt.index(512)]) == NUM_IMAGE_TOKENS > BUDGET
    assert out.outputs[0].token_ids == hf_tokens


async def test_several_images_of_different_sizes_match_transformers(engine, tiny_llava):
    images = [make_image(40, 30, seed=2), make_image(120, 90, seed=3), make_image(64, 64, seed=4)]
    text = "<image> then <image> and <image> end"
    out = await engine.generate({"prompt": text, "images": images}, GREEDY)
    hf_prompt, hf_tokens = hf_llava_greedy(tiny_llava, text, images, 8)
    assert out.prompt_token_ids == hf_prompt
    assert out.outputs[0].token_ids == hf_tokens


async def test_a_transparent_image_matches_transformers_given_it_as_it_is(engine, tiny_llava):
    """RGBA, half of it fully transparent: composited onto white, as the HF processor's ``convert_to_rgb``."""
    import io

    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(3).integers(0, 256, size=(40, 50, 4), dtype=np.uint8)
    pixels[:, :25, 3] = 0
    encoded = io.BytesIO()
    Image.fromarray(pixels, "RGBA").save(encoded, format="PNG")
    out = await engine.generate({"prompt": "Describe <image> please", "images": [encoded.getvalue()]}, GREEDY)
    assert out.outputs[0].token_ids == hf_llava_greedy(tiny_llava, "Describe <image> please", [encoded.getvalue()], 8)[1]


async def test_chat_messages_with_openai_image_parts_match_transformers(engine, tiny_llava):
    image = make_image(50, 40, seed=5)
    messages = [{"role": "user", "content": [{"type": "text", "text": "what is "},
                                             {"type": "image_url", "image_url": {"url": image}}]}]
    stream = engine.chat(messages, GREEDY)
    tokens = [token for delta in [d async for d in stream] for token in delta.token_ids]
    hf_messages = [{"role": "user", "content": [{"type": "text", "text": "what is "}, {"type": "image"}]}]
    hf_prompt, hf_tokens = hf_llava_greedy(tiny_llava, None, [image], 8, messages=hf_messages)
    assert stream.collector.prompt_token_ids == hf_prompt
    assert tokens == hf_tokens


async def test_a_media_chat_rendered_past_max_prompt_chars_is_refused_untokenized(engine, monkeypatch):
    """As a text chat (asyncllm/engine/prompt_tokens.py): a chat with image parts rendered longer than
    `max_prompt_chars` is refused before it is tokenized whole, naming ``messages``, truncate_prompt_tokens or not."""
    from asyncllm.engine.validation import max_prompt_chars
    from asyncllm.mm import host

    monkeypatch.setattr(host, "chat_token_ids", lambda *_: pytest.fail("tokenized"))
    text = "ab " * max_prompt_chars(engine.tokenizer, engine.config.max_model_len)
    messages = [{"role": "user", "content": [{"type": "text", "text": text},
                                             {"type": "image_url", "image_url": {"url": make_image(20, 20, seed=1)}}]}]
    for params in (GREEDY, SamplingParams(max_tokens=8, truncate_prompt_tokens=4)):
        with pytest.raises(InvalidRequestError, match="characters") as info:
            [d async for d in engine.chat(messages, params)]
        assert (info.value.field, info.value.code) == ("messages", "context_length_exceeded")


async def test_a_repeated_image_crosses_as_its_key_and_hits_both_caches(engine):
    image, other = make_image(80, 60, seed=6), make_image(80, 60, seed=7)
    prompt = "Look: <image> what?"
    first = await engine.generate({"prompt": prompt, "images": [image]}, GREEDY)
    before = engine.stats()
    second = await engine.generate({"prompt": prompt, "images": [image]}, GREEDY)
    (msg1, size1), (msg2, size2) = sent_requests(engine)[-2:]
    assert msg1.mm_items[0].data is not None and msg2.mm_items[0].data is None
    assert msg1.mm_items[0].mm_hash == msg2.mm_items[0].mm_hash
    assert size2 < 300 and size1 > len(msg1.mm_items[0].data) == 3 * 56 * 56 * 4  # the key only, vs the pixels
    assert engine.stats().mm_cache_hits == before.mm_cache_hits + 1
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    item = msg1.mm_items[0]
    assert second.num_cached_tokens >= (item.offset + item.length) // 4 * 4  # prefix cache covers the image
    third = await engine.generate({"prompt": prompt, "images": [other]}, GREEDY)
    msg3 = sent_requests(engine)[-1][0]
    assert msg3.mm_items[0].data is not None and msg3.mm_items[0].mm_hash != item.mm_hash
    assert engine.stats().mm_cache_hits == before.mm_cache_hits + 1  # a different image never hits
    assert third.num_cached_tokens <= item.offset  # only the text before the image is shared
    assert third.outputs[0].token_ids != first.outputs[0].token_ids


async def test_a_cache_miss_from_drift_is_resent_with_data(engine, tiny_llava):
    image = make_image(70, 50, seed=8)
    mm = engine._processor._mm  # type: ignore[union-attr]
    mm.cache.mirror.put(image_hash(image), 1, MirrorEntry(NUM_IMAGE_TOKENS))  # the host wrongly believes the core has it
    out = await engine.generate({"prompt": "Again <image>", "images": [image]}, GREEDY)
    (miss, _), (resent, _) = sent_requests(engine)[-2:]
    assert miss.request_id == resent.request_id
    assert miss.mm_items[0].data is None and resent.mm_items[0].data is not None
    assert out.outputs[0].token_ids == hf_llava_greedy(tiny_llava, "Again <image>", [image], 8)[1]


async def test_bad_images_fail_only_their_request(engine):
    with pytest.raises(InvalidRequestError, match=r"prompt.images\[0\]: cannot decode the image"):
        await engine.generate({"prompt": "x <image>", "images": [b"not an image at all"]}, GREEDY)
    with pytest.raises(InvalidRequestError, match="URLs are not fetched; pass bytes or a base64 data: URL"):
        await engine.generate({"prompt": "x <image>", "images": ["https://example.com/cat.png"]}, GREEDY)
    with pytest.raises(InvalidRequestError, match="over mm_max_image_pixels=40000"):
        await engine.generate({"prompt": "x <image>", "images": [make_image(300, 300, seed=9)]}, GREEDY)
    with pytest.raises(InvalidRequestError, match="1 image placeholder tokens .* but 2 images"):
        await engine.generate({"prompt": "x <image>", "images": [make_image(20, 20, 1)] * 2}, GREEDY)
    out = await engine.generate({"prompt": "still <image> serving", "images": [make_image(30, 30, seed=10)]}, GREEDY)
    assert len(out.outputs[0].token_ids) == 8
    text = await engine.generate("plain text still works", GREEDY)
    assert len(text.outputs[0].token_ids) == 8


async def test_a_bad_chat_image_is_named_by_its_message_and_part(engine):
    good = {"type": "image_url", "image_url": {"url": make_image(20, 20, seed=1)}}
    messages = [{"role": "user", "content": [good]}, {"role": "assistant", "content": "hi"},
                {"role": "user", "content": [{"type": "text", "text": "look"},
                                             {"type": "image_url", "image_url": {"url": b"not an image"}}]}]
    with pytest.raises(InvalidRequestError, match="cannot decode the image") as caught:
        async with engine.chat(messages, GREEDY) as stream:
            [delta async for delta in stream]
    assert caught.value.field == "messages[2].content[1]"  # not the chat's second image, messages[1]


async def test_a_failed_item_keyed_by_a_uuid_names_the_uuid_and_its_image(engine):
    """An item the workers cannot lay on its placeholders, keyed by the caller's uuid (how a uuid reused for other
    content fails where their rows differ, docs/multimodal.md): the error names the uuid and the image's field."""
    images = [make_image(30, 20, seed=14), make_image(40, 30, seed=15)]
    with items_altered(engine):  # the last item (the second image's) laid short
        with pytest.raises(InvalidRequestError) as info:
            await engine.generate({"prompt": "a <image> b <image>", "images": images,
                                   "image_uuids": [None, "photo-1"]}, GREEDY)
    assert info.value.field == "prompt.images[1]"
    assert info.value.message.startswith("uuid 'photo-1' (mm_items[1]): its data encodes to 16 rows, not its 15 ")


async def test_an_image_the_encoder_cannot_lay_on_its_placeholders_fails_only_its_request(engine, tiny_llava):
    """A host process sharing the core that lays an image's 16 feature rows over 15 of its placeholders (a bug, or
    a hostile client): the workers find it when the prefill reaches the image and fail that request alone, its
    blocks leave the prefix cache, and the same image laid right afterwards gets transformers' tokens. Pixels of a
    shape the vision tower refuses fail their request the same way."""
    image, text = make_image(44, 33, seed=12), "Shown <image> here"
    with items_altered(engine):
        bad, plain = await asyncio.gather(engine.generate({"prompt": text, "images": [image]}, GREEDY),
                                          engine.generate("a plain prompt beside it", GREEDY), return_exceptions=True)
    assert isinstance(bad, InvalidRequestError)
    assert "mm_items[0]: its data encodes to 16 rows, not its 15 placeholders" in str(bad)
    assert len(plain.outputs[0].token_ids) == 8
    out = await engine.generate({"prompt": text, "images": [image]}, GREEDY)
    hf_prompt, hf_tokens = hf_llava_greedy(tiny_llava, text, [image], 8)
    assert out.outputs[0].token_ids == hf_tokens
    assert out.num_cached_tokens <= hf_prompt.index(512)  # nothing of the failed request's image rows was kept
    odd = make_image(36, 36, seed=13)
    tiny = bytes(3 * 8 * 8 * 4)  # pixels of a shape the vision tower cannot take (its position embeddings are 56's)
    with items_altered(engine, lambda item: msgspec.structs.replace(item, data=tiny, shape=[3, 8, 8])):
        with pytest.raises(InvalidRequestError, match=r"mm_items\[0\]: the encoder refused its data of shape \[3, 8"):
            await engine.generate({"prompt": text, "images": [odd]}, GREEDY)
    assert (await engine.generate({"prompt": text, "images": [image]}, GREEDY)).outputs[0].token_ids == hf_tokens


async def test_the_processor_cache_off_and_tp2_give_the_same_tokens(engine, tiny_llava):
    images = [make_image(40, 30, seed=11), make_image(40, 30, seed=11)]  # the same image twice in one prompt
    prompt = {"prompt": "<image> twice <image>", "images": images}
    cached = await engine.generate(prompt, GREEDY)
    assert sent_requests(engine)[-1][0].mm_items[1].data is None  # the second copy rides on the first one's data
    async with AsyncEngine(tiny_llava, disable_log_stats=True, mm_processor_cache_gb=0, tensor_parallel_size=2,
                           max_num_batched_tokens=BUDGET, max_num_seqs=4) as uncached:  # decoder sharded, tower replicated
        out = await uncached.generate(prompt, GREEDY)
        assert uncached.stats().mm_cache_queries == 0
    assert out.outputs[0].token_ids == cached.outputs[0].token_ids


async def test_tool_history_beside_images_reaches_the_template(engine):
    """Tool calls in an image chat get their JSON arguments parsed for the template, as in a text chat."""
    from mm_utils import CHAT_TEMPLATE

    template = CHAT_TEMPLATE.replace("{{ eos_token }}", "{% for call in message.get('tool_calls') or [] %}"
                                     "{{ call['function']['arguments'] | tojson }}{% endfor %}{{ eos_token }}")
    image = make_image(20, 20, seed=9)

    def messages(arguments):
        return [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "x"}]},
                {"role": "assistant", "content": None,
                 "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}]},
                {"role": "user", "content": "ok"}]

    prompts = []
    for arguments in ('{"a": 1}', {"a": 1}):
        stream = engine.chat(messages(arguments), SamplingParams(max_tokens=1), chat_template=template)
        async with stream:
            [d async for d in stream]
        prompts.append(stream.collector.prompt_token_ids)
    assert prompts[0] == prompts[1]
    assert '{"a": 1}' in engine.tokenizer.decode(prompts[0])


async def test_new_weights_encode_cached_images_again(engine, tiny_llava, tmp_path_factory):
    """update_weights reloads the vision tower and projector too, and forgets the encoder outputs the old weights
    computed: the first test's image, cached in the workers, is encoded again. Then a sleep, and a push of the
    first weights from transformers' state_dict (`update_weights_from_tensors`)."""
    import torch
    from transformers import LlavaForConditionalGeneration

    other = make_tiny_llava(tmp_path_factory.mktemp("llava_b"), seed=1)
    image, text = make_image(40, 30, seed=1), "Describe <image> please"
    version = engine.stats().weights_version
    assert await engine.update_weights(other) == version + 1
    expected = hf_llava_greedy(other, text, [image], 8)[1]
    assert expected != hf_llava_greedy(tiny_llava, text, [image], 8)[1]
    assert (await engine.generate({"prompt": text, "images": [image]}, GREEDY)).outputs[0].token_ids == expected
    await engine.sleep(level=1)
    await engine.wake_up()
    assert (await engine.generate({"prompt": text, "images": [image]}, GREEDY)).outputs[0].token_ids == expected
    weights = LlavaForConditionalGeneration.from_pretrained(tiny_llava, dtype=torch.float32).state_dict()
    assert await engine.update_weights_from_tensors(weights) == version + 2
    out = await engine.generate({"prompt": text, "images": [image]}, GREEDY)
    assert out.outputs[0].token_ids == hf_llava_greedy(tiny_llava, text, [image], 8)[1]
