"""A tiny random Command A Vision checkpoint (a SigLIP tower, pixel shuffle, a SwiGLU projector, a Cohere2 decoder) and
transformers' processor and greedy reference for it.

transformers' ``Cohere2VisionImageProcessor`` needs torchvision: `hf_image_processor` runs transformers' own class with
torchvision's ``resize`` / ``normalize`` stood in (tests/lfm2_vl_utils.py); tiling, the thumbnail, the normalization
and the processor's prompt expansion are transformers' code.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

from lfm2_vl_utils import hf_image_processor_class
from lfm2_vl_utils import hf_image_processor as _hf_image_processor
from mm_utils import CHAT_TEMPLATE, IMAGE_SIZE, PATCH_SIZE, hf_generate, processor_inputs, random_model

NAMED = {"image_token": "<|IMG_PATCH|>", "boi_token": "<|START_OF_IMG|>", "eoi_token": "<|END_OF_IMG|>",
         "img_line_break_token": "<|IMG_LINE_BREAK|>"}
"""The tokenizer's named tokens that ``Cohere2VisionProcessor`` reads."""
IMAGE = NAMED["image_token"]
PROCESSOR = dict(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}, max_patches=4, patch_size=2)
"""56-pixel tiles of 2 x 2 features (14-pixel patches, shuffled 2 x 2), up to 4 of them plus the thumbnail."""
TEMPLATE = CHAT_TEMPLATE.replace("'<image>'", f"'{IMAGE}'")
_HF_CLASS = ("transformers.models.cohere2_vision.image_processing_cohere2_vision", "Cohere2VisionImageProcessor")


def hf_image_module() -> Any:
    """transformers' ``image_processing_cohere2_vision`` module, imported with torchvision stood in."""
    import sys

    return sys.modules[hf_image_processor_class(*_HF_CLASS).__module__]


def hf_image_processor(path: str | None = None, **settings: Any) -> Any:
    """transformers' ``Cohere2VisionImageProcessor`` (torchvision stood in) of the checkpoint at ``path`` or
    ``settings``."""
    return _hf_image_processor(path, cls=hf_image_processor_class(*_HF_CLASS), **settings)


def hf_processor(path: str) -> Any:
    from transformers import AutoTokenizer, Cohere2VisionProcessor

    return Cohere2VisionProcessor(image_processor=hf_image_processor(path),
                                  tokenizer=AutoTokenizer.from_pretrained(path), chat_template=TEMPLATE)


def make_tiny_cohere2_vision(path: str | os.PathLike[str], seed: int = 0) -> str:
    """Save a tiny random ``Cohere2VisionForConditionalGeneration`` (56-pixel tiles of 4 features each, up to 4 of them
    and a thumbnail; a 4-layer Cohere2 decoder, one layer in four full) with its tokenizer and image processor."""
    from transformers import Cohere2VisionForConditionalGeneration

    random_model(Cohere2VisionForConditionalGeneration, save_tiny_config(path), seed).save_pretrained(path)
    return str(path)


def save_tiny_config(path: str | os.PathLike[str]) -> Any:
    """Save the tiny checkpoint's config, tokenizer and image processor (no weights: what the host reads); its
    config."""
    from transformers import AutoTokenizer, Cohere2Config, Cohere2VisionConfig, SiglipVisionConfig

    from asyncllm.tiny import tiny_checkpoint

    path = Path(path)
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint("llama"), extra_special_tokens=NAMED)
    tokenizer.chat_template = TEMPLATE
    text = Cohere2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, sliding_window=16,
                         sliding_window_pattern=4, logit_scale=0.5, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                image_size=IMAGE_SIZE, patch_size=PATCH_SIZE)
    config = Cohere2VisionConfig(vision_config=vision, text_config=text, downsample_factor=2,
                                 alignment_intermediate_size=96, image_token_id=tokenizer.convert_tokens_to_ids(IMAGE))
    config.save_pretrained(path)
    tokenizer.save_pretrained(path)
    hf_image_processor(**PROCESSOR).save_pretrained(path)
    return config


@functools.lru_cache(maxsize=2)
def _hf_model_and_processor(path: str) -> tuple[Any, Any]:
    """transformers' model (float32) and processor of the checkpoint at ``path``, loaded once per test module."""
    import torch
    from transformers import Cohere2VisionForConditionalGeneration

    return Cohere2VisionForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval(), hf_processor(path)


def hf_cohere2_vision_greedy(path: str, text: str | None, images: list[bytes], max_new_tokens: int,
                             messages: list | None = None) -> tuple[list[int], list[int]]:
    """transformers' (prompt ids, greedy tokens) for a text with ``<|IMG_PATCH|>`` markers (or chat messages)."""
    model, processor = _hf_model_and_processor(path)
    if messages is not None:
        text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return hf_generate(model, processor_inputs(processor, text, images, add_special_tokens=messages is None),
                       max_new_tokens)
