"""A tiny random LFM2-VL checkpoint (SigLIP2's NaFlex tower, pixel unshuffle, an MLP projector, an LFM2 decoder)
and transformers' processor and greedy reference for it.

transformers' ``Lfm2VlImageProcessor`` needs torchvision, which cannot be imported beside the CPU machines' torch
build: `hf_image_processor` runs transformers' own class with a stand-in for the two torchvision functions it
calls (``resize``: torchvision's antialiased bilinear resize of a CPU tensor, which is torch's own kernel, on the
uint8 image where the CPU reports AVX2 and in float32 rounded back elsewhere, as torchvision chooses; ``normalize``).
Everything else (tiling, thumbnail, sizes, normalization, patch layout, the processor's token expansion) is
transformers' code.
"""

from __future__ import annotations

import enum
import functools
import os
import sys
import types
from pathlib import Path
from typing import Any

from mm_utils import CHAT_TEMPLATE, IMAGE_TOKEN, hf_generate, processor_inputs, random_model

PATCH = 8
"""The tower's patch (16 in the released checkpoints)."""
PROCESSOR = dict(encoder_patch_size=PATCH, downsample_factor=2, tile_size=64, min_image_tokens=4, max_image_tokens=16,
                 min_tiles=2, max_tiles=4, use_thumbnail=True, do_image_splitting=True, max_pixels_tolerance=2.0)
"""64-pixel tiles of 16 tokens; an image is 4 to 16 tokens at its smart size, and split past 8192 pixels."""
MARKERS = ["<|image_start|>", "<|image_end|>", "<|img_thumbnail|>"] + [
    f"<|img_row_{r}_col_{c}|>" for r in range(1, 5) for c in range(1, 5)]


class _InterpolationMode(enum.Enum):
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"  # Command A Vision's (tests/cohere2_vision_utils.py)
    LANCZOS = "lanczos"  # compared against, never used


def _tv_resize(image: Any, size: list[int], interpolation: Any = None, antialias: bool = True) -> Any:
    import torch
    import torch.nn.functional as F

    mode = (interpolation or _InterpolationMode.BILINEAR).value
    assert mode in ("bilinear", "bicubic"), interpolation
    size = [int(side) for side in size]  # Llama 4's processor passes 0-d tensors
    if list(image.shape[-2:]) == size:
        return image
    if image.dim() == 3:  # one (C, H, W) image (Phi-4-multimodal's processor passes one)
        return _tv_resize(image[None], size, interpolation, antialias)[0]
    native = image.dtype == torch.uint8 and (mode == "bicubic" or "AVX2" in torch.backends.cpu.get_cpu_capability())
    out = F.interpolate(image if native else image.float(), size=list(size), mode=mode, align_corners=False,
                        antialias=antialias)
    return out if native or image.dtype != torch.uint8 else out.round_().to(torch.uint8)


def _tv_normalize(image: Any, mean: Any, std: Any, inplace: bool = False) -> Any:
    import torch

    mean = torch.as_tensor(mean, dtype=image.dtype).view(-1, 1, 1)
    std = torch.as_tensor(std, dtype=image.dtype).view(-1, 1, 1)
    return (image if inplace else image.clone()).sub_(mean).div_(std)


def _tv_pad(image: Any, padding: list[int], fill: Any = 0, padding_mode: str = "constant") -> Any:
    import torch.nn.functional as F

    fills = set(fill) if isinstance(fill, list) else {fill}  # one value for every channel (Phi-4's white: 255)
    assert padding_mode == "constant" and len(padding) == 4 and len(fills) == 1
    left, top, right, bottom = padding
    return F.pad(image, [left, right, top, bottom], value=fills.pop())


@functools.lru_cache(maxsize=None)
def hf_image_processor_class(module: str = "transformers.models.lfm2_vl.image_processing_lfm2_vl",
                             name: str = "Lfm2VlImageProcessor") -> type:
    """transformers' image processor ``name`` of ``module`` (``Lfm2VlImageProcessor``; Llama 4's too) with
    torchvision's ``resize``, ``normalize`` and ``pad`` (zeros) stood in."""
    import importlib

    import transformers.image_processing_backends as backends
    from transformers.image_utils import PILImageResampling

    functional = types.ModuleType("torchvision.transforms.v2.functional")
    functional.resize, functional.normalize, functional.pad = _tv_resize, _tv_normalize, _tv_pad
    functional.InterpolationMode = _InterpolationMode
    modules = {name: types.ModuleType(name) for name in ("torchvision", "torchvision.transforms",
                                                         "torchvision.transforms.v2")}
    modules["torchvision.transforms.v2"].functional = functional
    saved = {name: sys.modules.get(name) for name in [*modules, functional.__name__]}
    sys.modules.update(modules, **{functional.__name__: functional})
    try:
        processor_cls = getattr(importlib.import_module(module), name)
    finally:  # only the class keeps the stand-in
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
    backends.tvF = functional  # absent without torchvision: nothing else reads them
    backends.pil_torch_interpolation_mapping = {PILImageResampling.BILINEAR: _InterpolationMode.BILINEAR,
                                                PILImageResampling.BICUBIC: _InterpolationMode.BICUBIC}
    return processor_cls


def hf_image_processor(path: str | None = None, cls: type | None = None, **settings: Any) -> Any:
    """An ``Lfm2VlImageProcessor`` (or ``cls``, another `hf_image_processor_class`) of the checkpoint at ``path``
    (or of ``settings``); its torchvision check passed for this construction only."""
    from transformers.utils import import_utils

    cls, saved = cls or hf_image_processor_class(), import_utils.BACKENDS_MAPPING["torchvision"]
    import_utils.BACKENDS_MAPPING["torchvision"] = (lambda: True, saved[1])
    try:
        return cls(**settings) if path is None else cls.from_pretrained(path, **settings)
    finally:
        import_utils.BACKENDS_MAPPING["torchvision"] = saved


def hf_processor(path: str) -> Any:
    """transformers' ``Lfm2VlProcessor`` over the checkpoint's tokenizer and image processor."""
    from transformers import AutoTokenizer, Lfm2VlProcessor

    return Lfm2VlProcessor(image_processor=hf_image_processor(path), tokenizer=AutoTokenizer.from_pretrained(path),
                           chat_template=CHAT_TEMPLATE)


def make_tiny_lfm2_vl(path: str | os.PathLike[str], seed: int = 0, layers: int = 2) -> str:
    """Save a tiny random ``Lfm2VlForConditionalGeneration`` (8-pixel patches, a 64-entry position grid, 2 x 2
    patches per token; an LFM2 decoder of ``layers`` layers alternating conv and attention) with its processor."""
    from transformers import AutoTokenizer, Lfm2Config, Lfm2VlConfig, Lfm2VlForConditionalGeneration, \
        Siglip2VisionConfig

    from asyncllm.tiny import tiny_checkpoint

    path = Path(path)
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint("llama"))
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN, *MARKERS]})
    tokenizer.chat_template = CHAT_TEMPLATE
    text = Lfm2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      layer_types=["conv", "full_attention"] * (layers // 2), conv_L_cache=3, block_multiple_of=32,
                      block_ffn_dim_multiplier=1.0, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    vision = Siglip2VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                 patch_size=PATCH, num_patches=64, vision_use_head=False)
    config = Lfm2VlConfig(vision_config=vision, text_config=text, projector_hidden_size=48, downsample_factor=2,
                          image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN), tie_word_embeddings=True)
    random_model(Lfm2VlForConditionalGeneration, config, seed).save_pretrained(path)
    tokenizer.save_pretrained(path)
    hf_image_processor(**PROCESSOR).save_pretrained(path)
    return str(path)


def hf_lfm2_vl_inputs(path: str, text: str, images: list[bytes], add_special_tokens: bool = True) -> Any:
    return processor_inputs(hf_processor(path), text, images, add_special_tokens)


def hf_lfm2_vl_greedy(path: str, text: str | None, images: list[bytes], max_new_tokens: int,
                      messages: list | None = None, adapter: str | None = None) -> tuple[list[int], list[int]]:
    """transformers' (prompt ids, greedy tokens) for a text with ``<image>`` markers (or chat messages), its
    processor expanding them; ``adapter``: a PEFT adapter folder the model runs with."""
    import torch
    from transformers import Lfm2VlForConditionalGeneration

    if messages is not None:
        text = hf_processor(path).apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = hf_lfm2_vl_inputs(path, text, images, add_special_tokens=messages is None)  # a template has its own
    model = Lfm2VlForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    return hf_generate(model, inputs, max_new_tokens, adapter)


DECODER_TARGETS = r".*language_model.*\.(self_attn\.(q_proj|k_proj|v_proj|out_proj)|feed_forward\.w\d)"
"""The decoder's projections that take adapters (LFM2's conv layers take none)."""


def lfm2_vl_adapter(path: str, out_dir: str, targets: str = DECODER_TARGETS) -> str:
    """A seeded PEFT LoRA adapter (rank 4) of the image-text model's ``targets``."""
    from lora_utils import make_adapter
    from transformers import AutoModelForImageTextToText

    return make_adapter(path, out_dir, seed=3, rank=4, alpha=8, targets=targets,
                        auto_class=AutoModelForImageTextToText)
