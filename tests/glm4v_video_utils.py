"""transformers' reference for GLM-4.1V's videos: its ``Glm4vVideoProcessor`` (torchvision only: run here with
torchvision's ``resize`` and ``normalize`` stood in), ``Glm4vProcessor``'s expansion of ``<|video|>`` into per-frame
runs with timestamps, and its model's greedy tokens."""

from __future__ import annotations

import contextlib
import functools
import io
import re
import sys
import types
from types import SimpleNamespace
from typing import Any, Iterator

from glm4v_utils import IMAGE, SPECIAL_TOKENS

__all__ = ["VIDEO", "VIDEO_PLACEHOLDER", "hf_glm4v_video_greedy", "hf_glm4v_video_inputs", "hf_video_processor"]

VIDEO = "<|video|>"
VIDEO_PLACEHOLDER = "<|begin_of_video|>" + VIDEO + "<|end_of_video|>"
"""What a prompt holds per video (GLM's chat template writes the same for a video part)."""


class _Mode:
    BICUBIC = "bicubic"
    LANCZOS = "lanczos"  # compared against, never used


def _tv_resize(image: Any, size: list[int], interpolation: Any = None, antialias: bool = True) -> Any:
    """torchvision's resize of a CPU tensor for bicubic: torch's kernel over the last two dims, uint8 in and out
    (its native path)."""
    import torch.nn.functional as F

    assert interpolation == _Mode.BICUBIC, interpolation
    flat = image.reshape(-1, *image.shape[-3:])
    out = F.interpolate(flat, size=list(size), mode="bicubic", align_corners=False, antialias=antialias)
    return out.reshape(*image.shape[:-2], *out.shape[-2:])


def _tv_grayscale_to_rgb(image: Any) -> Any:
    assert image.shape[-3] == 3, image.shape  # the tests' frames are RGB already
    return image


def _tv_crop(image: Any, top: int, left: int, height: int, width: int) -> Any:
    return image[..., top:top + height, left:left + width]


def _tv_pad(image: Any, padding: list[int], fill: int = 0) -> Any:
    import torch.nn.functional as F

    left, top, right, bottom = padding
    return F.pad(image, (left, right, top, bottom), value=fill)


def _tv_normalize(image: Any, mean: Any, std: Any, inplace: bool = False) -> Any:
    out = image if inplace else image.clone()
    return out.sub_(mean.view(-1, 1, 1).to(image.dtype)).div_(std.view(-1, 1, 1).to(image.dtype))


def _to_pil_image(image: Any) -> Any:
    """torchvision's ``to_pil_image`` of a ``[3, H, W]`` uint8 tensor."""
    from PIL import Image

    return Image.fromarray(image.permute(1, 2, 0).numpy())


def _pil_to_tensor(image: Any) -> Any:
    import numpy as np
    import torch

    return torch.from_numpy(np.array(image)).permute(2, 0, 1).contiguous()


@functools.lru_cache(maxsize=None)
def _processor_class(module: str = "transformers.models.glm4v.video_processing_glm4v",
                     name: str = "Glm4vVideoProcessor") -> type:
    """transformers' video processor class ``name`` of ``module``, imported with torchvision stubbed."""
    import importlib

    import transformers.models.auto.video_processing_auto  # noqa: F401 (imported before torchvision is stubbed,
    import transformers.video_processing_utils  # noqa: F401 as ERNIE's docstrings read the first)

    names = ("torchvision", "torchvision.transforms", "torchvision.transforms.v2",
             "torchvision.transforms.v2.functional", "torchvision.transforms.functional")
    stubs = {name: types.ModuleType(name) for name in names}
    stubs["torchvision.transforms.v2"].functional = stubs[names[3]]
    stubs[names[-1]].pil_to_tensor, stubs[names[-1]].to_pil_image = _pil_to_tensor, _to_pil_image  # ERNIE's drawing
    saved = {name: sys.modules.get(name) for name in names}
    sys.modules.update(stubs)
    try:
        processor_class = getattr(importlib.import_module(module), name)
    finally:
        for stub, saved_module in saved.items():
            sys.modules.pop(stub) if saved_module is None else sys.modules.__setitem__(stub, saved_module)
    return processor_class


@contextlib.contextmanager
def _torchvision_stood_in() -> Iterator[None]:
    """transformers' torchvision backend with the stand-ins, for the duration only."""
    import transformers.image_processing_backends as backends
    import transformers.video_processing_utils as videos
    from transformers.image_utils import PILImageResampling
    from transformers.utils import import_utils

    functional = SimpleNamespace(resize=_tv_resize, normalize=_tv_normalize, grayscale_to_rgb=_tv_grayscale_to_rgb,
                                 crop=_tv_crop, pad=_tv_pad, InterpolationMode=_Mode)
    patches = {(backends, "tvF"): functional, (videos, "tvF"): functional,
               (backends, "pil_torch_interpolation_mapping"): {PILImageResampling.BICUBIC: _Mode.BICUBIC}}
    saved = {key: getattr(*key, None) for key in patches}
    saved_check = import_utils.BACKENDS_MAPPING["torchvision"]
    for (module, name), value in patches.items():
        setattr(module, name, value)
    import_utils.BACKENDS_MAPPING["torchvision"] = (lambda: True, saved_check[1])
    try:
        yield
    finally:
        for (module, name), value in saved.items():
            setattr(module, name, value)
        import_utils.BACKENDS_MAPPING["torchvision"] = saved_check


def hf_video_processor(path: str, videos: list, processor_class: tuple[str, str] | None = None, **kwargs: Any) -> Any:
    """transformers' ``Glm4vVideoProcessor`` (or ``processor_class``: its module and name) of the checkpoint at
    ``path`` over ``videos`` (``(frames, metadata)`` pairs), the frames used as given: ``pixel_values_videos``,
    ``video_grid_thw``, ``video_metadata``."""
    import numpy as np
    from transformers.video_utils import VideoMetadata

    frames = [np.array(video) for video, _ in videos]  # copies: ERNIE's processor draws on its frames in place
    metadata = [VideoMetadata(total_num_frames=meta.get("total_num_frames", len(video)), fps=meta.get("fps"),
                              frames_indices=meta.get("frames_indices", list(range(len(video)))))
                for video, meta in videos]
    with _torchvision_stood_in():
        processor = _processor_class(*(processor_class or ())).from_pretrained(path)
        return processor(videos=frames, video_metadata=metadata, do_sample_frames=False, return_metadata=True,
                         return_tensors="pt", **kwargs)


def hf_glm4v_video_inputs(path: str, text: str, videos: list, images: list[bytes],
                          add_special_tokens: bool = True) -> dict:
    """transformers' model inputs for ``text`` with one `VIDEO_PLACEHOLDER` per video (``(frames, metadata)``) and
    one image placeholder per image, expanded by ``Glm4vProcessor``'s own methods (its instance needs torchvision)."""
    import torch
    from PIL import Image
    from transformers import AutoImageProcessor, AutoTokenizer, Glm4vProcessor

    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
    inputs: dict = {}
    if images:
        pil = [Image.open(io.BytesIO(image)).convert("RGB") for image in images]
        inputs.update(AutoImageProcessor.from_pretrained(path)(images=pil, return_tensors="pt"))
    if videos:
        inputs.update(hf_video_processor(path, videos))
    processor = SimpleNamespace(image_processor=SimpleNamespace(merge_size=2), video_processor=SimpleNamespace(
        merge_size=2), image_token=IMAGE, image_token_id=ids[IMAGE], video_start_id=ids["<|begin_of_video|>"],
        video_end_id=ids["<|end_of_video|>"])
    processor.replace_frame_token_id = functools.partial(Glm4vProcessor.replace_frame_token_id, processor)
    counts = {IMAGE: 0, VIDEO: 0}

    def expand(match: re.Match) -> str:
        token, counts[match.group(0)] = match.group(0), counts[match.group(0)] + 1
        if token == IMAGE:
            return Glm4vProcessor.replace_image_token(processor, inputs, counts[IMAGE] - 1)
        return Glm4vProcessor.replace_video_token(processor, inputs, counts[VIDEO] - 1)

    text = re.sub(re.escape(IMAGE) + "|" + re.escape(VIDEO), expand, text)
    inputs.pop("video_metadata", None)
    inputs["input_ids"] = tokenizer([text], return_tensors="pt", add_special_tokens=add_special_tokens)["input_ids"]
    inputs["mm_token_type_ids"] = torch.tensor(Glm4vProcessor.create_mm_token_type_ids(processor,
                                                                                       inputs["input_ids"].tolist()))
    return inputs


def hf_glm4v_video_greedy(path: str, text: str | None, videos: list, images: list[bytes], max_new_tokens: int,
                          messages: list | None = None) -> tuple[list[int], list[int]]:
    """transformers' (prompt ids, greedy tokens) for a text (or chat messages) with video and image placeholders."""
    import torch
    from mm_utils import hf_generate
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    if messages is not None:
        text = AutoTokenizer.from_pretrained(path).apply_chat_template(messages, add_generation_prompt=True,
                                                                        tokenize=False)
    inputs = hf_glm4v_video_inputs(path, text, videos, images, add_special_tokens=messages is None)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    return hf_generate(model, inputs, max_new_tokens)


def hf_glm4v_merged_greedy(path: str, text: str, videos: list, images: list[bytes],
                           max_new_tokens: int) -> tuple[list[int], list[int]]:
    """transformers' (prompt ids, greedy tokens) for videos beside images, its parts run by hand: its model's
    forward scatters image features over every ``<|image|>`` (a video's frames' too) and so refuses the mix. Here
    the image and video features (``get_image_features`` / ``get_video_features``) go where its processor's token
    types put them, the positions are its ``get_rope_index``'s, and each new token is the next text position
    (``generate``'s rule), the whole sequence run again per token."""
    import torch
    from transformers import AutoModelForImageTextToText

    inputs = hf_glm4v_video_inputs(path, text, videos, images)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    inner, ids, types = model.model, inputs["input_ids"], inputs["mm_token_type_ids"]
    with torch.no_grad():
        embeds = inner.get_input_embeddings()(ids)
        if images:
            features = inner.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"]).pooler_output
            embeds[types == 1] = torch.cat(features)
        features = inner.get_video_features(inputs["pixel_values_videos"], inputs["video_grid_thw"]).pooler_output
        embeds[types == 2] = torch.cat(features)
        positions, _ = inner.get_rope_index(ids, types, inputs.get("image_grid_thw"), inputs["video_grid_thw"])
        tokens: list[int] = []
        for _ in range(max_new_tokens):
            logits = model(inputs_embeds=embeds, position_ids=positions).logits
            tokens.append(int(logits[0, -1].argmax()))
            embeds = torch.cat([embeds, inner.get_input_embeddings()(torch.tensor([[tokens[-1]]]))], 1)
            positions = torch.cat([positions, positions[:, :, -1:].amax(0, keepdim=True).expand(3, 1, 1) + 1], -1)
    return ids[0].tolist(), tokens
