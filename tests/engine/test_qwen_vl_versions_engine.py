"""Qwen3-VL, Qwen3.5 (hybrid, MoE) and Qwen2-VL end to end, each on its own tiny checkpoint: deepstack and
interleaved M-RoPE, images and a video, experts split over two ranks, block-fp8 checkpoints with the tower left out,
encoding by data over two ranks with preemption; token for token equal to transformers. Qwen2.5-VL's engine
tests are in tests/engine/test_qwen_vl_engine.py."""

from __future__ import annotations

import asyncio

import pytest
from qwen_vl_utils import IMAGE_PLACEHOLDER, hf_qwen_vl_greedy, make_image, make_tiny_qwen_vl

from asyncllm import AsyncEngine
from test_qwen_vl_engine import BUDGET, GREEDY

pytestmark = pytest.mark.asyncio(loop_scope="module")


async def test_qwen3_vl_deepstack_and_interleaved_mrope_match_transformers(tmp_path_factory):
    """Qwen3-VL: images split across chunks beside a text-only request, then the same prompt from the prefix cache
    (the deepstack rows of a chunk's image tokens, the interleaved M-RoPE bands); and a video: each temporal patch
    after its ``<t seconds>`` text between vision start and end tokens (the prompt its processor writes), an item
    each, with deepstack rows, then from the prefix cache."""
    from transformers import AutoTokenizer
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    from qwen_vl_utils import VIDEO_PAD, VIDEO_PLACEHOLDER, hf_qwen_vl_video_greedy, make_video, video_patches_of

    path = make_tiny_qwen_vl(tmp_path_factory.mktemp("qwen3_vl"), version="3")
    images = [make_image(120, 70, seed=12), make_image(64, 64, seed=13)]
    text = f"first {IMAGE_PLACEHOLDER} then {IMAGE_PLACEHOLDER} end"
    prompts = [{"prompt": text, "images": images}, "only some text here"]
    video = (make_video(6, 96, 64, seed=5), {"fps": 12.0, "frames_indices": [0, 5, 10, 15, 20, 25],
                                             "total_num_frames": 30})
    video_text = f"see {VIDEO_PLACEHOLDER} and {IMAGE_PLACEHOLDER}"
    video_prompt = {"prompt": video_text, "videos": [video], "images": [images[1]]}
    async with AsyncEngine(path, disable_log_stats=True, block_size=4, max_num_batched_tokens=BUDGET,
                           max_num_seqs=4, enable_prefix_caching=True) as engine:
        outs = await asyncio.gather(*(engine.generate(p, GREEDY) for p in prompts))
        again = await engine.generate(prompts[0], GREEDY)
        with_video = await engine.generate(video_prompt, GREEDY)
        video_again = await engine.generate(video_prompt, GREEDY)
    hf_prompt, hf_tokens = hf_qwen_vl_greedy(path, text, images, 8)
    assert outs[0].prompt_token_ids == hf_prompt
    assert [o.outputs[0].token_ids for o in outs] == [hf_tokens, hf_qwen_vl_greedy(path, prompts[1], [], 8)[1]]
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == hf_tokens
    patches = video_patches_of(path, video)
    times = Qwen3VLProcessor._calculate_timestamps(None, video[1]["frames_indices"], 12.0, 2)
    per_frame = "".join(f"<{t:.1f} seconds><|vision_start|>" + VIDEO_PAD * (patches.shape[1] * patches.shape[2] // 4)
                        + "<|vision_end|>" for t in times)
    expected_ids = AutoTokenizer.from_pretrained(path)(
        video_text.replace(VIDEO_PAD, per_frame).replace("<|image_pad|>", "<|image_pad|>" * 4))["input_ids"]
    assert with_video.prompt_token_ids == expected_ids and len(times) == 3
    expected = hf_qwen_vl_video_greedy(path, with_video.prompt_token_ids, [patches], [images[1]], 8)
    assert with_video.outputs[0].token_ids == expected
    assert video_again.num_cached_tokens > 0 and video_again.outputs[0].token_ids == expected


async def test_qwen3_5_hybrid_with_images_and_a_video_matches_transformers(tmp_path_factory):
    """Qwen3.5: Qwen3-VL's tower without deepstack over the Gated DeltaNet hybrid, the attention layers rotating by
    the step's M-RoPE table; two images split across 8-token chunks beside a text-only request on two seats (state
    rows reused), then a video with its timestamps, then the images' prompt again from the prefix cache and the states
    saved every 8 tokens; in language-model-only mode the text decoder alone."""
    from qwen_vl_utils import VIDEO_PLACEHOLDER, hf_qwen_vl_video_greedy, make_video, video_patches_of

    path = make_tiny_qwen_vl(tmp_path_factory.mktemp("qwen3_5"), version="3.5")
    images = [make_image(120, 70, seed=12), make_image(64, 64, seed=13)]
    text = f"first {IMAGE_PLACEHOLDER} then {IMAGE_PLACEHOLDER} end"
    prompts = [{"prompt": text, "images": images}, "only some text here"]
    video = (make_video(4, 96, 64, seed=5), {"fps": 12.0, "frames_indices": [0, 5, 10, 15], "total_num_frames": 20})
    async with AsyncEngine(path, disable_log_stats=True, block_size=4, max_num_batched_tokens=BUDGET,
                           max_num_seqs=2, mamba_block_size=8) as engine:
        outs = await asyncio.gather(*(engine.generate(p, GREEDY) for p in prompts))
        with_video = await engine.generate({"prompt": f"see {VIDEO_PLACEHOLDER}", "videos": [video]}, GREEDY)
        again = await engine.generate(prompts[0], GREEDY)  # images included, from the cache and saved states
    hf_prompt, hf_tokens = hf_qwen_vl_greedy(path, text, images, 8)
    assert outs[0].prompt_token_ids == hf_prompt
    assert again.num_cached_tokens == (len(hf_prompt) - 1) // 8 * 8 and again.outputs[0].token_ids == hf_tokens
    assert [o.outputs[0].token_ids for o in outs] == [hf_tokens, hf_qwen_vl_greedy(path, prompts[1], [], 8)[1]]
    expected = hf_qwen_vl_video_greedy(path, with_video.prompt_token_ids, [video_patches_of(path, video)], [], 8)
    assert with_video.outputs[0].token_ids == expected
    async with AsyncEngine(path, disable_log_stats=True, limit_mm_per_prompt={"image": 0, "video": 0}) as text_only:
        assert (await text_only.generate(prompts[1], GREEDY)).outputs[0].token_ids == outs[1].outputs[0].token_ids


async def test_qwen3_5_moe_over_two_ranks_by_expert_matches_transformers(tmp_path_factory):
    """Qwen3.5-MoE with an image: the hybrid MoE decoder split over two ranks by expert (its linear layers whole on
    each), the fused-expert layout of its checkpoint."""
    path = make_tiny_qwen_vl(tmp_path_factory.mktemp("qwen3_5_moe"), version="3.5-moe")
    image, text = make_image(120, 70, seed=12), f"first {IMAGE_PLACEHOLDER} end"
    async with AsyncEngine(path, disable_log_stats=True, block_size=4, max_num_batched_tokens=16,
                           tensor_parallel_size=2, enable_expert_parallel=True) as engine:
        out = await engine.generate({"prompt": text, "images": [image]}, GREEDY)
    assert out.outputs[0].token_ids == hf_qwen_vl_greedy(path, text, [image], 8)[1]


async def test_qwen3_vl_moe_with_experts_split_over_two_ranks_matches_transformers(tmp_path_factory):
    """Qwen3-VL-MoE: the fused experts tensors (transformers 5's layout) split per expert and held by two ranks
    (expert parallel), deepstack and interleaved M-RoPE over the MoE decoder."""
    path = make_tiny_qwen_vl(tmp_path_factory.mktemp("qwen3_vl_moe"), version="3-moe")
    image, text = make_image(90, 100, seed=15), f"look {IMAGE_PLACEHOLDER} closely"
    async with AsyncEngine(path, disable_log_stats=True, tensor_parallel_size=2, enable_expert_parallel=True,
                           block_size=4, max_num_batched_tokens=BUDGET, max_num_seqs=2) as engine:
        out = await engine.generate({"prompt": text, "images": [image]}, GREEDY)
    hf_prompt, hf_tokens = hf_qwen_vl_greedy(path, text, [image], 8)
    assert out.prompt_token_ids == hf_prompt and out.outputs[0].token_ids == hf_tokens


@pytest.mark.parametrize("version, num_fp8", [("3", 2 * 7), ("3.5", 8 + 7)])
async def test_qwen3_vl_block_fp8_checkpoint_with_the_tower_left_out_matches_transformers(tmp_path_factory, version,
                                                                                          num_fp8):
    """Qwen3-VL's and Qwen3.5's official FP8 layout: block-wise fp8 decoder projections (Qwen3.5's Gated DeltaNet
    projections too), the tower's modules (transformers 5 names) in modules_to_not_convert."""
    import torch
    from fp8_checkpoint_reference import Fp8Reference, write_fp8_checkpoint
    from transformers import AutoModelForImageTextToText

    from qwen_vl_utils import hf_qwen_vl_inputs

    src = make_tiny_qwen_vl(tmp_path_factory.mktemp("qwen3_vl_src"), version=version, seed=1)
    float_model = AutoModelForImageTextToText.from_pretrained(src, dtype=torch.float32)
    tower = tuple(f"model.visual.{name}" for name, module in float_model.model.visual.named_modules()
                  if isinstance(module, torch.nn.Linear))
    path = tmp_path_factory.mktemp("qwen3_vl_fp8") / "fp8"
    tensors = write_fp8_checkpoint(src, path, (16, 16), ignored=("lm_head", *tower))
    image, text = make_image(100, 80, seed=14), f"see {IMAGE_PLACEHOLDER} here"
    async with AsyncEngine(str(path), disable_log_stats=True, block_size=4, max_num_batched_tokens=BUDGET,
                           max_num_seqs=2) as engine:
        out = await engine.generate({"prompt": text, "images": [image]}, GREEDY)
    reference = Fp8Reference(src, tensors, (16, 16), auto_class=AutoModelForImageTextToText).model
    inputs = hf_qwen_vl_inputs(src, text, [image])
    with torch.no_grad():
        expected = reference.generate(**inputs, max_new_tokens=8, do_sample=False)[0, inputs["input_ids"].shape[1]:]
    assert sum(t.dtype == torch.float8_e4m3fn for t in tensors.values()) == num_fp8
    assert out.outputs[0].token_ids == expected.tolist()


async def test_qwen2_vl_over_two_ranks_encoding_by_data_and_preempted_matches_transformers(tmp_path_factory):
    """The decoder over two ranks, the images split between them (``mm_encoder_tp_mode="data"``; the tower sharded
    by weights is checked against one rank in tests/unit/test_qwen_vision.py); a KV cache too small for the three
    requests at once, so some are preempted and recomputed (their M-RoPE tables rebuilt on resume)."""
    path = make_tiny_qwen_vl(tmp_path_factory.mktemp("qwen2_vl"), version="2")
    images = [[make_image(100, 70, seed=6), make_image(56, 56, seed=7)], [make_image(90, 120, seed=8)],
              [make_image(56, 112, seed=10)]]
    texts = [f"look: {IMAGE_PLACEHOLDER} and {IMAGE_PLACEHOLDER}.", f"{IMAGE_PLACEHOLDER} what?", f"a {IMAGE_PLACEHOLDER}"]
    async with AsyncEngine(path, disable_log_stats=True, tensor_parallel_size=2, mm_encoder_tp_mode="data",
                           block_size=4, max_num_batched_tokens=BUDGET, max_num_seqs=4, num_gpu_blocks_override=14,
                           max_model_len=56) as engine:
        outs = await asyncio.gather(*(engine.generate({"prompt": text, "images": image}, GREEDY)
                                      for text, image in zip(texts, images)))
        preemptions = engine.stats().num_preemptions_total
    expected = [hf_qwen_vl_greedy(path, text, image, 8) for text, image in zip(texts, images)]
    assert [out.prompt_token_ids for out in outs] == [prompt for prompt, _ in expected]
    assert [out.outputs[0].token_ids for out in outs] == [tokens for _, tokens in expected]
    assert preemptions > 0
