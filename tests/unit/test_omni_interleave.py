"""Qwen2.5-Omni's audio in video (asyncllm/models/omni_interleave.py) in process: the placeholder layout equals
transformers' ``Qwen2_5OmniProcessor.replace_video_with_audio_token`` and the M-RoPE positions its
``get_rope_index(use_audio_in_video=True)``, for videos whose temporal patches lie within a chunk, a chunk apart and
over a chunk apart (one-token chunks), with a standalone audio and an image around them."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import msgspec
import numpy as np
import pytest
import torch
from qwen2_5_omni_utils import hf_audio_in_video_text

from asyncllm.models.mrope import mrope_positions
from asyncllm.models.omni_interleave import AudioInVideo, interleaved_positions
from asyncllm.protocol import MultiModalItem

IDS = {"<|vision_bos|>": 1, "<|audio_bos|>": 2, "<|audio_eos|>": 3, "<|vision_eos|>": 4, "<|VIDEO|>": 5,
       "<|AUDIO|>": 6, "<|IMAGE|>": 7}
TEXT = 8
CASES = [([4, 4, 6], 1.0, 62), ([3, 4, 4], 4.0, 120), ([6, 2, 2], 0.5, 30), ([2, 4, 4], 2.0, 150)]
"""(video grid, seconds a temporal patch, audio rows): 2 fps, 0.5 fps (patches 100 positions apart: one-token
chunks), 4 fps, 1 fps with an audio longer than the video."""


def _config():
    return SimpleNamespace(vision_start_token_id=1, audio_start_token_id=2, audio_end_token_id=3, video_token_id=5,
                           audio_token_id=6, image_token_id=7, position_id_per_seconds=25, seconds_per_chunk=2,
                           vision_config=SimpleNamespace(spatial_merge_size=2))


def _video_with_audio(grid, seconds, rows, offset):
    """Our tokens (from <|audio_bos|> to <|audio_eos|>) and items of a video with its audio at ``offset``."""
    spec = AudioInVideo.of(_config())
    interval = float(np.float32(seconds) * np.float32(25))
    video = MultiModalItem("v", 0, grid[0] * grid[1] * grid[2] // 4, shape=[*grid, 1176], time_interval=interval)
    audio = MultiModalItem("a", 0, rows, shape=[1, 17, 3000])
    tokens, items = [spec.audio_start], []
    for is_video, start, stop in spec.pieces(tuple(grid), interval, rows):
        whole = video if is_video else audio
        items.append(msgspec.structs.replace(whole, offset=offset + len(tokens), length=stop - start,
                                             rows=[start, whole.length]))
        tokens += [IDS["<|VIDEO|>" if is_video else "<|AUDIO|>"]] * (stop - start)
    return tokens + [spec.audio_end], items


@pytest.mark.parametrize("grid, seconds, rows", CASES)
def test_the_placeholders_are_transformers(grid, seconds, rows):
    hf = hf_audio_in_video_text(grid, seconds, rows)
    ours, _ = _video_with_audio(grid, seconds, rows, 0)
    names = {v: k for k, v in IDS.items()}
    assert "".join(names[t] for t in ours) == hf


def _plain(prompt_len, items):
    return mrope_positions(prompt_len, [(i.offset, i.length, tuple(i.shape[:3]), i.time_interval) for i in items
                                        if len(i.shape) == 4], 2)


def _hf_positions(ids, videos, audio_frames, image_grid):
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (
        Qwen2_5OmniPreTrainedModelForConditionalGeneration as Hf,
    )

    model = SimpleNamespace(config=_config(), spatial_merge_size=2,
                            get_llm_pos_ids_for_vision=functools.partial(Hf.get_llm_pos_ids_for_vision, None),
                            get_chunked_index=functools.partial(Hf.get_chunked_index, None))
    ids = torch.tensor([ids])
    positions, delta = Hf.get_rope_index(model, ids, torch.tensor([image_grid]), torch.tensor([g for g, _, _ in videos]),
                                         torch.ones_like(ids), True, torch.tensor(audio_frames),
                                         torch.tensor([s for _, s, _ in videos]))
    return positions[:, 0].numpy(), int(delta)


def test_the_positions_are_transformers_get_rope_index():
    """Text, an image, two videos with their audio and a standalone audio between them; decoding goes on from the
    last prompt position (transformers' generate), not past a video chunk that reaches further."""
    ids, items, frames = [TEXT, TEXT, IDS["<|vision_bos|>"]] + [IDS["<|IMAGE|>"]] * 4 + [IDS["<|vision_eos|>"]], [], []
    items.append(MultiModalItem("i", 3, 4, shape=[1, 4, 4, 1176]))
    videos = [CASES[1], CASES[0]]  # the last one's second video chunk reaches past its last audio chunk
    for n, (grid, seconds, rows) in enumerate(videos):
        ids += [TEXT, IDS["<|vision_bos|>"]]
        tokens, pieces = _video_with_audio(grid, seconds, rows, len(ids))
        ids += tokens + [IDS["<|vision_eos|>"], TEXT]
        items += pieces
        frames.append(rows * 4)  # ((4r - 1) // 2 + 1 - 2) // 2 + 1 = r rows
        if n == 0:
            ids += [IDS["<|audio_bos|>"]]
            items.append(MultiModalItem("s", len(ids), 5, shape=[1, 17, 3000]))
            ids += [IDS["<|AUDIO|>"]] * 5 + [IDS["<|audio_eos|>"], TEXT]
            frames.append(20)
    want, want_delta = _hf_positions(ids, videos, frames, [1, 4, 4])
    got, delta = interleaved_positions(len(ids), items, 2, _plain)
    np.testing.assert_array_equal(got, want)
    assert delta == int(got[0, -1]) + 1 - len(ids) != want_delta  # transformers' get_rope_index: its largest + 1


def test_a_pieces_first_row_keys_its_blocks_and_is_checked():
    """Two pieces of one output at one place key their prefix-cache blocks apart; a piece past its output's rows
    fails the request."""
    from asyncllm.errors import InvalidRequestError
    from asyncllm.kv.hashing import _mm_keys
    from asyncllm.mm.cache import fill_mm_items
    from asyncllm.protocol import AddRequest
    from asyncllm.sampling import SamplingParams

    pieces = [MultiModalItem("a", 4, 8, rows=[start, 20]) for start in (0, 8)]
    assert _mm_keys(pieces[:1], 0, 16) != _mm_keys(pieces[1:], 0, 16)
    bad = MultiModalItem("a", 4, 8, data=bytes(4), shape=[1], rows=[13, 20])
    with pytest.raises(InvalidRequestError, match="rows"):
        fill_mm_items(None, AddRequest("r", [5] * 16, SamplingParams(), [1], 0.0, mm_items=[bad]))
