"""The image steps that transformers' torchvision-only ("fast") processors run, in torch alone: the CPU machines cannot
import torchvision beside their torch build, so the models whose processors need it (LFM2-VL:
asyncllm/mm/lfm2_vl_images.py; Llama 4: asyncllm/mm/llama4_images.py) process images with these."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any, ClassVar

__all__ = ["BICUBIC", "BILINEAR", "TorchImageProcessor", "normalize_like_torchvision", "read_json",
           "resize_like_torchvision"]

BICUBIC = 3
"""PIL's (and transformers') ``resample`` code for bicubic."""
BILINEAR = 2
"""PIL's (and transformers') ``resample`` code for bilinear (LFM2-VL's and Llama 4's)."""


class TorchImageProcessor:
    """What those processors share, as asyncllm/mm/processor.py uses an image processor: ``from_pretrained`` (the
    checkpoint's settings with overrides), ``to_dict`` and a call on one image. A subclass names its settings
    dataclass (``settings_cls``), may adjust the values read (`adjust`), checks them in ``__init__`` and
    processes an image in ``process``."""

    settings_cls: ClassVar[type]

    def __init__(self, settings: Any) -> None:
        self.settings = settings

    @classmethod
    def from_pretrained(cls, model_path: str, **overrides: Any) -> Any:
        """The checkpoint's settings (``preprocessor_config.json``, or ``processor_config.json``'s
        ``image_processor``) with ``overrides`` over them; keys that are no setting are dropped, as transformers
        drops them (the caller names one that changes nothing)."""
        folder = Path(model_path)
        processor = read_json(folder / "processor_config.json")
        values: dict[str, Any] = dict(processor.get("image_processor") or read_json(folder / "preprocessor_config.json"))
        cls.adjust(values, processor)
        values.update(overrides)
        if isinstance(values.get("size"), dict) and {"height", "width"} <= set(values["size"]):
            values["size"] = (values["size"]["height"], values["size"]["width"])
        known = set(cls.settings_cls.__dataclass_fields__)
        return cls(cls.settings_cls(**{k: tuple(v) if isinstance(v, list) else v
                                       for k, v in values.items() if k in known}))

    @classmethod
    def adjust(cls, values: dict[str, Any], processor: dict[str, Any]) -> None:
        """Settings the checkpoint keeps elsewhere (``processor`` is its ``processor_config.json``)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self.settings)

    def __call__(self, images: list[Any], **_: Any) -> Any:
        """One RGB PIL image (``images=[image]``, as asyncllm/mm/processor.py calls every image processor)."""
        (image,) = images
        return self.process(image)

    def process(self, image: Any) -> Any:
        raise NotImplementedError


def resize_like_torchvision(pixels: Any, height: int, width: int, mode: str = "bilinear") -> Any:
    """torchvision's antialiased bilinear (or ``mode="bicubic"``) resize of an ``(N, 3, H, W)`` uint8 CPU tensor:
    torch's own kernel, on the uint8 image where torchvision resizes it natively (bicubic always; bilinear where the
    CPU reports AVX2) and in float32 rounded back elsewhere."""
    import torch
    import torch.nn.functional as F

    if tuple(pixels.shape[-2:]) == (height, width):
        return pixels
    if mode == "bicubic":
        return F.interpolate(pixels, size=(height, width), mode="bicubic", align_corners=False, antialias=True)
    if "AVX2" in torch.backends.cpu.get_cpu_capability():  # torchvision resizes uint8 natively there
        return F.interpolate(pixels, size=(height, width), mode="bilinear", align_corners=False, antialias=True)
    out = F.interpolate(pixels.to(torch.float32), size=(height, width), mode="bilinear", align_corners=False,
                        antialias=True)
    return out.round_().to(torch.uint8)


def normalize_like_torchvision(pixels: Any, s: Any) -> Any:
    """A ``(..., 3, H, W)`` uint8 image rescaled and normalized as transformers' torchvision processors do, in float32:
    the rescale folded into the mean and std (``s``: their ``do_rescale``, ``rescale_factor``, ``do_normalize``,
    ``image_mean``, ``image_std``)."""
    import torch

    x = pixels.to(torch.float32)
    if s.do_normalize:
        scale = 1.0 / s.rescale_factor if s.do_rescale else 1.0
        mean = (torch.tensor(s.image_mean) * scale).view(-1, 1, 1)
        std = (torch.tensor(s.image_std) * scale).view(-1, 1, 1)
        return x.sub_(mean).div_(std)
    return x * s.rescale_factor if s.do_rescale else x


def read_json(path: Path) -> dict[str, Any]:
    """A checkpoint's JSON settings file, or {} when it has none."""
    return json.loads(path.read_text()) if path.is_file() else {}
