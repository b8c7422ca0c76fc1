"""Llama 4's host and tower halves against transformers: the image processing (asyncllm/mm/llama4_images.py) and the
prompt ids against ``Llama4ImageProcessor`` and ``Llama4Processor`` (torchvision's resize stood in:
tests/llama4_vl_utils.py), the vision model and projector (asyncllm/models/llama4_vision.py) against transformers'."""

from __future__ import annotations

import io

import numpy as np
import pytest
from llama4_vl_utils import PROCESSOR, hf_image_module, hf_image_processor, hf_llama4_inputs, hf_processor, make_tiny_llama4_vl
from mm_utils import make_image

SIZES = [(40, 40), (70, 50), (20, 90), (150, 60), (33, 97), (16, 16), (64, 64), (300, 20)]
"""(width, height): one tile up- and downscaled, 2 x 2, 4 x 1, 1 x 4 canvases, padded and exact fits."""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_llama4_vl(tmp_path_factory.mktemp("llama4_vl"))


@pytest.mark.parametrize("settings", [dict(max_patches=16, size=336), dict(max_patches=5, size=32),
                                      dict(max_patches=4, size=32, resize_to_max_canvas=True)])
def test_canvases_and_sizes_equal_transformers(settings: dict) -> None:
    """The canvas list (its order breaks ties), the best canvas and the fitted size over a sweep of image sizes."""
    import torch
    from transformers.image_utils import SizeDict

    from asyncllm.mm.llama4_images import Llama4ImageSettings, best_canvas, canvases, fitted_size

    hf = hf_image_module()
    tile, to_max = settings["size"], settings.get("resize_to_max_canvas", False)
    ours = Llama4ImageSettings(size=(tile, tile), max_patches=settings["max_patches"], resize_to_max_canvas=to_max)
    options = hf.find_supported_resolutions.__wrapped__(ours.max_patches, SizeDict(height=tile, width=tile))
    assert canvases(ours.max_patches, tile) == options
    table = torch.tensor(options)
    for height in range(3, 1500, 29):
        for width in range(2, 1500, 31):
            canvas = best_canvas(height, width, table, to_max)
            expected = hf.get_best_fit((height, width), table, resize_to_max_canvas=to_max)
            assert canvas.tolist() == expected.tolist()
            bound = expected if to_max else (min(max(height, tile), expected[0]), min(max(width, tile), expected[1]))
            hf_size = hf.get_max_res_without_distortion((height, width), bound)
            assert fitted_size(height, width, canvas, ours) == (max(int(hf_size[0]), 1), max(int(hf_size[1]), 1))


@pytest.mark.parametrize("size", SIZES)
def test_tiles_equal_transformers_pixel_values(tiny: str, size: tuple[int, int]) -> None:
    """Every tile and the global view, bit for bit (transformers' bfloat16 values), and the grid."""
    import torch

    from asyncllm.mm.llama4_images import Llama4Images

    image = _pil_of(make_image(*size, seed=sum(size)))
    hf = hf_image_processor(tiny)(images=[image], return_tensors="pt")
    ours = Llama4Images.from_pretrained(tiny)(images=[image])
    assert (ours.rows, ours.cols) == tuple(hf["aspect_ratios"][0].tolist())
    assert hf["pixel_values"].dtype == torch.bfloat16
    np.testing.assert_array_equal(ours.tiles, hf["pixel_values"].float().numpy())


def _prompt_ids(tiny: str, text: str, images: list[bytes], overrides: dict | None = None) -> list[int]:
    from transformers import AutoConfig, AutoTokenizer

    from asyncllm.mm.inputs import MultiModalInputs
    from asyncllm.mm.processor import MultiModalProcessor
    from asyncllm.models.llama4 import Llama4ForConditionalGeneration

    tokenizer = AutoTokenizer.from_pretrained(tiny)
    mm = MultiModalProcessor(tiny, AutoConfig.from_pretrained(tiny), Llama4ForConditionalGeneration, tokenizer,
                             2**26, 2**24, processor_kwargs=overrides)
    return mm.process(tokenizer(text)["input_ids"], MultiModalInputs(list(images)), "prompt.images").token_ids


@pytest.mark.parametrize("sizes", [[(40, 40)], [(70, 50)], [(150, 60), (33, 97)], [(20, 90), (30, 28)]])
def test_prompt_ids_equal_transformers_processor(tiny: str, sizes: list) -> None:
    """One and two images, one tile alone and tiled ones (the separators, the global view's ``<|image|>``)."""
    images = [make_image(*size, seed=i) for i, size in enumerate(sizes)]
    text = " and ".join(["<|image|>"] * len(images)) + " described"
    expected = hf_llama4_inputs(tiny, text, images)["input_ids"][0].tolist()
    assert _prompt_ids(tiny, text, images) == expected


@pytest.mark.parametrize("overrides, size", [(dict(max_patches=2), (70, 50)), (dict(resize_to_max_canvas=True), (20, 20))])
def test_mm_processor_kwargs_change_the_prompt_as_transformers(tiny: str, overrides: dict, size: tuple) -> None:
    """Fewer tiles (1 x 2, not 2 x 2); a small image upscaled to the largest canvas (2 x 2, not one tile)."""
    images = [make_image(*size, seed=3)]
    expected = hf_processor(tiny)(text="<|image|> described", images=[_pil_of(images[0])], **overrides)["input_ids"]
    assert _prompt_ids(tiny, "<|image|> described", images, overrides) == expected[0]
    assert _prompt_ids(tiny, "<|image|> described", images) != expected[0]


def test_unknown_settings_and_resampling_are_refused(tiny: str) -> None:
    from asyncllm.errors import ConfigError, NotBuiltError
    from asyncllm.mm.llama4_images import Llama4Images

    with pytest.raises(ConfigError, match="mm_processor_kwargs.max_patch"):
        _prompt_ids(tiny, "<|image|>", [make_image(40, 40, seed=1)], dict(max_patch=8))
    with pytest.raises(NotBuiltError, match="resample"):
        Llama4Images.from_pretrained(tiny, resample=3)
    with pytest.raises(ConfigError, match="square"):
        Llama4Images.from_pretrained(tiny, size={"height": 32, "width": 64})


def test_tower_and_projector_equal_transformers_image_features(tiny: str) -> None:
    """Two images' tiles (2 x 2 plus the global view; one tile) through our tower and projector against transformers'
    ``get_image_features`` and projector, within float32 noise."""
    import torch
    from transformers import Llama4ForConditionalGeneration

    from asyncllm.mm.llama4_images import Llama4Images
    from asyncllm.models.llama4_vision import Llama4MultiModalProjector, Llama4VisionModel

    hf = Llama4ForConditionalGeneration.from_pretrained(tiny, dtype=torch.float32).eval()
    tower = Llama4VisionModel(hf.config.vision_config, torch.float32).eval()
    tower.load_state_dict(hf.vision_model.state_dict())
    projector = Llama4MultiModalProjector(hf.config, torch.float32).eval()
    projector.load_state_dict(hf.multi_modal_projector.state_dict())
    images = [make_image(70, 50, seed=1), make_image(30, 28, seed=2)]
    pixels = hf_llama4_inputs(tiny, "<|image|> <|image|>", images)["pixel_values"].float()
    tiles = np.concatenate([Llama4Images.from_pretrained(tiny)(images=[_pil_of(i)]).tiles for i in images])
    assert tiles.shape == (6, 3, 32, 32)
    with torch.no_grad():
        expected = hf.multi_modal_projector(hf.get_image_features(pixels, return_dict=True).last_hidden_state)
        torch.testing.assert_close(projector(tower(torch.from_numpy(tiles))), expected, rtol=1e-5, atol=1e-5)


def _pil_of(image: bytes):
    from PIL import Image

    return Image.open(io.BytesIO(image)).convert("RGB")


def test_processor_settings_are_the_checkpoint_s(tiny: str) -> None:
    from asyncllm.mm.llama4_images import Llama4Images

    settings = Llama4Images.from_pretrained(tiny).settings
    assert (settings.size, settings.max_patches) == ((PROCESSOR["size"]["height"],) * 2, PROCESSOR["max_patches"])
