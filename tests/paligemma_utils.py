"""Tiny random PaliGemma checkpoints (SigLIP tower + linear projector + a Gemma or Gemma 2 decoder) for the tests,
and transformers' greedy tokens through its ``PaliGemmaProcessor``."""

from __future__ import annotations

import functools
import io
import os
from pathlib import Path

from mm_utils import random_model

__all__ = ["IMAGE_TOKENS", "SLIDING_WINDOW", "hf_paligemma_greedy", "make_tiny_paligemma"]

IMAGE_TOKENS = 16
"""``<image>`` rows per image: 32-pixel images in 8-pixel patches."""
SLIDING_WINDOW = 40
"""PaliGemma 2's sliding layers' window: over the test prompts, under a prompt plus its generated tokens."""


def make_tiny_paligemma(path: str | os.PathLike[str], generation: int, seed: int = 0, std: float = 0.2) -> str:
    """Save a tiny random ``PaliGemmaForConditionalGeneration`` with its processor in ``path``: PaliGemma 1's
    Gemma decoder (``generation=1``) or PaliGemma 2's Gemma 2 decoder, sliding and global layers alternating."""
    from transformers import (
        AutoTokenizer,
        Gemma2Config,
        GemmaConfig,
        PaliGemmaConfig,
        PaliGemmaForConditionalGeneration,
        PaliGemmaProcessor,
        SiglipImageProcessorPil,
        SiglipVisionConfig,
    )

    from asyncllm.tiny import tiny_checkpoint

    path = Path(path)
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint("llama"))
    image_processor = SiglipImageProcessorPil(size={"height": 32, "width": 32}, image_seq_length=IMAGE_TOKENS)
    processor = PaliGemmaProcessor(image_processor=image_processor, tokenizer=tokenizer)  # adds <image>, <loc*>, ...
    sizes = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                 bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=0)
    text = GemmaConfig(**sizes) if generation == 1 else Gemma2Config(
        **sizes, sliding_window=SLIDING_WINDOW, layer_types=["sliding_attention", "full_attention"])
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                image_size=32, patch_size=8, vision_use_head=False)
    config = PaliGemmaConfig(text_config=text, vision_config=vision, image_token_index=processor.image_token_id,
                             projection_dim=64, hidden_size=64, vocab_size=len(tokenizer))
    random_model(PaliGemmaForConditionalGeneration, config, seed, std).save_pretrained(path)
    processor.save_pretrained(path)
    return str(path)


def hf_paligemma_greedy(path: str, text: str, images: list[bytes], max_new_tokens: int,
                        bidirectional: bool = True) -> tuple[list[int], list[int]]:
    """transformers' (prompt ids, greedy tokens): through ``PaliGemmaProcessor`` with images; a text prompt as the
    tokenizer's ids, the whole prompt the prefix (``token_type_ids`` 0) as the processor marks one.
    ``bidirectional=False``: every prompt token causal (no ``token_type_ids``, the decoder's layers causal), to show
    the prefix attention matters."""
    import torch
    from PIL import Image

    processor, model = _hf_model(path)
    if images:
        pil = [Image.open(io.BytesIO(image)).convert("RGB") for image in images]
        inputs = dict(processor(text=text, images=pil, return_tensors="pt"))
        inputs.pop("labels")
    else:
        inputs = dict(processor.tokenizer(text, return_tensors="pt"))
        inputs["token_type_ids"] = torch.zeros_like(inputs["input_ids"])
    if not bidirectional:
        inputs.pop("token_type_ids")
    causal = not bidirectional
    for layer in model.model.language_model.layers:  # the layers' own flag decides a prompt without token_type_ids
        layer.self_attn.is_causal = causal
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    prompt = inputs["input_ids"][0].tolist()
    return prompt, out[0, len(prompt):].tolist()


@functools.lru_cache(maxsize=2)
def _hf_model(path: str):
    """(``PaliGemmaProcessor``, float32 ``PaliGemmaForConditionalGeneration``) of the checkpoint at ``path``."""
    import torch
    from transformers import PaliGemmaForConditionalGeneration, PaliGemmaProcessor

    model = PaliGemmaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    return PaliGemmaProcessor.from_pretrained(path), model
