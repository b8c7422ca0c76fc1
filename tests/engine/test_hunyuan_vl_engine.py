"""HunYuan VL (``HunYuanVLForConditionalGeneration``, HunyuanOCR's architecture) end to end: prompt ids and greedy
tokens equal transformers' with an image split across prefill chunks, two images of different shapes beside a
text-only request, a prefix-cache hit, chat (a "string" chat's markers too), two tensor-parallel ranks, videos
refused; three-axis XD-RoPE too; its tower and merger equal transformers';
XD-RoPE positions shown to matter; two pipeline stages; LoRA adapters on the decoder equal PEFT's."""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio
from engine_helpers import assert_chat_image_part_equals_transformers
from hunyuan_vl_utils import IMAGE, IMAGE_PLACEHOLDER, hf_hunyuan_vl_greedy, hf_hunyuan_vl_inputs, make_tiny_hunyuan_vl
from mm_utils import make_image
from qwen_vl_utils import make_video

from asyncllm import AsyncEngine, InvalidRequestError, SamplingParams

pytestmark = pytest.mark.asyncio(loop_scope="module")

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
BUDGET = 8
"""max_num_batched_tokens: fewer than every image's placeholders, so each image is split across steps."""
TWO_IMAGES = f"{IMAGE_PLACEHOLDER} then {IMAGE_PLACEHOLDER} and the end"


def _two_images() -> list[bytes]:
    return [make_image(60, 200, seed=2), make_image(150, 60, seed=3)]  # tall and wide, different grids


@pytest.fixture(scope="module")
def hunyuan_vl(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_hunyuan_vl(tmp_path_factory.mktemp("hunyuan_vl"))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(hunyuan_vl: str):
    async with AsyncEngine(hunyuan_vl, disable_log_stats=True, block_size=4, max_num_batched_tokens=BUDGET,
                           max_num_seqs=4, enable_prefix_caching=True) as engine:
        yield engine


async def test_one_image_matches_transformers_with_the_image_split_across_chunks(engine, hunyuan_vl):
    image = make_image(120, 90, seed=1)
    text = f"Describe {IMAGE_PLACEHOLDER} please"
    out = await engine.generate({"prompt": text, "images": [image]}, GREEDY)
    hf_prompt, hf_tokens = hf_hunyuan_vl_greedy(hunyuan_vl, text, [image], 8)
    assert out.prompt_token_ids == hf_prompt
    # a 12 x 16 patch grid: 6 rows of 8 merged patches and a newline, the begin and end rows
    assert hf_prompt.count(engine.tokenizer.convert_tokens_to_ids(IMAGE)) == 6 * 9 + 2 > BUDGET
    assert out.outputs[0].token_ids == hf_tokens
    vllm_style = await engine.generate({"prompt": text, "multi_modal_data": {"image": image}}, GREEDY)
    assert vllm_style.outputs[0].token_ids == hf_tokens


async def test_images_of_different_sizes_in_a_batch_with_text_and_a_prefix_hit_match_transformers(engine, hunyuan_vl):
    images = _two_images()
    prompts = [{"prompt": TWO_IMAGES, "images": images}, "a text prompt with no image at all"]
    outs = await asyncio.gather(*(engine.generate(p, GREEDY) for p in prompts))
    again = await engine.generate(prompts[0], GREEDY)  # its prefix, images included, from the cache
    hf_prompt, hf_tokens = hf_hunyuan_vl_greedy(hunyuan_vl, TWO_IMAGES, images, 8)
    hf_text_prompt, hf_text = hf_hunyuan_vl_greedy(hunyuan_vl, prompts[1], [], 8)
    assert [o.prompt_token_ids for o in outs] == [hf_prompt, hf_text_prompt]
    assert [o.outputs[0].token_ids for o in outs] == [hf_tokens, hf_text]
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == hf_tokens


async def test_chat_messages_with_an_image_part_match_transformers(engine, hunyuan_vl):
    await assert_chat_image_part_equals_transformers(
        engine, make_image(90, 90, seed=5), lambda *args, **kwargs: hf_hunyuan_vl_greedy(hunyuan_vl, *args, **kwargs))


async def test_a_string_chat_writes_the_image_markers_as_vllm(engine, hunyuan_vl):
    """chat_template_content_format="string": an image part becomes the start, image and end tokens (the config's
    ``im_start_id`` / ``im_end_id`` around the marker) and a newline ahead of the text; transformers' tokens."""
    template = "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    image = make_image(60, 60, seed=7)
    part = {"type": "image_url", "image_url": {"url": image}}
    stream = engine.chat([{"role": "user", "content": [part, {"type": "text", "text": "OCR:"}]}], GREEDY,
                         chat_template=template, chat_template_content_format="string")
    tokens = [token for delta in [d async for d in stream] for token in delta.token_ids]
    expected = hf_hunyuan_vl_greedy(hunyuan_vl, f"user: {IMAGE_PLACEHOLDER}\nOCR:\n", [image], 8)
    assert (stream.collector.prompt_token_ids, tokens) == expected


async def test_a_video_is_refused(engine):
    video = (make_video(4, 56, 56, seed=3), {"fps": 2.0, "frames_indices": [0, 1, 2, 3], "total_num_frames": 4})
    with pytest.raises(InvalidRequestError, match="HunYuanVLForConditionalGeneration takes no videos"):
        await engine.generate({"prompt": "Watch", "videos": [video]}, GREEDY)


@pytest.mark.parametrize("mode", ["weights", "data"])
async def test_tensor_parallel_matches_transformers(hunyuan_vl, mode):
    """Two ranks: the decoder sharded, the tower sharded by heads ("weights") or whole on both ("data" deals the
    images out); the merger whole on both; transformers' tokens."""
    images = _two_images()
    async with AsyncEngine(hunyuan_vl, disable_log_stats=True, tensor_parallel_size=2, mm_encoder_tp_mode=mode,
                           max_num_batched_tokens=16) as engine:
        out = await engine.generate({"prompt": TWO_IMAGES, "images": images}, GREEDY)
    assert (out.prompt_token_ids, out.outputs[0].token_ids) == hf_hunyuan_vl_greedy(hunyuan_vl, TWO_IMAGES, images, 8)


async def test_xd_rope_positions_change_transformers_tokens(hunyuan_vl):
    """The engine's tokens are transformers' with its XD-RoPE positions, and not those of plain 1-D positions (so
    the tests above check the positions)."""
    import torch

    images = _two_images()
    prompt, hf_tokens = hf_hunyuan_vl_greedy(hunyuan_vl, TWO_IMAGES, images, 8)
    plain = torch.arange(len(prompt))[None]
    _, hf_plain = hf_hunyuan_vl_greedy(hunyuan_vl, TWO_IMAGES, images, 8, position_ids=plain)
    assert hf_plain != hf_tokens


async def test_three_axis_xd_rope_matches_transformers(tmp_path):
    """A checkpoint whose ``xdrope_section`` has three axes (width, height, image; no sequence axis)."""
    path = make_tiny_hunyuan_vl(tmp_path / "hunyuan_vl3", sections=(4, 2, 2))
    images = _two_images()
    async with AsyncEngine(path, disable_log_stats=True, block_size=4, max_num_batched_tokens=BUDGET) as engine:
        out = await engine.generate({"prompt": TWO_IMAGES, "images": images}, GREEDY)
    assert (out.prompt_token_ids, out.outputs[0].token_ids) == hf_hunyuan_vl_greedy(path, TWO_IMAGES, images, 8)


async def test_tower_and_merger_equal_transformers_image_features(hunyuan_vl):
    """Two grids (12 x 16, 24 x 8) against ``get_image_features``, within float32 noise, each image's begin, rows
    with their newlines, and end; a wrong position resampling (nearest) is far off (the merger normalizes rows)."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForImageTextToText

    from asyncllm.models.hunyuan_vl import HunYuanVLForConditionalGeneration, HunYuanVLVisionTower
    from asyncllm.models.layers import TensorParallel

    hf = AutoModelForImageTextToText.from_pretrained(hunyuan_vl, dtype=torch.float32).eval()
    tower = HunYuanVLVisionTower(hf.config.vision_config, TensorParallel(), torch.float32).eval()
    state = {HunYuanVLForConditionalGeneration.normalize_name("model.vision_tower." + k).removeprefix("visual."): v
             for k, v in hf.model.vision_tower.state_dict().items()}
    tower.load_state_dict(state)
    inputs = hf_hunyuan_vl_inputs(hunyuan_vl, f"{IMAGE_PLACEHOLDER} {IMAGE_PLACEHOLDER}",
                                  [make_image(120, 90, seed=1), make_image(60, 200, seed=2)])
    grids = [tuple(g) for g in inputs["image_grid_thw"].tolist()]
    assert grids == [(1, 12, 16), (1, 24, 8)]
    with torch.no_grad():
        expected = hf.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"]).pooler_output
        first = 12 * 16
        ours = [tower(inputs["pixel_values"][:first], [grids[0]]), tower(inputs["pixel_values"][first:], [grids[1]])]
        for mine, theirs in zip(ours, expected, strict=True):
            torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)
        embeddings = tower.embeddings
        resample = embeddings.positions
        embeddings.positions = lambda rows, cols: F.interpolate(
            resample(embeddings.edge, embeddings.edge).T.reshape(1, -1, embeddings.edge, embeddings.edge),
            size=(rows, cols), mode="nearest")[0].flatten(1).T
        assert (tower(inputs["pixel_values"][:first], [grids[0]]) - expected[0]).abs().max() > 0.03


async def test_two_pipeline_stages_match_transformers(tmp_path):
    """The tower and merger on the first stage, one decoder layer on each."""
    path = make_tiny_hunyuan_vl(tmp_path / "hunyuan_vl")
    images, text = [make_image(60, 200, seed=2)], f"{IMAGE_PLACEHOLDER} and the end"
    async with AsyncEngine(path, pipeline_parallel_size=2, disable_log_stats=True, block_size=4,
                           max_num_batched_tokens=BUDGET) as engine:
        out = await engine.generate({"prompt": text, "images": images}, GREEDY)
    assert out.outputs[0].token_ids == hf_hunyuan_vl_greedy(path, text, images, 8)[1]


async def test_lora_adapters_on_the_decoder_equal_peft(tmp_path):
    """PEFT's adapter of the decoder's every projection: with an image, batched with the base model, PEFT's tokens
    and transformers'."""
    from lora_utils import make_adapter
    from transformers import AutoModelForImageTextToText

    from asyncllm import LoRARequest

    path = make_tiny_hunyuan_vl(tmp_path / "hunyuan_vl")
    adapter = make_adapter(path, str(tmp_path / "adapter"), seed=3, rank=4, alpha=8,
                           targets=r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)",
                           auto_class=AutoModelForImageTextToText)
    images, text = [make_image(60, 200, seed=2)], f"{IMAGE_PLACEHOLDER} and the end"
    prompt = {"prompt": text, "images": images}
    async with AsyncEngine(path, enable_lora=True, disable_log_stats=True, block_size=4,
                           max_num_batched_tokens=BUDGET) as engine:
        adapted, base = await asyncio.gather(
            engine.generate(prompt, GREEDY, lora_request=LoRARequest("hy", 1, adapter)),
            engine.generate(prompt, GREEDY))
    assert adapted.outputs[0].token_ids == hf_hunyuan_vl_greedy(path, text, images, 8, adapter=adapter)[1]
    assert base.outputs[0].token_ids == hf_hunyuan_vl_greedy(path, text, images, 8)[1] != adapted.outputs[0].token_ids
