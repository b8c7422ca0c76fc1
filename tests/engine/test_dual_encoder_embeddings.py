"""CLIP (``CLIPModel``) and SigLIP (``SiglipModel``) as embedding models: a prompt's text or its one image, each
equal to transformers' ``get_text_features`` / ``get_image_features``, whatever shares the step, over prefill chunks
and cached blocks."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import pytest_asyncio
from clip_utils import hf_image_embedding, hf_siglip_embeddings, hf_text_rows, make_tiny_clip, make_tiny_siglip
from mm_utils import make_image

from asyncllm import AsyncEngine, PoolingParams
from asyncllm.errors import InvalidRequestError

pytestmark = pytest.mark.asyncio(loop_scope="module")

RAW = PoolingParams(normalize=False)
LONG = "a photo of a cat and a dog in the sea"  # 19 tokens: three 8-token chunks


@pytest.fixture(scope="module")
def tiny_clip(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_clip(tmp_path_factory.mktemp("clip"))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tiny_clip: str):
    async with AsyncEngine(tiny_clip, disable_log_stats=True, block_size=4, max_num_batched_tokens=8, max_num_seqs=4,
                           enable_prefix_caching=True, dtype="float32") as engine:
        yield engine


def unit(vector) -> np.ndarray:
    vector = np.asarray(vector, dtype=np.float64)
    return vector / np.linalg.norm(vector)


async def test_text_is_transformers_projected_last_row_over_chunks_and_cached_blocks(engine, tiny_clip):
    """The last row's projected final hidden state (vLLM's LAST pooling), 24 floats (``projection_dim``, not the
    text width 48), normalized by default; split across 8-token chunks, then again from cached blocks."""
    raw = await engine.embed(LONG, RAW)
    rows, _ = hf_text_rows(tiny_clip, raw.prompt_token_ids)
    assert len(raw.prompt_token_ids) > 16 and len(raw.embedding) == 24
    np.testing.assert_allclose(raw.embedding, rows[-1].numpy(), rtol=0, atol=1e-5)
    normalized = await engine.embed(LONG)
    assert normalized.num_cached_tokens > 0
    np.testing.assert_allclose(normalized.embedding, unit(rows[-1].numpy()), rtol=0, atol=1e-6)


async def test_a_prompt_ending_in_eos_is_get_text_features(engine, tiny_clip):
    """CLIP's tokenizer ends a text with EOS, where transformers pools: such a prompt's embedding is its
    ``get_text_features``."""
    ids = (await engine.embed("a photo of a cat", RAW)).prompt_token_ids + [engine.tokenizer.eos_token_id]
    out = await engine.embed({"prompt_token_ids": ids}, RAW)
    _, pooled = hf_text_rows(tiny_clip, ids)
    np.testing.assert_allclose(out.embedding, pooled.numpy(), rtol=0, atol=1e-5)


async def test_an_image_is_get_image_features_in_both_prompt_forms(engine, tiny_clip):
    """vLLM's ``{"prompt": "", "multi_modal_data": {"image": ...}}`` and asyncllm's ``images``: one row, the image's
    ``get_image_features``; a second image differs."""
    image, other = make_image(40, 30, seed=1), make_image(32, 48, seed=2)
    vllm_form = await engine.embed({"prompt": "", "multi_modal_data": {"image": image}}, RAW)
    ours = await engine.embed({"prompt": "", "images": [image]})
    assert vllm_form.prompt_token_ids == [0] and len(vllm_form.embedding) == 24
    expected = hf_image_embedding(tiny_clip, image).numpy()
    np.testing.assert_allclose(vllm_form.embedding, expected, rtol=0, atol=1e-5)
    np.testing.assert_allclose(ours.embedding, unit(expected), rtol=0, atol=1e-6)
    np.testing.assert_allclose((await engine.embed({"prompt": "", "images": [other]}, RAW)).embedding,
                               hf_image_embedding(tiny_clip, other).numpy(), rtol=0, atol=1e-5)
    by_ids = await engine.embed({"prompt_token_ids": [], "images": [image]}, RAW)  # no ids at all: the image alone
    np.testing.assert_allclose(by_ids.embedding, vllm_form.embedding, rtol=0, atol=1e-6)


async def test_texts_and_images_sharing_steps_are_as_alone(engine, tiny_clip):
    """Image rows next to text rows in one step (and texts holding token 0, the image placeholder's id: here the
    tokenizer's BOS): each as transformers gives it alone."""
    images = [make_image(36, 36, seed=seed) for seed in (3, 4)]
    texts = [LONG.upper(), "a dog!", "tree"]
    prompts = [*({"prompt": "", "images": [image]} for image in images), *texts,
               {"prompt_token_ids": [1, 0, 5, 0]}]
    outs = await asyncio.gather(*(engine.embed(prompt, RAW) for prompt in prompts))
    for image, out in zip(images, outs):
        np.testing.assert_allclose(out.embedding, hf_image_embedding(tiny_clip, image).numpy(), rtol=0, atol=1e-5)
    for out in outs[len(images):]:
        rows, _ = hf_text_rows(tiny_clip, out.prompt_token_ids)
        np.testing.assert_allclose(out.embedding, rows[-1].numpy(), rtol=0, atol=1e-5)


@pytest.mark.parametrize(("prompt", "field", "words"), [
    ({"prompt": "a cat", "images": ["IMAGE"]}, "prompt", "not both"),
    ({"prompt": "", "images": ["IMAGE", "IMAGE"]}, "prompt.images", "one image per prompt"),
    ({"prompt_token_ids": []}, "prompt", "empty"),
])
async def test_text_with_an_image_two_images_or_nothing_are_refused_by_name(engine, prompt, field, words):
    """vLLM's rule (text or one image, not both), and no tokens without an image; the engine serves on (an empty
    text, ``""`` or ``{"prompt": ""}``, is the tokenizer's special tokens: the test below)."""
    image = make_image(32, 32, seed=5)
    prompt = {**prompt, **({"images": [image] * len(prompt["images"])} if "images" in prompt else {})}
    with pytest.raises(InvalidRequestError) as info:
        await engine.embed(prompt)
    assert info.value.field == field and words in info.value.message
    assert len((await engine.embed("still here")).embedding) == 24


async def test_an_empty_text_is_its_special_tokens(engine):
    """``{"prompt": ""}`` is the bare ``""`` (vLLM's TextPrompt): the tokenizer's special tokens, embedded as text."""
    bare, as_dict = await engine.embed("", RAW), await engine.embed({"prompt": ""}, RAW)
    assert as_dict.prompt_token_ids == bare.prompt_token_ids and len(bare.prompt_token_ids) >= 1
    np.testing.assert_array_equal(as_dict.embedding, bare.embedding)


async def test_pixels_the_tower_cannot_take_and_videos_are_refused_by_name(engine):
    """Processor settings that change the image's size (CLIP's position embeddings are fixed) are refused on the
    host, naming ``mm_processor_kwargs`` (the worker failed, before); a video with an empty prompt names videos."""
    image = make_image(40, 30, seed=1)
    with pytest.raises(InvalidRequestError, match="32x42 pixels; CLIP takes 32x32") as info:
        await engine.embed({"prompt": "", "images": [image], "mm_processor_kwargs": {"do_center_crop": False}})
    assert info.value.field == "mm_processor_kwargs"
    with pytest.raises(InvalidRequestError, match="takes no videos") as info:
        await engine.embed({"prompt": "", "videos": [[image]]})
    assert info.value.field == "prompt.videos"
    with pytest.raises(InvalidRequestError, match="must be a list of images") as info:  # one array, not a list
        await engine.embed({"prompt": "", "images": np.zeros((32, 32, 3), dtype=np.uint8)})
    assert info.value.field == "prompt.images"
    assert len((await engine.embed({"prompt": "", "images": [image]})).embedding) == 24


async def test_generation_is_refused(engine):
    with pytest.raises(InvalidRequestError, match="embeddings only|serves"):
        async for _ in engine.stream("a cat"):
            pass


async def test_two_tensor_parallel_ranks_give_transformers_embeddings(tiny_clip):
    """The text decoder sharded over two ranks, the vision tower whole on each (``mm_encoder_tp_mode="data"``; SigLIP's
    test below shards it)."""
    image = make_image(40, 30, seed=1)
    async with AsyncEngine(tiny_clip, disable_log_stats=True, block_size=4, tensor_parallel_size=2,
                           mm_encoder_tp_mode="data", dtype="float32") as engine:
        text, picture = await asyncio.gather(engine.embed(LONG, RAW), engine.embed({"prompt": "", "images": [image]},
                                                                                   RAW))
    rows, _ = hf_text_rows(tiny_clip, text.prompt_token_ids)
    np.testing.assert_allclose(text.embedding, rows[-1].numpy(), rtol=0, atol=1e-5)
    np.testing.assert_allclose(picture.embedding, hf_image_embedding(tiny_clip, image).numpy(), rtol=0, atol=1e-5)


async def test_the_server_embeds_texts_and_image_chats(engine, tiny_clip):
    """``/v1/embeddings``: ``input`` texts, and an image as chat ``messages`` with a chat template that writes the
    messages' text alone (CLIP ships none; the image gets no placeholder text, as vLLM's CLIP)."""
    import base64

    from asgi_helpers import asgi_client

    from asyncllm.integrations.openai_server import create_app

    image = make_image(40, 30, seed=1)
    url = "data:image/png;base64," + base64.b64encode(image).decode()
    template = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
    async with asgi_client(create_app(engine, chat_template=template)) as client:  # --chat-template
        text = await client.post("/v1/embeddings", json={"model": tiny_clip, "input": LONG})
        chat = await client.post("/v1/embeddings", json={
            "model": tiny_clip, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]})
        both = await client.post("/v1/embeddings", json={"model": tiny_clip, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "a cat"}, {"type": "image_url", "image_url": {"url": url}}]}]})
    assert text.status_code == chat.status_code == 200, chat.text
    assert both.status_code == 400 and "not both" in both.json()["error"]["message"], both.text  # the model's rule
    rows, _ = hf_text_rows(tiny_clip, (await engine.embed(LONG, RAW)).prompt_token_ids)
    np.testing.assert_allclose(text.json()["data"][0]["embedding"], unit(rows[-1].numpy()), rtol=0, atol=1e-5)
    np.testing.assert_allclose(chat.json()["data"][0]["embedding"], unit(hf_image_embedding(tiny_clip, image).numpy()),
                               rtol=0, atol=1e-5)



@pytest.fixture(scope="module")
def tiny_siglip(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_siglip(tmp_path_factory.mktemp("siglip"))


async def test_siglip_texts_and_images_are_transformers_features(tiny_siglip):
    """Texts read both ways (each prompt prefilled whole, in steps shared with others and with an image) through the
    text head, again from cached blocks; images through the attention-pooling head; 32 floats (the head's
    ``projection_size``, not the text width 48). A text longer than a step is refused by name."""
    image = make_image(40, 30, seed=1)
    texts = [LONG, "a dog", LONG.upper()]
    async with AsyncEngine(tiny_siglip, disable_log_stats=True, block_size=4, max_num_batched_tokens=48,
                           max_num_seqs=4, enable_prefix_caching=True, dtype="float32") as engine:
        outs = await asyncio.gather(*(engine.embed(text, RAW) for text in texts),
                                    engine.embed({"prompt": "", "multi_modal_data": {"image": image}}, RAW))
        again = await engine.embed(LONG)
        with pytest.raises(InvalidRequestError) as info:
            await engine.embed({"prompt": "a cat", "images": [image]})
    assert again.num_cached_tokens > 0 and info.value.field == "prompt"
    for out in outs[:-1]:
        assert len(out.embedding) == 32
        np.testing.assert_allclose(out.embedding, hf_siglip_embeddings(tiny_siglip, out.prompt_token_ids).numpy(),
                                   rtol=0, atol=1e-5)
    np.testing.assert_allclose(again.embedding, unit(outs[0].embedding), rtol=0, atol=1e-6)
    np.testing.assert_allclose(outs[-1].embedding, hf_siglip_embeddings(tiny_siglip, image=image).numpy(),
                               rtol=0, atol=1e-5)


async def test_siglip_text_longer_than_a_step_and_two_ranks(tiny_siglip):
    """A text read both ways cannot be split across steps: longer than ``max_num_batched_tokens`` it is refused by
    name; over two tensor-parallel ranks (the tower sharded, the pooling head whole) the features are transformers'."""
    image = make_image(40, 30, seed=2)
    async with AsyncEngine(tiny_siglip, disable_log_stats=True, block_size=4, max_num_batched_tokens=8,
                           dtype="float32") as engine:
        with pytest.raises(InvalidRequestError, match="SigLIP's text.*max_num_batched_tokens=8"):
            await engine.embed(LONG)
        assert len((await engine.embed("a dog")).embedding) == 32
    async with AsyncEngine(tiny_siglip, disable_log_stats=True, block_size=4, tensor_parallel_size=2,
                           dtype="float32") as engine:
        text, picture = await asyncio.gather(engine.embed(LONG, RAW), engine.embed({"prompt": "", "images": [image]},
                                                                                   RAW))
    np.testing.assert_allclose(text.embedding, hf_siglip_embeddings(tiny_siglip, text.prompt_token_ids).numpy(),
                               rtol=0, atol=1e-5)
    np.testing.assert_allclose(picture.embedding, hf_siglip_embeddings(tiny_siglip, image=image).numpy(), rtol=0,
                               atol=1e-5)
