"""PaddleOCR-VL (``PaddleOCRVLForConditionalGeneration``) end to end: prompt ids and greedy tokens equal
transformers' for two images of different grids split across prefill chunks beside a text-only request, and on a
prefix-cache hit; videos refused by name (the tower and projector against transformers': tests/unit/
test_paddleocr_vl.py)."""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio
from mm_utils import make_image
from paddleocr_vl_utils import IMAGE, IMAGE_PLACEHOLDER, hf_paddleocr_vl_greedy, make_tiny_paddleocr_vl
from qwen_vl_utils import make_video

from asyncllm import AsyncEngine, SamplingParams
from asyncllm.errors import InvalidRequestError

pytestmark = pytest.mark.asyncio(loop_scope="module")

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
BUDGET = 8
"""max_num_batched_tokens: fewer than every image's placeholders, so each image is split across steps."""
IMAGES = [make_image(120, 90, seed=1), make_image(60, 200, seed=2)]  # 6 x 8 and 14 x 4 patch grids
TEXT = f"Describe {IMAGE_PLACEHOLDER} then {IMAGE_PLACEHOLDER} in words"


@pytest.fixture(scope="module")
def paddleocr_vl(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_paddleocr_vl(tmp_path_factory.mktemp("paddleocr_vl"))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(paddleocr_vl: str):
    async with AsyncEngine(paddleocr_vl, disable_log_stats=True, block_size=4, max_num_batched_tokens=BUDGET,
                           max_num_seqs=4, enable_prefix_caching=True) as engine:
        yield engine


async def test_images_beside_text_then_a_prefix_hit_match_transformers(engine, paddleocr_vl):
    prompts = [{"prompt": TEXT, "images": IMAGES}, "a text prompt with no image at all"]
    outs = await asyncio.gather(*(engine.generate(p, GREEDY) for p in prompts))
    again = await engine.generate(prompts[0], GREEDY)  # its prefix, images included, from the cache
    expected = [hf_paddleocr_vl_greedy(paddleocr_vl, TEXT, IMAGES, 8),
                hf_paddleocr_vl_greedy(paddleocr_vl, prompts[1], [], 8)]
    assert [(o.prompt_token_ids, o.outputs[0].token_ids) for o in outs] == expected
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == expected[0][1]
    assert expected[0][0].count(engine.tokenizer.convert_tokens_to_ids(IMAGE)) == 12 + 14 > 2 * BUDGET  # 2 x 2 each


async def test_a_single_image_matches_transformers(engine, paddleocr_vl):
    """A square image below the processor's min_pixels (resized up to 4 merged tokens at least)."""
    text = f"{IMAGE_PLACEHOLDER}OCR:"
    image = [make_image(30, 30, seed=4)]
    out = await engine.generate({"prompt": text, "images": image}, GREEDY)
    assert (out.prompt_token_ids, out.outputs[0].token_ids) == hf_paddleocr_vl_greedy(paddleocr_vl, text, image, 8)


async def test_a_video_is_refused(engine):
    video = (make_video(4, 56, 56, seed=3), {"fps": 2.0, "frames_indices": [0, 1, 2, 3], "total_num_frames": 4})
    with pytest.raises(InvalidRequestError, match="PaddleOCRVLForConditionalGeneration takes no videos"):
        await engine.generate({"prompt": "Watch", "videos": [video]}, GREEDY)


async def test_a_requests_max_pixels_bounds_its_image_as_transformers(engine, paddleocr_vl):
    image, text = make_image(200, 150, seed=16), f"small {IMAGE_PLACEHOLDER} please"
    small = {"max_pixels": 28 * 28 * 6}
    default, bounded = await asyncio.gather(
        engine.generate({"prompt": text, "images": [image]}, GREEDY),
        engine.generate({"prompt": text, "images": [image], "mm_processor_kwargs": small}, GREEDY))
    placeholder = engine.tokenizer.convert_tokens_to_ids(IMAGE)
    assert bounded.prompt_token_ids.count(placeholder) <= 6 < default.prompt_token_ids.count(placeholder)
    expected = hf_paddleocr_vl_greedy(paddleocr_vl, text, [image], 8, processor_kwargs=small)
    assert (bounded.prompt_token_ids, bounded.outputs[0].token_ids) == expected


async def test_a_string_chat_writes_the_image_markers_as_vllm(engine, paddleocr_vl):
    """chat_template_content_format="string": an image part becomes ``<|IMAGE_START|><|IMAGE_PLACEHOLDER|>
    <|IMAGE_END|>`` and a newline ahead of the text; prompt ids and tokens equal transformers' over that text."""
    template = "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    image = make_image(60, 60, seed=7)
    part = {"type": "image_url", "image_url": {"url": image}}
    stream = engine.chat([{"role": "user", "content": [part, {"type": "text", "text": "OCR:"}]}], GREEDY,
                         chat_template=template, chat_template_content_format="string")
    tokens = [token for delta in [d async for d in stream] for token in delta.token_ids]
    expected = hf_paddleocr_vl_greedy(paddleocr_vl, f"user: {IMAGE_PLACEHOLDER}\nOCR:\n", [image], 8)
    assert (stream.collector.prompt_token_ids, tokens) == expected


@pytest.mark.parametrize("mode", ["weights", "data"])
async def test_tensor_parallel_matches_transformers(paddleocr_vl, mode):
    """Two ranks: the decoder sharded, the tower sharded by heads ("weights") or whole on both ("data" deals the
    images out); the projector whole on both; transformers' tokens."""
    async with AsyncEngine(paddleocr_vl, disable_log_stats=True, tensor_parallel_size=2, mm_encoder_tp_mode=mode,
                           max_num_batched_tokens=16) as engine:
        out = await engine.generate({"prompt": TEXT, "images": IMAGES}, GREEDY)
    assert (out.prompt_token_ids, out.outputs[0].token_ids) == hf_paddleocr_vl_greedy(paddleocr_vl, TEXT, IMAGES, 8)


async def test_two_pipeline_stages_match_transformers(paddleocr_vl):
    """Two stages (the tower and projector on the first; M-RoPE positions on both) with the images split across
    chunks beside a text prompt; transformers' tokens."""
    prompts = [{"prompt": TEXT, "images": IMAGES}, "a text prompt beside it"]
    async with AsyncEngine(paddleocr_vl, pipeline_parallel_size=2, disable_log_stats=True, block_size=4,
                           max_model_len=128, num_gpu_blocks_override=64, max_num_batched_tokens=24) as engine:
        outs = await asyncio.gather(*(engine.generate(p, GREEDY) for p in prompts))
    assert [o.outputs[0].token_ids for o in outs] == [hf_paddleocr_vl_greedy(paddleocr_vl, TEXT, IMAGES, 8)[1],
                                                      hf_paddleocr_vl_greedy(paddleocr_vl, prompts[1], [], 8)[1]]
