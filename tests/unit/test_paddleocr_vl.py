"""PaddleOCR-VL's image encoder (asyncllm/models/paddleocr_vl.py) against transformers': the tower (learned positions
resampled to each grid, 2-D rotary attention within an image) and the 2 x 2 projector give transformers'
``get_image_features`` for images of different grids; transformers 5's in-memory names load as the released layout
does, the tower's unused head left unread. (Greedy tokens through the engine: tests/engine/
test_paddleocr_vl_engine.py.)"""

from __future__ import annotations

import pytest
import torch
from mm_utils import make_image
from paddleocr_vl_utils import IMAGE_PLACEHOLDER, hf_paddleocr_vl_inputs, make_tiny_paddleocr_vl
from safetensors.torch import load_file, save_file

from asyncllm.config import EngineConfig
from asyncllm.models.loader import load_hf_config, load_model
from asyncllm.models.paddleocr_vl import interpolated_positions

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_paddleocr_vl(tmp_path_factory.mktemp("paddleocr_vl"))


def _load(path: str) -> torch.nn.Module:
    return load_model(EngineConfig.create(path, max_model_len=256), load_hf_config(path), CPU, torch.float32)


def test_image_features_equal_transformers(tiny: str) -> None:
    from transformers import PaddleOCRVLForConditionalGeneration

    images = [make_image(120, 90, seed=1), make_image(60, 200, seed=2), make_image(90, 120, seed=3)]
    inputs = hf_paddleocr_vl_inputs(tiny, IMAGE_PLACEHOLDER * 3, images)
    hf = PaddleOCRVLForConditionalGeneration.from_pretrained(tiny, dtype=torch.float32).eval()
    model = _load(tiny)
    grids = [tuple(grid) for grid in inputs["image_grid_thw"].tolist()]
    assert grids == [(1, 6, 8), (1, 14, 4), (1, 8, 6)]  # none the table's 4 x 4; rows and columns apart
    with torch.no_grad():
        expected = hf.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"]).pooler_output
        start = 0
        for (t, h, w), want in zip(grids, expected, strict=True):
            pixels = inputs["pixel_values"][start : start + t * h * w]
            start += t * h * w
            got = model.embed_multimodal(pixels.reshape(1, t, h, w, -1))[0]  # an item as the host makes it
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_positions_resample_as_bilinear_interpolation() -> None:
    """The table resampled per grid equals ``F.interpolate``'s bilinear (half-pixel) resize, up and down."""
    table = torch.randn(16, 5)
    square = table.T.reshape(1, 5, 4, 4)
    for rows, cols in ((6, 8), (14, 2), (3, 3)):
        want = torch.nn.functional.interpolate(square, size=(rows, cols), mode="bilinear", align_corners=False)
        torch.testing.assert_close(interpolated_positions(table, rows, cols), want[0].flatten(1).T)


def test_transformers_5_names_load_as_the_released_layout(tiny: str, tmp_path) -> None:
    """``model.visual.*``, ``model.projector.*``, ``model.language_model.*`` (and an untied ``lm_head``) load into the
    same parameters as ``visual.*``, ``mlp_AR.*``, ``model.*``; the pooling head and packing positions are skipped."""
    import shutil

    renamed = tmp_path / "renamed"
    shutil.copytree(tiny, renamed)
    tensors = load_file(f"{tiny}/model.safetensors")
    prefixes = (("mlp_AR.", "model.projector."), ("visual.", "model.visual."), ("model.", "model.language_model."))

    def new_name(name: str) -> str:
        theirs, ours = next(pair for pair in prefixes if name.startswith(pair[0]))
        return ours + name.removeprefix(theirs)

    moved = {new_name(name): tensor for name, tensor in tensors.items()}
    moved["model.visual.vision_model.head.probe"] = torch.zeros(1, 1, 32)
    moved["model.visual.vision_model.packing_position_embedding.weight"] = torch.zeros(8, 32)
    save_file(moved, f"{renamed}/model.safetensors", metadata={"format": "pt"})
    model = _load(str(renamed))
    want, got = dict(_load(tiny).named_parameters()), dict(model.named_parameters())
    assert want.keys() == got.keys() and any(name.startswith("projector.") for name in got)
    assert all(torch.equal(want[name], got[name]) for name in want)
    # the names the loader skips are the ones a weight push is refused for (not taken and dropped)
    assert model.unread_weight("model.visual.vision_model.head.probe") and not model.unread_weight(next(iter(moved)))


def test_an_image_processor_other_than_paddleocr_vls_is_refused(tiny: str, tmp_path) -> None:
    """SigLIP's fixed-size processor (what a remote-code processor's name may resolve to), or PaddleOCR-VL's patching
    other than the tower, would size the items wrongly: a `ConfigError` naming it, before any request."""
    import shutil

    from transformers import AutoTokenizer, PaddleOCRVLImageProcessorPil, SiglipImageProcessorPil

    from asyncllm.errors import ConfigError
    from asyncllm.mm.processor import MultiModalProcessor
    from asyncllm.models.paddleocr_vl import PaddleOCRVLForConditionalGeneration

    config = load_hf_config(tiny)
    check = PaddleOCRVLForConditionalGeneration.mm_check_image_processor
    check(config, PaddleOCRVLImageProcessorPil())
    with pytest.raises(ConfigError, match="SiglipImageProcessorPil"):
        check(config, SiglipImageProcessorPil())
    with pytest.raises(ConfigError, match="merge_size"):
        check(config, PaddleOCRVLImageProcessorPil(merge_size=1))
    other = tmp_path / "siglip"
    shutil.copytree(tiny, other)
    SiglipImageProcessorPil().save_pretrained(other)
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    with pytest.raises(ConfigError, match="SiglipImageProcessorPil"):  # the host's processor, loaded
        MultiModalProcessor(str(other), config, PaddleOCRVLForConditionalGeneration, tokenizer, 2**26, 2**24)
    with pytest.raises(ConfigError, match="merge_size"):  # as the engine's processor_kwargs
        MultiModalProcessor(tiny, config, PaddleOCRVLForConditionalGeneration, tokenizer, 2**26, 2**24,
                            processor_kwargs={"merge_size": 1})
