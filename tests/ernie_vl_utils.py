"""A tiny random ERNIE 4.5 VL checkpoint (``Ernie4_5_VLMoeForConditionalGeneration``: its vision tower and
resampler before ERNIE 4.5's modality-split experts with M-RoPE) and transformers' reference for the tests."""

from __future__ import annotations

from pathlib import Path

from mm_utils import expand_image_tokens, hf_generate, random_model

__all__ = ["IMAGE", "IMAGE_PLACEHOLDER", "SPECIAL_TOKENS", "VIDEO_PLACEHOLDER", "hf_ernie_vl_greedy",
           "hf_ernie_vl_inputs", "hf_ernie_video_processor", "make_tiny_ernie_vl"]

START, IMAGE, END = "<|IMAGE_START|>", "<|IMAGE_PLACEHOLDER|>", "<|IMAGE_END|>"
IMAGE_PLACEHOLDER = START + IMAGE + END
"""What a prompt holds per image (the checkpoint's chat template writes the same)."""
SPECIAL_TOKENS = [START, IMAGE, END, "<|VIDEO_START|>", "<|VIDEO_PLACEHOLDER|>", "<|VIDEO_END|>"]
VIDEO = "<|VIDEO_PLACEHOLDER|>"
VIDEO_PLACEHOLDER = "<|VIDEO_START|>" + VIDEO + "<|VIDEO_END|>"
"""What a prompt holds per video."""
FONT = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf"
"""The font the tiny checkpoint's video processor draws timestamps in (ERNIE's ships Roboto)."""
_IDS = ("image_start_token_id", "image_token_id", "image_end_token_id", "video_start_token_id", "video_token_id",
        "video_end_token_id")


def make_tiny_ernie_vl(path: str | Path, seed: int = 0) -> str:
    """Save a tiny random ``Ernie4_5_VLMoeForConditionalGeneration`` (a dense layer, then two of 4 text and 4
    vision experts, 2 routed, and a shared one; text and vision experts of different widths) with its tokenizer
    (Qwen2's, ERNIE's image and video markers added), its image processor (4 to 64 merged tokens per image) and
    its video processor's config (4 to 16 merged tokens per frame pair, timestamps drawn in `FONT`)."""
    import json
    import shutil

    import torch
    from transformers import AutoTokenizer, Ernie4_5_VLMoeConfig, Ernie4_5_VLMoeForConditionalGeneration
    from transformers import Ernie4_5_VLMoeImageProcessorPil

    from asyncllm.tiny import tiny_checkpoint

    path = Path(path)
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint("qwen2"))
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS})
    ids = dict(zip(_IDS, tokenizer.convert_tokens_to_ids(SPECIAL_TOKENS)))
    text = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, moe_num_experts=4,
                moe_k=2, moe_intermediate_size=[32, 16], moe_num_shared_experts=1, bos_token_id=0, eos_token_id=1,
                pad_token_id=2, rope_parameters={"rope_type": "default", "rope_theta": 10_000.0,
                                                 "mrope_section": [3, 3, 2]})
    vision = dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=64)
    config = Ernie4_5_VLMoeConfig(text_config=text, vision_config=vision, **ids)
    model = random_model(Ernie4_5_VLMoeForConditionalGeneration, config, seed)
    with torch.no_grad():  # the score corrections matter: random, not transformers' zeros
        for name, param in model.named_parameters():
            if name.endswith("e_score_correction_bias"):
                param.normal_(0.0, 0.1)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    unit = 28 * 28
    Ernie4_5_VLMoeImageProcessorPil(size={"shortest_edge": 4 * unit, "longest_edge": 64 * unit}).save_pretrained(path)
    shutil.copy(FONT, path)
    video = {"video_processor_type": "Ernie4_5_VLMoeVideoProcessor", "draw_on_frames": True, "font": Path(FONT).name,
             "size": {"shortest_edge": 4 * unit, "longest_edge": 16 * unit}}
    (path / "video_preprocessor_config.json").write_text(json.dumps(video))
    return str(path)


def hf_ernie_video_processor(path: str, videos: list) -> dict:
    """transformers' ``Ernie4_5_VLMoeVideoProcessor`` over ``videos`` (``(frames, metadata)``), torchvision stood in
    (tests/glm4v_video_utils.py): ``pixel_values_videos``, ``video_grid_thw``."""
    from glm4v_video_utils import hf_video_processor

    module = "transformers.models.ernie4_5_vl_moe.video_processing_ernie4_5_vl_moe"
    out = hf_video_processor(path, videos, (module, "Ernie4_5_VLMoeVideoProcessor"))
    return {key: out[key] for key in ("pixel_values_videos", "video_grid_thw")}


def hf_ernie_vl_inputs(path: str, text: str, images: list[bytes], videos: list = ()) -> dict:
    """transformers' model inputs for ``text`` with one `IMAGE_PLACEHOLDER` per image and one `VIDEO_PLACEHOLDER`
    per video (``(frames, metadata)``): ``Ernie4_5_VLMoeProcessor``'s expansion and token types (its instance needs
    a video processor, which needs torchvision: its methods run over the checkpoint's tokenizer and processors
    here)."""
    from types import SimpleNamespace

    from transformers import AutoImageProcessor, AutoTokenizer, Ernie4_5_VLMoeProcessor

    tokenizer = AutoTokenizer.from_pretrained(path)
    image_processor = AutoImageProcessor.from_pretrained(path)
    ids = dict(zip(_IDS, tokenizer.convert_tokens_to_ids(SPECIAL_TOKENS)))
    processor = SimpleNamespace(image_processor=image_processor, image_token=IMAGE, video_token=VIDEO, **ids,
                                video_processor=SimpleNamespace(merge_size=2, temporal_patch_size=2))
    text, inputs = expand_image_tokens(Ernie4_5_VLMoeProcessor, processor, text, images)
    if videos:
        inputs.update(hf_ernie_video_processor(path, list(videos)))
        parts = text.split(VIDEO)
        text = parts[0] + "".join(Ernie4_5_VLMoeProcessor.replace_video_token(processor, inputs, i) + part
                                  for i, part in enumerate(parts[1:]))
    input_ids = tokenizer([text], return_tensors="pt")["input_ids"]
    inputs["input_ids"] = input_ids
    # what M-RoPE's positions follow: image 1, video 2
    videos_at = input_ids == ids["video_token_id"]
    inputs["mm_token_type_ids"] = ((input_ids == ids["image_token_id"]) + 2 * videos_at).int()
    inputs["moe_mm_token_type_ids"] = Ernie4_5_VLMoeProcessor.create_moe_mm_token_type_ids(processor, input_ids)
    return inputs


def hf_ernie_vl_greedy(path: str, text: str, images: list[bytes], max_new_tokens: int,
                       videos: list = ()) -> tuple[list[int], list[int]]:
    """transformers' (prompt ids, greedy tokens) for a text with image (and video) placeholders."""
    import torch
    from transformers import Ernie4_5_VLMoeForConditionalGeneration

    model = Ernie4_5_VLMoeForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    return hf_generate(model, hf_ernie_vl_inputs(path, text, images, videos), max_new_tokens)
