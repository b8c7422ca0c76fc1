"""GLM-4.1V's video pixels and timestamps (asyncllm/mm/glm4v_video.py) against transformers' ``Glm4vVideoProcessor``
(torchvision's resize and normalize stood in: tests/glm4v_video_utils.py)."""

from __future__ import annotations

import numpy as np
import pytest
from glm4v_utils import make_tiny_glm4v
from glm4v_video_utils import hf_video_processor
from qwen_vl_utils import make_video

from asyncllm.mm.glm4v_video import frame_seconds
from asyncllm.mm.qwen_video import load_video_settings, video_grid, video_patches
from asyncllm.mm.videos import read_video
from asyncllm.models.glm4v import Glm4vForConditionalGeneration


@pytest.fixture(scope="module")
def glm4v(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_glm4v(tmp_path_factory.mktemp("glm4v_video_unit"))


@pytest.mark.parametrize("frames, height, width", [(2, 56, 56), (5, 80, 100), (4, 20, 300), (3, 400, 170), (7, 150, 90)])
def test_patches_equal_transformers_video_processor(glm4v, frames, height, width):
    """Shrunk, enlarged and untouched frames: the same grid and exactly the same pixel values."""
    settings = load_video_settings(glm4v, Glm4vForConditionalGeneration.video_settings)
    video = (make_video(frames, width, height, seed=frames), {"fps": 3.0})
    expected = hf_video_processor(glm4v, [video])
    ours = video_patches(read_video(video, "v", 10**8), settings, "v")
    assert [list(ours.shape[:3])] == expected["video_grid_thw"].tolist()
    assert video_grid(read_video(video, "v", 10**8), settings, "v") == ours.shape[:3]
    np.testing.assert_array_equal(ours.reshape(-1, ours.shape[-1]), expected["pixel_values_videos"].numpy())


def test_timestamps_are_each_temporal_patchs_first_frames_whole_seconds():
    video = read_video((make_video(5, 28, 28, seed=0), {"fps": 1.5, "frames_indices": [0, 2, 3, 7, 9],
                                                          "total_num_frames": 10}), "v", 10**8)
    assert frame_seconds(video, 2, 3) == [0, 2, 6]  # 0 / 1.5, 3 / 1.5, 9 / 1.5
    assert frame_seconds(video, 2, 4) == [0, 2, 6, 6]
