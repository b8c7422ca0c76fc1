"""A tiny random Aria checkpoint (Idefics3's SigLIP tower, the cross-attention projector, the MoE decoder) with
transformers' ``AriaProcessor``, for the tests."""

from __future__ import annotations

import io
import os
from pathlib import Path

from mm_utils import random_model

__all__ = ["IMAGE", "hf_aria_greedy", "make_tiny_aria"]

IMAGE = "<|img|>"
"""The released checkpoints' image token (the tokenizer's named ``image_token``)."""


def make_tiny_aria(path: str | os.PathLike[str], seed: int = 0, split_image: bool = False) -> str:
    """Save a tiny random ``AriaForConditionalGeneration`` with transformers' ``AriaProcessor`` in ``path``: crops
    of 980 pixels (the processor's default ``max_image_size``, which wins over the 490 its image processor saves) cut into 35-pixel patches (28 x 28 of them, 16 queries
    a crop; 490-pixel crops: 14 x 14, 8 queries), short sides down to 70 pixels (padded: masked patches), a decoder
    of 8 experts (2 routed a token, intermediate 48) and 2 shared experts."""
    from transformers import (
        AriaConfig,
        AriaForConditionalGeneration,
        AriaImageProcessorPil,
        AriaProcessor,
        AriaTextConfig,
        AutoTokenizer,
        Idefics3VisionConfig,
    )

    from asyncllm.tiny import tiny_checkpoint

    path = Path(path)
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint("qwen3"), extra_special_tokens={"image_token": IMAGE})
    text = AriaTextConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=48, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                          moe_num_experts=8, moe_topk=2, moe_num_shared_experts=2, bos_token_id=0, eos_token_id=1,
                          pad_token_id=2)
    vision = Idefics3VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  patch_size=35, image_size=980)
    config = AriaConfig(vision_config=vision, text_config=text, projector_patch_to_query_dict={196: 8, 784: 16},
                        image_token_index=tokenizer.convert_tokens_to_ids(IMAGE))
    random_model(AriaForConditionalGeneration, config, seed).save_pretrained(path)
    image_processor = AriaImageProcessorPil(max_image_size=490, min_image_size=70, split_image=split_image)
    AriaProcessor(image_processor=image_processor, tokenizer=tokenizer,
                  size_conversion={490: 8, 980: 16}).save_pretrained(path)
    return str(path)


def hf_aria_greedy(path: str, text: str, images: list[bytes], max_new_tokens: int,
                   **images_kwargs) -> tuple[list[int], list[int]]:
    """transformers' (prompt ids, greedy tokens), the prompt made by the checkpoint's own ``AriaProcessor`` (given
    ``images_kwargs``: ``split_image``, ``max_image_size``)."""
    import torch
    from PIL import Image
    from transformers import AriaForConditionalGeneration, AutoProcessor

    processor = AutoProcessor.from_pretrained(path)
    pil = [Image.open(io.BytesIO(image)).convert("RGB") for image in images] or None
    inputs = dict(processor(text=[text], images=pil, return_tensors="pt", **images_kwargs))
    inputs.pop("attention_mask", None)
    model = AriaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    prompt = inputs["input_ids"][0].tolist()
    return prompt, out[0, len(prompt):].tolist()
