"""A tiny random PaddleOCR-VL checkpoint (``PaddleOCRVLForConditionalGeneration``: its NaViT SigLIP tower with 2-D
rotary positions, the 2 x 2 patch projector and ERNIE 4.5's dense decoder with M-RoPE) and transformers' reference for
the tests."""

from __future__ import annotations

from pathlib import Path

from mm_utils import expand_image_tokens, hf_generate, random_model

__all__ = ["IMAGE", "IMAGE_PLACEHOLDER", "hf_paddleocr_vl_greedy", "hf_paddleocr_vl_inputs", "make_tiny_paddleocr_vl"]

START, IMAGE, END, VIDEO = "<|IMAGE_START|>", "<|IMAGE_PLACEHOLDER|>", "<|IMAGE_END|>", "<|video_pad|>"
IMAGE_PLACEHOLDER = START + IMAGE + END
"""What a prompt holds per image (the checkpoint's chat template writes the same)."""
_IDS = ("vision_start_token_id", "image_token_id", "vision_end_token_id", "video_token_id")


def make_tiny_paddleocr_vl(path: str | Path, seed: int = 0) -> str:
    """Save a tiny random ``PaddleOCRVLForConditionalGeneration`` (3 decoder layers of head_dim 16 with GQA, its
    embeddings tied; a 2-layer tower whose learned positions are a 4 x 4 table, interpolated to each image's grid)
    with its tokenizer (Qwen2's, PaddleOCR-VL's image markers added) and its image processor (4 to 64 merged tokens
    per image; the PIL one, transformers' other needing torchvision)."""
    import torch
    from transformers import AutoTokenizer, PaddleOCRVLConfig, PaddleOCRVLForConditionalGeneration
    from transformers import PaddleOCRVLImageProcessorPil

    from asyncllm.tiny import tiny_checkpoint

    path = Path(path)
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint("qwen2"))
    tokenizer.add_special_tokens({"additional_special_tokens": [START, IMAGE, END, VIDEO]})
    ids = dict(zip(_IDS, tokenizer.convert_tokens_to_ids([START, IMAGE, END, VIDEO])))
    text = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                bos_token_id=0, eos_token_id=1, pad_token_id=2,
                rope_parameters={"rope_type": "default", "rope_theta": 10_000.0, "mrope_section": [2, 3, 3]})
    vision = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64, image_size=56,
                  rope_parameters={"rope_type": "axial", "rope_theta": 10_000.0})
    config = PaddleOCRVLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, **ids)
    model = random_model(PaddleOCRVLForConditionalGeneration, config, seed)
    with torch.no_grad():  # the projector's pre_norm bias (random_model leaves "norm" biases at std 0.2) stays
        model.model.projector.pre_norm.weight.normal_(1.0, 0.2)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    unit = 28 * 28
    PaddleOCRVLImageProcessorPil(size={"shortest_edge": 4 * unit, "longest_edge": 64 * unit}).save_pretrained(path)
    return str(path)


def hf_paddleocr_vl_inputs(path: str, text: str, images: list[bytes], processor_kwargs: dict | None = None) -> dict:
    """transformers' model inputs for ``text`` with one `IMAGE_PLACEHOLDER` per image: ``PaddleOCRVLProcessor``'s
    expansion (one placeholder per 2 x 2 patches) and token types, over the checkpoint's tokenizer and image
    processor (loaded with ``processor_kwargs``: ``min_pixels`` / ``max_pixels``)."""
    from types import SimpleNamespace

    from transformers import AutoImageProcessor, AutoTokenizer, PaddleOCRVLProcessor

    tokenizer = AutoTokenizer.from_pretrained(path)
    image_processor = AutoImageProcessor.from_pretrained(path, **(processor_kwargs or {}))
    processor = SimpleNamespace(image_processor=image_processor, image_token=IMAGE)
    text, inputs = expand_image_tokens(PaddleOCRVLProcessor, processor, text, images)
    input_ids = tokenizer([text], return_tensors="pt")["input_ids"]
    inputs["input_ids"] = input_ids
    inputs["mm_token_type_ids"] = (input_ids == tokenizer.convert_tokens_to_ids(IMAGE)).int()  # M-RoPE's image rows
    return inputs


def hf_paddleocr_vl_greedy(path: str, text: str, images: list[bytes], max_new_tokens: int,
                           processor_kwargs: dict | None = None) -> tuple[list[int], list[int]]:
    """transformers' (prompt ids, greedy tokens) for a text with image placeholders."""
    import torch
    from transformers import PaddleOCRVLForConditionalGeneration

    model = PaddleOCRVLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    return hf_generate(model, hf_paddleocr_vl_inputs(path, text, images, processor_kwargs), max_new_tokens)
