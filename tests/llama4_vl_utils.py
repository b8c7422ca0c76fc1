"""A tiny random Llama 4 image-text checkpoint (the Llama 4 vision model and projector before the tiny Llama 4 text
decoder) and transformers' processor and greedy reference for it.

transformers' ``Llama4ImageProcessor`` needs torchvision: `hf_image_processor` runs transformers' own class with
torchvision's ``resize`` / ``normalize`` / ``pad`` stood in (tests/lfm2_vl_utils.py); tiling, canvases, the bfloat16
normalization and the processor's prompt expansion are transformers' code.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from lfm2_vl_utils import hf_image_processor_class
from lfm2_vl_utils import hf_image_processor as _hf_image_processor
from mm_utils import CHAT_TEMPLATE, processor_inputs, random_model

IMAGE = "<|image|>"
MARKERS = ["<|image_start|>", "<|image_end|>", IMAGE, "<|patch|>", "<|tile_x_separator|>", "<|tile_y_separator|>"]
TILE, PATCH = 32, 4
"""Tiles of 32 pixels, 4-pixel patches: 8 x 8 patches a tile, 16 tokens after the pixel shuffle (336 / 14 / 144
in the released checkpoints)."""
PROCESSOR = dict(size={"height": TILE, "width": TILE}, max_patches=4)
TEMPLATE = CHAT_TEMPLATE.replace("'<image>'", f"'{IMAGE}'")
_HF_CLASS = ("transformers.models.llama4.image_processing_llama4", "Llama4ImageProcessor")


def hf_image_module() -> Any:
    """transformers' ``image_processing_llama4`` module, imported with torchvision stood in."""
    import sys

    return sys.modules[hf_image_processor_class(*_HF_CLASS).__module__]


def hf_image_processor(path: str | None = None, **settings: Any) -> Any:
    """transformers' ``Llama4ImageProcessor`` (torchvision stood in) of the checkpoint at ``path`` or ``settings``."""
    return _hf_image_processor(path, cls=hf_image_processor_class(*_HF_CLASS), **settings)


def hf_processor(path: str) -> Any:
    from transformers import AutoTokenizer, Llama4Processor

    return Llama4Processor(image_processor=hf_image_processor(path), tokenizer=AutoTokenizer.from_pretrained(path),
                           patch_size=PATCH, pixel_shuffle_ratio=0.5, chat_template=TEMPLATE)


def make_tiny_llama4_vl(path: str | os.PathLike[str], seed: int = 0) -> str:
    """Save a tiny random ``Llama4ForConditionalGeneration``: the tiny Llama 4 text model (a chunked rotary layer, a
    MoE layer without positions) under a 2-layer vision model of 32-pixel tiles, with its processor."""
    from transformers import AutoTokenizer, Llama4Config, Llama4ForConditionalGeneration

    from asyncllm.models.loader import load_hf_config
    from asyncllm.tiny import tiny_checkpoint

    path = Path(path)
    base = tiny_checkpoint("llama4")
    tokenizer = AutoTokenizer.from_pretrained(base)
    tokenizer.add_special_tokens({"additional_special_tokens": MARKERS})
    tokenizer.chat_template = TEMPLATE
    text = load_hf_config(base).to_dict()
    text.update(vocab_size=len(tokenizer), architectures=None)
    vision = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
                  vision_output_dim=48, image_size=TILE, patch_size=PATCH, projector_input_dim=48,
                  projector_output_dim=48, rope_parameters={"rope_type": "default", "rope_theta": 100.0})
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in MARKERS}
    config = Llama4Config(text_config=text, vision_config=vision, image_token_index=ids["<|patch|>"],
                          boi_token_index=ids["<|image_start|>"], eoi_token_index=ids["<|image_end|>"])
    random_model(Llama4ForConditionalGeneration, config, seed).save_pretrained(path)
    tokenizer.save_pretrained(path)
    hf_image_processor(**PROCESSOR).save_pretrained(path)
    return str(path)


def hf_llama4_inputs(path: str, text: str, images: list[bytes], add_special_tokens: bool = True) -> Any:
    return processor_inputs(hf_processor(path), text, images, add_special_tokens)


def hf_llama4_greedy(path: str, text: str | None, images: list[bytes], max_new_tokens: int,
                     messages: list | None = None, adapter: str | None = None) -> tuple[list[int], list[int]]:
    """transformers' (prompt ids, greedy tokens) for a text with ``<|image|>`` markers (or chat messages): its model's
    own image features, projector and placeholder mask, then its language model's generate from those embeddings
    (``Llama4ForConditionalGeneration.forward`` fails in transformers 5.24: it reads ``image_outputs`` from the
    language model's output, which has none); ``adapter``: a PEFT adapter folder the model runs with."""
    import torch
    from transformers import Llama4ForConditionalGeneration

    if messages is not None:
        text = hf_processor(path).apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = hf_llama4_inputs(path, text, images, add_special_tokens=messages is None)
    model = Llama4ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter).eval().base_model.model
    ids = inputs["input_ids"]
    with torch.no_grad():
        embeds = model.get_input_embeddings()(ids)
        if "pixel_values" in inputs:  # bfloat16 values (the processor's): the float32 model takes them as float32
            features = model.get_image_features(inputs["pixel_values"].float(), return_dict=True).last_hidden_state
            rows = model.multi_modal_projector(features.reshape(-1, features.shape[-1]))
            embeds = embeds.masked_scatter(model.get_placeholder_mask(ids, embeds, rows), rows)
        out = model.language_model.generate(inputs_embeds=embeds, attention_mask=inputs["attention_mask"],
                                            max_new_tokens=max_new_tokens, do_sample=False)
    return ids[0].tolist(), out[0].tolist()
