"""A tiny random Mistral 3 checkpoint (Pixtral tower + projector + Mistral decoder) for the tests."""

from __future__ import annotations

import io
import os
from pathlib import Path

from mistral_utils import write_tekken
from mm_utils import random_model

__all__ = ["IMAGE", "TEKKEN_IMAGE", "hf_mistral3_greedy", "make_tiny_mistral3", "make_tiny_pixtral_llava"]

IMAGE, IMAGE_BREAK, IMAGE_END = "[IMG]", "[IMG_BREAK]", "[IMG_END]"

TEKKEN_IMAGE = {"image_patch_size": 14, "max_image_size": 112, "spatial_merge_size": 2}
"""The tekken.json image section of the tiny Mistral 3 (its processor's: 14-pixel patches merged 2 x 2, 112 at most)."""

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '[INST]' }}{% endif %}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '[IMG]' }}{% else %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[/INST]' }}{% else %}{{ eos_token }}{% endif %}"
    "{% endfor %}"
)


def make_tiny_mistral3(path: str | os.PathLike[str], seed: int = 0, decoder: str = "mistral",
                       tekken: bool = False) -> str:
    """Save a tiny random ``Mistral3ForConditionalGeneration`` with its tokenizer and Pixtral image processor (longest
    edge 112 pixels: at most 4 x 4 merged patches an image) in ``path``; ``decoder`` "ministral3": Ministral 3's
    (a YaRN rope, the attention temperature from position 16 on); "mistral4": Mistral 4's. ``tekken``: Mistral's
    vocabulary only, a tekken.json with an image section (`TEKKEN_IMAGE`; [IMG] 10, BOS 1, EOS 2) and a SiLU
    tower, as Mistral Small 3.1 ships.

    ``unit`` in `hf_mistral3_greedy`: the pixels of one image token (28: Mistral 3's merged patches; 14: the tiny
    Pixtral-12B's patches)."""
    from transformers import (
        AutoTokenizer,
        Mistral3Config,
        Mistral3ForConditionalGeneration,
        MistralConfig,
        PixtralImageProcessorPil,
        PixtralVisionConfig,
    )

    from asyncllm.tiny import tiny_checkpoint

    path = Path(path)
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint("llama"))
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE, IMAGE_BREAK, IMAGE_END, "[INST]", "[/INST]"]})
    tokenizer.chat_template = CHAT_TEMPLATE
    shape = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                 bos_token_id=0, eos_token_id=1, pad_token_id=2)
    if tekken:
        shape.update(vocab_size=512, bos_token_id=1, eos_token_id=2, pad_token_id=11, tie_word_embeddings=False)
    if decoder == "mistral4":  # Mistral 4: DeepSeek-V3's latent attention and experts, the temperature past 16
        from transformers import Mistral4Config

        text = Mistral4Config(**{k: v for k, v in shape.items() if k not in ("intermediate_size", "head_dim",
                                                                            "num_key_value_heads")},
                              intermediate_size=128, kv_lora_rank=32, q_lora_rank=24, qk_nope_head_dim=16,
                              qk_rope_head_dim=8, v_head_dim=24, moe_intermediate_size=24, n_routed_experts=4,
                              n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
                              first_k_dense_replace=1, num_key_value_heads=4, rope_parameters={
                                  "rope_type": "yarn", "rope_theta": 10_000.0, "factor": 4.0,
                                  "original_max_position_embeddings": 16, "beta_fast": 32.0, "beta_slow": 1.0,
                                  "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.2,
                                  "partial_rotary_factor": 8 / 24})
    elif decoder == "ministral3":
        from transformers import Ministral3Config

        text = Ministral3Config(**shape, rope_parameters={
            "rope_type": "yarn", "rope_theta": 1_000_000.0, "factor": 32.0, "original_max_position_embeddings": 16,
            "max_position_embeddings": 512, "beta_fast": 32.0, "beta_slow": 1.0, "llama_4_scaling_beta": 0.5})
    else:
        text = MistralConfig(**shape, sliding_window=None)
    vision = PixtralVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                 patch_size=14, image_size=112, hidden_act="silu" if tekken else "gelu")
    config = Mistral3Config(vision_config=vision, text_config=text,
                            image_token_id=10 if tekken else tokenizer.convert_tokens_to_ids(IMAGE),
                            spatial_merge_size=2, vision_feature_layer=-1, multimodal_projector_bias=False)
    random_model(Mistral3ForConditionalGeneration, config, seed).save_pretrained(path)
    if tekken:
        write_tekken(str(path), image=TEKKEN_IMAGE)
    else:
        tokenizer.save_pretrained(path)
    PixtralImageProcessorPil(size={"longest_edge": 112}, patch_size=14).save_pretrained(path)
    return str(path)


def make_tiny_pixtral_llava(path: str | os.PathLike[str], seed: int = 0, tekken: bool = False) -> str:
    """Save a tiny random Pixtral-12B-style ``LlavaForConditionalGeneration`` (the tiny Mistral 3's tower, no patch
    merging, LLaVA's projector, a Mistral decoder) with its tokenizer and image processor in ``path``; ``tekken``:
    as `make_tiny_mistral3`'s, the tekken.json's patches 14 pixels, unmerged."""
    from transformers import AutoConfig, AutoTokenizer, LlavaConfig, LlavaForConditionalGeneration, PixtralImageProcessorPil

    reference = Path(make_tiny_mistral3(Path(path) / "mistral3", seed, tekken=tekken))
    mistral3 = AutoConfig.from_pretrained(reference)
    config = LlavaConfig(vision_config=mistral3.vision_config, text_config=mistral3.text_config,
                         image_token_index=mistral3.image_token_id, vision_feature_layer=-1,
                         vision_feature_select_strategy="full", projector_hidden_act="gelu")
    random_model(LlavaForConditionalGeneration, config, seed).save_pretrained(path)
    if tekken:
        write_tekken(str(path), image={**TEKKEN_IMAGE, "spatial_merge_size": 1})
    else:
        AutoTokenizer.from_pretrained(reference).save_pretrained(path)
    PixtralImageProcessorPil(size={"longest_edge": 112}, patch_size=14).save_pretrained(path)
    return str(path)


def hf_mistral3_greedy(path: str, text: str, images: list[bytes], max_new_tokens: int,
                       add_special_tokens: bool = True, unit: int = 28) -> tuple[list[int], list[int]]:
    """transformers' (prompt ids, greedy tokens): each ``[IMG]`` expanded as ``PixtralProcessor`` does (rows of
    ``[IMG]`` closed by ``[IMG_BREAK]``, the last by ``[IMG_END]``), the image processor called with 28-pixel patches."""
    import torch
    from PIL import Image
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    inputs: dict = {}
    if images:
        pil = [Image.open(io.BytesIO(image)).convert("RGB") for image in images]
        inputs = dict(AutoImageProcessor.from_pretrained(path)(images=pil, return_tensors="pt", patch_size=unit))
        parts = text.split(IMAGE)
        for (height, width), i in zip(inputs["image_sizes"].tolist(), range(1, len(parts))):
            row = IMAGE * (width // unit) + IMAGE_BREAK
            parts[i] = (row * (height // unit))[: -len(IMAGE_BREAK)] + IMAGE_END + parts[i]
        text = "".join(parts)
    inputs["input_ids"] = tokenizer([text], return_tensors="pt", add_special_tokens=add_special_tokens)["input_ids"]
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    prompt = inputs["input_ids"][0].tolist()
    return prompt, out[0, len(prompt):].tolist()
