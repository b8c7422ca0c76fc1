"""A tiny random InternVL checkpoint (InternViT tower + pixel shuffle + projector + Qwen2 decoder) for the tests."""

from __future__ import annotations

import io
import os
from pathlib import Path

from mm_utils import random_model

__all__ = ["IMAGE", "hf_internvl_greedy", "make_tiny_internvl"]

START, IMAGE, END = "<img>", "<IMG_CONTEXT>", "</img>"
TOKENS_PER_TILE = 4
"""56 x 56 tiles of 14 x 14 patches: 16 patches, 4 after the pixel shuffle."""


def make_tiny_internvl(path: str | os.PathLike[str], seed: int = 0) -> str:
    """Save a tiny random ``InternVLForConditionalGeneration`` with its tokenizer and tiling image processor
    (56 x 56 tiles, at most 4 and a thumbnail) in ``path``."""
    from transformers import (
        AutoTokenizer,
        GotOcr2ImageProcessorPil,
        InternVLConfig,
        InternVLForConditionalGeneration,
        InternVLVisionConfig,
        Qwen2Config,
    )

    from asyncllm.tiny import tiny_checkpoint

    path = Path(path)
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint("qwen2"))
    tokenizer.add_special_tokens({"additional_special_tokens": [START, IMAGE, END]})
    text = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                       bos_token_id=0, eos_token_id=1, pad_token_id=2, tie_word_embeddings=False)
    vision = InternVLVisionConfig(hidden_size=32, num_attention_heads=4, intermediate_size=64, num_hidden_layers=2,
                                  image_size=56, patch_size=14, use_qk_norm=True, attention_bias=True)
    config = InternVLConfig(vision_config=vision, text_config=text, image_token_id=tokenizer.convert_tokens_to_ids(IMAGE),
                            image_seq_length=TOKENS_PER_TILE)
    random_model(InternVLForConditionalGeneration, config, seed).save_pretrained(path)
    tokenizer.save_pretrained(path)
    GotOcr2ImageProcessorPil(size={"height": 56, "width": 56}, crop_to_patches=True, min_patches=1,
                             max_patches=4).save_pretrained(path)
    return str(path)


def hf_internvl_greedy(path: str, text: str, images: list[bytes], max_new_tokens: int) -> tuple[list[int], list[int]]:
    """transformers' (prompt ids, greedy tokens): each ``<IMG_CONTEXT>`` expanded as ``InternVLProcessor`` does
    (``<img>``, 4 per tile, ``</img>``)."""
    import torch
    from PIL import Image
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    inputs: dict = {}
    if images:
        pil = [Image.open(io.BytesIO(image)).convert("RGB") for image in images]
        processed = AutoImageProcessor.from_pretrained(path)(images=pil, return_tensors="pt")
        inputs["pixel_values"] = processed["pixel_values"]
        parts = text.split(IMAGE)
        text = parts[0] + "".join(START + IMAGE * TOKENS_PER_TILE * int(n) + END + part
                                  for n, part in zip(processed["num_patches"], parts[1:]))
    inputs["input_ids"] = tokenizer([text], return_tensors="pt")["input_ids"]
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    prompt = inputs["input_ids"][0].tolist()
    return prompt, out[0, len(prompt):].tolist()
