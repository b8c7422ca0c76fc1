"""Bounds on the image the HF image processor makes of an input, checked before it runs (on the processor thread every
request shares): ``mm_max_image_pixels`` bounds the decoded image (asyncllm/mm/images.py, with its aspect ratio), and
here what processing may grow it to. A request's ``mm_processor_kwargs`` may not raise a size-like setting above the
engine's (`check_request_sizes`), and a processor that resizes the shorter edge to a length (CLIP's
``size={"shortest_edge": N}``) may not resize an image past ``mm_max_image_pixels`` (`check_processed_size`). A
setting the model's config fixes (`FIXED_SETTINGS`: the patch and merge sizes its encoder was built for) may not
change at all."""

from __future__ import annotations

from typing import Any

from asyncllm.errors import ConfigError, InvalidRequestError

__all__ = ["FIXED_SETTINGS", "PIXEL_COUNT_EDGES", "check_processed_size", "check_request_sizes"]

_SIZE_WORDS = ("size", "pixel", "edge", "height", "width", "pinpoint", "resolution", "token", "tile", "crop", "patch")
"""A setting whose name (or the name of a dict it is in) holds one of these sizes the processed image."""
FIXED_SETTINGS = frozenset({"patch_size", "merge_size", "temporal_patch_size", "spatial_merge_size",
                            "encoder_patch_size", "downsample_factor", "image_grid_pinpoints", "crop_size"})
"""Settings (or dicts of them) that must match the model's config (its encoder's patches, their merging, LLaVA-NeXT's
tile grids and the tower's crop, which the placeholders follow): a request's other value would be processed, then
refused by the encoder on the workers."""
PIXEL_COUNT_EDGES = {"max_pixels": "longest_edge", "min_pixels": "shortest_edge"}
"""Where in its ``size`` dict Qwen-VL's image processor keeps the ``max_pixels`` / ``min_pixels`` it is given."""
_COUNT_EDGES = {f"size.{edge}": count for count, edge in PIXEL_COUNT_EDGES.items()}


def _size_leaves(settings: Any, path: str = "", sized: bool = False) -> dict[str, float]:
    """The numeric values of size-like settings, by their dotted path (``size.shortest_edge``)."""
    if isinstance(settings, dict):
        leaves: dict[str, float] = {}
        for key, value in settings.items():
            name = f"{path}.{key}" if path else str(key)
            leaves.update(_size_leaves(value, name, sized or any(w in str(key).lower() for w in _SIZE_WORDS)))
        return leaves
    if isinstance(settings, (list, tuple)):
        return {k: v for i, item in enumerate(settings) for k, v in _size_leaves(item, f"{path}[{i}]", sized).items()}
    if sized and isinstance(settings, (int, float)) and not isinstance(settings, bool):
        return {path: settings}
    return {}


def check_request_sizes(engine: dict[str, Any], request: dict[str, Any], overrides: dict[str, Any],
                        max_pixels: int) -> None:
    """`ConfigError` naming ``mm_processor_kwargs.<setting>`` for a size-like setting (``size``, ``crop_size``,
    ``max_pixels``, ``max_patches`` ...) of the request's processor settings (``request``, its ``to_dict()``) above
    the engine's (``engine``), or one the engine's processor has not: a request may lower them, not raise them; and
    for one of `FIXED_SETTINGS` other than the engine's. A pixel count (`_pixel_count`) may rise up to
    ``mm_max_image_pixels`` (``max_pixels``)."""
    _check_fixed(_fixed_settings(engine), _fixed_settings(request))
    plain = _size_leaves(engine)
    for path, value in _size_leaves(request).items():
        if path in plain and value <= plain[path] or _pixel_count(path, value, overrides, max_pixels):
            continue
        bound = f"at most the engine's {plain[path]!r}" if path in plain else "a setting the engine's processor has"
        raise ConfigError(f"mm_processor_kwargs.{path}", value, f"{bound} (a request may lower the image "
                          f"processor's sizes, not raise them; pixel counts up to mm_max_image_pixels={max_pixels}; "
                          "set larger ones for the engine)")


def _pixel_count(path: str, value: float, overrides: Any, max_pixels: int) -> bool:
    """Whether the setting at ``path`` is a pixel count of at most ``max_pixels``: one named so (``max_pixels``,
    ``min_pixels``; not ``max_pixels_tolerance``), or Qwen-VL's ``size.longest_edge`` / ``size.shortest_edge``
    equal to the ``max_pixels`` / ``min_pixels`` the request itself gives (``overrides``), which it keeps there."""
    if not value <= max_pixels:  # NaN too
        return False
    if path.rsplit(".", 1)[-1].endswith("pixels"):
        return True
    named = _COUNT_EDGES.get(path)
    return named is not None and isinstance(overrides, dict) and overrides.get(named) == value


def _fixed_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """``settings``' `FIXED_SETTINGS` (top-level or in a dict), by their dotted path."""
    found: dict[str, Any] = {}
    for key, value in settings.items():
        if key in FIXED_SETTINGS:
            found[str(key)] = value
        elif isinstance(value, dict):
            found.update({f"{key}.{k}": v for k, v in _fixed_settings(value).items()})
    return found


def _check_fixed(engine: dict[str, Any], request: dict[str, Any]) -> None:
    """`ConfigError` for a request's `FIXED_SETTINGS` value other than the engine's."""
    for path, value in request.items():
        if path not in engine or value != engine[path]:
            raise ConfigError(f"mm_processor_kwargs.{path}", value, f"the engine's {engine.get(path)!r}: it must "
                              "match the model's config (the patches its encoder takes), so a request may not change "
                              "it")


def check_processed_size(processor: Any, size: tuple[int, int], field: str, max_pixels: int) -> None:
    """`InvalidRequestError` for an image (``size``: width, height) that ``processor`` would resize past
    ``max_pixels`` (mm_max_image_pixels) by its ``size={"shortest_edge": N}`` alone (CLIP, LLaVA: a narrow strip
    becomes N pixels wide and as many times longer)."""
    to_dict = getattr(processor, "to_dict", None)
    target = to_dict().get("size") if callable(to_dict) else None
    if not isinstance(target, dict) or set(target) != {"shortest_edge"} or not isinstance(target["shortest_edge"], int):
        return
    width, height = size
    scale = target["shortest_edge"] / max(1, min(width, height))
    out_w, out_h = round(width * scale), round(height * scale)
    if out_w * out_h > max_pixels:
        raise InvalidRequestError(field, f"the image processor would resize the {width}x{height} image to "
                                         f"{out_w}x{out_h} = {out_w * out_h} pixels (size.shortest_edge="
                                         f"{target['shortest_edge']}), over mm_max_image_pixels={max_pixels}")
