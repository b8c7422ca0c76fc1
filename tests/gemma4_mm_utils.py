"""A tiny random Gemma 4 image-text checkpoint (Gemma 4's vision tower + embedder + the tiny Gemma 4 decoder)."""

from __future__ import annotations

import io
import os
from pathlib import Path

from mm_utils import random_model

__all__ = ["BOI", "IMAGE", "fill_checkpoint_buffers", "hf_gemma4_greedy", "hf_gemma4_logits", "hf_gemma4_prompt", "make_tiny_gemma4_mm"]

BOI, EOI, IMAGE = "<|image>", "<image|>", "<|image|>"
PATCH, POOL = 4, 2
"""4-pixel patches pooled 2 x 2: an image resized to at most 70 soft tokens (the processor's smallest budget)."""


def make_tiny_gemma4_mm(path: str | os.PathLike[str], seed: int = 0, bidirectional: str | None = "vision",
                        standardize: bool = True, clipped: bool = True, **text_overrides: object) -> str:
    """Save a tiny random ``Gemma4ForConditionalGeneration`` in ``path``: the tiny E2B-style decoder (KV sharing,
    per-layer inputs; its sliding layers see 8 tokens, fewer than an image's rows), whose sliding layers let an
    image's rows see each other (``use_bidirectional_attention="vision"``), under a 2-layer vision tower with
    clipped linears and standardized outputs. ``text_overrides``: the decoder's config fields changed."""
    from tokenizers import AddedToken  # noqa: F401
    from transformers import AutoTokenizer, Gemma4Config, Gemma4ForConditionalGeneration, Gemma4ImageProcessor

    from asyncllm.models.checkpoint import load_hf_config
    from asyncllm.tiny import tiny_checkpoint

    path = Path(path)
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint("llama"))
    tokenizer.add_special_tokens({"additional_special_tokens": [BOI, EOI, IMAGE]})
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in (BOI, EOI, IMAGE)}
    text = load_hf_config(tiny_checkpoint("gemma4")).to_dict()
    text.update(vocab_size=len(tokenizer), vocab_size_per_layer_input=len(tokenizer), pad_token_id=2,
                use_bidirectional_attention=bidirectional, **text_overrides)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=16, patch_size=PATCH, pooling_kernel_size=POOL,
                  position_embedding_size=64, use_clipped_linears=clipped, standardize=standardize)
    config = Gemma4Config(text_config=text, vision_config=vision, audio_config=None, boi_token_id=ids[BOI],
                          eoi_token_id=ids[EOI], image_token_id=ids[IMAGE], architectures=["Gemma4ForConditionalGeneration"])
    model = random_model(Gemma4ForConditionalGeneration, config, seed, std=0.05)
    fill_checkpoint_buffers(model, seed)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    Gemma4ImageProcessor(patch_size=PATCH, pooling_kernel_size=POOL, max_soft_tokens=70).save_pretrained(path)
    return str(path)


def fill_checkpoint_buffers(model, seed: int) -> None:
    """The buffers a Gemma 4 checkpoint carries, set: clip bounds at +-2, standardization and layer scalars
    random near 0 (biases) or 1."""
    import torch

    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed)
        for name, buffer in model.named_buffers():
            if name.endswith(("input_min", "output_min")):
                buffer.fill_(-2.0)
            elif name.endswith(("input_max", "output_max")):
                buffer.fill_(2.0)
            elif name.endswith(("std_bias", "layer_scalar", "std_scale")):
                buffer.copy_(torch.randn(buffer.shape, generator=gen) * 0.1 + (0.0 if "bias" in name else 1.0))


def hf_gemma4_prompt(path: str, text: str, soft_tokens: list[int]) -> list[int]:
    """The prompt ids ``Gemma4Processor`` makes of ``text``: each ``<|image|>`` replaced by
    ``<|image>`` + ``<|image|>`` once per soft token of that image + ``<image|>``, then tokenized."""
    from transformers import AutoTokenizer

    parts = text.split(IMAGE)
    assert len(parts) == len(soft_tokens) + 1
    full = parts[0] + "".join(f"{BOI}{IMAGE * n}{EOI}{rest}" for n, rest in zip(soft_tokens, parts[1:]))
    return AutoTokenizer.from_pretrained(path)(full)["input_ids"]


def _hf_inputs(path: str, text: str, images: list[bytes], bidirectional: bool) -> dict:
    import torch
    from PIL import Image
    from transformers import AutoImageProcessor

    inputs: dict = {}
    soft: list[int] = []
    if images:
        pil = [Image.open(io.BytesIO(image)).convert("RGB") for image in images]
        processed = AutoImageProcessor.from_pretrained(path)(images=pil, return_tensors="pt")
        soft = [int(n) for n in processed.pop("num_soft_tokens_per_image")]
        inputs.update(processed)
    prompt = hf_gemma4_prompt(path, text, soft)
    inputs["input_ids"] = torch.tensor([prompt])
    if bidirectional:
        from transformers import AutoTokenizer

        image = AutoTokenizer.from_pretrained(path).convert_tokens_to_ids(IMAGE)
        inputs["mm_token_type_ids"] = (inputs["input_ids"] == image).long()
    return inputs


def hf_gemma4_logits(path: str, text: str, images: list[bytes], bidirectional: bool = True):
    """transformers' (prompt ids, float32 logits at every prompt position)."""
    import torch
    from transformers import AutoModelForImageTextToText

    inputs = _hf_inputs(path, text, images, bidirectional)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return inputs["input_ids"][0].tolist(), model(**inputs).logits[0]


def hf_gemma4_greedy(path: str, text: str, images: list[bytes], max_new_tokens: int,
                     bidirectional: bool = True) -> tuple[list[int], list[int]]:
    """transformers' (prompt ids, greedy tokens); ``bidirectional=False`` leaves out ``mm_token_type_ids``."""
    import torch
    from transformers import AutoModelForImageTextToText

    inputs = _hf_inputs(path, text, images, bidirectional)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    prompt = inputs["input_ids"][0].tolist()
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return prompt, out[0, len(prompt):].tolist()
