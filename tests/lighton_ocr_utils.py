"""A tiny random LightOnOCR checkpoint (Pixtral tower + projector + Qwen3 decoder) with transformers' processor, for
the tests."""

from __future__ import annotations

import io
import os
from pathlib import Path

from mm_utils import random_model

__all__ = ["IMAGE", "hf_lighton_ocr_greedy", "make_tiny_lighton_ocr"]

NAMED = {"image_token": "<|image_pad|>", "image_break_token": "<|vision_pad|>", "image_end_token": "<|vision_end|>"}
"""The tokenizer's named tokens that ``LightOnOcrProcessor`` reads (the released checkpoints' names; its prompts
hold the image token alone)."""
IMAGE = NAMED["image_token"]

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<|image_pad|>' }}{% else %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tiny_lighton_ocr(path: str | os.PathLike[str], seed: int = 0) -> str:
    """Save a tiny random ``LightOnOcrForConditionalGeneration`` with transformers' ``LightOnOcrProcessor`` (a
    Pixtral image processor of 14-pixel patches and longest edge 112 pixels: at most 8 x 8 patches, 4 x 4 image
    tokens an image; the tokenizer's image, break and end tokens as the released checkpoints name them) in
    ``path``."""
    from transformers import (
        AutoTokenizer,
        LightOnOcrConfig,
        LightOnOcrForConditionalGeneration,
        LightOnOcrProcessor,
        PixtralImageProcessorPil,
        PixtralVisionConfig,
        Qwen3Config,
    )

    from asyncllm.tiny import tiny_checkpoint

    path = Path(path)
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint("qwen3"), extra_special_tokens=NAMED)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]},
                                 replace_extra_special_tokens=False)
    tokenizer.chat_template = CHAT_TEMPLATE
    text = Qwen3Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                       bos_token_id=0, eos_token_id=1, pad_token_id=2, tie_word_embeddings=True)
    vision = PixtralVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                 patch_size=14, image_size=112, head_dim=8)
    config = LightOnOcrConfig(vision_config=vision, text_config=text, spatial_merge_size=2,
                              image_token_id=tokenizer.convert_tokens_to_ids(IMAGE), tie_word_embeddings=True)
    random_model(LightOnOcrForConditionalGeneration, config, seed).save_pretrained(path)
    image_processor = PixtralImageProcessorPil(size={"longest_edge": 112}, patch_size=14)
    LightOnOcrProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=14, spatial_merge_size=2,
                        chat_template=CHAT_TEMPLATE).save_pretrained(path)
    return str(path)


def hf_lighton_ocr_greedy(path: str, text: str, images: list[bytes], max_new_tokens: int,
                          add_special_tokens: bool = True) -> tuple[list[int], list[int]]:
    """transformers' (prompt ids, greedy tokens), the prompt made by the checkpoint's own ``LightOnOcrProcessor``."""
    import torch
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(path)
    pil = [Image.open(io.BytesIO(image)).convert("RGB") for image in images] or None
    inputs = dict(processor(text=[text], images=pil, return_tensors="pt", add_special_tokens=add_special_tokens))
    inputs.pop("attention_mask", None)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    prompt = inputs["input_ids"][0].tolist()
    return prompt, out[0, len(prompt):].tolist()
