"""A tiny random Phi-4-multimodal checkpoint (``Phi4MultimodalForCausalLM``: a Phi-3 decoder, a SigLIP-like vision
tower over 448-pixel HD crops, a conformer audio encoder) and transformers' preprocessing and greedy reference for it.

transformers' ``Phi4MultimodalImageProcessor`` needs torchvision: `hf_phi4_image_processor` runs transformers' own
class with torchvision's ``resize``, ``normalize`` and ``pad`` stood in (tests/lfm2_vl_utils.py). The crops stay
448 pixels of 14-pixel patches, as transformers' processor counts its tokens for them (256 + 16 per view).
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Any

from lfm2_vl_utils import hf_image_processor, hf_image_processor_class
from mm_utils import random_model

IMAGE_TOKEN, AUDIO_TOKEN = "<|image|>", "<|audio|>"
EAGER = "eager"
"""transformers' SDPA path runs the vision tower causally when no view of the batch has padding (its vision attention
says ``is_causal = True`` and the mask it builds is then None); its eager path, like the original checkpoint's code,
attends both ways: the reference runs eager."""
PROCESSOR = dict(dynamic_hd=4)
"""At most 4 crops (36 in the released checkpoint), so a wide image is fitted to a grid."""


def hf_phi4_image_processor(path: str | None = None, **settings: Any) -> Any:
    cls = hf_image_processor_class("transformers.models.phi4_multimodal.image_processing_phi4_multimodal",
                                   "Phi4MultimodalImageProcessor")
    return hf_image_processor(path, cls, **settings)


def tiny_phi4_mm_config(vocab_size: int, image_id: int, audio_id: int, bos: int = 0, eos: int = 1) -> Any:
    """A tiny ``Phi4MultimodalConfig``: a 2-layer decoder with partial rotary, a 3-layer vision tower read up to its
    second-to-last layer, a 2-block audio conformer."""
    from transformers import Phi4MultimodalConfig

    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                  image_token_id=image_id)
    audio = dict(hidden_size=32, intermediate_size=48, num_blocks=2, num_attention_heads=4, ext_pw_out_channel=32,
                 depthwise_separable_out_channel=32, nemo_conv_channels=16, bias_max_distance=64,
                 audio_token_id=audio_id)
    return Phi4MultimodalConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                                original_max_position_embeddings=4096,
                                rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                 "partial_rotary_factor": 0.75},
                                bos_token_id=bos, eos_token_id=eos, pad_token_id=eos, vision_config=vision,
                                audio_config=audio)


def make_tiny_phi4_mm(path: str | os.PathLike[str], seed: int = 0) -> str:
    """Save a tiny random ``Phi4MultimodalForCausalLM`` (`tiny_phi4_mm_config`) with its tokenizer and processors."""
    from transformers import AutoTokenizer, Phi4MultimodalFeatureExtractor, Phi4MultimodalForCausalLM

    from asyncllm.tiny import tiny_checkpoint

    path = Path(path)
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint("llama"))
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN, AUDIO_TOKEN]})
    config = tiny_phi4_mm_config(len(tokenizer), *tokenizer.convert_tokens_to_ids([IMAGE_TOKEN, AUDIO_TOKEN]),
                                 tokenizer.bos_token_id, tokenizer.eos_token_id)
    config.architectures = ["Phi4MultimodalForCausalLM"]
    random_model(Phi4MultimodalForCausalLM, config, seed).save_pretrained(path)
    tokenizer.save_pretrained(path)
    processors = {"image_processor": hf_phi4_image_processor(**PROCESSOR).to_dict(),
                  "audio_processor": Phi4MultimodalFeatureExtractor().to_dict(),
                  "processor_class": "Phi4MultimodalProcessor"}  # transformers 5's one file for both
    (path / "processor_config.json").write_text(json.dumps(processors, indent=1))
    return str(path)


def hf_phi4_image_inputs(path: str, images: list[bytes]) -> dict[str, Any]:
    """transformers' image processor outputs for ``images`` (PNG bytes)."""
    from PIL import Image

    pil = [Image.open(io.BytesIO(image)).convert("RGB") for image in images]
    return dict(hf_phi4_image_processor(path)(pil, return_tensors="pt"))


def hf_phi4_audio_inputs(path: str, audios: list[Any]) -> dict[str, Any]:
    """transformers' feature extractor outputs for 16 kHz float32 ``audios``."""
    from transformers import Phi4MultimodalFeatureExtractor

    extractor = Phi4MultimodalFeatureExtractor.from_pretrained(path)
    return dict(extractor(audios, sampling_rate=16000, return_tensors="pt"))


def hf_phi4_greedy(path: str, text: str, images: list[bytes], audios: list[Any],
                   max_new_tokens: int) -> tuple[list[int], list[int]]:
    """transformers' (prompt ids, greedy tokens) for ``text`` whose ``<|image|>`` / ``<|audio|>`` markers are
    expanded as ``Phi4MultimodalProcessor`` does (one token per feature row)."""
    import torch
    from transformers import AutoTokenizer, Phi4MultimodalForCausalLM

    inputs: dict[str, Any] = {}
    if images:
        inputs.update(hf_phi4_image_inputs(path, images))
        counts = iter(inputs.pop("num_img_tokens"))
        text = "".join(part + (IMAGE_TOKEN * int(next(counts)) if i < len(images) else "")
                       for i, part in enumerate(text.split(IMAGE_TOKEN)))
    if audios:
        inputs.update(hf_phi4_audio_inputs(path, audios))
        counts = iter(inputs["audio_embed_sizes"].tolist())
        text = "".join(part + (AUDIO_TOKEN * int(next(counts)) if i < len(audios) else "")
                       for i, part in enumerate(text.split(AUDIO_TOKEN)))
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = tokenizer(text, return_tensors="pt")["input_ids"]
    model = Phi4MultimodalForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=EAGER).eval()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, **inputs)
    return ids[0].tolist(), out[0, ids.shape[1]:].tolist()
