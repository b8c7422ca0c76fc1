"""Encoded video files (mp4, webm, ...) -> sampled RGB frames and their timing, with PyAV.

A file is given as bytes, a path or a base64 ``data:video/<type>;base64,...`` URL
(http(s) URLs are refused: the engine fetches nothing). A path is opened here and PyAV reads the open file, as a
container of `FORMATS` only (FFmpeg's ``format_whitelist``, checked before the demuxer reads a byte past its probe),
and FFmpeg may open no other file (``io_open`` refuses): an HLS playlist (``.m3u8``), a concat list or an SDP file
inside ``--allowed-local-media-path`` would otherwise make FFmpeg read the files or URLs it names. Its size is read
from the stream header before any frame is decoded, and each frame's own before it is converted; ``num_frames`` frames
(``media_io_kwargs={"video": {"num_frames": N}}``, vLLM's knob; 32 by default)
are taken at evenly spaced indices over the whole video, as vLLM's loader does, and
their indices and the stream's frame rate become the video's metadata
(asyncllm/mm/videos.py), so the model sees their real timing.
"""

from __future__ import annotations

import base64
import io
import os
from typing import Any

import numpy as np

from asyncllm.errors import InvalidRequestError

__all__ = ["DEFAULT_NUM_FRAMES", "FORMATS", "MAX_VIDEO_FILE_FRAMES", "OtherFileError", "decode_video_file", "refuse_open", "sample_indices"]

DEFAULT_NUM_FRAMES = 32
"""Frames taken from a video file when ``media_io_kwargs`` names no ``num_frames`` (vLLM's default)."""
MAX_VIDEO_FILE_FRAMES = 36_000
"""Frames a video file may have (20 minutes at 30 fps): the frames up to the last one taken are all decoded, on
the processor thread every request shares, so a file of more (a small one can hold a million near-empty frames,
minutes of decoding) is refused, by the container's count or by counting its packets, before any is decoded."""
_PACKETS_PER_FRAME = 4
"""Packets of any size `_counted_frames` demuxes per frame of the bound before it stops counting."""
FORMATS = ("mov,mp4,m4a,3gp,3g2,mj2,matroska,webm,avi,mpegts,mpeg,mpegvideo,flv,asf,ogg,nut,gif,apng,mxf,gxf,lxf,rm,"
            "wtv,swf,nsv,nuv,smjpeg,mpjpeg,flic,ivf,obu,yuv4mpegpipe,dv,h264,hevc,vvc,evc,m4v,mjpeg,vc1,av1,h261,h263,"
            "cavsvideo,dirac,dnxhd,avs2,avs3")
"""FFmpeg demuxers a video file may be read with: self-contained containers and raw streams. Not those that read
other files or URLs (``hls``, ``dash``, ``concat``, ``image2``, ``sdp``, ``rtp``, ``rtsp``, ``imf``, ``mlv``'s
sibling chunks ...) and no input device (``lavfi``, ``v4l2``, ``x11grab`` ...): a list of what may be read, not of
what may not, so a demuxer or device another FFmpeg build adds is refused until it is named here."""


def sample_indices(total: int, num_frames: int) -> list[int]:
    """``num_frames`` evenly spaced frame indices over ``total`` frames (all of them when there are fewer), truncated
    as vLLM's loader takes them (``np.linspace(0, total - 1, n, dtype=int)``, not rounded)."""
    if total <= num_frames:
        return list(range(total))
    return np.linspace(0, total - 1, num_frames, dtype=int).tolist()


def _file_source(source: Any, field: str) -> Any:
    """A file-like object or path PyAV can open."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        return io.BytesIO(bytes(source))
    if isinstance(source, str) and source.startswith("data:"):
        header, comma, payload = source.partition(",")
        params = header.removeprefix("data:").split(";")
        if not comma or params[-1] != "base64" or (params[0] and not params[0].startswith("video/")):
            raise InvalidRequestError(field, f"a data: URL must be 'data:video/<type>;base64,<data>', got {header!r:.60}")
        try:
            return io.BytesIO(base64.b64decode(payload))  # not validated, as vLLM's VideoMediaIO: line breaks dropped
        except ValueError as exc:  # binascii.Error, or a ValueError for a non-ASCII character
            raise InvalidRequestError(field, f"the data: URL's base64 is invalid: {exc}") from exc
    if isinstance(source, str) and source.startswith(("http://", "https://")):
        raise InvalidRequestError(field, "URLs are not fetched; pass the video's bytes, a base64 data: URL or frames")
    if not os.path.isfile(os.fspath(source)):
        raise InvalidRequestError(field, f"no video file at {os.fspath(source)!r:.120} (a str video is a path, or a "
                                         "data:video/<type>;base64,... URL)")
    try:
        return open(os.fspath(source), "rb")  # PyAV reads this file object; FFmpeg opens nothing itself
    except OSError as exc:
        raise InvalidRequestError(field, f"cannot read video file {os.fspath(source)!r:.120}: {exc.strerror}") from exc


def refuse_open(url: str, flags: int, options: dict[str, Any]) -> Any:
    """PyAV's ``io_open``: a demuxer's request to open another file or URL, always refused (video and audio
    files: `asyncllm/mm/audios.py`)."""
    raise OtherFileError(url)


class OtherFileError(Exception):
    """The media file named another file for FFmpeg to open (a playlist, a concat list)."""


def decode_video_file(source: Any, field: str, max_frame_pixels: int,
                      num_frames: int = DEFAULT_NUM_FRAMES) -> tuple[np.ndarray, dict[str, Any]]:
    """(``[n, H, W, 3]`` uint8 frames, vLLM's metadata dict) of an encoded video; `InvalidRequestError` for anything
    that is not a decodable video within ``max_frame_pixels`` per frame."""
    try:
        import av
    except ImportError as exc:
        raise InvalidRequestError(field, "decoding video files needs PyAV (pip install 'asyncllm[multimodal]'); "
                                         "or pass decoded frames") from exc
    with _file_source(source, field) as opened:
        try:
            return _decode(av, opened, field, max_frame_pixels, num_frames)
        except OtherFileError as exc:  # the same whether that file exists or not
            raise InvalidRequestError(field, "the file names other files to read (a playlist or list); only "
                                             "self-contained video files are read") from exc
        except av.FFmpegError as exc:
            raise InvalidRequestError(field, f"cannot decode the video: {exc} (only self-contained video files are "
                                             f"read, as one of {FORMATS.replace(',', ', ')})") from exc


def _open(av: Any, opened: Any) -> Any:
    """``opened`` from its first byte, as a container of `FORMATS` that may open no other file."""
    opened.seek(0)
    return av.open(opened, io_open=refuse_open, container_options={"format_whitelist": FORMATS})


def _decode(av: Any, opened: Any, field: str, max_frame_pixels: int, num_frames: int) -> tuple[np.ndarray, dict[str, Any]]:
    with _open(av, opened) as container:
        size, total, fps = _probe(container, field, max_frame_pixels)
    wanted = sample_indices(total, num_frames)
    with _open(av, opened) as container:  # opened again, not seeked: FFmpeg cannot seek a raw H.264 or HEVC stream
        keep, frames = set(wanted), []
        for index, frame in enumerate(container.decode(container.streams.video[0])):
            _check_frame(frame, index, size, field, max_frame_pixels)
            if index in keep:
                frames.append(frame.to_ndarray(format="rgb24"))
            if wanted and index >= wanted[-1]:
                break
    if not frames:
        raise InvalidRequestError(field, "the video has no frames")
    taken = wanted[: len(frames)]
    return np.stack(frames), {"fps": fps, "frames_indices": taken, "total_num_frames": max(total, taken[-1] + 1)}


def _probe(container: Any, field: str, max_frame_pixels: int) -> tuple[tuple[int, int], int, float | None]:
    """(width x height, frames, frame rate) of the first video stream, read before any frame is decoded;
    `InvalidRequestError` for a frame over ``max_frame_pixels`` or a file of over `MAX_VIDEO_FILE_FRAMES`."""
    if not container.streams.video:
        raise InvalidRequestError(field, "the file has no video stream")
    stream = container.streams.video[0]
    width, height = stream.codec_context.width, stream.codec_context.height
    if width * height > max_frame_pixels:
        raise InvalidRequestError(field, f"the video is {width}x{height} = {width * height} pixels a frame, over "
                                         f"mm_max_image_pixels={max_frame_pixels}")
    total, unit = (stream.frames, "frames") if stream.frames else _counted_frames(container, stream)
    if total > MAX_VIDEO_FILE_FRAMES:
        raise InvalidRequestError(field, f"the video has over {MAX_VIDEO_FILE_FRAMES} frames ({total} {unit} "
                                         f"read), more "
                                         f"than a video file may have (asyncllm.mm.video_files."
                                         f"MAX_VIDEO_FILE_FRAMES); pass fewer frames")
    return (width, height), total, float(stream.average_rate or stream.guessed_rate or 0) or None


def _check_frame(frame: Any, index: int, size: tuple[int, int], field: str, max_frame_pixels: int) -> None:
    """`InvalidRequestError` for a decoded frame over ``max_frame_pixels`` or of another size than ``size`` (the
    stream header's, checked before any frame is decoded): the header says one size, the frames may be of any."""
    width, height = frame.width, frame.height
    if width * height > max_frame_pixels:
        raise InvalidRequestError(field, f"frame {index} of the video is {width}x{height} = {width * height} pixels, "
                                         f"over mm_max_image_pixels={max_frame_pixels}")
    if (width, height) != tuple(size):
        raise InvalidRequestError(field, f"frame {index} of the video is {width}x{height}, not {size[0]}x{size[1]} "
                                         "as the stream header says: a video whose frame size changes is not read")


def _counted_frames(container: Any, stream: Any) -> tuple[int, str]:
    """The stream's packets with data (its frames), for a container that does not say how many: counted up to one
    past `MAX_VIDEO_FILE_FRAMES`, enough to refuse the file. Empty packets count no frame but are demuxed too, so
    past `_PACKETS_PER_FRAME` times the bound (a file of mostly empty packets) the count is the packets read, over it
    too: (the count, what it counted)."""
    count = 0
    for read, packet in enumerate(container.demux(stream), 1):
        count += bool(packet.size)
        if count > MAX_VIDEO_FILE_FRAMES:
            break
        if read > _PACKETS_PER_FRAME * MAX_VIDEO_FILE_FRAMES:
            return read, "packets"
    return count, "frames"
