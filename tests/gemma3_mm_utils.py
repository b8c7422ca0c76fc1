"""A tiny random Gemma 3 image-text checkpoint (SigLIP tower + projector + Gemma 3 decoder) for the tests."""

from __future__ import annotations

import io
import os
from pathlib import Path

from mm_utils import random_model

__all__ = ["BOI", "hf_gemma3_greedy", "hf_gemma3_pan_and_scan_greedy", "hf_gemma3_prompt", "make_tiny_gemma3_mm"]

BOI, EOI, SOFT = "<start_of_image>", "<end_of_image>", "<image_soft_token>"
TOKENS_PER_IMAGE = 16

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<start_of_turn>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<start_of_image>' }}{% else %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)


def make_tiny_gemma3_mm(path: str | os.PathLike[str], seed: int = 0) -> str:
    """Save a tiny random ``Gemma3ForConditionalGeneration`` in ``path``: 64-pixel images in 8-pixel patches, pooled
    to 16 image tokens; a decoder whose sliding layers see 8 tokens (fewer than an image's rows); a tokenizer with one
    token for each run of 1 to 4 newlines, as Gemma's has."""
    from tokenizers import AddedToken
    from transformers import (
        AutoTokenizer,
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3ImageProcessorPil,
        Gemma3TextConfig,
        SiglipVisionConfig,
    )

    from asyncllm.tiny import tiny_checkpoint

    path = Path(path)
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint("llama"))
    tokenizer.add_special_tokens({"additional_special_tokens": [BOI, EOI, SOFT, "<start_of_turn>", "<end_of_turn>"]})
    tokenizer.add_tokens([AddedToken("\n" * n, normalized=False, special=False) for n in (4, 3, 2, 1)])
    tokenizer.chat_template = CHAT_TEMPLATE
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in (BOI, EOI, SOFT)}
    text = Gemma3TextConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                            sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                            bos_token_id=0, eos_token_id=1, pad_token_id=2)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                image_size=64, patch_size=8, vision_use_head=False)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=TOKENS_PER_IMAGE,
                          boi_token_index=ids[BOI], eoi_token_index=ids[EOI], image_token_index=ids[SOFT])
    # std 0.05: with the usual 0.2 this tiny Gemma repeats one token whatever the image
    random_model(Gemma3ForConditionalGeneration, config, seed, std=0.05).save_pretrained(path)
    tokenizer.save_pretrained(path)
    Gemma3ImageProcessorPil(size={"height": 64, "width": 64}).save_pretrained(path)
    return str(path)


def hf_gemma3_prompt(path: str, text: str, add_special_tokens: bool = True) -> list[int]:
    """The prompt ids ``Gemma3Processor`` makes of ``text``: each ``<start_of_image>`` replaced by
    ``"\\n\\n<start_of_image>" + <image_soft_token> * 16 + "<end_of_image>\\n\\n"``, then tokenized."""
    from transformers import AutoTokenizer

    full = f"\n\n{BOI}{SOFT * TOKENS_PER_IMAGE}{EOI}\n\n"
    tokenizer = AutoTokenizer.from_pretrained(path)
    return tokenizer(text.replace(BOI, full), add_special_tokens=add_special_tokens)["input_ids"]


def hf_gemma3_greedy(path: str, text: str, images: list[bytes], max_new_tokens: int, add_special_tokens: bool = True,
                     bidirectional: bool = True) -> tuple[list[int], list[int]]:
    """transformers' (prompt ids, greedy tokens); ``bidirectional=False`` leaves out ``token_type_ids`` (every
    image row causal, to show the mask matters)."""
    import torch
    from PIL import Image
    from transformers import AutoImageProcessor, AutoTokenizer

    prompt = hf_gemma3_prompt(path, text, add_special_tokens)
    input_ids = torch.tensor([prompt])
    inputs: dict = {"input_ids": input_ids}
    if images:
        pil = [Image.open(io.BytesIO(image)).convert("RGB") for image in images]
        inputs.update(AutoImageProcessor.from_pretrained(path)(images=pil, return_tensors="pt"))
        inputs.pop("num_crops", None)
        if bidirectional:
            soft = AutoTokenizer.from_pretrained(path).convert_tokens_to_ids(SOFT)
            inputs["token_type_ids"] = (input_ids == soft).long()
    return prompt, _hf_generate(path, inputs, max_new_tokens)


def hf_gemma3_pan_and_scan_greedy(path: str, text: str, images: list[bytes], max_new_tokens: int,
                                  bidirectional: bool = True) -> tuple[list[int], list[int]]:
    """transformers' (prompt ids, greedy tokens) through its ``Gemma3Processor`` with ``do_pan_and_scan=True``: its
    text around each image's crops, its pixels and its ``token_type_ids`` (left out with ``bidirectional=False``)."""
    from PIL import Image
    from transformers import AutoImageProcessor, AutoTokenizer, Gemma3Processor

    tokenizer = AutoTokenizer.from_pretrained(path, extra_special_tokens={"boi_token": BOI, "eoi_token": EOI,
                                                                          "image_token": SOFT})
    processor = Gemma3Processor(AutoImageProcessor.from_pretrained(path), tokenizer, image_seq_length=TOKENS_PER_IMAGE)
    pil = [Image.open(io.BytesIO(image)).convert("RGB") for image in images]
    inputs = dict(processor(text=[text], images=[pil], do_pan_and_scan=True, return_tensors="pt"))
    inputs.pop("num_crops", None)
    if not bidirectional:
        inputs.pop("token_type_ids")
    return inputs["input_ids"][0].tolist(), _hf_generate(path, inputs, max_new_tokens)


def _hf_generate(path: str, inputs: dict, max_new_tokens: int) -> list[int]:
    import torch
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()
