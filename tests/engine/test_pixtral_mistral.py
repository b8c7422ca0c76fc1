"""Pixtral-12B and Mistral Small 3.1 as Mistral ships them (params.json with a ``vision_encoder`` section,
consolidated.safetensors, a tekken.json with an image section, no transformers file): chats with images encoded by
mistral_common, prompt ids equal to mistral_common's own encoding of the same chat (vLLM's), greedy tokens equal to
transformers' model on the converted checkpoint given those ids and its Pixtral processor's pixels; the same
checkpoint in transformers' layout under ``tokenizer_mode="mistral"`` too (docs/tokenizers.md)."""

from __future__ import annotations

import base64
import os

import pytest
import pytest_asyncio
from mistral3_utils import make_tiny_mistral3, make_tiny_pixtral_llava
from mistral_utils import mistral_vision_checkpoint
from mm_utils import make_image

from asyncllm import AsyncEngine, InvalidRequestError, SamplingParams

pytestmark = pytest.mark.asyncio(loop_scope="module")

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)

LAYOUTS = {"mistral3-mistral-format": (make_tiny_mistral3, True, 28),
           "mistral3-hf-format": (make_tiny_mistral3, False, 28),
           "pixtral-12b-mistral-format": (make_tiny_pixtral_llava, True, 14)}
"""checkpoint -> (maker, Mistral's format, pixels of an image token)."""


@pytest.fixture(scope="module", params=list(LAYOUTS))
def checkpoint(request, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str, int]:
    """(the folder served, the transformers folder of the same weights, pixels of an image token)."""
    make, mistral_format, unit = LAYOUTS[request.param]
    hf = make(tmp_path_factory.mktemp("hf"), seed=3, tekken=True)
    served = mistral_vision_checkpoint(hf, str(tmp_path_factory.mktemp("mistral"))) if mistral_format else hf
    return served, hf, unit


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(checkpoint):
    async with AsyncEngine(checkpoint[0], tokenizer_mode="mistral", disable_log_stats=True, block_size=4,
                           max_num_batched_tokens=32, limit_mm_per_prompt={"image": 2}) as engine:
        yield engine


def _url(image: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(image).decode()


def mistral_common_ids(path: str, messages: list[dict]) -> list[int]:
    """mistral_common's own encoding of the chat, the images read and resized by it (vLLM's under this mode)."""
    from mistral_common.protocol.instruct.request import ChatCompletionRequest
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

    tokenizer = MistralTokenizer.from_file(os.path.join(path, "tekken.json"))
    return tokenizer.encode_chat_completion(ChatCompletionRequest.from_openai(messages)).tokens


def hf_greedy(path: str, prompt_ids: list[int], images: list[bytes], unit: int) -> list[int]:
    """transformers' model on ``prompt_ids`` with its Pixtral processor's pixels (patches of ``unit`` pixels)."""
    import io

    import torch
    from PIL import Image
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    pil = [Image.open(io.BytesIO(image)).convert("RGB") for image in images]
    inputs = dict(AutoImageProcessor.from_pretrained(path)(images=pil, return_tensors="pt", patch_size=unit))
    inputs["input_ids"] = torch.tensor([prompt_ids])
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=GREEDY.max_tokens, do_sample=False)
    return out[0, len(prompt_ids):].tolist()


async def test_chat_with_images_equals_mistral_common_and_transformers(engine, checkpoint) -> None:
    served, hf, unit = checkpoint
    images = [make_image(84, 56, seed=1), make_image(150, 90, seed=2)]  # the second one downscaled to 112 wide
    messages = [{"role": "system", "content": "Answer briefly."},
                {"role": "user", "content": [{"type": "text", "text": "Compare"},
                                             {"type": "image_url", "image_url": {"url": _url(images[0])}},
                                             {"type": "text", "text": "with"},
                                             {"type": "image_url", "image_url": {"url": _url(images[1])}}]}]
    stream = engine.chat(messages, GREEDY)
    tokens = [t for d in [d async for d in stream] for t in d.token_ids]
    prompt_ids = stream.collector.prompt_token_ids
    assert prompt_ids == mistral_common_ids(served, messages) and prompt_ids.count(10) > 8
    assert tokens == hf_greedy(hf, prompt_ids, images, unit)


async def test_an_image_after_the_text_goes_first_as_mistral_common_puts_it(engine, checkpoint) -> None:
    image = make_image(40, 70, seed=4)
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                             {"type": "image_url", "image_url": {"url": _url(image)}}]}]
    stream = engine.chat(messages, GREEDY)
    tokens = [t for d in [d async for d in stream] for t in d.token_ids]
    prompt_ids = stream.collector.prompt_token_ids
    assert prompt_ids == mistral_common_ids(checkpoint[0], messages) and prompt_ids[2] == 10  # <s>[INST][IMG]...
    assert tokens == hf_greedy(checkpoint[1], prompt_ids, [image], checkpoint[2])
    one_each = prompt_ids[:3] + [t for t in prompt_ids[3:] if t not in (10, 12, 13)]  # the image as one [IMG]
    out = await engine.generate({"prompt_token_ids": one_each, "multi_modal_data": {"image": [image]}}, GREEDY)
    assert one_each.count(10) == 1 and out.prompt_token_ids == prompt_ids and out.outputs[0].token_ids == tokens


async def test_video_parts_are_refused_and_the_engine_serves_on(engine) -> None:
    video = {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}
    with pytest.raises(InvalidRequestError):
        _ = [d async for d in engine.chat([{"role": "user", "content": [video]}], GREEDY)]
    assert len([d async for d in engine.chat([{"role": "user", "content": "hello"}], GREEDY)]) > 0


async def test_mistral_commons_own_prompt_ids_with_their_rows_are_served_as_vllm_does(engine, checkpoint) -> None:
    """vLLM's offline Pixtral prompts: mistral_common's encoding (each image's rows written out) as
    prompt_token_ids beside the images; rows that differ from the engine's for that image are refused."""
    image = make_image(84, 56, seed=6)
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _url(image)}},
                                             {"type": "text", "text": "Describe it"}]}]
    encoded = mistral_common_ids(checkpoint[0], messages)
    out = await engine.generate({"prompt_token_ids": encoded, "multi_modal_data": {"image": [image]}}, GREEDY)
    assert out.prompt_token_ids == encoded and out.outputs[0].token_ids == hf_greedy(checkpoint[1], encoded, [image],
                                                                                     checkpoint[2])
    short = encoded[:3] + encoded[4:]  # a row one [IMG] short
    with pytest.raises(InvalidRequestError, match="mistral_common"):
        await engine.generate({"prompt_token_ids": short, "multi_modal_data": {"image": [image]}}, GREEDY)


async def test_processor_settings_it_does_not_read_are_refused(checkpoint) -> None:
    """A key of mm_processor_kwargs the Pixtral processor does not read (a typo, params.json's own name) is refused
    as for a checkpoint in transformers' layout; one it reads is taken."""
    from asyncllm import ConfigError

    for kwargs in ({"do_rezise": False}, {"max_image_size": 56}):
        with pytest.raises(ConfigError, match=next(iter(kwargs))):
            async with AsyncEngine(checkpoint[0], tokenizer_mode="mistral", mm_processor_kwargs=kwargs):
                pass
    async with AsyncEngine(checkpoint[0], tokenizer_mode="mistral", mm_processor_kwargs={
            "size": {"longest_edge": 56}}, disable_log_stats=True) as small:
        stream = small.chat([{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": _url(make_image(112, 112, seed=7))}}]}], GREEDY)
        _ = [d async for d in stream]
    assert stream.collector.prompt_token_ids.count(10) == (56 // checkpoint[2]) ** 2
