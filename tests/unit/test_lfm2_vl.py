"""LFM2-VL's host and tower halves against transformers: the image processing (asyncllm/mm/lfm2_vl_images.py) and
the prompt ids against ``Lfm2VlImageProcessor`` and ``Lfm2VlProcessor`` (torchvision's resize stood in:
tests/lfm2_vl_utils.py), the SigLIP2 tower and projector against ``get_image_features``."""

from __future__ import annotations

import io

import numpy as np
import pytest
from lfm2_vl_utils import PROCESSOR, hf_image_processor, hf_lfm2_vl_inputs, hf_processor, make_tiny_lfm2_vl
from mm_utils import make_image

SIZES = [(40, 40), (150, 60), (60, 130), (300, 300), (33, 97), (500, 70), (100, 90)]
"""(width, height): one tile at its smart size (up or down), split into 3 x 1, 1 x 2, 2 x 2, ... plus thumbnails."""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_lfm2_vl(tmp_path_factory.mktemp("lfm2_vl"))


@pytest.mark.parametrize("settings", [{}, PROCESSOR, dict(PROCESSOR, max_tiles=6, min_tiles=1, tile_size=96),
                                      dict(PROCESSOR, max_image_tokens=64, min_image_tokens=16)])
def test_sizes_grids_and_splitting_equal_transformers(settings: dict) -> None:
    """Smart sizes, the too-large test and the tile grid (its ties broken as transformers breaks them) over a sweep
    of image sizes."""
    from asyncllm.mm.lfm2_vl_images import Lfm2VlSettings, smart_size, tile_grid, too_large

    hf = hf_image_processor(**settings)
    ours = Lfm2VlSettings(**settings)
    args = dict(downsample_factor=ours.downsample_factor, min_image_tokens=ours.min_image_tokens,
                max_image_tokens=ours.max_image_tokens, encoder_patch_size=ours.encoder_patch_size)
    for height in range(7, 1400, 37):
        for width in range(5, 1400, 41):
            assert smart_size(height, width, ours) == hf.smart_resize(height, width, **args)[::-1]
            assert too_large(height, width, ours) == hf._is_image_too_large(
                height, width, ours.max_image_tokens, ours.encoder_patch_size, ours.downsample_factor,
                ours.max_pixels_tolerance)
            cols, rows = hf._get_grid_layout(height, width, ours.min_tiles, ours.max_tiles, ours.tile_size)[:2]
            assert tile_grid(height, width, ours) == (rows, cols)


@pytest.mark.parametrize("size", SIZES)
def test_tiles_equal_transformers_pixel_values(tiny: str, size: tuple[int, int]) -> None:
    """Every tile's patches (transformers' padded rows cut to the tile's own) and the grid, exactly."""
    from asyncllm.mm.lfm2_vl_images import Lfm2VlImages

    image = _pil_of(make_image(*size, seed=sum(size)))
    hf = hf_image_processor(tiny)(images=[image], return_tensors="np", return_row_col_info=True)
    ours = Lfm2VlImages.from_pretrained(tiny)(images=[image])
    shapes = hf["spatial_shapes"].tolist()
    assert [list(tile.shape[:2]) for tile in ours.tiles] == shapes
    assert (ours.rows, ours.cols) == (hf["image_rows"][0], hf["image_cols"][0])
    for tile, pixels, (rows, cols) in zip(ours.tiles, hf["pixel_values"], shapes):
        np.testing.assert_array_equal(tile.reshape(rows * cols, -1), pixels[: rows * cols])


def _prompt_ids(tiny: str, text: str, images: list[bytes], overrides: dict | None = None) -> list[int]:
    from transformers import AutoConfig, AutoTokenizer

    from asyncllm.mm.inputs import MultiModalInputs
    from asyncllm.mm.processor import MultiModalProcessor
    from asyncllm.models.lfm2_vl import Lfm2VlForConditionalGeneration

    tokenizer = AutoTokenizer.from_pretrained(tiny)
    mm = MultiModalProcessor(tiny, AutoConfig.from_pretrained(tiny), Lfm2VlForConditionalGeneration, tokenizer,
                             2**26, 2**24, processor_kwargs=overrides)
    return mm.process(tokenizer(text)["input_ids"], MultiModalInputs(list(images)), "prompt.images").token_ids


@pytest.mark.parametrize("sizes", [[(100, 90)], [(150, 60)], [(150, 60), (33, 97)], [(300, 300), (500, 70)]])
def test_prompt_ids_equal_transformers_processor(tiny: str, sizes: list) -> None:
    """One and two images, single tiles and split ones (row / column markers, the thumbnail)."""
    images = [make_image(*size, seed=i) for i, size in enumerate(sizes)]
    text = " and ".join(["<image>"] * len(images)) + " described"
    expected = hf_lfm2_vl_inputs(tiny, text, images)["input_ids"][0].tolist()
    assert _prompt_ids(tiny, text, images) == expected


@pytest.mark.parametrize("overrides", [dict(use_thumbnail=False), dict(do_image_splitting=False),
                                       dict(max_image_tokens=8, min_image_tokens=2)])
def test_mm_processor_kwargs_change_the_prompt_as_transformers(tiny: str, overrides: dict) -> None:
    """``mm_processor_kwargs`` over the checkpoint's settings: the ids transformers' processor writes with them."""
    images = [make_image(300, 140, seed=3)]
    text = "<image> described"
    pil = [_pil_of(images[0])]
    expected = hf_processor(tiny)(text=text, images=pil, add_special_tokens=True, **overrides)["input_ids"]
    assert _prompt_ids(tiny, text, images, overrides) == expected[0]
    assert _prompt_ids(tiny, text, images) != expected[0]


def test_unknown_processor_settings_and_resampling_are_refused(tiny: str) -> None:
    from asyncllm.errors import ConfigError, NotBuiltError
    from asyncllm.mm.lfm2_vl_images import Lfm2VlImages

    with pytest.raises(ConfigError, match="mm_processor_kwargs.max_image_token"):
        _prompt_ids(tiny, "<image>", [make_image(40, 40, seed=1)], dict(max_image_token=8))
    with pytest.raises(NotBuiltError, match="resample"):
        Lfm2VlImages.from_pretrained(tiny, resample=3)


def test_tower_and_projector_equal_transformers_image_features(tiny: str) -> None:
    """Tiles of three shapes (8 x 8 tiles and a 4 x 12 thumbnail; a 6 x 8 image) against ``get_image_features`` of the
    same images batched and padded, within float32 noise."""
    import torch
    from transformers import Lfm2VlForConditionalGeneration

    from asyncllm.mm.lfm2_vl_images import Lfm2VlImages
    from asyncllm.models import lfm2_vl
    from asyncllm.models.layers import TensorParallel
    from asyncllm.models.siglip2 import Siglip2VisionTower

    hf = Lfm2VlForConditionalGeneration.from_pretrained(tiny, dtype=torch.float32).eval()
    tower = Siglip2VisionTower(hf.config.vision_config, TensorParallel(), torch.float32).eval()
    tower.load_state_dict(hf.model.vision_tower.state_dict())
    projector = lfm2_vl.Lfm2VlMultiModalProjector(hf.config, torch.float32).eval()
    projector.load_state_dict(hf.model.multi_modal_projector.state_dict())
    images = [make_image(150, 60, seed=1), make_image(100, 90, seed=2)]
    inputs = hf_lfm2_vl_inputs(tiny, "<image> <image>", images)
    tiles = [tile for image in images for tile in Lfm2VlImages.from_pretrained(tiny)(images=[_pil_of(image)]).tiles]
    assert sorted({tile.shape[:2] for tile in tiles}) == [(4, 12), (6, 8), (8, 8)]

    def ours() -> torch.Tensor:
        return torch.cat([projector(tower(torch.from_numpy(t)[None]), *t.shape[:2])[0] for t in tiles])

    with torch.no_grad():
        expected = torch.cat(hf.model.get_image_features(inputs["pixel_values"], inputs["spatial_shapes"],
                                                         inputs["pixel_attention_mask"]).pooler_output)
        torch.testing.assert_close(ours(), expected, rtol=1e-4, atol=1e-4)


def _pil_of(image: bytes):
    from PIL import Image

    return Image.open(io.BytesIO(image)).convert("RGB")
