"""Command A Vision's image processing (asyncllm/mm/cohere2_vision_images.py) against transformers'
``Cohere2VisionImageProcessor`` (torchvision's resize stood in: tests/cohere2_vision_utils.py): the tile grid over a
sweep of sizes, and every tile's pixels bit for bit. Prompt ids and greedy tokens: tests/engine/test_cohere2_vision_engine.py."""

from __future__ import annotations

import io
import re

import numpy as np
import pytest
from cohere2_vision_utils import IMAGE, NAMED, PROCESSOR, hf_image_module, hf_image_processor, hf_processor, save_tiny_config
from mm_utils import make_image

SIZES = [(40, 40), (150, 60), (60, 130), (20, 90), (120, 120), (400, 30), (7, 300)]
"""(width, height): one tile upscaled, 3 x 1 and 1 x 2 / 1 x 4 grids, 2 x 2, downscaled 4 x 1 and 1 x 4."""


@pytest.mark.parametrize("max_patches, tile", [(12, 512), (4, 56), (1, 56)])
def test_tile_grid_equals_transformers(max_patches: int, tile: int) -> None:
    """The grid chosen (least upscaling, else least downscaling; ties to the fewest tiles) over a sweep of sizes."""
    from asyncllm.mm.cohere2_vision_images import tile_grid

    hf = hf_image_module()
    for height in range(3, 2500, 43):
        for width in range(2, 2500, 47):
            expected = hf.get_optimal_tiled_canvas((height, width), (tile, tile), 1, max_patches)
            assert tile_grid(height, width, tile, max_patches) == tuple(expected)


@pytest.mark.parametrize("overrides, counts", [({}, {1, 3, 4, 5}), ({"crop_to_patches": False}, {1}),
                                               ({"max_patches": 2}, {1, 3})])
def test_tiles_equal_transformers_pixel_values(overrides: dict, counts: set) -> None:
    """Every tile and the thumbnail, bit for bit, and their count, over `SIZES`."""
    from asyncllm.mm.cohere2_vision_images import Cohere2VisionImages, Cohere2VisionImageSettings

    settings = {**PROCESSOR, **overrides}
    hf = hf_image_processor(**settings)
    size = settings.pop("size")
    ours = Cohere2VisionImages(Cohere2VisionImageSettings(size=(size["height"], size["width"]), **settings))
    seen = set()
    for width, height in SIZES:
        image = _pil_of(make_image(width, height, seed=width + height))
        expected = hf(images=[image], return_tensors="pt")
        tiles = ours(images=[image])
        assert tiles.dtype == np.float32 and len(tiles) == int(expected["num_patches"][0])
        np.testing.assert_array_equal(tiles, expected["pixel_values"].numpy())
        seen.add(len(tiles))
    assert seen == counts


def test_settings_from_the_checkpoint_and_refusals(tmp_path) -> None:
    """The checkpoint's settings with overrides; bilinear resizing, non-square tiles and a tokenizer without the
    processor's tokens refused by name."""
    from transformers import AutoTokenizer

    from asyncllm.errors import ConfigError, NotBuiltError
    from asyncllm.mm.cohere2_vision_images import Cohere2VisionImages
    from asyncllm.models.cohere2_vision import marker_ids
    from asyncllm.tiny import tiny_checkpoint

    hf_image_processor(**PROCESSOR).save_pretrained(tmp_path)
    settings = Cohere2VisionImages.from_pretrained(str(tmp_path), max_patches=2).settings
    assert (settings.size, settings.max_patches, settings.patch_size, settings.resample) == ((56, 56), 2, 2, 3)
    with pytest.raises(NotBuiltError, match="resample"):
        Cohere2VisionImages.from_pretrained(str(tmp_path), resample=2)
    with pytest.raises(ConfigError, match="square"):
        Cohere2VisionImages.from_pretrained(str(tmp_path), size={"height": 56, "width": 112})
    with pytest.raises(ConfigError, match=re.escape("with <|IMG_PATCH|> (image_token)")):
        marker_ids(AutoTokenizer.from_pretrained(tiny_checkpoint("llama")))


@pytest.mark.parametrize("overrides, rows", [({}, 32), ({"max_patches": 2}, 24), ({"crop_to_patches": False}, 8)])
def test_prompt_ids_equal_transformers_processor(tmp_path, overrides: dict, rows: int) -> None:
    """The host's expansion of two images (3 x 1 tiles plus the thumbnail; 1 x 3 plus it) against
    ``Cohere2VisionProcessor``'s, with a request's ``mm_processor_kwargs`` as transformers' call kwargs (fewer tiles;
    one tile each)."""
    from transformers import AutoConfig, AutoTokenizer

    from asyncllm.mm.inputs import MultiModalInputs
    from asyncllm.mm.processor import MultiModalProcessor
    from asyncllm.models.cohere2_vision import Cohere2VisionForConditionalGeneration

    save_tiny_config(tmp_path)
    images, text = [make_image(150, 60, seed=1), make_image(60, 130, seed=2)], f"{IMAGE} and {IMAGE} described"
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    mm = MultiModalProcessor(str(tmp_path), AutoConfig.from_pretrained(tmp_path), Cohere2VisionForConditionalGeneration,
                             tokenizer, 2**26, 2**24)
    ours = mm.process(tokenizer(text)["input_ids"], MultiModalInputs(images), "prompt.images", overrides).token_ids
    expected = hf_processor(str(tmp_path))(text=text, images=[_pil_of(i) for i in images], **overrides)["input_ids"]
    assert ours == expected[0]
    assert ours.count(tokenizer.convert_tokens_to_ids(IMAGE)) == rows


def _pil_of(image: bytes):
    from PIL import Image

    return Image.open(io.BytesIO(image)).convert("RGB")


def test_patch_size_is_checked_at_load_and_the_markers_looked_up_once(tmp_path) -> None:
    """``patch_size`` is the tokens per side of a tile that transformers' processor writes: a value the model's config
    disagrees with is refused when the engine's (or a request's) processor is loaded. Two images look the tokenizer's
    marker ids up once (4 tokens), not once per image."""
    from transformers import AutoTokenizer

    from asyncllm.errors import ConfigError, InvalidRequestError
    from asyncllm.mm.inputs import MultiModalInputs
    from asyncllm.mm.processor import MultiModalProcessor
    from asyncllm.models.cohere2_vision import Cohere2VisionForConditionalGeneration

    config = save_tiny_config(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    lookups = []
    lookup = tokenizer.convert_tokens_to_ids
    tokenizer.convert_tokens_to_ids = lambda tokens: lookups.append(tokens) or lookup(tokens)

    def processor(**kwargs):
        return MultiModalProcessor(str(tmp_path), config, Cohere2VisionForConditionalGeneration, tokenizer, 2**26,
                                   2**24, **kwargs)

    with pytest.raises(ConfigError, match=r"patch_size=3 .*2, the model's tokens per side of a tile"):
        processor(processor_kwargs={"patch_size": 3})
    mm, images = processor(), MultiModalInputs([make_image(150, 60, seed=1), make_image(60, 130, seed=2)])
    prompt = tokenizer(f"{IMAGE} and {IMAGE}")["input_ids"]
    with pytest.raises(InvalidRequestError, match="patch_size=3"):
        mm.process(prompt, images, "prompt.images", {"patch_size": 3})
    assert mm.process(prompt, images, "prompt.images", {}).token_ids.count(config.image_token_id) == 32
    assert sorted(t for t in lookups if t in NAMED.values()) == sorted(NAMED.values())
