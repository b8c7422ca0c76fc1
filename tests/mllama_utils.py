"""A tiny random Llama 3.2 Vision (``MllamaForConditionalGeneration``) checkpoint and transformers' greedy output."""

from __future__ import annotations

import contextlib
import functools
import io
import os
from pathlib import Path

IMAGE_TOKEN = "<|image|>"
TILE = 16
"""Tiles of 16 pixels, patches of 4: 16 patches + the class row = 17 rows a tile (padded to 24 inside the encoder)."""
CROSS_LAYERS = [1, 3]


def make_tiny_mllama(path: str | os.PathLike[str], seed: int = 0) -> str:
    """Save a tiny random ``MllamaForConditionalGeneration`` (4 tiles of 16 pixels at most; a 2 + 1 layer vision
    encoder; a 4-layer decoder whose layers 1 and 3 are cross-attention layers) with its image processor and
    tokenizer in ``path``. ``<|image|>`` is the first id past ``vocab_size``, as in Meta's checkpoints, and the gates
    are drawn (transformers starts them at zero, which would hide the images)."""
    from mm_utils import random_model
    from transformers import AutoTokenizer, MllamaForConditionalGeneration, MllamaImageProcessorPil

    from asyncllm.tiny import tiny_checkpoint

    path = Path(path)
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint("llama"))
    vocab_size = len(tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    config = tiny_mllama_config(vocab_size)
    model = random_model(MllamaForConditionalGeneration, config, seed)
    model.save_pretrained(path)
    MllamaImageProcessorPil(size={"height": TILE, "width": TILE}, max_image_tiles=4).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def tiny_mllama_config(vocab_size: int = 512):
    """The tiny checkpoint's config (`make_tiny_mllama`): ``<|image|>`` is ``vocab_size``."""
    from transformers import MllamaConfig, MllamaTextConfig, MllamaVisionConfig

    vision = MllamaVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_global_layers=1,
                                attention_heads=4, image_size=TILE, patch_size=4, max_num_tiles=4,
                                intermediate_layers_indices=[0], vision_output_dim=64)
    text = MllamaTextConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                            num_attention_heads=4, num_key_value_heads=2, cross_attention_layers=CROSS_LAYERS,
                            max_position_embeddings=512, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    config = MllamaConfig(vision_config=vision, text_config=text, image_token_index=vocab_size)
    config.architectures = ["MllamaForConditionalGeneration"]
    return config


@functools.lru_cache(maxsize=2)
def _hf_model(path: str):
    import torch
    from transformers import MllamaForConditionalGeneration

    return MllamaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()


@contextlib.contextmanager
def vision_layer_inputs():
    """transformers' ``MllamaVisionEncoder`` recording each layer's input (``hidden_states[i]``: what layer i takes,
    as Meta's encoder, transformers 4 and vLLM pick ``intermediate_layers_indices``), not 5.x's each layer's output
    (docs/multimodal.md#llama-32-vision)."""
    from transformers.modeling_outputs import BaseModelOutput
    from transformers.models.mllama import modeling_mllama

    def forward(self, hidden_states, attention_mask=None):
        inputs = []
        for layer in self.layers:
            inputs.append(hidden_states)
            hidden_states = layer(hidden_states=hidden_states, attention_mask=attention_mask)
        return BaseModelOutput(last_hidden_state=hidden_states, hidden_states=tuple(inputs))

    original = modeling_mllama.MllamaVisionEncoder.forward
    modeling_mllama.MllamaVisionEncoder.forward = forward
    try:
        yield
    finally:
        modeling_mllama.MllamaVisionEncoder.forward = original


def hf_mllama_greedy(path: str, prompt_ids: list[int], images: list[bytes], max_new_tokens: int,
                     adapter: str | None = None) -> list[int]:
    """transformers' greedy tokens for ``prompt_ids`` (its ``<|image|>`` tokens in place) and ``images``, with the
    cross-attention mask its processor builds and its vision encoder's intermediate layers as Meta's
    (`vision_layer_inputs`); PEFT's with ``adapter`` (a LoRA folder)."""
    import torch
    from PIL import Image
    from transformers import AutoImageProcessor
    from transformers.models.mllama.processing_mllama import (
        convert_sparse_cross_attention_mask_to_dense,
        get_cross_attention_token_mask,
    )

    if adapter is None:
        model = _hf_model(path)
    else:
        from lora_utils import _peft_model
        from transformers import MllamaForConditionalGeneration

        model = _peft_model(path, adapter, MllamaForConditionalGeneration)
    inputs: dict = {"input_ids": torch.tensor([prompt_ids])}
    if images:
        processor = AutoImageProcessor.from_pretrained(path)
        pil = [Image.open(io.BytesIO(image)).convert("RGB") for image in images]
        pixels = processor(images=[pil], return_tensors="pt")
        num_tiles = pixels.pop("num_tiles")
        mask = convert_sparse_cross_attention_mask_to_dense(
            [get_cross_attention_token_mask(prompt_ids, model.config.image_token_index)], num_tiles,
            processor.max_image_tiles, len(prompt_ids))
        inputs.update(pixels, cross_attention_mask=torch.from_numpy(mask))
    with torch.no_grad(), vision_layer_inputs():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt_ids):].tolist()
