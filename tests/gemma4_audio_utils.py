"""A tiny random Gemma 4 checkpoint with an audio tower (and the vision tower of tests/gemma4_mm_utils.py), its
feature extractor and image processor in one nested processor_config.json (as the release's), and transformers'
prompt ids and greedy tokens for texts with audio and image tokens."""

from __future__ import annotations

import json
import os
from pathlib import Path

from gemma4_mm_utils import BOI, EOI, IMAGE, fill_checkpoint_buffers, make_tiny_gemma4_mm

__all__ = ["AUDIO", "BOA", "EOA", "MEL", "hf_gemma4_audio_inputs", "hf_gemma4_audio_greedy", "make_tiny_gemma4_audio"]

BOA, EOA, AUDIO = "<|audio>", "<audio|>", "<|audio|>"
MEL = 16
"""Mel bins: the first convolution's channels (transformers sizes the projection as ``channels[0] // 4`` bins)."""
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|turn>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'audio' %}{{ '<|audio|>' }}{% elif part['type'] == 'image' %}{{ '<|image|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<turn|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|turn>model\n' }}{% endif %}"
)
"""Gemma 4's template's shape: an audio part as ``<|audio|>``, an image part as ``<|image|>``."""


def make_tiny_gemma4_audio(path: str | os.PathLike[str], seed: int = 0, chunk: int = 4, left: int = 5,
                           right: int = 0, **text_overrides: object) -> str:
    """Save the tiny Gemma 4 image-text checkpoint with a 2-layer audio tower (attention chunks of ``chunk``
    queries, ``left - 1`` frames back, ``right`` ahead) and its processors in ``path``; ``text_overrides``: the
    decoder's config fields changed."""
    from transformers import AutoTokenizer, Gemma4AudioFeatureExtractor, Gemma4ForConditionalGeneration

    from asyncllm.models.checkpoint import load_hf_config
    from mm_utils import random_model

    path = Path(path)
    make_tiny_gemma4_mm(path, seed=seed, **text_overrides)  # the tokenizer, config and image processor to extend
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.add_special_tokens({"additional_special_tokens": [BOI, EOI, IMAGE, BOA, EOA, AUDIO]})
    tokenizer.chat_template = CHAT_TEMPLATE
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in (BOA, EOA, AUDIO)}
    config = load_hf_config(str(path))
    config.text_config.vocab_size = config.text_config.vocab_size_per_layer_input = len(tokenizer)
    config.audio_config = type(config).sub_configs["audio_config"](
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, subsampling_conv_channels=[MEL, 8],
        conv_kernel_size=5, attention_chunk_size=chunk, attention_context_left=left, attention_context_right=right,
        output_proj_dims=24, use_clipped_linears=True)
    config.boa_token_id, config.eoa_token_index, config.audio_token_id = ids[BOA], ids[EOA], ids[AUDIO]
    model = random_model(Gemma4ForConditionalGeneration, config, seed, std=0.05)
    fill_checkpoint_buffers(model, seed + 1)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    image = json.loads((path / "preprocessor_config.json").read_text())
    extractor = json.loads(Gemma4AudioFeatureExtractor(feature_size=MEL).to_json_string())
    (path / "preprocessor_config.json").unlink()
    (path / "processor_config.json").write_text(json.dumps({"feature_extractor": extractor, "image_processor": image}))
    return str(path)


def _audio_rows(mask) -> int:
    """``Gemma4Processor``'s count: the mask after two stride-2 convolutions."""
    return int(mask[::2][::2].sum())


def hf_gemma4_audio_inputs(path: str, text: str, audios: list, images: list[bytes] = (),
                           add_special_tokens: bool = True) -> dict:
    """What ``Gemma4Processor`` makes of ``text`` (audio and image tokens in it) with 16 kHz ``audios`` (padded to
    the longest, each with its mask) and ``images``: ids, features and masks, pixels and the vision token types
    (``add_special_tokens=False``: no BOS, as for a chat template's text)."""
    import io

    import torch
    from PIL import Image
    from transformers import AutoFeatureExtractor, AutoImageProcessor, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    inputs: dict = {}
    audio_rows: list[int] = []
    if audios:
        processed = AutoFeatureExtractor.from_pretrained(path)(list(audios), return_tensors="pt")
        inputs.update(input_features=processed["input_features"], input_features_mask=processed["input_features_mask"])
        audio_rows = [_audio_rows(mask) for mask in processed["input_features_mask"]]
    image_rows: list[int] = []
    if images:
        pil = [Image.open(io.BytesIO(image)).convert("RGB") for image in images]
        processed = AutoImageProcessor.from_pretrained(path)(images=pil, return_tensors="pt")
        image_rows = [int(n) for n in processed.pop("num_soft_tokens_per_image")]
        inputs.update(processed)
    full, rows = "", {AUDIO: iter(audio_rows), IMAGE: iter(image_rows)}
    for piece in _split(text):
        if piece == AUDIO:
            full += f"{BOA}{AUDIO * next(rows[AUDIO])}{EOA}"
        elif piece == IMAGE:
            full += f"{BOI}{IMAGE * next(rows[IMAGE])}{EOI}"
        else:
            full += piece
    ids = torch.tensor([tokenizer(full, add_special_tokens=add_special_tokens)["input_ids"]])
    inputs["input_ids"] = ids
    inputs["mm_token_type_ids"] = (ids == tokenizer.convert_tokens_to_ids(IMAGE)).long()
    return inputs


def _split(text: str) -> list[str]:
    import re

    return [piece for piece in re.split(f"({re.escape(AUDIO)}|{re.escape(IMAGE)})", text) if piece]


def hf_gemma4_audio_greedy(path: str, text: str, audios: list, max_new_tokens: int, images: list[bytes] = (),
                           add_special_tokens: bool = True) -> tuple[list[int], list[int]]:
    """transformers' (prompt ids, greedy tokens)."""
    import torch
    from transformers import Gemma4ForConditionalGeneration

    inputs = hf_gemma4_audio_inputs(path, text, audios, images, add_special_tokens)
    model = Gemma4ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    prompt = inputs["input_ids"][0].tolist()
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return prompt, out[0, len(prompt):].tolist()

