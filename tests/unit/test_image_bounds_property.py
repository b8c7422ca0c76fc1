"""Property tests of the bounds on what the HF image processor makes of an image (asyncllm/mm/image_bounds.py), which
run before it does, on the processor thread every request shares (docs/multimodal.md "Limits", docs/security.md).

Checked against plain models written from the documented rules, not from the module:
* `check_request_sizes` on drawn nested settings: a size-like setting (its name, or a dict's it is in, holds size,
  pixel, edge, height, width, pinpoint, resolution, token, tile, crop or patch) may not rise above the engine's nor be
  one the engine has not; a pixel count (a setting named ``*pixels``, or Qwen-VL's ``size.longest_edge`` /
  ``size.shortest_edge`` equal to the request's own ``max_pixels`` / ``min_pixels``) may rise to
  ``mm_max_image_pixels`` (a NaN is none: refused, as any other NaN size is); a setting the model's config fixes
  may not change at all. A refusal is a `ConfigError` naming ``mm_processor_kwargs.<one refused setting>`` and its
  value.
* `check_processed_size`: a ``size={"shortest_edge": N}`` resize is refused when it would make more pixels than
  ``mm_max_image_pixels``, accepted when it would not (rounding of the long side either way).
* End to end, with real transformers image processors (Qwen2-VL, CLIP, LLaVA-NeXT) built from a local
  preprocessor_config.json: drawn request ``mm_processor_kwargs`` and images within ``mm_max_image_pixels`` either
  fail with an `InvalidRequestError` naming ``prompt.mm_processor_kwargs`` or the image, or every resize the processor
  does and its ``pixel_values`` stay within what the engine's settings (pixel counts raised to the limit) allow.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from fractions import Fraction

import pytest
from hypothesis import HealthCheck, assume, event, example, given, settings
from hypothesis import strategies as st

from asyncllm.errors import ConfigError, InvalidRequestError
from asyncllm.mm.image_bounds import FIXED_SETTINGS, check_processed_size, check_request_sizes

pytest.importorskip("PIL")
pytest.importorskip("transformers")


def _settings(examples: int):
    """``examples`` draws, times PROP_SCALE (a larger run for mutation checks)."""
    return settings(max_examples=max(1, int(examples * float(os.environ.get("PROP_SCALE", "1")))), deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


# --- the documented rule (docs/multimodal.md "Limits"), written out ---------------------------------------------

WORDS = ("size", "pixel", "edge", "height", "width", "pinpoint", "resolution", "token", "tile", "crop", "patch")
FIXED = {"patch_size", "merge_size", "temporal_patch_size", "spatial_merge_size", "encoder_patch_size",
         "downsample_factor", "image_grid_pinpoints", "crop_size"}
COUNT_EDGES = {"size.longest_edge": "max_pixels", "size.shortest_edge": "min_pixels"}


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _ref_leaves(value, path: str, sized: bool, named: bool, out: dict) -> dict:
    """Size-like numbers by dotted path -> (value, whether a dict key ending in 'pixels' holds it directly)."""
    if isinstance(value, dict):
        for key, item in value.items():
            _ref_leaves(item, f"{path}.{key}" if path else key, sized or any(w in key.lower() for w in WORDS),
                        key.endswith("pixels"), out)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _ref_leaves(item, f"{path}[{i}]", sized, False, out)
    elif sized and _is_number(value):
        out[path] = (value, named)
    return out


def _ref_fixed(settings_: dict, prefix: str = "") -> dict:
    found = {}
    for key, value in settings_.items():
        if key in FIXED:
            found[prefix + key] = value
        elif isinstance(value, dict):
            found.update(_ref_fixed(value, f"{prefix}{key}."))
    return found


def _ref_refused(engine: dict, request: dict, overrides: dict, max_pixels: int) -> tuple[dict, dict]:
    """(fixed settings changed, size-like settings raised), each by path -> the request's value."""
    eng_fixed = _ref_fixed(engine)
    fixed = {p: v for p, v in _ref_fixed(request).items() if p not in eng_fixed or eng_fixed[p] != v}
    eng = _ref_leaves(engine, "", False, False, {})
    raised = {}
    for path, (value, named) in _ref_leaves(request, "", False, False, {}).items():
        lowered = path in eng and value <= eng[path][0]
        own = COUNT_EDGES.get(path)
        count = named or (own is not None and overrides.get(own) == value)
        if not lowered and not (count and value <= max_pixels):
            raised[path] = value
    return fixed, raised


# --- drawn settings -------------------------------------------------------------------------------------------

SIZE_KEYS = ["size", "shortest_edge", "longest_edge", "height", "width", "max_pixels", "min_pixels",
             "max_pixels_tolerance", "max_patches", "max_image_tokens", "Tile_Count", "max_resolution", "do_resize"]
FIXED_KEYS = ["patch_size", "merge_size", "crop_size", "image_grid_pinpoints", "downsample_factor"]
PLAIN_KEYS = ["do_normalize", "image_mean", "rescale_factor", "vision", "foo"]
NUMBERS = st.one_of(st.sampled_from([0, 1, 2, 10, 14, 99, 100, 101, 150, 151]), st.integers(-3, 200),
                    st.sampled_from([0.5, 99.5, 100.0, 150.0, float("nan")]))
SCALARS = st.one_of(NUMBERS, NUMBERS, st.booleans(), st.none(), st.just("14"))
KEYS = st.sampled_from(SIZE_KEYS + FIXED_KEYS + PLAIN_KEYS)
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                      st.dictionaries(KEYS, inner, max_size=3)), max_leaves=8)
SETTINGS = st.dictionaries(KEYS, VALUES, max_size=5)


def _merge(base: dict, patch: dict) -> dict:
    merged = dict(base)
    for key, value in patch.items():
        merged[key] = _merge(base[key], value) if isinstance(value, dict) and isinstance(base.get(key), dict) \
            else value
    return merged


@st.composite
def request_cases(draw):
    engine = draw(SETTINGS)
    patch = draw(SETTINGS)
    request = _merge(engine, patch) if draw(st.booleans()) else patch
    overrides = dict(draw(st.dictionaries(st.sampled_from(["max_pixels", "min_pixels"]), NUMBERS, max_size=2)))
    size = request.get("size")
    if isinstance(size, dict) and draw(st.booleans()):  # the request's own count, kept in Qwen-VL's size dict
        for edge, own in (("longest_edge", "max_pixels"), ("shortest_edge", "min_pixels")):
            if edge in size:
                overrides[own] = size[edge]
    return engine, request, overrides, draw(st.sampled_from([10, 100, 150]))


QWEN = {"size": {"longest_edge": 100, "shortest_edge": 10}, "patch_size": 14}


@_settings(400)
@given(request_cases())
@example((QWEN, _merge(QWEN, {"size": {"longest_edge": 150}}), {"max_pixels": 150}, 150))  # own count: to the limit
@example((QWEN, _merge(QWEN, {"size": {"longest_edge": 151}}), {"max_pixels": 151}, 150))  # past it
@example((QWEN, _merge(QWEN, {"size": {"longest_edge": 150}}), {"min_pixels": 150}, 150))  # not its own count
@example((QWEN, _merge(QWEN, {"size": {"shortest_edge": 150}}), {"min_pixels": 150}, 150))
@example((QWEN, _merge(QWEN, {"size": {"longest_edge": 100.0}}), {}, 150))  # equal: kept
@example((QWEN, _merge(QWEN, {"size": {"longest_edge": float("nan")}}), {"max_pixels": float("nan")}, 150))
@example(({"max_pixels": 5}, {"max_pixels": float("nan")}, {}, 150))  # NaN is no count up to the limit
@example(({"max_pixels_tolerance": 2.0}, {"max_pixels_tolerance": 3.0}, {}, 150))  # no pixel count
@example(({"min_pixels": 10}, {"min_pixels": 150}, {}, 150))
@example(({"min_pixels": 10}, {"min_pixels": 151}, {}, 150))
@example(({"vision": {"patch_size": 14}}, {"vision": {"patch_size": 16}}, {}, 150))  # fixed, nested
@example(({"crop_size": {"height": 14}}, {"crop_size": {"height": 10}}, {}, 150))  # fixed: lowered too
@example(({"crop_size": 14}, {"merge_size": 2}, {}, 150))  # fixed, the engine has none
@example(({"Tile_Count": 4}, {"Tile_Count": 5}, {}, 150))
@example(({"max_patches": [4, 5]}, {"max_patches": [4, 6]}, {}, 150))
@example(({"vision": {"max_pixels": 1}}, {"vision": {"max_pixels": 150}}, {}, 150))
@example(({}, {"size": {"max_pixels": 150, "height": 5}}, {}, 150))  # a count beside a new setting
def test_check_request_sizes_follows_the_documented_rule(case):
    engine, request, overrides, max_pixels = case
    fixed, raised = _ref_refused(engine, request, overrides, max_pixels)
    event("accepted" if not fixed and not raised else "refused")
    if not fixed and not raised:
        check_request_sizes(engine, request, overrides, max_pixels)
        return
    with pytest.raises(ConfigError) as info:
        check_request_sizes(engine, request, overrides, max_pixels)
    assert info.value.field.startswith("mm_processor_kwargs.")
    path = info.value.field[len("mm_processor_kwargs."):]
    refused = {**raised, **fixed}
    assert path in refused, (path, refused)
    assert repr(info.value.value) == repr(refused[path])


def test_the_fixed_settings_are_the_documented_ones():
    assert FIXED_SETTINGS == FIXED


# --- check_processed_size against the resize it bounds -------------------------------------------------------


class _Processor:
    def __init__(self, settings_: dict) -> None:
        self._settings = settings_

    def to_dict(self) -> dict:
        return dict(self._settings)


SIZE_SETTINGS = st.one_of(
    st.builds(lambda n: {"shortest_edge": n}, st.integers(1, 120)),
    st.builds(lambda n: {"shortest_edge": n}, st.sampled_from([56.0, 1e9])),
    st.builds(lambda n: {"shortest_edge": n, "longest_edge": 10**9}, st.integers(1, 120)),
    st.builds(lambda n: {"height": n, "width": n}, st.integers(1, 10**6)),
    st.integers(1, 10**6), st.none())


@_settings(300)
@given(size=SIZE_SETTINGS, width=st.integers(1, 400), height=st.integers(1, 400),
       max_pixels=st.integers(1, 20_000))
@example(size={"shortest_edge": 56}, width=2, height=400, max_pixels=100_000)  # 56 x 11200: refused
@example(size={"shortest_edge": 56}, width=40, height=30, max_pixels=100_000)
@example(size={"shortest_edge": 10}, width=10, height=20, max_pixels=200)  # exactly the limit
@example(size={"shortest_edge": 10}, width=10, height=20, max_pixels=199)
@example(size={"shortest_edge": 100}, width=1, height=1, max_pixels=10_000)
def test_a_shortest_edge_resize_stays_within_the_limit(size, width, height, max_pixels):
    processor = _Processor({"size": size, "crop_size": {"height": 1, "width": 1}})
    applies = isinstance(size, dict) and set(size) == {"shortest_edge"} and isinstance(size["shortest_edge"], int)
    short, long = min(width, height), max(width, height)
    n = size["shortest_edge"] if applies else 0
    stretched = Fraction(n * long, short)  # the long side after resizing the short one to n
    if applies and n * math.floor(stretched) > max_pixels:
        with pytest.raises(InvalidRequestError) as info:
            check_processed_size(processor, (width, height), "prompt.images[0]", max_pixels)
        assert info.value.field == "prompt.images[0]"
        assert f"mm_max_image_pixels={max_pixels}" in info.value.message
    elif not applies or n * math.ceil(stretched) <= max_pixels:
        check_processed_size(processor, (width, height), "prompt.images[0]", max_pixels)
    check_processed_size(object(), (width, height), "prompt.images[0]", max_pixels)  # no to_dict: nothing to bound


# --- end to end, real image processors ----------------------------------------------------------------------


class _Model:
    @staticmethod
    def mm_placeholder_token_id(hf_config):
        return 5


def _recording(processor, resized: list) -> None:
    """Record the pixels of every image ``processor`` resizes (once per processor: it is cached)."""
    if getattr(processor, "_recorded", None) is resized:
        return
    resize = type(processor).resize

    def recorded(*args, **kwargs):
        out = resize(processor, *args, **kwargs)
        resized.append(int(out.size // 3))
        return out

    processor.resize, processor._recorded = recorded, resized


def _process(config: dict, max_pixels: int, image: tuple[int, int], overrides: dict):
    """(pixels of each resize, the processor's output), or None where the request is refused (as documented)."""
    from PIL import Image

    from asyncllm.mm.processor import MultiModalProcessor

    with tempfile.TemporaryDirectory(dir="/tmp") as folder:
        with open(os.path.join(folder, "preprocessor_config.json"), "w") as f:
            json.dump(config, f)
        mm = MultiModalProcessor(folder, None, _Model, None, 0, max_pixels)
        resized: list[int] = []
        try:
            _recording(mm._processor_for(overrides), resized)
        except InvalidRequestError as exc:
            assert exc.field == "prompt.mm_processor_kwargs"
            event("refused: mm_processor_kwargs")
            return None
        try:
            out = mm._processor_output(Image.new("RGB", image), "prompt.images[0]", overrides)
        except InvalidRequestError as exc:
            assert exc.field == "prompt.images[0]"
            event("refused: the image")
            return None
    event("processed")
    assert resized or not config.get("do_resize", True) or overrides.get("do_resize") is False
    return resized, out


@st.composite
def images(draw, max_pixels: int, side: int = 300):
    """A width x height within mm_max_image_pixels and the aspect bound (both checked as the image is decoded)."""
    width = draw(st.one_of(st.integers(1, 30), st.integers(1, side)))  # small ones: the upscaled
    height = draw(st.one_of(st.integers(1, 30), st.integers(1, min(side, max_pixels // width))))
    assume(width * height <= max_pixels)
    assume(max(width, height) <= 200 * min(width, height))
    return width, height


def _sizes(draw, keys: dict, bad: dict) -> dict:
    """Drawn settings of ``keys``; one time in three also one of ``bad`` (fixed settings, unknown keys)."""
    drawn = draw(st.fixed_dictionaries({}, optional=keys))
    if draw(st.integers(0, 2)) == 0:
        key = draw(st.sampled_from(sorted(bad)))
        drawn[key] = draw(bad[key])
    return drawn


@st.composite
def qwen_cases(draw):
    max_pixels = draw(st.integers(8_000, 40_000))
    low = draw(st.sampled_from([784, 3136]))
    high = draw(st.integers(low, 2 * max_pixels))
    count = st.one_of(st.integers(0, 4 * max_pixels), st.sampled_from([max_pixels, max_pixels + 1, high, low]),
                      st.sampled_from([0.5, 5000.5]))
    size = st.fixed_dictionaries({"shortest_edge": count, "longest_edge": count})
    overrides = _sizes(draw, {"max_pixels": count, "min_pixels": count, "size": size, "patch_size": st.just(14)},
                       {"patch_size": st.just(7), "merge_size": st.sampled_from([2, 1]), "foo": st.integers(0, 3),
                        "do_resize": st.booleans(),
                        "temporal_patch_size": st.sampled_from([2, 1]), "size": st.fixed_dictionaries(
                            {"height": count}, optional={"shortest_edge": count})})
    config = {"image_processor_type": "Qwen2VLImageProcessor", "size": {"shortest_edge": low, "longest_edge": high},
              "patch_size": 14, "merge_size": 2, "temporal_patch_size": 2}
    return config, max_pixels, draw(images(max_pixels)), overrides


@_settings(40)
@given(qwen_cases())
@example(({"image_processor_type": "Qwen2VLImageProcessor", "size": {"shortest_edge": 3136, "longest_edge": 20_000},
           "patch_size": 14, "merge_size": 2, "temporal_patch_size": 2}, 20_000, (7, 1000),
          {"min_pixels": 20_000, "max_pixels": 20_000}))
@example(({"image_processor_type": "Qwen2VLImageProcessor", "size": {"shortest_edge": 3136, "longest_edge": 20_000},
           "patch_size": 14, "merge_size": 2, "temporal_patch_size": 2}, 20_000, (10, 20),
          {"min_pixels": 80_000, "max_pixels": 80_000}))  # past the limit: would upscale past it
@example(({"image_processor_type": "Qwen2VLImageProcessor", "size": {"shortest_edge": 3136, "longest_edge": 20_000},
           "patch_size": 14, "merge_size": 2, "temporal_patch_size": 2}, 20_000, (100, 100), {"patch_size": 7}))
@example(({"image_processor_type": "Qwen2VLImageProcessor", "size": {"shortest_edge": 3136, "longest_edge": 20_000},
           "patch_size": 14, "merge_size": 2, "temporal_patch_size": 2}, 20_000, (100, 100), {"min_pixels": 20_001}))
def test_qwen_vl_processes_no_more_than_the_limit_allows(case):
    """Qwen2-VL resizes to multiples of 28 between min_pixels and max_pixels, each at most the engine's or
    mm_max_image_pixels (L): its rounding (one 28-pixel row and column past the scale to L) is the only slack."""
    config, max_pixels, (width, height), overrides = case
    result = _process(config, max_pixels, (width, height), overrides)
    if result is None:
        return
    resized, out = result
    scale = math.sqrt(max(config["size"]["longest_edge"], max_pixels) / (width * height))
    bound = (width * scale + 28) * (height * scale + 28)
    assert all(pixels <= bound for pixels in resized), (resized, bound)
    grid = [int(x) for x in out["image_grid_thw"][0]]
    assert grid[0] == 1 and grid[1] * grid[2] * 14 * 14 <= bound
    assert out["pixel_values"].size <= bound * 3 * 2


def _edge_overrides(draw, edge: int, bad: dict | None = None) -> dict:
    n = st.one_of(st.integers(1, edge), st.integers(-1, 2 * edge), st.just(edge + 1))
    return _sizes(draw, {"size": st.one_of(st.builds(lambda v: {"shortest_edge": v}, n), n),
                         "do_center_crop": st.booleans(), "do_resize": st.booleans()},
                  {"size": st.builds(lambda v: {"height": v, "width": v}, n), "foo": st.integers(0, 2),
                   "crop_size": st.builds(lambda v: {"height": v, "width": v}, n), **(bad or {})})


@st.composite
def clip_cases(draw):
    max_pixels = draw(st.integers(2_000, 20_000))
    edge = draw(st.integers(14, 80))
    crop = draw(st.integers(14, edge))
    config = {"image_processor_type": "CLIPImageProcessor", "size": {"shortest_edge": edge},
              "crop_size": {"height": crop, "width": crop}, "do_center_crop": draw(st.booleans()), "do_resize": True}
    return config, max_pixels, draw(images(max_pixels)), _edge_overrides(draw, edge)


CLIP = {"image_processor_type": "CLIPImageProcessor", "size": {"shortest_edge": 56},
        "crop_size": {"height": 56, "width": 56}, "do_center_crop": True, "do_resize": True}


@_settings(40)
@given(clip_cases())
@example((CLIP, 10_000, (2, 400), {}))  # the engine's own resize of a strip: refused
@example((CLIP, 10_000, (2, 400), {"size": {"shortest_edge": 5}, "do_center_crop": False}))
@example((CLIP, 10_000, (30, 30), {"size": {"shortest_edge": 57}}))
def test_clip_resizes_no_image_past_the_limit(case):
    """CLIP resizes the shorter side to size.shortest_edge (at most the engine's), then crops to the fixed crop_size:
    no resize past mm_max_image_pixels, no output past it or the crop."""
    config, max_pixels, image, overrides = case
    result = _process(config, max_pixels, image, overrides)
    if result is None:
        return
    resized, out = result
    assert all(pixels <= max_pixels for pixels in resized), (resized, max_pixels)
    crop = config["crop_size"]["height"] ** 2
    assert out["pixel_values"].size <= 3 * max(max_pixels, crop, image[0] * image[1])


@st.composite
def llava_next_cases(draw):
    edge = draw(st.sampled_from([14, 28]))
    config = {"image_processor_type": "LlavaNextImageProcessor", "size": {"shortest_edge": edge},
              "crop_size": {"height": edge, "width": edge}, "do_center_crop": True,
              "image_grid_pinpoints": [[edge, 2 * edge], [2 * edge, edge], [2 * edge, 2 * edge]]}
    max_pixels = draw(st.integers(1_000, 10_000))
    overrides = _edge_overrides(draw, edge, {"image_grid_pinpoints": st.just([[edge, 3 * edge]])})
    return config, max_pixels, draw(images(max_pixels, 120)), overrides


@_settings(25)
@given(llava_next_cases())
def test_llava_next_tiles_stay_within_its_pinpoints(case):
    """LLaVA-NeXT resizes the image into its best grid pinpoint (fixed) and each tile and the thumbnail to
    size.shortest_edge (at most the engine's): no resize past the largest pinpoint, no more tiles than it holds."""
    config, max_pixels, image, overrides = case
    result = _process(config, max_pixels, image, overrides)
    if result is None:
        return
    resized, out = result
    edge = config["size"]["shortest_edge"]
    largest = max(h * w for h, w in config["image_grid_pinpoints"])
    assert all(pixels <= max(largest, edge * edge) for pixels in resized), resized
    assert out["pixel_values"].size <= 3 * edge * edge * (1 + largest // (edge * edge))
