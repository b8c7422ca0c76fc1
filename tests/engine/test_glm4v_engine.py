"""GLM-4.1V (``Glm4vForConditionalGeneration``) end to end: prompt ids and greedy tokens equal transformers' with
images split across prefill chunks, two images of different shapes beside a text-only request, a prefix-cache hit
and chat; its tower equals transformers'; M-RoPE positions shown to matter (videos: test_glm4v_video.py). GLM-4.5V
(``Glm4vMoeForConditionalGeneration``) over its experts."""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio
from engine_helpers import assert_chat_image_part_equals_transformers
from glm4v_utils import IMAGE, IMAGE_PLACEHOLDER, hf_glm4v_greedy, hf_glm4v_inputs, make_image, make_tiny_glm4v

from asyncllm import AsyncEngine, SamplingParams

pytestmark = pytest.mark.asyncio(loop_scope="module")

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
BUDGET = 8
"""max_num_batched_tokens: fewer than every image's placeholders, so each image is split across steps."""


@pytest.fixture(scope="module")
def glm4v(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_glm4v(tmp_path_factory.mktemp("glm4v"))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(glm4v: str):
    async with AsyncEngine(glm4v, disable_log_stats=True, block_size=4, max_num_batched_tokens=BUDGET,
                           max_num_seqs=4, enable_prefix_caching=True) as engine:
        yield engine


async def test_one_image_matches_transformers_with_the_image_split_across_chunks(engine, glm4v):
    image = make_image(120, 90, seed=1)
    text = f"Describe {IMAGE_PLACEHOLDER} please"
    out = await engine.generate({"prompt": text, "images": [image]}, GREEDY)
    hf_prompt, hf_tokens = hf_glm4v_greedy(glm4v, text, [image], 8)
    assert out.prompt_token_ids == hf_prompt
    assert hf_prompt.count(engine.tokenizer.convert_tokens_to_ids(IMAGE)) == 12 > BUDGET  # a 6 x 8 patch grid
    assert out.outputs[0].token_ids == hf_tokens
    vllm_style = await engine.generate({"prompt": text, "multi_modal_data": {"image": image}}, GREEDY)
    assert vllm_style.outputs[0].token_ids == hf_tokens


async def test_images_of_different_sizes_in_a_batch_with_text_and_a_prefix_hit_match_transformers(engine, glm4v):
    images = [make_image(60, 200, seed=2), make_image(150, 60, seed=3)]  # tall and wide, different grids
    text = f"{IMAGE_PLACEHOLDER} then {IMAGE_PLACEHOLDER} and the end"
    prompts = [{"prompt": text, "images": images}, "a text prompt with no image at all"]
    outs = await asyncio.gather(*(engine.generate(p, GREEDY) for p in prompts))
    again = await engine.generate(prompts[0], GREEDY)  # its prefix, images included, from the cache
    hf_prompt, hf_tokens = hf_glm4v_greedy(glm4v, text, images, 8)
    hf_text_prompt, hf_text = hf_glm4v_greedy(glm4v, prompts[1], [], 8)
    assert [o.prompt_token_ids for o in outs] == [hf_prompt, hf_text_prompt]
    assert [o.outputs[0].token_ids for o in outs] == [hf_tokens, hf_text]
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == hf_tokens


async def test_chat_messages_with_an_image_part_match_transformers(engine, glm4v):
    await assert_chat_image_part_equals_transformers(
        engine, make_image(90, 90, seed=5), lambda *args, **kwargs: hf_glm4v_greedy(glm4v, *args, **kwargs))


async def test_mrope_positions_change_transformers_tokens(engine, glm4v):
    """The engine's tokens are transformers' with its M-RoPE positions, and not those of plain 1-D positions (so
    the test above checks the positions)."""
    import torch

    images = [make_image(60, 200, seed=2), make_image(150, 60, seed=3)]
    text = f"{IMAGE_PLACEHOLDER} then {IMAGE_PLACEHOLDER} and the end"
    prompt, hf_tokens = hf_glm4v_greedy(glm4v, text, images, 8)
    plain = torch.arange(len(prompt))[None]
    _, hf_plain = hf_glm4v_greedy(glm4v, text, images, 8, position_ids=plain)
    assert hf_plain != hf_tokens


async def test_tower_equals_transformers_image_features(glm4v):
    """Two grids (6 x 8, 14 x 4) against ``get_image_features``, within float32 noise; without the position table's
    bicubic resampling (the table read at the patch's own row and column) the features are far off."""
    import torch
    from transformers import AutoModelForImageTextToText

    from asyncllm.models.glm4v_vision import Glm4vVisionTower
    from asyncllm.models.layers import TensorParallel

    hf = AutoModelForImageTextToText.from_pretrained(glm4v, dtype=torch.float32).eval()
    tower = Glm4vVisionTower(hf.config.vision_config, TensorParallel(), torch.float32)
    tower.load_state_dict(hf.model.visual.state_dict())
    inputs = hf_glm4v_inputs(glm4v, f"{IMAGE_PLACEHOLDER} {IMAGE_PLACEHOLDER}",
                             [make_image(120, 90, seed=1), make_image(60, 200, seed=2)])
    grids = inputs["image_grid_thw"].tolist()
    assert grids == [[1, 6, 8], [1, 14, 4]]
    with torch.no_grad():
        expected = torch.cat(hf.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"]).pooler_output)
        ours = tower.eval()(inputs["pixel_values"], grids)
        torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-4)
        tower.embeddings.forward = lambda hidden, positions, sizes: hidden + _table_at(tower, positions)
        assert (tower(inputs["pixel_values"], grids) - expected).abs().max() > 0.1


def _table_at(tower, positions):
    """The 4 x 4 table read at each patch's (row, col), clamped: no resampling to the image's grid."""
    table = tower.embeddings.position_embedding.weight
    side = 4
    rows, cols = positions.clamp(max=side - 1).unbind(-1)
    return table[rows * side + cols]


@pytest.mark.parametrize("moe", [False, True])
async def test_two_pipeline_stages_match_transformers(tmp_path, moe: bool):
    """The tower on the first stage, one decoder layer (GLM-4's, or GLM-4.5's experts) on each."""
    path = make_tiny_glm4v(tmp_path / "glm4v", moe=moe)
    images, text = [make_image(60, 200, seed=2)], f"{IMAGE_PLACEHOLDER} and the end"
    async with AsyncEngine(path, pipeline_parallel_size=2, disable_log_stats=True, block_size=4,
                           max_num_batched_tokens=BUDGET) as engine:
        out = await engine.generate({"prompt": text, "images": images}, GREEDY)
    assert out.outputs[0].token_ids == hf_glm4v_greedy(path, text, images, 8)[1]


@pytest.mark.parametrize("moe", [False, True])
async def test_lora_adapters_on_the_decoder_equal_peft(tmp_path, moe: bool):
    """PEFT's adapter of the decoder: GLM-4.1V's every projection (GLM's fused gate-up, q / k rows reordered as the
    interleaved rotary's); GLM-4.5V's attention and experts (PEFT's ``target_parameters``, the experts under the
    image-text model's ``language_model``). With an image, batched with the base model: PEFT's tokens and
    transformers'."""
    from lora_utils import make_adapter
    from transformers import AutoModelForImageTextToText

    from asyncllm import LoRARequest

    path = make_tiny_glm4v(tmp_path / "glm4v", moe=moe)
    projections = "q_proj|k_proj|v_proj|o_proj" + ("" if moe else "|gate_up_proj|down_proj")
    experts = {"target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]} if moe else {}
    adapter = make_adapter(path, str(tmp_path / "adapter"), seed=3, rank=4, alpha=8,
                           targets=rf".*language_model.*\.({projections})", auto_class=AutoModelForImageTextToText,
                           **experts)
    images, text = [make_image(60, 200, seed=2)], f"{IMAGE_PLACEHOLDER} and the end"
    prompt = {"prompt": text, "images": images}
    async with AsyncEngine(path, enable_lora=True, disable_log_stats=True, block_size=4,
                           max_num_batched_tokens=BUDGET) as engine:
        adapted, base = await asyncio.gather(
            engine.generate(prompt, GREEDY, lora_request=LoRARequest("glm", 1, adapter)), engine.generate(prompt, GREEDY))
    assert adapted.outputs[0].token_ids == hf_glm4v_greedy(path, text, images, 8, adapter=adapter)[1]
    assert base.outputs[0].token_ids == hf_glm4v_greedy(path, text, images, 8)[1] != adapted.outputs[0].token_ids


@pytest.mark.parametrize("parallel", [{}, dict(tensor_parallel_size=2, enable_expert_parallel=True)])
async def test_glm45v_moe_decoder_matches_transformers(tmp_path, parallel: dict):
    """GLM-4.5V (``Glm4vMoeForConditionalGeneration``): two images across 8-token chunks beside a text-only request;
    on one rank, and on two with the experts split by expert."""
    path = make_tiny_glm4v(tmp_path / "glm4v_moe", moe=True)
    images = [make_image(60, 200, seed=2), make_image(120, 90, seed=1)]
    text = f"{IMAGE_PLACEHOLDER} then {IMAGE_PLACEHOLDER} and the end"
    prompts = [{"prompt": text, "images": images}, "a text prompt with no image at all"]
    async with AsyncEngine(path, disable_log_stats=True, block_size=4, max_num_batched_tokens=BUDGET,
                           max_num_seqs=4, **parallel) as engine:
        outs = await asyncio.gather(*(engine.generate(p, GREEDY) for p in prompts))
    hf_prompt, hf_tokens = hf_glm4v_greedy(path, text, images, 8)
    _, hf_text = hf_glm4v_greedy(path, prompts[1], [], 8)
    assert outs[0].prompt_token_ids == hf_prompt
    assert [o.outputs[0].token_ids for o in outs] == [hf_tokens, hf_text]
