"""A tiny random Aya Vision checkpoint (a SigLIP tower, pixel shuffle, a SwiGLU projector, a Cohere2 decoder) and
transformers' greedy reference for it."""

from __future__ import annotations

import io
import os
from pathlib import Path

from mm_utils import CHAT_TEMPLATE, IMAGE_SIZE, IMAGE_TOKEN, PATCH_SIZE, random_model

AYA_SPECIALS = ["<|START_OF_IMG|>", "<|END_OF_IMG|>", "<|IMG_PATCH|>", "<|IMG_LINE_BREAK|>"]
MAX_PATCHES = 4
"""Tiles of 56 pixels per image at most (plus the thumbnail)."""


def make_tiny_aya_vision(path: str | os.PathLike[str], seed: int = 0) -> str:
    """Save a tiny random ``AyaVisionForConditionalGeneration`` (56-pixel tiles of 4 features each, up to
    `MAX_PATCHES` of them and a thumbnail; a 4-layer Cohere2 decoder, one layer in four full) with its processor."""
    from transformers import (
        AutoTokenizer,
        AyaVisionConfig,
        AyaVisionForConditionalGeneration,
        AyaVisionProcessor,
        Cohere2Config,
        GotOcr2ImageProcessorPil,
        SiglipVisionConfig,
    )

    from asyncllm.tiny import tiny_checkpoint

    path = Path(path)
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint("llama"))
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN, *AYA_SPECIALS]})
    tokenizer.chat_template = CHAT_TEMPLATE
    text = Cohere2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, sliding_window=16,
                         sliding_window_pattern=4, logit_scale=0.5, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                image_size=IMAGE_SIZE, patch_size=PATCH_SIZE, vision_use_head=False)
    config = AyaVisionConfig(vision_config=vision, text_config=text, downsample_factor=2,
                             alignment_intermediate_size=96, vision_feature_layer=-1,
                             vision_feature_select_strategy="full",
                             image_token_index=tokenizer.convert_tokens_to_ids("<|IMG_PATCH|>"))
    random_model(AyaVisionForConditionalGeneration, config, seed).save_pretrained(path)
    image_processor = GotOcr2ImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}, crop_to_patches=True,
                                               max_patches=MAX_PATCHES)
    AyaVisionProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=2 * PATCH_SIZE,
                       img_size=IMAGE_SIZE, chat_template=CHAT_TEMPLATE).save_pretrained(path)
    return str(path)


def hf_aya_greedy(path: str, text: str | None, images: list[bytes], max_new_tokens: int,
                  messages: list | None = None) -> tuple[list[int], list[int]]:
    """transformers' (prompt ids, greedy tokens) for a text with ``<image>`` markers (or chat messages)."""
    import torch
    from PIL import Image
    from transformers import AutoTokenizer, AyaVisionForConditionalGeneration, AyaVisionProcessor, \
        GotOcr2ImageProcessorPil

    tokenizer = AutoTokenizer.from_pretrained(path)
    processor = AyaVisionProcessor(image_processor=GotOcr2ImageProcessorPil.from_pretrained(path), tokenizer=tokenizer,
                                   patch_size=2 * PATCH_SIZE, img_size=IMAGE_SIZE, chat_template=CHAT_TEMPLATE)
    if messages is not None:
        text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    pil = [Image.open(io.BytesIO(image)).convert("RGB") for image in images]
    inputs = processor(text=text, images=pil or None, return_tensors="pt", add_special_tokens=messages is None)
    model = AyaVisionForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    prompt_ids = inputs["input_ids"][0].tolist()
    return prompt_ids, out[0, len(prompt_ids):].tolist()
