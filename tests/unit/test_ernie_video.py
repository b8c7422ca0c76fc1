"""ERNIE 4.5 VL's videos against transformers: the frames stamped, padded, resized and patched
(asyncllm/mm/ernie_video.py vs ``Ernie4_5_VLMoeVideoProcessor``, torchvision stood in: tests/glm4v_video_utils.py),
the placeholder count (``Ernie4_5_VLMoeProcessor``) and the M-RoPE positions (``get_rope_index``)."""

from __future__ import annotations

import dataclasses
import functools
import json
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
from ernie_vl_utils import FONT, hf_ernie_video_processor
from qwen_vl_utils import make_video

from asyncllm.errors import InvalidRequestError
from asyncllm.mm.ernie_video import ernie_video_grid, ernie_video_patches, load_ernie_video_settings, stamped_frames
from asyncllm.mm.videos import read_video
from asyncllm.models.ernie4_5_vl import Ernie4_5_VLMoeForConditionalGeneration, ernie_mrope_positions

UNIT = 28 * 28


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A folder with the video processor's config and font alone (what both processors read)."""
    path = tmp_path_factory.mktemp("ernie_video")
    shutil.copy(FONT, path)
    config = {"video_processor_type": "Ernie4_5_VLMoeVideoProcessor", "draw_on_frames": True, "font": "DejaVuSans.ttf",
              "size": {"shortest_edge": 4 * UNIT, "longest_edge": 16 * UNIT}}
    (path / "video_preprocessor_config.json").write_text(json.dumps(config))
    return str(path)


@pytest.mark.parametrize("frames, height, width, fps", [(9, 60, 90, 2.0), (4, 200, 140, 24.0), (3, 56, 84, 0.5)])
def test_patches_equal_transformers_video_processor(checkpoint, frames, height, width, fps):
    """Odd and even frame counts, shrunk, enlarged and untouched frames, timestamps past a minute: the same grid,
    the same pixel values and transformers' placeholder count."""
    from transformers import Ernie4_5_VLMoeProcessor

    settings = load_ernie_video_settings(checkpoint, None)
    timing = {"fps": fps, "frames_indices": [7 * i for i in range(frames)], "total_num_frames": 7 * frames}
    pair = (make_video(frames, width, height, seed=frames), timing)
    video = read_video(pair, "v", 10**8)
    expected = hf_ernie_video_processor(checkpoint, [pair])
    ours = ernie_video_patches(video, settings, "v")
    assert [list(ours.shape[:3])] == expected["video_grid_thw"].tolist()
    assert ernie_video_grid(video, settings, "v") == ours.shape[:3] and ours.shape[0] == frames + frames % 2
    np.testing.assert_array_equal(ours.reshape(-1, ours.shape[-1]), expected["pixel_values_videos"].numpy())
    processor = SimpleNamespace(video_token="v", video_processor=SimpleNamespace(merge_size=2, temporal_patch_size=2))
    hf_count = len(Ernie4_5_VLMoeProcessor.replace_video_token(processor, expected, 0))
    config = SimpleNamespace(vision_config=SimpleNamespace(spatial_merge_size=2))
    assert Ernie4_5_VLMoeForConditionalGeneration.mm_placeholder_length(config, ours.shape) == hf_count


def test_timestamps_are_drawn_on_the_frames(checkpoint):
    video = read_video((np.full((2, 56, 84, 3), 128, np.uint8), {"fps": 1.0}), "v", 10**8)
    stamped = stamped_frames(video, FONT)
    assert not np.array_equal(stamped, video.frames) and not np.array_equal(stamped[0], stamped[1])  # 0 s vs 1 s
    assert np.array_equal(stamped[:, 20:], video.frames[:, 20:])  # the top left corner only


def test_frames_too_small_for_their_timestamps_are_refused_by_field(checkpoint):
    """Under 10 pixels on the shorter side a timestamp's font size is 0, which PIL (so transformers' processor)
    refuses: refused naming the field and the minimum. 10 pixels are stamped; without timestamps 9 are processed."""
    settings = load_ernie_video_settings(checkpoint, None)
    small = read_video(make_video(2, 40, 9, seed=0), "videos[0]", 10**8)
    for hook in (ernie_video_grid, ernie_video_patches):
        with pytest.raises(InvalidRequestError, match="at least 10 pixels") as error:
            hook(small, settings, "videos[0]")
        assert error.value.field == "videos[0]"
    assert ernie_video_patches(read_video(make_video(2, 40, 10, seed=0), "v", 10**8), settings, "v").shape[0] == 2
    unstamped = dataclasses.replace(settings, font=None)
    assert ernie_video_patches(small, unstamped, "v").shape[:3] == ernie_video_grid(small, unstamped, "v")


def test_positions_equal_transformers_rope_index():
    """An image, then a video of more frame pairs than rows or columns (the text after it resumes by its rows and
    columns alone: transformers' rule), then a text token."""
    import torch
    from transformers.models.ernie4_5_vl_moe.modeling_ernie4_5_vl_moe import Ernie4_5_VLMoeModel

    items = [(2, 12, (1, 6, 8)), (16, 30, (10, 4, 6))]  # (offset, length, (t, h, w) in patches)
    prompt_len = 47  # one text token after the video
    types = torch.zeros(1, prompt_len, dtype=torch.int32)
    types[0, 2:14], types[0, 16:46] = 1, 2
    vision = SimpleNamespace(temporal_merge_size=2, spatial_merge_size=2)
    positions_of = functools.partial(Ernie4_5_VLMoeModel.get_vision_position_ids, None)
    model = SimpleNamespace(config=SimpleNamespace(vision_config=vision), get_vision_position_ids=positions_of)
    expected, delta = Ernie4_5_VLMoeModel.get_rope_index(model, torch.zeros(1, prompt_len, dtype=torch.long), types,
                                                         torch.tensor([[1, 6, 8]]), torch.tensor([[10, 4, 6]]))
    table, ours_delta = ernie_mrope_positions(prompt_len, items, 2)
    np.testing.assert_array_equal(table, expected[:, 0].numpy())
    assert table[0, 16:46].max() > table[0, -1]  # the video's time reaches past the text after it
    assert ours_delta == table[0, -1] + 1 - prompt_len < int(delta)  # generate goes on from the last position


def test_a_checkpoint_without_its_font_refuses_the_video_by_name(tmp_path):
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps({"font": "Roboto-Regular.ttf"}))
    settings = load_ernie_video_settings(str(tmp_path), None)
    with pytest.raises(InvalidRequestError, match="Roboto-Regular.ttf"):
        ernie_video_patches(read_video(make_video(2, 56, 56, seed=0), "v", 10**8), settings, "v")
