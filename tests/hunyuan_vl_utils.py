"""A tiny random HunYuan VL checkpoint (``HunYuanVLForConditionalGeneration``: its ViT, the patch merger with row
newlines and begin / end rows, and HunYuan's dense decoder with XD-RoPE) and transformers' reference for the tests."""

from __future__ import annotations

from pathlib import Path

from mm_utils import expand_image_tokens, hf_generate, random_model

__all__ = ["IMAGE", "IMAGE_PLACEHOLDER", "hf_hunyuan_vl_greedy", "hf_hunyuan_vl_inputs", "make_tiny_hunyuan_vl"]

START, IMAGE, END, NEWLINE = "<|hy_image_start|>", "<|hy_image|>", "<|hy_image_end|>", "<|hy_image_newline|>"
IMAGE_PLACEHOLDER = START + IMAGE + END
"""What a prompt holds per image (transformers' processor insists on the start and end around the marker)."""
_IDS = ("im_start_id", "image_token_id", "im_end_id", "im_newline_id")
CHAT_TEMPLATE = (  # roles as <|role|>, an image part as its placeholder (HunYuan's layout, trimmed)
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<|hy_image_start|><|hy_image|><|hy_image_end|>' }}"
    "{% else %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def make_tiny_hunyuan_vl(path: str | Path, seed: int = 0, sections: tuple[int, ...] = (2, 2, 2, 2)) -> str:
    """Save a tiny random ``HunYuanVLForConditionalGeneration`` (2 decoder layers of head_dim 16 with GQA, tied
    embeddings, the checkpoints' fixed-alpha ``xdrope`` rope over ``sections`` (HunyuanOCR's four axes: position,
    width, height, image; or three); a 2-layer tower of 8-pixel patches whose 8 x 8 position table is resampled
    to each image's grid) with its tokenizer (Qwen2's, the image markers added) and its PIL image processor
    (4 to 64 merged patches per image)."""
    from transformers import (AutoTokenizer, HunYuanVLConfig, HunYuanVLForConditionalGeneration,
                              HunYuanVLImageProcessorPil)

    from asyncllm.tiny import tiny_checkpoint

    path = Path(path)
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint("qwen2"))
    tokenizer.add_special_tokens({"additional_special_tokens": [START, IMAGE, END, NEWLINE]})
    tokenizer.chat_template = CHAT_TEMPLATE
    ids = dict(zip(_IDS, tokenizer.convert_tokens_to_ids([START, IMAGE, END, NEWLINE])))
    rope = {"type": "xdrope", "alpha": 1000.0, "factor": 1.0, "rope_theta": 10_000.0, "xdrope_section": list(sections)}
    text = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                bos_token_id=0, eos_token_id=1, pad_token_id=2, rope_scaling=rope)
    vision = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64, patch_size=8,
                  max_image_size=64, spatial_merge_size=2)
    config = HunYuanVLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, **ids)
    random_model(HunYuanVLForConditionalGeneration, config, seed).save_pretrained(path)
    tokenizer.save_pretrained(path)
    unit = 16 * 16
    HunYuanVLImageProcessorPil(size={"shortest_edge": 4 * unit, "longest_edge": 64 * unit}, patch_size=8,
                               merge_size=2).save_pretrained(path)
    return str(path)


def hf_hunyuan_vl_inputs(path: str, text: str, images: list[bytes], add_special_tokens: bool = True) -> dict:
    """transformers' model inputs for ``text`` with one `IMAGE_PLACEHOLDER` per image: ``HunYuanVLProcessor``'s
    own expansion (its ``replace_image_token`` over the checkpoint's tokenizer and image processor) and its token
    types (1 on the image tokens), from which the model computes its positions."""
    from types import SimpleNamespace

    from transformers import AutoImageProcessor, AutoTokenizer, HunYuanVLProcessor

    tokenizer = AutoTokenizer.from_pretrained(path)
    processor = SimpleNamespace(image_processor=AutoImageProcessor.from_pretrained(path), image_token=IMAGE,
                                cat_extra_token=True)
    text, inputs = expand_image_tokens(HunYuanVLProcessor, processor, text, images)
    inputs["input_ids"] = tokenizer([text], return_tensors="pt", add_special_tokens=add_special_tokens)["input_ids"]
    inputs["mm_token_type_ids"] = (inputs["input_ids"] == tokenizer.convert_tokens_to_ids(IMAGE)).int()
    return inputs


def hf_hunyuan_vl_greedy(path: str, text: str | None, images: list[bytes], max_new_tokens: int,
                         messages: list | None = None, position_ids=None,
                         adapter: str | None = None) -> tuple[list[int], list[int]]:
    """transformers' (prompt ids, greedy tokens) for a text with image placeholders (or chat messages);
    ``position_ids``: given to the model instead of its XD-RoPE positions; ``adapter``: a PEFT adapter folder the
    model runs with."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    if messages is not None:
        text = AutoTokenizer.from_pretrained(path).apply_chat_template(messages, add_generation_prompt=True,
                                                                        tokenize=False)
    inputs = hf_hunyuan_vl_inputs(path, text, images, add_special_tokens=messages is None)
    if position_ids is not None:
        inputs["position_ids"] = position_ids
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    return hf_generate(model, inputs, max_new_tokens, adapter)
