"""A tiny random GLM-4.1V checkpoint (``Glm4vForConditionalGeneration``: its vision tower before GLM-4-0414's
decoder with M-RoPE) and transformers' reference for the tests."""

from __future__ import annotations

import json
import os
from pathlib import Path

from mm_utils import expand_image_tokens, hf_generate, make_image, random_model

__all__ = ["IMAGE", "IMAGE_PLACEHOLDER", "hf_glm4v_greedy", "hf_glm4v_inputs", "make_image", "make_tiny_glm4v"]

BEGIN, IMAGE, END = "<|begin_of_image|>", "<|image|>", "<|end_of_image|>"
IMAGE_PLACEHOLDER = BEGIN + IMAGE + END
"""What a prompt holds per image (the checkpoint's chat template renders the same)."""
SPECIAL_TOKENS = ["[gMASK]", "<sop>", "<|user|>", "<|assistant|>", BEGIN, IMAGE, END, "<|begin_of_video|>",
                  "<|video|>", "<|end_of_video|>"]

CHAT_TEMPLATE = (  # GLM-4.1V's layout, trimmed: roles as <|role|>, an image part as its placeholder
    "[gMASK]<sop>"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<|begin_of_image|><|image|><|end_of_image|>' }}"
    "{% elif part['type'] == 'video' %}{{ '<|begin_of_video|><|video|><|end_of_video|>' }}"
    "{% else %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def make_tiny_glm4v(path: str | os.PathLike[str], seed: int = 0, partial_rotary: float = 0.5, moe: bool = False) -> str:
    """Save a tiny random ``Glm4vForConditionalGeneration`` (``moe``: ``Glm4vMoeForConditionalGeneration``, a dense
    layer then one of 4 experts, 2 routed, and a shared one) with its tokenizer (GLM's special tokens, a chat
    template) and its image processor in ``path`` (4 to 64 merged tokens per image; a 4 x 4 position table, so
    every image's is resampled) and video processor config (8 to 128 merged tokens over all of a video's frames)."""
    import transformers
    from transformers import AutoTokenizer, Glm4vImageProcessorPil

    from asyncllm.tiny import tiny_checkpoint

    path = Path(path)
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint("qwen2"))
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS})
    tokenizer.chat_template = CHAT_TEMPLATE
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
    text = dict(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                rope_parameters={"rope_type": "default", "rope_theta": 10_000.0, "mrope_section": [4, 2, 2],
                                 "partial_rotary_factor": partial_rotary},
                bos_token_id=0, eos_token_id=1, pad_token_id=2)
    vision = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=4, out_hidden_size=128, image_size=56,
                  patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
    if moe:
        text.update(moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                    first_k_dense_replace=1, n_group=1, topk_group=1)
    name = "Glm4vMoe" if moe else "Glm4v"
    config = getattr(transformers, f"{name}Config")(text_config=text, vision_config=vision, image_token_id=ids[IMAGE],
                         video_token_id=ids["<|video|>"], image_start_token_id=ids[BEGIN],
                         image_end_token_id=ids[END], video_start_token_id=ids["<|begin_of_video|>"],
                         video_end_token_id=ids["<|end_of_video|>"])
    random_model(getattr(transformers, f"{name}ForConditionalGeneration"), config, seed).save_pretrained(path)
    tokenizer.save_pretrained(path)
    unit = 28 * 28
    Glm4vImageProcessorPil(size={"shortest_edge": 4 * unit, "longest_edge": 64 * unit}).save_pretrained(path)
    (path / "video_preprocessor_config.json").write_text(json.dumps(  # by hand: its class needs torchvision
        {"video_processor_type": "Glm4vVideoProcessor", "size": {"shortest_edge": 8 * unit, "longest_edge": 128 * unit}}))
    return str(path)


def hf_glm4v_inputs(path: str, text: str, images: list[bytes], add_special_tokens: bool = True) -> dict:
    """transformers' model inputs for ``text`` with one `IMAGE_PLACEHOLDER` per image, made by ``Glm4vProcessor``'s
    own expansion and token types (its instance needs a video processor, which needs torchvision: its methods run
    over the checkpoint's tokenizer and image processor here)."""
    from types import SimpleNamespace

    import torch
    from transformers import AutoImageProcessor, AutoTokenizer, Glm4vProcessor

    tokenizer = AutoTokenizer.from_pretrained(path)
    image_processor = AutoImageProcessor.from_pretrained(path)
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
    processor = SimpleNamespace(image_processor=image_processor, image_token=IMAGE, image_token_id=ids[IMAGE],
                                video_start_id=ids["<|begin_of_video|>"], video_end_id=ids["<|end_of_video|>"])
    text, inputs = expand_image_tokens(Glm4vProcessor, processor, text, images)
    inputs["input_ids"] = tokenizer([text], return_tensors="pt", add_special_tokens=add_special_tokens)["input_ids"]
    types = Glm4vProcessor.create_mm_token_type_ids(processor, inputs["input_ids"].tolist())
    inputs["mm_token_type_ids"] = torch.tensor(types)  # what M-RoPE's positions are computed from
    return inputs


def hf_glm4v_greedy(path: str, text: str | None, images: list[bytes], max_new_tokens: int,
                    messages: list | None = None, position_ids=None, adapter: str | None = None
                    ) -> tuple[list[int], list[int]]:
    """transformers' (prompt ids, greedy tokens) for a text with image placeholders (or chat messages), its
    processor expanding them; ``position_ids``: given to the model instead of its M-RoPE positions; ``adapter``: a
    PEFT adapter folder the model runs with."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    if messages is not None:
        text = AutoTokenizer.from_pretrained(path).apply_chat_template(messages, add_generation_prompt=True,
                                                                        tokenize=False)
    inputs = hf_glm4v_inputs(path, text, images, add_special_tokens=messages is None)  # a template has its own
    if position_ids is not None:
        inputs["position_ids"] = position_ids
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    return hf_generate(model, inputs, max_new_tokens, adapter)
