"""The multimodal plumbing without processes: the processor cache's two halves, item checks, block keys, chat parts."""

from __future__ import annotations

import pytest

from asyncllm.config import EngineConfig
from asyncllm.errors import ConfigError, InvalidRequestError, NotBuiltError
from asyncllm.kv.hashing import extend_block_hashes
from asyncllm.mm.cache import LRUBudget, MirrorEntry, MultiModalCacheMiss, ProcessorCacheStore, fill_mm_items
from asyncllm.mm.inputs import split_chat_media
from asyncllm.mm.images import check_max_image_pixels, decode_image, image_hash, load_image
from asyncllm.models.llava import normalize_llava_name
from asyncllm.models.qwen2_vl import normalize_qwen2_vl_name
from asyncllm.protocol import AddRequest, MultiModalItem
from asyncllm.sampling import SamplingParams


def _item(mm_hash: str, offset: int = 1, length: int = 2, data: bytes | None = b"\0" * 8) -> MultiModalItem:
    return MultiModalItem(mm_hash, offset, length, data, [2] if data else [], "float32")


def _add(items: list[MultiModalItem], num_tokens: int = 8) -> AddRequest:
    return AddRequest("r", [5] * num_tokens, SamplingParams(), [1], 0.0, mm_items=items)


def test_lru_budget_evicts_oldest_first_and_refreshes_on_get():
    lru: LRUBudget[int] = LRUBudget(10)
    lru.put("a", 4, 1)
    lru.put("b", 4, 2)
    assert lru.get("a") == 1  # "b" is now the oldest
    lru.put("c", 4, 3)
    assert (lru.get("a"), lru.get("b"), lru.get("c"), lru.total_bytes) == (1, None, 3, 8)
    lru.put("huge", 11, 4)  # larger than the whole budget: not kept, nothing evicted
    assert (lru.get("huge"), len(lru)) == (None, 2)


def test_mirror_and_store_stay_in_step_under_the_same_operations():
    mirror: LRUBudget[MirrorEntry] = LRUBudget(16)
    store = ProcessorCacheStore(16)
    for key in ["a", "b", "a", "c", "d"]:  # the host sends data on a mirror miss, the key on a hit
        hit = mirror.get(key) is not None
        if not hit:
            mirror.put(key, 8, MirrorEntry(2))
        message = _add([_item(key, data=None if hit else b"\0" * 8)])
        fill_mm_items(store, message)
        assert message.mm_items[0].data == b"\0" * 8
    assert [k for k in "abcd" if mirror.get(k)] == [k for k in "abcd" if store.get(k)] == ["c", "d"]


def test_a_key_the_store_lacks_is_a_cache_miss_naming_it():
    with pytest.raises(MultiModalCacheMiss, match="not in the core's processor cache: gone"):
        fill_mm_items(ProcessorCacheStore(100), _add([_item("gone", data=None)]))
    with pytest.raises(MultiModalCacheMiss):
        fill_mm_items(None, _add([_item("off", data=None)]))  # the cache is disabled: data is required


@pytest.mark.parametrize("items, match", [
    ([_item("a", offset=7, length=2)], r"mm_items\[0\]: placeholders \[7, 9\) must be in the prompt"),
    ([_item("a", 1, 3), _item("b", 2, 2)], r"mm_items\[1\]"),
    ([MultiModalItem("a", 1, 2, b"\0" * 7, [2], "float32")], "does not match shape"),
    ([MultiModalItem("a", 1, 2, b"\0" * 8, [2], "object")], "dtype 'object'"),
])
def test_malformed_items_are_refused_with_the_field(items, match):
    with pytest.raises(InvalidRequestError, match=match):
        fill_mm_items(ProcessorCacheStore(100), _add(items))


def test_block_hashes_key_on_the_image_and_its_place():
    tokens = [9] * 12  # placeholders are all the same token
    def hashes(items):
        out: list[bytes] = []
        extend_block_hashes(out, tokens, 4, 3, None, items)
        return out
    plain, same = hashes([]), hashes([_item("img", 2, 4)])
    assert hashes([_item("img", 2, 4)]) == same  # same image, same place: hits
    other = hashes([_item("other", 2, 4)])
    assert other[0] != same[0] and other[1] != same[1]  # a different image never hits
    assert hashes([_item("img", 3, 4)])[0] != same[0]  # same image elsewhere: another key
    assert plain[2] != same[2]  # the chain carries the image into later blocks


def test_chat_media_parts_become_template_parts_and_inputs_in_order():
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "image", "image": b"A"}, {"type": "text", "text": "and"},
                                     {"type": "image_url", "image_url": {"url": b"B"}}]},
    ]
    messages[1]["content"].append({"type": "video_url", "video_url": {"url": b"V"}, "uuid": "clip"})
    rendered, inputs = split_chat_media(messages)
    assert inputs.images == [b"A", b"B"] and inputs.image_uuids == [None, None]
    assert inputs.videos == [b"V"] and inputs.video_uuids == ["clip"]
    assert inputs.locations == {"image": ["messages[1].content[0]", "messages[1].content[2]"],
                                "video": ["messages[1].content[3]"], "audio": []}  # what their errors name
    assert rendered[0] == messages[0]
    assert rendered[1]["content"] == [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"},
                                      {"type": "video"}]
    audio_parts = [{"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
                   {"type": "audio_url", "audio_url": {"url": "data:audio/mp3;base64,AAAA"}, "uuid": "a2"}]
    rendered, inputs = split_chat_media([{"role": "user", "content": audio_parts}])
    assert inputs.audios == ["data:audio/wav;base64,UklGRg==", "data:audio/mp3;base64,AAAA"]
    assert inputs.audio_uuids == [None, "a2"]
    assert rendered[0]["content"] == [{"type": "audio", "audio": ""}] * 2  # the key Qwen2-Audio's template tests
    with pytest.raises(InvalidRequestError, match="input_audio part is"):
        split_chat_media([{"role": "user", "content": [{"type": "input_audio", "input_audio": "raw"}]}])
    with pytest.raises(InvalidRequestError, match="unknown type 'sound'"):
        split_chat_media([{"role": "user", "content": [{"type": "sound"}]}])


@pytest.mark.parametrize("name, expected", [
    ("vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight", "vision_tower.encoder.layers.0.mlp.fc1.weight"),
    ("model.vision_tower.embeddings.class_embedding", "vision_tower.embeddings.class_embedding"),
    ("model.language_model.layers.0.self_attn.q_proj.weight", "language_model.model.layers.0.self_attn.q_proj.weight"),
    ("lm_head.weight", "language_model.lm_head.weight"),
    ("language_model.model.norm.weight", "language_model.model.norm.weight"),
    ("multi_modal_projector.linear_1.bias", "multi_modal_projector.linear_1.bias"),
])
def test_llava_checkpoint_layouts_map_to_one_naming(name, expected):
    assert normalize_llava_name(name) == expected


@pytest.mark.parametrize(("name", "expected"), [
    ("visual.blocks.0.attn.qkv.weight", "visual.blocks.0.attn.qkv.weight"),  # the original layout
    ("model.layers.0.mlp.up_proj.weight", "language_model.model.layers.0.mlp.up_proj.weight"),
    ("lm_head.weight", "language_model.lm_head.weight"),
    ("model.visual.merger.mlp.0.bias", "visual.merger.mlp.0.bias"),  # transformers 5's
    ("model.language_model.norm.weight", "language_model.model.norm.weight"),
])
def test_qwen2_vl_checkpoint_layouts_map_to_one_naming(name, expected):
    assert normalize_qwen2_vl_name(name) == expected


def test_a_base64_data_url_is_its_image_and_bad_ones_name_the_field():
    import base64

    png = b"\x89PNG\r\n\x1a\n fake but bytes"
    raw, key = load_image("data:image/png;base64," + base64.b64encode(png).decode(), "images[0]")
    assert raw == png and key == image_hash(png)  # the same cache key as the bytes themselves
    encoded = base64.b64encode(png).decode()
    for header in ("data:Image/PNG;BASE64,", "data:application/octet-stream;base64,", "data:;base64,"):
        assert load_image(header + encoded, "images[1]")[0] == png  # media types as vLLM takes them
    for url, match in [("data:text/plain;base64,aGk=", "data:image/<type>;base64"),
                       ("data:image/png,rawtext", "data:image/<type>;base64"),
                       ("data:image/png;base64,@@@", "base64 is invalid"),
                       ("https://example.com/a.png", "URLs are not fetched")]:
        with pytest.raises(InvalidRequestError, match=match) as info:
            load_image(url, "images[3]")
        assert info.value.field == "images[3]"


def test_a_str_that_is_no_file_is_named_short_with_the_data_url_it_may_have_meant():
    """A bare base64 string (a data: URL without its header) is read as a path: its error quotes the start of it and
    says what a str is (until 2026-12-07 the whole string, 133 kB of exception for a 100 kB image)."""
    import base64

    from asyncllm.mm.audios import read_audio
    from asyncllm.mm.videos import read_video

    bare = base64.b64encode(b"x" * 100_000).decode()
    for read, hint in [(lambda v: load_image(v, "f"), "data:image/<type>;base64,"),
                       (lambda v: read_video(v, "f", 10**6), "data:video/<type>;base64,"),
                       (lambda v: read_audio(v, "f", 16_000), "data:audio/<type>;base64,")]:
        with pytest.raises(InvalidRequestError, match=hint) as info:
            read(bare)
        assert info.value.field == "f" and len(str(info.value)) < 400 and bare[:60] in str(info.value)


def test_both_processor_cache_types_are_accepted_and_others_refused():
    assert EngineConfig.create("m", mm_processor_cache_type="shm").multimodal_config.mm_processor_cache_type == "shm"
    with pytest.raises(ConfigError, match="mm_processor_cache_type='disk'") as info:
        EngineConfig.create("m", mm_processor_cache_type="disk")
    assert not isinstance(info.value, NotBuiltError)


def test_mm_max_image_pixels_stays_within_pils_bomb_limit_which_names_it_when_met(monkeypatch):
    """PIL refuses an image over 2 x its ``MAX_IMAGE_PIXELS`` before ours is read: a larger setting is a ConfigError
    where the host prepares a multimodal model (never silently PIL's), not in the config, which the core rebuilds in
    a fresh interpreter with PIL's default; an image PIL refuses names ours."""
    import io

    from PIL import Image

    default_bound = 2 * Image.MAX_IMAGE_PIXELS
    above_default = EngineConfig.create("m", mm_max_image_pixels=default_bound + 1)
    rebuilt = EngineConfig.from_dict(above_default.to_dict(wire=True))  # the core's rebuild: no PIL check
    assert rebuilt.multimodal_config.mm_max_image_pixels == default_bound + 1
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    check_max_image_pixels(2000)
    with pytest.raises(ConfigError, match=r"mm_max_image_pixels=2001.*at most 2000, PIL's decompression-bomb limit"):
        check_max_image_pixels(2001)
    encoded = io.BytesIO()
    Image.new("RGB", (64, 64)).save(encoded, format="PNG")
    with pytest.raises(InvalidRequestError, match=r"^images\[0\]: the image is too large: .*\(mm_max_image_pixels=2000\)$"):
        decode_image(encoded.getvalue(), "images[0]", 2000)


class _FakeModel:
    """Embeddings = the token id; an image's features = its first pixel + row index (2 rows per image)."""

    def __init__(self) -> None:
        self.encoded: list[int] = []

    def embed_input_ids(self, input_ids):
        return input_ids.float().unsqueeze(1)

    def embed_multimodal(self, pixels):
        import torch

        self.encoded += [int(p.flatten()[0]) for p in pixels]
        return pixels.flatten(1)[:, :1].unsqueeze(1) + torch.arange(2.0).view(1, 2, 1)


def test_an_image_split_across_steps_is_encoded_once_and_scattered_row_by_row():
    import numpy as np
    import torch

    from asyncllm.mm.embeddings import EncoderOutputCache, ScheduledSpan

    def image(value: float, offset: int) -> MultiModalItem:
        return MultiModalItem(f"h{value}", offset, 2, np.full(4, value, np.float32).tobytes(), [4], "float32")

    model = _FakeModel()
    cache = EncoderOutputCache(model, torch.device("cpu"))
    cache.add_request("a", [image(100.0, 1), image(200.0, 3)])  # prompt: t I I J J t
    step1 = cache.inputs_embeds(torch.tensor([9, 7, 0]), [ScheduledSpan("a", 0, 2, 1)])  # another request's token first
    assert step1.flatten().tolist() == [9.0, 7.0, 100.0]  # the chunk ends inside the first image
    step2 = cache.inputs_embeds(torch.tensor([0, 0, 0]), [ScheduledSpan("a", 2, 3, 0)])
    assert step2.flatten().tolist() == [101.0, 200.0, 201.0]
    assert model.encoded == [100, 200] and len(cache.store) == 0  # each once; no budget: freed once the prefill passed them
    assert cache.inputs_embeds(torch.tensor([5]), [ScheduledSpan("a", 5, 1, 0)]) is None  # past every image
    cache.remove_request("a")
    assert cache.items == {}


def test_palette_images_key_on_their_palette_and_a_truncated_lazy_one_is_a_decode_error():
    import io

    from PIL import Image

    indices = Image.frombytes("L", (8, 8), bytes(range(4)) * 16)
    first, second = indices.convert("P"), indices.convert("P")
    first.putpalette([0, 0, 0, 255, 0, 0, 0, 255, 0, 0, 0, 255])
    second.putpalette([255, 255, 255, 10, 200, 30, 90, 0, 250, 200, 200, 0])
    assert first.tobytes() == second.tobytes()  # the same indices: only the palettes differ
    assert image_hash(first) != image_hash(second) and image_hash(first) == image_hash(first.copy())
    encoded = io.BytesIO()
    indices.convert("RGB").save(encoded, format="PNG")
    truncated = Image.open(io.BytesIO(encoded.getvalue()[:60]))  # PIL reads the header only until it loads
    with pytest.raises(InvalidRequestError, match="cannot decode the image") as info:
        load_image(truncated, "images[1]")
    assert info.value.field == "images[1]"
    big = io.BytesIO()
    Image.new("RGB", (64, 64)).save(big, format="PNG")
    lazy = Image.open(io.BytesIO(big.getvalue()))
    with pytest.raises(InvalidRequestError) as info:  # refused by its header, before a pixel is decoded to hash it
        load_image(lazy, "images[2]", max_pixels=1000)
    assert str(info.value) == "images[2]: the image is 64x64 = 4096 pixels, over mm_max_image_pixels=1000"
    assert lazy._im is None  # never loaded (PIL decodes on the first pixel access)


def test_an_undecodable_image_is_named_without_a_python_object_repr():
    """PIL's "cannot identify image file <_io.BytesIO object at 0x...>" reaches the client as its reason alone."""
    import io

    from PIL import Image

    encoded = io.BytesIO()
    Image.frombytes("L", (64, 64), bytes(range(256)) * 16).save(encoded, format="PNG")
    truncated = encoded.getvalue()[:len(encoded.getvalue()) // 2]
    for raw in (b"not an image at all", b"\x89PNG\r\n\x1a\n fake", truncated):
        with pytest.raises(InvalidRequestError) as info:
            decode_image(raw, "messages[0].content[1]", 10**6)
        message = str(info.value)
        assert info.value.field == "messages[0].content[1]" and "object at 0x" not in message, message
        assert message.startswith("messages[0].content[1]: cannot decode the image: its bytes are not a decodable "
                                  "image ("), message
    with pytest.raises(InvalidRequestError, match=r"not a decodable image \(cannot identify image file\)$"):
        decode_image(b"not an image at all", "images[0]", 10**6)


def _transparent(mode: str):
    """A PIL image of ``mode`` with transparent pixels: RGBA, LA (alpha 0 over half), P with a tRNS index."""
    import io

    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(3)
    if mode == "P":
        quantized = Image.fromarray(rng.integers(0, 256, size=(12, 10, 3), dtype=np.uint8)).quantize(8)
        encoded = io.BytesIO()
        quantized.save(encoded, format="PNG", transparency=0)
        return Image.open(io.BytesIO(encoded.getvalue()))
    pixels = rng.integers(0, 256, size=(12, 10, len(mode)), dtype=np.uint8)
    pixels[:, :5, -1] = 0
    return Image.fromarray(pixels, mode)


@pytest.mark.parametrize("mode", ["RGBA", "LA", "P"])
def test_transparency_is_composited_onto_white_as_transformers_and_keys_the_image(mode):
    import numpy as np
    from transformers.image_transforms import convert_to_rgb

    from asyncllm.mm.videos import read_video

    image = _transparent(mode)
    want = convert_to_rgb(image, return_numpy=True)
    assert (want == 255).all(axis=-1).any()  # some pixels are transparent: white, not their colour
    assert np.array_equal(np.asarray(decode_image(image, "images[0]", 10**6)), want)
    assert np.array_equal(read_video([image, image], "videos[0]", 10**6).frames[1], want)
    if mode == "P":  # the same indices and palette, another transparent index: another image
        other = image.copy()
        other.info["transparency"] = 1
        assert image_hash(other) != image_hash(image)


def test_a_numpy_array_of_pixels_is_its_image_as_vllm_takes_it():
    """(H, W, 3) / (H, W, 4) / (H, W) uint8 arrays are images (keyed as the same PIL image); other arrays are refused
    naming the field."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(0).integers(0, 256, size=(6, 9, 3), dtype=np.uint8)
    raw, key = load_image(pixels, "images[0]")
    assert isinstance(raw, Image.Image) and raw.size == (9, 6) and key == image_hash(Image.fromarray(pixels))
    assert load_image(pixels[:, :, 0], "images[0]")[0].mode == "L"
    assert load_image(np.dstack([pixels, pixels[:, :, :1]]), "images[0]")[0].mode == "RGBA"
    for bad in (pixels.astype(np.float32), pixels[None], np.zeros((4, 4, 2), np.uint8)):
        with pytest.raises(InvalidRequestError, match="uint8 pixels") as info:
            load_image(bad, "images[2]")
        assert info.value.field == "images[2]"
