"""A tiny random LLaVA-NeXT-Video checkpoint, and transformers' reference for it: ``LlavaNextVideoVideoProcessor``
(torchvision only: run with torchvision's functions stood in, tests/glm4v_video_utils.py), ``LlavaNextVideoProcessor``'s
placeholder counts (its methods, without the instance it cannot build here) and the model's greedy tokens."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from types import SimpleNamespace

from glm4v_video_utils import _processor_class, _torchvision_stood_in
from mm_utils import GRID_PINPOINTS, IMAGE_SIZE, PATCH_SIZE, make_tiny_llava, random_model

__all__ = ["VIDEO_TOKEN", "hf_llava_next_video_greedy", "hf_llava_video_pixels", "make_tiny_llava_next_video"]

VIDEO_TOKEN = "<video>"
_CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
_CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


def make_tiny_llava_next_video(path: str | os.PathLike[str], seed: int = 0, pool: str = "average") -> str:
    """Save a tiny random ``LlavaNextVideoForConditionalGeneration`` (the tiny LLaVA-NeXT's tower, decoder and anyres
    grids; videos' 56-pixel frames pooled 2 x 2 by ``pool``: 4 features a frame) with its image processor, tokenizer
    (``<image>``, ``<video>``) and video processor config in ``path``."""
    from transformers import (
        AutoConfig,
        AutoTokenizer,
        LlavaNextImageProcessorPil,
        LlavaNextVideoConfig,
        LlavaNextVideoForConditionalGeneration,
    )

    base = Path(make_tiny_llava(Path(path) / "base", seed))
    llava = AutoConfig.from_pretrained(base)
    tokenizer = AutoTokenizer.from_pretrained(base)
    tokenizer.add_special_tokens({"additional_special_tokens": [VIDEO_TOKEN]}, replace_extra_special_tokens=False)
    text = llava.text_config
    text.vocab_size = len(tokenizer)
    config = LlavaNextVideoConfig(
        vision_config=llava.vision_config, text_config=text, image_token_index=llava.image_token_id,
        video_token_index=tokenizer.convert_tokens_to_ids(VIDEO_TOKEN), vision_feature_layer=-2,
        vision_feature_select_strategy="default", image_grid_pinpoints=GRID_PINPOINTS, spatial_pool_mode=pool,
        spatial_pool_stride=2,
    )
    random_model(LlavaNextVideoForConditionalGeneration, config, seed).save_pretrained(path)
    LlavaNextImageProcessorPil(size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
                               image_grid_pinpoints=GRID_PINPOINTS).save_pretrained(path)
    video = {"video_processor_type": "LlavaNextVideoVideoProcessor", "size": {"shortest_edge": IMAGE_SIZE},
             "crop_size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE}, "resample": 3, "do_resize": True,
             "do_center_crop": True, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
             "image_mean": _CLIP_MEAN, "image_std": _CLIP_STD, "do_convert_rgb": True, "do_sample_frames": False}
    (Path(path) / "video_preprocessor_config.json").write_text(json.dumps(video))
    tokenizer.save_pretrained(path)
    return str(path)


def hf_llava_video_pixels(path: str, videos: list) -> object:
    """transformers' ``LlavaNextVideoVideoProcessor`` of the checkpoint at ``path`` over ``videos`` (``[T, H, W, 3]``
    uint8 arrays), the frames used as given: ``pixel_values_videos`` ``[N, T, 3, H, W]``."""
    cls = _processor_class("transformers.models.llava_next_video.video_processing_llava_next_video",
                           "LlavaNextVideoVideoProcessor")
    with _torchvision_stood_in():
        return cls.from_pretrained(path)(videos=videos, return_tensors="pt")["pixel_values_videos"]


def hf_llava_next_video_greedy(path: str, text: str, images: list[bytes], videos: list,
                               max_new_tokens: int) -> tuple[list[int], list[int]]:
    """transformers' (prompt ids, greedy tokens) for ``text`` with one ``<image>`` per image and one ``<video>`` per
    video, each expanded by ``LlavaNextVideoProcessor``'s own count."""
    import torch
    from PIL import Image
    from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer, LlavaNextVideoForConditionalGeneration
    from transformers import LlavaNextVideoProcessor

    config, tokenizer = AutoConfig.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    counter = SimpleNamespace(image_processor=AutoImageProcessor.from_pretrained(path), patch_size=PATCH_SIZE,
                              num_additional_image_tokens=1, vision_feature_select_strategy="default",
                              image_token="<image>", video_token=VIDEO_TOKEN)
    for name in ("_get_number_of_features", "_get_unpadded_features"):
        setattr(counter, name, getattr(LlavaNextVideoProcessor, name).__get__(counter))
    inputs: dict = {}
    if images:
        pil = [Image.open(io.BytesIO(image)).convert("RGB") for image in images]
        inputs.update(counter.image_processor(images=pil, return_tensors="pt"))
    if videos:
        inputs["pixel_values_videos"] = hf_llava_video_pixels(path, videos)
    expanded, seen = [], {"image": 0, "video": 0}
    for token in tokenizer(text, add_special_tokens=True)["input_ids"]:
        kind = {config.image_token_id: "image", config.video_token_id: "video"}.get(token)
        if kind is None:
            expanded.append(token)
            continue
        replace = getattr(LlavaNextVideoProcessor, f"replace_{kind}_token")
        expanded += [token] * replace(counter, inputs, seen[kind]).count(getattr(counter, f"{kind}_token"))
        seen[kind] += 1
    model = LlavaNextVideoForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([expanded]), max_new_tokens=max_new_tokens, do_sample=False,
                             **inputs)
    return expanded, out[0, len(expanded):].tolist()
