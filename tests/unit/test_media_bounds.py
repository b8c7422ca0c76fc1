"""What a request's media may make the host read and allocate (asyncllm/mm/video_files.py, images.py, image_bounds.py):
no file outside the one given (an HLS playlist's segments), no frame past the header's size, no image the processor
resizes past ``mm_max_image_pixels`` (an extreme aspect ratio, a request's larger ``size``)."""

from __future__ import annotations

import io
import json

import pytest

from asyncllm.errors import InvalidRequestError

pytest.importorskip("av")
pytest.importorskip("PIL")


def _ts(width: int, height: int, frames: int) -> bytes:
    """An MPEG-TS clip of ``frames`` grey ``width x height`` frames (mpeg2video: any build of FFmpeg has it)."""
    import av
    import numpy as np

    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mpegts") as container:
        stream = container.add_stream("mpeg2video", rate=10)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(frames):
            frame = av.VideoFrame.from_ndarray(np.full((height, width, 3), 20 * i, np.uint8), format="rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    return buffer.getvalue()


def _playlist(tmp_path, segment: str) -> str:
    allowed = tmp_path / "allowed"
    allowed.mkdir(exist_ok=True)
    path = allowed / "clip.m3u8"
    path.write_text(f"#EXTM3U\n#EXT-X-TARGETDURATION:10\n#EXTINF:6.0,\n{segment}\n#EXT-X-ENDLIST\n")
    return str(path)


def test_a_playlist_never_makes_ffmpeg_read_the_files_it_names(tmp_path, monkeypatch):
    """An .m3u8 playlist naming a clip outside its folder: refused the same whether that clip exists or not by either
    guard alone: FFmpeg's hls demuxer is not on the whitelist, and FFmpeg's open of the clip is refused."""
    from asyncllm.mm import video_files

    outside = tmp_path / "outside.ts"
    outside.write_bytes(_ts(32, 32, 6))
    monkeypatch.setattr(video_files, "refuse_open", None)  # the whitelist alone
    errors = []
    for segment in (str(outside), str(tmp_path / "missing.ts")):
        with pytest.raises(InvalidRequestError) as info:
            video_files.decode_video_file(_playlist(tmp_path, segment), "video", 10**6)
        errors.append(str(info.value))
    assert errors[0] == errors[1]
    monkeypatch.undo()
    monkeypatch.setattr(video_files, "FORMATS", "hls," + video_files.FORMATS)  # the refused open alone
    with pytest.raises(InvalidRequestError, match="names other files"):
        video_files.decode_video_file(_playlist(tmp_path, str(outside)), "video", 10**6)
    frames, _ = video_files.decode_video_file(str(outside), "video", 10**6)  # a plain file is read as before
    assert frames.shape == (6, 32, 32, 3)


def test_a_frame_larger_than_its_header_or_resized_is_refused():
    """A stream whose header says 16 x 16 and whose later frames are larger: over the pixel limit, or a size change."""
    from asyncllm.mm.video_files import decode_video_file

    with pytest.raises(InvalidRequestError, match=r"frame \d of the video is 64x64 = 4096 pixels, over mm_max_image"):
        decode_video_file(_ts(16, 16, 4) + _ts(64, 64, 2), "video", 1000)
    with pytest.raises(InvalidRequestError, match=r"frame \d of the video is 32x32, not 16x16"):
        decode_video_file(_ts(16, 16, 4) + _ts(32, 32, 2), "video", 10**6)


def _png(width: int, height: int) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (width, height), (9, 9, 9)).save(out, format="PNG")
    return out.getvalue()


def test_an_image_of_an_extreme_aspect_ratio_is_refused():
    from asyncllm.mm.images import decode_image

    assert decode_image(_png(200, 1), "img", 10**6).size == (200, 1)
    with pytest.raises(InvalidRequestError, match="MAX_IMAGE_ASPECT_RATIO"):
        decode_image(_png(1, 201), "img", 10**6)


@pytest.mark.parametrize("pixels_over_frames", [False, True], ids=["qwen2-vl", "qwen3-vl"])
def test_images_and_video_frames_share_one_aspect_bound_and_a_side_of_no_pixels_is_refused(monkeypatch,
                                                                                            pixels_over_frames):
    """One bound (`MAX_IMAGE_ASPECT_RATIO`, `check_aspect_ratio`) for images and Qwen-VL video frames; a side of 0
    pixels is an `InvalidRequestError` naming the field, not a ZeroDivisionError in the resize."""
    import dataclasses

    from PIL import Image

    from asyncllm.mm import images
    from asyncllm.mm.qwen_video import VideoSettings, frame_size

    settings = dataclasses.replace(VideoSettings(), pixels_over_frames=pixels_over_frames)
    for height, width in ((0, 64), (64, 0)):
        with pytest.raises(InvalidRequestError, match="at least one pixel") as refused:
            frame_size(settings, 4, height, width, "videos[0]")
        assert refused.value.field == "videos[0]"
    with pytest.raises(InvalidRequestError, match="at least one pixel") as refused:
        images.decode_image(Image.new("RGB", (0, 50)), "img", 10**6)
    assert refused.value.field == "img"
    assert frame_size(settings, 4, 64, 192, "v")  # 1:3 within 200
    monkeypatch.setattr(images, "MAX_IMAGE_ASPECT_RATIO", 2)
    with pytest.raises(InvalidRequestError, match="aspect ratio 192:64 is over 2"):
        frame_size(settings, 4, 64, 192, "v")
    with pytest.raises(InvalidRequestError, match="aspect ratio 192:64 is over 2"):
        images.decode_image(Image.new("RGB", (192, 64)), "img", 10**6)


class _Llava:
    """What `MultiModalProcessor` reads of a LLaVA-style model class, for its image processing alone."""

    @staticmethod
    def mm_placeholder_token_id(hf_config):
        return 5

    @staticmethod
    def mm_pixel_values(output):
        return output["pixel_values"][0]


def _clip_processor(tmp_path, max_pixels: int):
    from asyncllm.mm.processor import MultiModalProcessor

    (tmp_path / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "CLIPImageProcessor", "size": {"shortest_edge": 56},
        "crop_size": {"height": 56, "width": 56}, "do_center_crop": True, "do_resize": True}))
    return MultiModalProcessor(str(tmp_path), None, _Llava, None, 0, max_pixels)


def test_the_processed_image_is_bounded_before_the_processor_runs(tmp_path):
    """A request may not raise the processor's size (a 32 x 32 image resized to 10000 x 10000), nor may CLIP's
    shortest-edge resize make a narrow strip past mm_max_image_pixels; a smaller size and a plain image pass."""
    from asyncllm.mm.inputs import MultiModalInputs

    mm = _clip_processor(tmp_path, 100_000)
    with pytest.raises(InvalidRequestError, match=r"mm_processor_kwargs.size.shortest_edge=10000: at most the en"):
        mm.process([5], MultiModalInputs([_png(32, 32)]), "prompt.images", {"size": {"shortest_edge": 10000}})
    with pytest.raises(InvalidRequestError, match=r"crop_size=.*engine's \{'height': 56"):  # the tower's crop: fixed
        mm.process([5], MultiModalInputs([_png(32, 32)]), "prompt.images", {"crop_size": {"height": 99, "width": 9}})
    with pytest.raises(InvalidRequestError, match=r"56x11200 = 627200 pixels \(size.shortest_edge=56\), over mm_max"):
        mm.process([5], MultiModalInputs([_png(2, 400)]), "prompt.images")
    assert mm._processor_output(_pil(40, 30), "img", {"size": {"shortest_edge": 28}})["pixel_values"].shape[-1] == 56
    assert mm._processor_output(_pil(40, 30), "img", {})["pixel_values"].shape[-1] == 56


def _pil(width: int, height: int):
    from PIL import Image

    return Image.new("RGB", (width, height))


def test_a_requests_pixel_count_may_rise_to_the_limit():
    """Qwen-VL's ``max_pixels`` (kept as ``size.longest_edge``): up to mm_max_image_pixels, not past it."""
    from asyncllm.errors import ConfigError
    from asyncllm.mm.image_bounds import check_request_sizes

    engine = {"size": {"longest_edge": 1000, "shortest_edge": 10}, "patch_size": 14}
    check_request_sizes(engine, {**engine, "size": {"longest_edge": 5000, "shortest_edge": 10}}, {"max_pixels": 5000},
                        5000)
    with pytest.raises(ConfigError, match="size.longest_edge"):
        check_request_sizes(engine, {**engine, "size": {"longest_edge": 5001, "shortest_edge": 10}},
                            {"max_pixels": 5001}, 5000)


@pytest.mark.parametrize("engine, request_, overrides, refused", [
    ({"max_tiles": 10, "max_pixels_tolerance": 2.0}, {"max_tiles": 64, "max_pixels_tolerance": 64.0},
     {"max_tiles": 64, "max_pixels_tolerance": 64}, "max_tiles=64"),  # a tolerance is no pixel count
    ({"max_image_tokens": 256, "min_image_tokens": 64, "max_pixels_tolerance": 2.0},
     {"max_image_tokens": 4096, "min_image_tokens": 4096, "max_pixels_tolerance": 4096.0},
     {"max_image_tokens": 4096, "min_image_tokens": 4096, "max_pixels_tolerance": 4096}, "max_image_tokens=4096"),
    ({"size": {"longest_edge": 1000, "shortest_edge": 10}}, {"size": {"longest_edge": 4000, "shortest_edge": 10}},
     {"size": {"longest_edge": 4000}, "min_pixels": 4000}, "size.longest_edge=4000"),  # not its own max_pixels
    ({"size": {"longest_edge": 1000, "shortest_edge": 10}, "patch_size": 14},
     {"size": {"longest_edge": 4000, "shortest_edge": 10}, "patch_size": 4000},
     {"max_pixels": 4000, "patch_size": 4000}, "patch_size=4000"),
])
def test_a_pixel_count_lets_no_other_setting_rise(engine, request_, overrides, refused):
    """Only a pixel count's own setting may rise to mm_max_image_pixels, not any setting of the same value."""
    from asyncllm.errors import ConfigError
    from asyncllm.mm.image_bounds import check_request_sizes

    with pytest.raises(ConfigError, match=rf"mm_processor_kwargs\.{refused}"):
        check_request_sizes(engine, request_, overrides, 16_777_216)


def _qwen_processor(tmp_path):
    from asyncllm.mm.processor import MultiModalProcessor

    (tmp_path / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Qwen2VLImageProcessor", "size": {"shortest_edge": 3136, "longest_edge": 1_003_520},
        "patch_size": 14, "merge_size": 2, "temporal_patch_size": 2}))
    return MultiModalProcessor(str(tmp_path), None, _Llava, None, 0, 16_777_216)


def test_a_request_keeps_the_models_patch_sizes_and_its_own_settings(tmp_path):
    """The patch, merge and temporal patch sizes the model's config fixes: refused changed (lowered too), kept equal;
    the request's own ``size`` dict is not rewritten by Qwen-VL's processor (it writes ``max_pixels`` into it)."""
    mm = _qwen_processor(tmp_path)
    for key, value in (("patch_size", 7), ("merge_size", 1), ("temporal_patch_size", 1)):
        with pytest.raises(InvalidRequestError, match=rf"{key}={value}: the engine's 2?\d+: it must match the model"):
            mm._processor_for({key: value})
    assert mm._processor_for({"patch_size": 14, "max_pixels": 2_000_000}).to_dict()["size"]["longest_edge"] == 2_000_000
    overrides = {"size": {"longest_edge": 500_000, "shortest_edge": 3136}, "max_pixels": 800_000}
    assert mm._processor_for(overrides).to_dict()["size"]["longest_edge"] == 800_000
    assert overrides == {"size": {"longest_edge": 500_000, "shortest_edge": 3136}, "max_pixels": 800_000}


def _clip(fmt: str, codec: str) -> bytes:
    """Eight 32 x 32 frames as ``fmt`` with ``codec`` (skipped where this FFmpeg build cannot write them)."""
    import av
    import numpy as np

    buffer = io.BytesIO()
    try:
        with av.open(buffer, "w", format=fmt) as container:
            stream = container.add_stream(codec, rate=25)  # a rate MXF takes
            stream.width, stream.height, stream.pix_fmt = 32, 32, "yuv420p"
            for i in range(8):
                frame = av.VideoFrame.from_ndarray(np.full((32, 32, 3), 25 * i, np.uint8), format="rgb24")
                container.mux(stream.encode(frame))
            container.mux(stream.encode())
    except (av.FFmpegError, ValueError) as exc:
        pytest.skip(f"this FFmpeg build cannot write {fmt} with {codec}: {exc}")
    return buffer.getvalue()


@pytest.mark.parametrize("fmt, codec", [("mxf", "mpeg2video"), ("rm", "rv20"), ("wtv", "mpeg2video"),
                                        ("h264", "libx264"), ("swf", "flv")])
def test_self_contained_files_and_raw_streams_decode(fmt, codec):
    """Containers that read no other file (MXF, RealMedia, WTV) and streams FFmpeg cannot seek (raw H.264: the frames
    are read from a second open, not a seek back)."""
    from asyncllm.mm.video_files import decode_video_file

    frames, meta = decode_video_file(_clip(fmt, codec), "video", 10**6, num_frames=4)
    assert frames.shape == (4, 32, 32, 3) and meta["frames_indices"] == [0, 2, 4, 7]


@pytest.mark.parametrize("exists", [True, False])
def test_an_audio_concat_list_reads_no_other_file(tmp_path, monkeypatch, exists) -> None:
    """An ffconcat list sent as audio bytes made FFmpeg read the file it names (any path the server can read)."""
    pytest.importorskip("av")
    import wave

    from asyncllm.mm.audios import read_audio

    monkeypatch.chdir(tmp_path)  # a relative name: the concat demuxer's "safe" mode refuses absolute ones itself
    secret = tmp_path / "secret.wav"
    if exists:
        with wave.open(str(secret), "wb") as out:
            out.setnchannels(1), out.setsampwidth(2), out.setframerate(16000)
            out.writeframes(b"\x10\x00" * 1600)
    listing = b"ffconcat version 1.0\nfile secret.wav\n"
    with pytest.raises(InvalidRequestError, match="could not be decoded") as refused:
        read_audio(listing, "audio", 16000)
    assert "only self-contained" in str(refused.value) or "Invalid argument" in str(refused.value)
