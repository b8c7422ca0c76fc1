"""Qwen-VL video processing without torchvision (asyncllm/mm/qwen_video.py, videos.py, video_files.py): frame sizes
equal to transformers' ``smart_resize``, the patch layout equal to its image processor's, Qwen3-VL's timestamps,
the checkpoint's settings, and inputs refused by name."""

from __future__ import annotations

import ast
import dataclasses
import io
import json
import math

import numpy as np
import pytest
from qwen_vl_utils import make_mp4

from asyncllm.config import EngineConfig
from asyncllm.errors import ConfigError, InvalidRequestError, NotBuiltError
from asyncllm.mm.qwen_video import (
    QWEN3_VIDEO_SETTINGS,
    VideoSettings,
    frame_size,
    frame_timestamps,
    load_video_settings,
    video_grid,
    video_patches,
)
from asyncllm.mm.video_files import decode_video_file, sample_indices
from asyncllm.mm.videos import Video, is_one_video, read_video

SIZES = [(56, 56), (80, 100), (28, 700), (1000, 90), (333, 444), (20, 30), (1080, 1920)]


def _transformers_smart_resize(module: str):
    """transformers' video ``smart_resize`` of ``module``, read from its source: importing the module needs
    torchvision."""
    import importlib.util

    path = importlib.util.find_spec(module).origin
    tree = ast.parse(open(path).read())
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "smart_resize")
    namespace = {"math": math}
    exec(compile(ast.Module([node], []), path, "exec"), namespace)
    return namespace["smart_resize"]


@pytest.mark.parametrize("height, width", SIZES)
def test_frame_sizes_equal_transformers_smart_resize(height, width):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        smart_resize as per_frame,
    )

    qwen3 = _transformers_smart_resize("transformers.models.qwen3_vl.video_processing_qwen3_vl")
    qwen2 = VideoSettings(min_pixels=4 * 784, max_pixels=64 * 784)
    assert frame_size(qwen2, 5, height, width, "v") == per_frame(height, width, 28, 4 * 784, 64 * 784)
    for frames in (2, 7, 40):
        expected = qwen3(frames, height, width, 2, 32, QWEN3_VIDEO_SETTINGS.min_pixels, QWEN3_VIDEO_SETTINGS.max_pixels)
        assert frame_size(QWEN3_VIDEO_SETTINGS, frames, height, width, "v") == expected


def _image_processor(patch_size: int):
    from transformers import Qwen2VLImageProcessorPil

    unit = (2 * patch_size) ** 2
    return Qwen2VLImageProcessorPil(min_pixels=4 * unit, max_pixels=64 * unit, patch_size=patch_size)


@pytest.mark.parametrize("patch_size", [14, 16])
def test_patches_are_the_image_processors_frame_by_frame_in_time_order(patch_size):
    """Frames already of a valid size (no resampling): each temporal slot of the video's patches holds exactly what
    transformers' image processor makes of that frame (an image fills both slots with itself)."""
    processor = _image_processor(patch_size)
    unit = (2 * patch_size) ** 2
    settings = VideoSettings(4 * unit, 64 * unit, patch_size, 2, 2, tuple(processor.image_mean),
                             tuple(processor.image_std), pixels_over_frames=patch_size == 16)
    rng = np.random.default_rng(0)
    frames = rng.integers(0, 256, (3, 4 * patch_size, 6 * patch_size, 3), dtype=np.uint8)  # 3 frames: padded to 4
    patches = video_patches(Video(frames, 24.0, (0, 1, 2), 3), settings, "v")
    assert patches.shape == (2, 4, 6, 3 * 2 * patch_size**2)
    slots = patches.reshape(2, 24, 3, 2, -1)
    expected = [processor(images=[f], return_tensors="np")["pixel_values"].reshape(24, 3, 2, -1)[:, :, 0]
                for f in (*frames, frames[-1])]
    for index, frame in enumerate(expected):
        np.testing.assert_allclose(slots[index // 2, :, :, index % 2], frame, rtol=0, atol=1e-6)


def test_a_resized_video_keeps_its_grid_and_patch_width():
    settings = VideoSettings(4 * 784, 64 * 784)
    video = read_video(np.zeros((4, 100, 150, 3), np.uint8), "v", 10**6)
    grid = video_grid(video, settings, "v")
    assert video_patches(video, settings, "v").shape == (*grid, 3 * 2 * 14 * 14)
    assert grid[0] == 2 and grid[1] * grid[2] * 784 // 4 <= 64 * 784


def test_qwen3_timestamps_equal_transformers():
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    for indices, fps in (([0, 1, 2, 3], 24.0), ([0, 12, 24, 36, 48], 24.0), ([3, 9, 15], 2.5)):
        video = Video(np.zeros((len(indices), 8, 8, 3), np.uint8), fps, tuple(indices), max(indices) + 1)
        assert frame_timestamps(video, 2) == Qwen3VLProcessor._calculate_timestamps(None, indices, fps, 2)


def test_settings_come_from_the_checkpoint_where_transformers_looks(tmp_path):
    assert load_video_settings(str(tmp_path), QWEN3_VIDEO_SETTINGS) == QWEN3_VIDEO_SETTINGS
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"min_pixels": 100, "max_pixels": 900}))
    fallback = load_video_settings(str(tmp_path), VideoSettings())
    assert (fallback.min_pixels, fallback.max_pixels) == (100, 900)
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps(
        {"size": {"shortest_edge": 200, "longest_edge": 800}, "image_mean": [0.5] * 3, "patch_size": 16}))
    video = load_video_settings(str(tmp_path), VideoSettings())
    assert (video.min_pixels, video.max_pixels, video.image_mean, video.patch_size) == (200, 800, (0.5,) * 3, 16)
    (tmp_path / "processor_config.json").write_text(json.dumps({"video_processor": {"max_pixels": 500}}))
    assert load_video_settings(str(tmp_path), VideoSettings()).max_pixels == 500
    (tmp_path / "processor_config.json").write_text(json.dumps({"video_processor": {"do_normalize": False}}))
    with pytest.raises(NotBuiltError, match="do_normalize"):
        load_video_settings(str(tmp_path), VideoSettings())
    (tmp_path / "processor_config.json").write_text(json.dumps({"video_processor": {"cap_pixels_per_frame": True}}))
    with pytest.raises(NotBuiltError, match="cap_pixels_per_frame"):
        load_video_settings(str(tmp_path), VideoSettings())


def test_video_inputs_and_their_metadata():
    from PIL import Image

    frames = np.zeros((3, 10, 12, 3), np.uint8)
    video = read_video((frames, {"fps": 30, "frames_indices": [0, 15, 30], "total_num_frames": 90}), "v", 10**6)
    assert video.sampled_fps == pytest.approx(1.0) and video.frames_indices == (0, 15, 30)
    assert read_video(list(frames), "v", 10**6).key() == read_video(frames, "v", 10**6).key() != video.key()
    as_images = read_video([Image.fromarray(f) for f in frames], "v", 10**6)
    assert (as_images.fps, as_images.total_num_frames, as_images.frames.shape) == (24.0, 3, (3, 10, 12, 3))
    assert is_one_video(frames) and is_one_video(list(frames)) and is_one_video((frames, {}))
    assert is_one_video(b"mp4 bytes") and is_one_video("clip.mp4") and not is_one_video([frames, frames])
    bad = [
        (frames.astype(np.float32), "uint8"), ([frames[0], frames[0, :5]], "one size"),
        (np.zeros((2, 100, 100, 3), np.uint8), "over mm_max_image_pixels=1000"),
        ((frames, {"fps": 0}), r"v.metadata.fps"), ((frames, {"speed": 2}), "unknown keys"),
        ((frames, {"do_sample_frames": True}), "sampling frames is not built"),
        ((frames, {"frames_indices": [0, 1]}), "frames_indices"),
        ((frames, {"frames_indices": [0, 1, 5], "total_num_frames": 4}), "total_num_frames"),
        (np.zeros((769, 2, 2, 3), np.uint8), "over the 768"), (7, "got int"),
        ("https://example.com/a.mp4", "URLs are not fetched"),
    ]
    for value, message in bad:
        with pytest.raises(InvalidRequestError, match=message):
            read_video(value, "v", 1000)


def test_metadata_of_numpy_numbers_is_the_same_timing():
    """vLLM's metadata as numpy gives it (``np.arange`` indices, ``np.int64`` counts, ``np.float32`` rates): the same
    video as the plain numbers (until 2026-12-07 numpy indices without a count, a numpy count or a float32 rate were
    refused, the first naming a total_num_frames the caller never gave); an infinite rate is refused as 0 is."""
    frames = np.zeros((3, 10, 12, 3), np.uint8)
    plain = read_video((frames, {"fps": 2.5, "frames_indices": [0, 15, 30], "total_num_frames": 90}), "v", 10**6)
    numpy = read_video((frames, {"fps": np.float32(2.5), "frames_indices": np.arange(0, 31, 15),
                                 "total_num_frames": np.int64(90)}), "v", 10**6)
    assert numpy.key() == plain.key() and numpy.total_num_frames == 90 and type(numpy.total_num_frames) is int
    counted = read_video((frames, {"frames_indices": np.arange(3)}), "v", 10**6)
    assert counted.key() == read_video(frames, "v", 10**6).key()
    for fps in (float("inf"), np.float64("nan"), True):
        with pytest.raises(InvalidRequestError, match="v.metadata.fps"):
            read_video((frames, {"fps": fps}), "v", 10**6)
    with pytest.raises(InvalidRequestError, match="total_num_frames"):
        read_video((frames, {"total_num_frames": np.float64(90)}), "v", 10**6)


def test_video_files_are_decoded_and_sampled_with_their_timing(tmp_path):
    import base64

    data = make_mp4(20)
    frames, meta = decode_video_file(data, "v", 10**6, num_frames=5)
    assert frames.shape == (5, 48, 64, 3) and meta["frames_indices"] == sample_indices(20, 5) == [0, 4, 9, 14, 19]
    assert (meta["fps"], meta["total_num_frames"]) == (10.0, 20)
    assert abs(int(frames[2].mean()) - 9 * 12) < 8  # the 10th frame's grey, through the lossy codec
    path = tmp_path / "clip.mp4"
    path.write_bytes(data)
    url = "data:video/mp4;base64," + base64.b64encode(data).decode()
    keys = {read_video(source, "v", 10**6, 5).key() for source in (data, str(path), url)}
    assert len(keys) == 1
    assert read_video(data, "v", 10**6).frames.shape[0] == 20  # fewer frames than asked: all of them
    for source, message in ((b"not a video", "cannot decode"), (str(tmp_path / "none.mp4"), "no video file"),
                            ("data:image/png;base64,AAAA", "data:video/"), (data, "over mm_max_image_pixels")):
        with pytest.raises(InvalidRequestError, match=message):
            read_video(source, "v", 1000 if source is data else 10**6)


def _matroska(mp4: bytes) -> io.BytesIO:
    """An mp4's video packets in matroska, whose header says no frame count."""
    import av

    mkv = io.BytesIO()
    with av.open(io.BytesIO(mp4)) as source, av.open(mkv, "w", format="matroska") as target:
        stream = target.add_stream_from_template(source.streams.video[0])
        for packet in source.demux(source.streams.video[0]):
            if packet.dts is not None:
                packet.stream = stream
                target.mux(packet)
    return mkv


def test_a_video_file_of_too_many_frames_is_refused_before_decoding(monkeypatch):
    """By the container's count (mp4), or by its packets counted (matroska says none), no frame decoded."""
    import av

    from asyncllm.mm import video_files

    mkv = _matroska(make_mp4(20))
    monkeypatch.setattr(video_files, "MAX_VIDEO_FILE_FRAMES", 20)
    assert decode_video_file(mkv.getvalue(), "v", 10**6, 5)[1]["total_num_frames"] == 20
    monkeypatch.setattr(video_files, "MAX_VIDEO_FILE_FRAMES", 5)
    monkeypatch.setattr(av.container.InputContainer, "decode", lambda *_: pytest.fail("decoded"))
    for data, read in ((make_mp4(20), 20), (mkv.getvalue(), 6)):  # counted no further than one past the bound
        with pytest.raises(InvalidRequestError, match=rf"over 5 frames \({read} frames read\)") as info:
            decode_video_file(data, "prompt.videos[0]", 10**6)
        assert info.value.field == "prompt.videos[0]"


def test_a_video_file_of_empty_packets_is_refused_after_a_bounded_count(monkeypatch):
    """Empty packets count no frame, but no more than `_PACKETS_PER_FRAME` times the bound are demuxed to count."""
    import types

    import av

    from asyncllm.mm import video_files

    mkv = _matroska(make_mp4(2))  # no frame count in the header, so its packets are counted
    demuxed = []

    def empty_packets(*_):
        for _ in range(1000):
            demuxed.append(1)
            yield types.SimpleNamespace(size=0)

    monkeypatch.setattr(video_files, "MAX_VIDEO_FILE_FRAMES", 5)
    monkeypatch.setattr(av.container.InputContainer, "demux", empty_packets)
    monkeypatch.setattr(av.container.InputContainer, "decode", lambda *_: pytest.fail("decoded"))
    with pytest.raises(InvalidRequestError, match=r"over 5 frames \(21 packets read\)"):
        decode_video_file(mkv.getvalue(), "v", 10**6)
    assert len(demuxed) == 21


def test_media_io_kwargs_take_the_video_frame_count_only():
    assert EngineConfig.create("m", media_io_kwargs={"video": {"num_frames": 8}}).multimodal_config.video_num_frames == 8
    assert EngineConfig.create("m").multimodal_config.video_num_frames == 32
    with pytest.raises(NotBuiltError, match="media_io_kwargs.video.fps"):
        EngineConfig.create("m", media_io_kwargs={"video": {"fps": 2}})
    with pytest.raises(ConfigError, match="media_io_kwargs.video.num_frames"):
        EngineConfig.create("m", media_io_kwargs={"video": {"num_frames": 0}})


def test_a_qwen3_video_needs_two_frames():
    settings = dataclasses.replace(QWEN3_VIDEO_SETTINGS)
    with pytest.raises(InvalidRequestError, match="at least 2"):
        frame_size(settings, 1, 64, 64, "v")
