"""Qwen2.5-Omni's audio in video (``mm_processor_kwargs={"use_audio_in_video": True}``): a video and its audio track
interleaved by time chunks in the prompt, and their M-RoPE positions (transformers' ``Qwen2_5OmniProcessor`` and
``get_rope_index``).

The video's ``<|VIDEO|>`` (between ``<|vision_bos|>`` and ``<|vision_eos|>``) becomes ``<|audio_bos|>``, then the
video's and the audio's placeholders cut into chunks of ``position_id_per_seconds * seconds_per_chunk`` positions of
time (`chunked_index`, transformers' ``get_chunked_index`` as it is: a token may advance the chunk by one only, so a
video whose temporal patches lie over a chunk apart has one-token chunks), video chunk j before audio chunk j, then
``<|audio_eos|>``. Each chunk is one item (`asyncllm.protocol.MultiModalItem.rows`: its rows of the whole video's or
audio's encoder output, which is encoded once). Positions: the two start tokens share one, the video's temporal
patches and the audio's rows count on from the next (the audio's as text, one a row, so 25 rows a second of either),
the two end tokens share the last chunk's largest position + 1. A temporal patch's time is the processor's float64
``i * seconds * 25`` for the layout (`layout_times`) and ``get_rope_index``'s float32 ``((i * seconds) * 25).long()``
for the positions (`video_times`), which the tokens take in ``get_rope_index``'s own chunks of them, as it does.

Qwen3-Omni's (`TimeOrderedAudioInVideo`, transformers' ``Qwen3OmniMoeProcessor`` and its ``get_rope_index``) merges
the two token by token in time order instead: a video placeholder goes before the audio row ``j`` whose index (one
time position a row) its time reaches (``time <= j``, a temporal patch's placeholders all at its time), the rest of
either after the other runs out; each run of one kind is an item. Its two start tokens take consecutive positions,
the video's patches and the audio's rows count on from the next (in ``get_rope_index``'s own order of them), its two
end tokens the last run's largest position + 1 and + 2, and decoding goes on from the prompt's largest position + 1.
transformers' time positions are floats; a video whose temporal patches are not a whole number of positions apart is
refused here (asyncllm's positions are whole numbers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import msgspec
import numpy as np

from asyncllm.errors import ConfigError

__all__ = ["AudioInVideo", "TimeOrderedAudioInVideo", "chunked_index", "interleaved_positions", "video_times"]


def chunked_index(values: np.ndarray, per_chunk: int) -> list[tuple[int, int]]:
    """transformers' ``get_chunked_index``: ``[start, stop)`` runs of ``values`` (non-decreasing), a new run where a
    value reaches the next multiple of ``per_chunk`` (one chunk further a value, whatever it skips)."""
    runs, start, chunk = [], 0, 1
    for i, value in enumerate(values.tolist()):
        if value >= chunk * per_chunk:
            runs.append((start, i))
            start, chunk = i, chunk + 1
    runs.append((start, len(values)))
    return runs


def float_times(t: int, seconds: float, per_second: float) -> np.ndarray:
    """A video's temporal patches' time positions in float32, as transformers' ``get_rope_index``: ``(i * seconds) *
    per_second`` (``seconds``: the item's `time_interval`, seconds a temporal patch)."""
    return (np.arange(t, dtype=np.float32) * np.float32(seconds)) * np.float32(per_second)


def video_times(t: int, seconds: float, per_second: float) -> np.ndarray:
    """`float_times` truncated, as Qwen2.5-Omni's ``get_rope_index`` does (``.long()``)."""
    return float_times(t, seconds, per_second).astype(np.int64)


def layout_times(grid: tuple[int, int, int], merge: int, seconds: float, per_second: float) -> np.ndarray:
    """Each of a video's placeholders' time, as transformers' processor lays the chunks out: ``i * seconds *
    per_second`` in float64 (not truncated; `video_times` are the positions)."""
    t, h, w = grid
    return np.repeat(np.arange(t) * seconds * per_second, (h // merge) * (w // merge))


@dataclass(frozen=True)
class AudioInVideo:
    """A Qwen2.5-Omni thinker's tokens and chunk size for a video with its audio (`of`)."""

    vision_start: int
    audio_start: int
    audio_end: int
    per_chunk: int
    """``int(position_id_per_seconds * seconds_per_chunk)``: time positions a chunk."""
    merge: int
    """The vision tower's spatial merge: a temporal patch's placeholders are its ``(h / merge) x (w / merge)``."""
    per_second: float
    """``position_id_per_seconds``: time positions a second."""

    vision_end_token = "<|vision_eos|>"
    """The token that must follow the video's placeholder."""
    bracket_step = 0
    """How far apart the two start tokens' positions are, and the two end tokens' (Qwen2.5-Omni: they share one)."""
    decode_from_largest = False
    """Whether decoding goes on from the prompt's largest position + 1 (transformers' Qwen3-Omni), not its last's."""

    @classmethod
    def of(cls, hf_config: Any) -> AudioInVideo:
        per_chunk = int(hf_config.position_id_per_seconds * hf_config.seconds_per_chunk)
        if per_chunk < 1:
            raise ConfigError("seconds_per_chunk", hf_config.seconds_per_chunk,
                              "at least one time position a chunk (position_id_per_seconds x seconds_per_chunk >= 1)")
        return cls(int(hf_config.vision_start_token_id), int(hf_config.audio_start_token_id), int(hf_config.audio_end_token_id), per_chunk,
                   int(hf_config.vision_config.spatial_merge_size), hf_config.position_id_per_seconds)

    def pieces(self, grid: tuple[int, int, int], seconds: float, audio_rows: int) -> list[tuple[bool, int, int]]:
        """(is the video's, first row, stop row) of each run of placeholders in prompt order of a video of ``grid``
        patches ``seconds`` apart and its audio's ``audio_rows``: video chunk j, then audio chunk j (transformers'
        processor's chunks: `layout_times`); empty runs left out."""
        return _interleave(chunked_index(layout_times(grid, self.merge, seconds, self.per_second), self.per_chunk),
                           chunked_index(np.arange(audio_rows), self.per_chunk))

    def runs(self, video_times: np.ndarray, audio_rows: int) -> list[tuple[bool, int, int]]:
        """The runs of `group_positions` (``get_rope_index``'s order): its chunks of the video's placeholders'
        ``video_times`` and of the audio's rows."""
        return _interleave(chunked_index(video_times, self.per_chunk), chunked_index(np.arange(audio_rows),
                                                                                     self.per_chunk))

    def group_positions(self, items: list[Any], origin: int) -> list[np.ndarray]:
        """The ``[3, n]`` positions of the runs of one video with its audio (its ``items``), the video's and audio's
        rows counting from ``origin``, in transformers' ``get_rope_index`` order of them (`runs`; the video's times
        `video_times`), which the tokens take one after another."""
        video = next((item for item in items if len(item.shape) == 4), None)
        audio = next((item for item in items if len(item.shape) == 3), None)
        video_rows = np.zeros((3, 0), dtype=np.int64)
        if video is not None:
            t, h, w = video.shape[:3]
            video_rows = np.indices((t, h // self.merge, w // self.merge)).reshape(3, -1)
            video_rows[0] = np.repeat(video_times(t, video.time_interval, self.per_second), video_rows.shape[1] // t)
        rows = audio.rows[1] if audio is not None else 0
        audio_rows = np.broadcast_to(np.arange(rows), (3, rows))
        return [(video_rows if is_video else audio_rows)[:, start:stop] + origin
                for is_video, start, stop in self.runs(video_rows[0], rows)]


@dataclass(frozen=True)
class TimeOrderedAudioInVideo(AudioInVideo):
    """A Qwen3-Omni thinker's tokens for a video with its audio (`of`): merged token by token in time order."""

    vision_end_token = "<|vision_end|>"
    bracket_step = 1
    decode_from_largest = True

    @classmethod
    def of(cls, hf_config: Any) -> TimeOrderedAudioInVideo:
        return cls(int(hf_config.vision_start_token_id), int(hf_config.audio_start_token_id),
                   int(hf_config.audio_end_token_id), 0, int(hf_config.vision_config.spatial_merge_size),
                   hf_config.position_id_per_seconds)

    def pieces(self, grid: tuple[int, int, int], seconds: float, audio_rows: int) -> list[tuple[bool, int, int]]:
        """(is the video's, first row, stop row) of each run of placeholders in prompt order: transformers'
        ``replace_video_with_audio_token`` (a placeholder's time in float64, `layout_times`, before audio row j when
        ``<= j``). `ValueError` for a video whose time positions are not whole numbers (float32, as
        ``get_rope_index``)."""
        times = float_times(grid[0], seconds, self.per_second)
        if not np.array_equal(times, np.floor(times)):
            raise ValueError(f"with use_audio_in_video a video's temporal patches lie {float(times[-1] - times[-2]):g} "
                             "time positions apart (position_id_per_seconds x temporal_patch_size / fps): Qwen3-Omni's "
                             "fractional positions are not built (asyncllm's are whole numbers)")
        return self.runs(layout_times(grid, self.merge, seconds, self.per_second), audio_rows)

    def runs(self, video_times: np.ndarray, audio_rows: int) -> list[tuple[bool, int, int]]:
        """Runs of each kind in time order: a video placeholder (its time) before the audio rows its time does not
        pass (``time <= row``), ties to the video, as transformers' merge loop."""
        kinds = np.argsort(np.concatenate([video_times, np.arange(audio_rows)]), kind="stable") < len(video_times)
        edges = [0, *(np.flatnonzero(kinds[1:] != kinds[:-1]) + 1).tolist(), len(kinds)]
        runs, taken = [], [0, 0]  # rows taken of the audio's, of the video's
        for start, stop in zip(edges, edges[1:]):
            is_video = bool(kinds[start])
            runs.append((is_video, taken[is_video], taken[is_video] + stop - start))
            taken[is_video] += stop - start
        return [run for run in runs if run[1] < run[2]]


def _interleave(video: list[tuple[int, int]], audio: list[tuple[int, int]]) -> list[tuple[bool, int, int]]:
    runs = []
    for j in range(max(len(video), len(audio))):
        runs += [(True, *video[j])] if j < len(video) else []
        runs += [(False, *audio[j])] if j < len(audio) else []
    return [run for run in runs if run[1] < run[2]]


def end_of(item: Any) -> int:
    return item.offset + item.length


def interleaved_positions(prompt_len: int, items: list[Any], spec: AudioInVideo,
                          plain: Callable[[int, list[Any]], tuple[np.ndarray, int]]) -> tuple[np.ndarray, int]:
    """The prompt's ``[3, prompt_len]`` positions and delta: ``plain(length, items)`` (the model's own rule) between
    the videos with their audio, whose pieces (items with ``rows``, adjacent, a video's first) are positioned as
    transformers' ``get_rope_index`` does: the two tokens before ``spec.bracket_step`` apart, the pieces counting on
    from the next (`AudioInVideo.group_positions`), the two tokens after at the last run's largest position + 1 and
    ``spec.bracket_step`` further. Decoding goes on from the prompt's last position, as transformers' ``generate``
    does for Qwen2.5-Omni (from 5.3; vLLM and earlier transformers from its largest + 1, further where a video chunk
    reaches past the last audio chunk), or with ``spec.decode_from_largest`` from its largest + 1 (Qwen3-Omni's)."""
    table = np.empty((3, prompt_len), dtype=np.int64)
    base = cursor = i = 0
    step = spec.bracket_step
    while True:
        first = next((k for k in range(i, len(items)) if items[k].rows), len(items))
        last = first
        while last + 1 < len(items) and items[last + 1].rows and items[last + 1].offset == end_of(items[last]):
            last += 1  # the pieces of one video with its audio: no text between them
        stop = items[first].offset - 1 if first < len(items) else prompt_len  # the text up to the second start token
        segment = [msgspec.structs.replace(item, offset=item.offset - cursor) for item in items[i:first]]
        part, _ = plain(stop - cursor, segment)
        table[:, cursor:stop] = part + base
        if first == len(items):
            break
        table[:, stop] = table[:, stop - 1] + step
        pieces = spec.group_positions(items[first:last + 1], int(table[0, stop]) + 1)
        end = end_of(items[last])
        table[:, items[first].offset : end] = np.concatenate(pieces, axis=1)
        ends = int(pieces[-1].max()) + 1 + np.array([0, step])  # the two end tokens' (the core checks they are here)
        table[:, end : end + 2] = ends[: min(2, prompt_len - end)]
        base, cursor, i = int(ends[-1]) + 1, min(end + 2, prompt_len), last + 1
    last_position = int(table.max() if spec.decode_from_largest else table[:, -1].max())
    return table, last_position + 1 - prompt_len
