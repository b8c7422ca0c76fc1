"""LLaVA-NeXT-Video's videos in process: the frames' pixels (asyncllm/mm/llava_video.py) against transformers'
``LlavaNextVideoVideoProcessor`` (torchvision's functions stood in), the pooled features and the placeholder count
against transformers' model, and the settings refused by name."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from llava_next_video_utils import hf_llava_video_pixels, make_tiny_llava_next_video
from qwen_vl_utils import make_video

from asyncllm.errors import InvalidRequestError, NotBuiltError
from asyncllm.mm.llava_video import LlavaVideoSettings, llava_video_grid, llava_video_pixels, load_llava_video_settings
from asyncllm.mm.videos import read_video
from asyncllm.models.checkpoint import load_hf_config


@pytest.fixture(scope="module")
def tiny_video(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_llava_next_video(tmp_path_factory.mktemp("llava_video_unit"))


@pytest.mark.parametrize("frames, height, width", [(3, 60, 80), (2, 40, 30), (1, 56, 56), (4, 200, 57)])
def test_pixels_equal_transformers_video_processor(tiny_video, frames, height, width):
    """Shrunk and cropped across, enlarged, untouched, and a tall frame cropped down: exactly the processor's."""
    video = make_video(frames, width, height, seed=frames + height)
    settings = load_llava_video_settings(tiny_video, load_hf_config(tiny_video))
    ours = llava_video_pixels(read_video(video, "v", 10**8), settings, "v")
    np.testing.assert_array_equal(ours, hf_llava_video_pixels(tiny_video, [video]).numpy())


def test_exact_size_and_a_padded_crop_equal_transformers(tiny_video, tmp_path):
    """``size`` as height x width, then a crop larger than the frame: zero-padded (before normalizing) as it pads."""
    config = json.loads(open(f"{tiny_video}/video_preprocessor_config.json").read())
    config.update(size={"height": 41, "width": 50}, crop_size={"height": 56, "width": 56})
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps(config))
    video = make_video(2, 70, 33, seed=9)
    settings = LlavaVideoSettings(None, (41, 50), (56, 56))
    ours = llava_video_pixels(read_video(video, "v", 10**8), settings, "v")
    np.testing.assert_array_equal(ours, hf_llava_video_pixels(str(tmp_path), [video]).numpy())


def test_frames_of_an_aspect_ratio_over_200_are_refused_by_field():
    """A 2 x 401 frame (224 x 44912 after the resize) is refused before any resize, as the Qwen-VL models refuse it;
    2 x 400 is not."""
    thin = read_video(make_video(2, 401, 2, seed=0), "videos[0]", 10**8)
    for hook in (llava_video_grid, llava_video_pixels):
        with pytest.raises(InvalidRequestError, match="aspect ratio 401:2 is over 200") as error:
            hook(thin, LlavaVideoSettings(), "videos[0]")
        assert error.value.field == "videos[0]"
    assert llava_video_grid(read_video(make_video(2, 400, 2, seed=0), "v", 10**8), LlavaVideoSettings(), "v") == (
        2, 224, 224)
    with pytest.raises(InvalidRequestError, match="needs at least one pixel"):  # not a ZeroDivisionError later
        read_video(np.zeros((2, 0, 8, 3), np.uint8), "videos[0]", 10**8)


@pytest.mark.parametrize("pool", ["average", "max"])
def test_video_features_equal_transformers(tmp_path, pool):
    """Two videos of 3 frames in one call: each one's rows are its frames' pooled features, as transformers'
    ``get_video_features``; the placeholder count is its processor's (a quarter of the patches, per frame)."""
    from transformers import LlavaNextVideoForConditionalGeneration as HFModel

    from asyncllm.config import EngineConfig
    from asyncllm.models.llava_next_video import LlavaNextVideoForConditionalGeneration
    from asyncllm.models.loader import load_model

    path = make_tiny_llava_next_video(tmp_path / pool, pool=pool)
    hf_config = load_hf_config(path)
    pixels = torch.from_numpy(hf_llava_video_pixels(path, [make_video(3, 70, 60, seed=s) for s in (1, 2)]).numpy())
    ours = load_model(EngineConfig.create(path), hf_config, torch.device("cpu"), torch.float32)
    hf = HFModel.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        got = ours.embed_multimodal(pixels[:, None])
        expected = hf.model.get_video_features(pixels, vision_feature_layer=-2,
                                               vision_feature_select_strategy="default").pooler_output
    assert LlavaNextVideoForConditionalGeneration.mm_placeholder_length_of(hf_config, pixels[:1].numpy()) == 3 * 4
    assert [rows.shape[0] for rows in got] == [3 * 4, 3 * 4]
    torch.testing.assert_close(torch.stack(got), expected, atol=1e-5, rtol=0)


def test_unbuilt_settings_are_refused_by_name(tiny_video, tmp_path):
    """A learned ("conv") pooling, a crop other than the tower's input and a resample other than bicubic."""
    from asyncllm.models.llava_next_video import LlavaNextVideoForConditionalGeneration

    hf_config = load_hf_config(tiny_video)
    hf_config.spatial_pool_mode = "conv"
    with pytest.raises(NotBuiltError, match="spatial_pool_mode"):
        LlavaNextVideoForConditionalGeneration(hf_config, dtype=torch.float32, tp=None, attn_backend=None,
                                               max_position=64)
    for change, name in (({"crop_size": {"height": 28, "width": 28}}, "crop_size"), ({"resample": 2}, "resample")):
        config = json.loads(open(f"{tiny_video}/video_preprocessor_config.json").read())
        (tmp_path / "video_preprocessor_config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(NotBuiltError, match=name):
            load_llava_video_settings(str(tmp_path), load_hf_config(tiny_video))
