"""Qwen2.5-Omni's and Qwen3-Omni's audio in video (asyncllm/models/omni_interleave.py) in process: the placeholder
layout equals transformers' ``replace_video_with_audio_token`` and the M-RoPE positions its
``get_rope_index(use_audio_in_video=True)``: Qwen2.5-Omni's for videos whose temporal patches lie within a chunk, a
chunk apart and over a chunk apart (one-token chunks), Qwen3-Omni's time-ordered merge for videos longer and shorter
than their audio, each with a standalone audio and an image around them; the core's check of the pieces."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import msgspec
import numpy as np
import pytest
import torch
from qwen2_5_omni_utils import hf_audio_in_video_text
from qwen3_omni_utils import hf_audio_in_video_text3

from asyncllm.mm.audios import qwen3_asr_output_length
from asyncllm.models.omni_interleave import AudioInVideo, TimeOrderedAudioInVideo, interleaved_positions
from asyncllm.models.qwen2_5_omni import Qwen2_5OmniThinkerForConditionalGeneration as Omni
from asyncllm.protocol import MultiModalItem

IDS = {"<|vision_bos|>": 1, "<|audio_bos|>": 2, "<|audio_eos|>": 3, "<|vision_eos|>": 4, "<|VIDEO|>": 5,
       "<|AUDIO|>": 6, "<|IMAGE|>": 7}
TEXT = 8
CASES = [([4, 4, 6], 1.0, 62), ([3, 4, 4], 4.0, 120), ([6, 2, 2], 0.5, 30), ([2, 4, 4], 2.0, 150)]
"""(video grid, seconds a temporal patch, audio rows): 2 fps, 0.5 fps (patches 100 positions apart: one-token
chunks), 4 fps, 1 fps with an audio longer than the video."""
ODD_FPS = [([16, 2, 2], 2 / fps, int(16 * 50 / fps)) for fps in (0.3, 0.6, 1.2, 2.4)]
"""fps whose ``i * seconds * 25`` the float32 products of ``get_rope_index`` and the float64 ones of the processor
round to either side of a whole number (and of a chunk's end), an audio as long as the video (a chunk of each in
turn, so a video chunk's end shows in the tokens)."""


def _config():
    return SimpleNamespace(vision_start_token_id=1, audio_start_token_id=2, audio_end_token_id=3, video_token_id=5,
                           audio_token_id=6, image_token_id=7, position_id_per_seconds=25, seconds_per_chunk=2,
                           vision_config=SimpleNamespace(spatial_merge_size=2))


def _video_with_audio(grid, seconds, rows, offset, spec=None):
    """Our tokens (from <|audio_bos|> to <|audio_eos|>) and items of a video with its audio at ``offset``
    (Qwen2.5-Omni's layout, or ``spec``'s)."""
    spec = spec or AudioInVideo.of(_config())
    video = MultiModalItem("v", 0, grid[0] * grid[1] * grid[2] // 4, shape=[*grid, 1176], time_interval=seconds)
    audio = MultiModalItem("a", 0, rows, shape=[1, 17, 3000])
    tokens, items = [spec.audio_start], []
    for is_video, start, stop in spec.pieces(tuple(grid), seconds, rows):
        whole = video if is_video else audio
        items.append(msgspec.structs.replace(whole, offset=offset + len(tokens), length=stop - start,
                                             rows=[start, whole.length]))
        tokens += [IDS["<|VIDEO|>" if is_video else "<|AUDIO|>"]] * (stop - start)
    return tokens + [spec.audio_end], items


@pytest.mark.parametrize("grid, seconds, rows", CASES + ODD_FPS)
def test_the_placeholders_are_transformers(grid, seconds, rows):
    hf = hf_audio_in_video_text(grid, seconds, rows)
    ours, _ = _video_with_audio(grid, seconds, rows, 0)
    names = {v: k for k, v in IDS.items()}
    assert "".join(names[t] for t in ours) == hf


_plain = functools.partial(Omni._plain_positions, SimpleNamespace(hf_config=_config(), merge=2))
"""The thinker's own positions of images and videos (without their audio)."""


def _hf_positions(ids, videos, audio_frames, image_grid, with_audio=True, qwen3=False):
    """transformers' ``get_rope_index`` (Qwen2.5-Omni's, or Qwen3-Omni's) positions and delta."""
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (
        Qwen2_5OmniPreTrainedModelForConditionalGeneration as Hf2,
    )
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
        Qwen3OmniMoePreTrainedModelForConditionalGeneration as Hf3,
    )

    hf = Hf3 if qwen3 else Hf2
    model = SimpleNamespace(config=_config3() if qwen3 else _config(), spatial_merge_size=2,
                            get_llm_pos_ids_for_vision=functools.partial(hf.get_llm_pos_ids_for_vision, None),
                            get_chunked_index=functools.partial(hf.get_chunked_index, None))
    ids = torch.tensor([ids])
    positions, delta = hf.get_rope_index(model, ids, torch.tensor([image_grid]), torch.tensor([g for g, _, _ in videos]),
                                         torch.ones_like(ids), with_audio, torch.tensor(audio_frames),
                                         torch.tensor([s for _, s, _ in videos]))
    return positions[:, 0].numpy(), float(delta)


@pytest.mark.parametrize("videos", [[CASES[1], CASES[0]], ODD_FPS[:2], ODD_FPS[2:]], ids=["2-0.5fps", "0.3-0.6fps",
                                                                                            "1.2-2.4fps"])
def test_the_positions_are_transformers_get_rope_index(videos):
    """Text, an image, two videos with their audio and a standalone audio between them; decoding goes on from the
    last prompt position (transformers' generate), not past a video chunk that reaches further (2 fps's second)."""
    ids, items, frames = [TEXT, TEXT, IDS["<|vision_bos|>"]] + [IDS["<|IMAGE|>"]] * 4 + [IDS["<|vision_eos|>"]], [], []
    items.append(MultiModalItem("i", 3, 4, shape=[1, 4, 4, 1176]))
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
    got, delta = interleaved_positions(len(ids), items, AudioInVideo.of(_config()), _plain)
    np.testing.assert_array_equal(got, want)
    assert delta == int(got[0, -1]) + 1 - len(ids)
    if videos[1] is CASES[0]:
        assert delta != want_delta  # transformers' get_rope_index: its largest + 1


@pytest.mark.parametrize("fps", [0.3, 0.6, 1.2, 2.4, 2.0])
def test_a_plain_videos_positions_are_transformers_get_rope_index(fps):
    """A video without its audio: the thinker's time positions are get_rope_index's ``((i * seconds) * 25).long()``
    (float32), not Qwen2.5-VL's ``i * (seconds * 25)``."""
    grid, seconds = [12, 2, 2], Omni.mm_video_pieces(SimpleNamespace(vision_config=SimpleNamespace(
        temporal_patch_size=2)), None, SimpleNamespace(sampled_fps=fps), (12, 2, 2))[0].time_interval
    ids = [TEXT, IDS["<|vision_bos|>"]] + [IDS["<|VIDEO|>"]] * 12 + [IDS["<|vision_eos|>"], TEXT]
    item = MultiModalItem("v", 2, 12, shape=[*grid, 1176], time_interval=seconds)
    want, want_delta = _hf_positions(ids, [(grid, seconds, 0)], [4], [1, 2, 2], with_audio=False)
    got, delta = _plain(len(ids), [item])
    np.testing.assert_array_equal(got, want)


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
        fill_mm_items(None, AddRequest("r", [5] * 16, SamplingParams(), [1], 0.0, mm_items=[bad]), None, 2)


def _data(item, frames_short: int = 0) -> bytes:
    """Float32 values of the item's shape; an audio's ``[1, mel + 1, frames]`` with a frames' mask (its last row)
    of as many frames as its whole's rows take (4 a row: the convolution's stride and the pooling), less
    ``frames_short``."""
    values = np.zeros(item.shape, np.float32)
    if len(item.shape) == 3 and item.rows:
        values[0, -1, : 4 * item.rows[1] - frames_short] = 1
    return values.tobytes()


def _fill(items, prompt_len, piece_merge=2, frames_short=0):
    from asyncllm.mm.cache import fill_mm_items
    from asyncllm.protocol import AddRequest
    from asyncllm.sampling import SamplingParams

    items = [msgspec.structs.replace(item, data=_data(item, frames_short)) for item in items]
    fill_mm_items(None, AddRequest("r", [TEXT] * prompt_len, SamplingParams(), [1], 0.0, mm_items=items), None,
                  piece_merge)


def _replace(items, k, **fields):
    return items[:k] + [msgspec.structs.replace(items[k], **fields)] + items[k + 1:]


def test_malformed_rows_are_refused_before_any_worker_sees_them():
    """The core refuses (InvalidRequestError) pieces a worker could not take: rows for a model that takes none
    (LLaVA's image), a piece before its two start tokens, a second whole for a hash, a video's whole that is not its
    grid's, an audio's that is not its frames', pieces out of order or leaving rows out, pieces without two tokens
    of text before and after them; a video with its audio twice passes."""
    from asyncllm.errors import InvalidRequestError

    tokens, items = _video_with_audio([4, 4, 6], 1.0, 62, 2)
    _fill(items, len(tokens) + 4)
    repeat = [msgspec.structs.replace(item, offset=item.offset + len(tokens) + 2) for item in items]
    _fill(items + repeat, 2 * len(tokens) + 8)
    image = MultiModalItem("h", 1, 4, shape=[3, 4, 4], rows=[0, 999])
    assert items[1].rows == [0, 62] and items[2].rows == [items[0].length, 24]
    bad = {"no pieces here": ([image], 0), "at offset 0": ([msgspec.structs.replace(i, offset=i.offset - 2)
                                                             for i in items], 2),
           "two wholes": (_replace(items, 2, rows=[items[0].length, 28]), 2),
           "not the video's grid": ([msgspec.structs.replace(i, rows=[i.rows[0], 28]) if i.mm_hash == "v" else i
                                     for i in items], 2),
           "out of order": (_replace(items, 2, rows=[0, 24]), 2), "rows left out": (items[:-1], 2),
           "past the whole": (_replace(items, 1, rows=[0, 30]), 2), "not a pair": (_replace(items, 0, rows=[0]), 2),
           "one end token": (items, 1), "an image's placeholder as a start token": (
               [MultiModalItem("h", items[0].offset - 2, 1, shape=[1, 2, 2, 4])] + items, 2)}
    for case, (wrong, prompt_extra) in bad.items():
        with pytest.raises(InvalidRequestError, match="rows"):
            _fill(wrong, max(end.offset + end.length for end in wrong) + prompt_extra, 0 if case == "no pieces here" else 2)
            pytest.fail(case)
    with pytest.raises(InvalidRequestError, match="an audio's: its frames'"):  # the audio's mask: 2 rows fewer
        _fill(items, len(tokens) + 4, frames_short=8)


def test_only_each_outputs_first_piece_carries_data_and_takes_a_cache_operation():
    """The core fills a following piece (rows past 0) from its output's first piece: one store operation an output
    and occurrence, in the order the host looked them up (the video's, the audio's), though the last piece is a
    video chunk; a following piece with no first piece before it is refused."""
    from asyncllm.errors import InvalidRequestError
    from asyncllm.mm.cache import ProcessorCacheStore, fill_mm_items
    from asyncllm.protocol import AddRequest
    from asyncllm.sampling import SamplingParams

    tokens, items = _video_with_audio([6, 2, 2], 1.0, 30, 2)  # V A V V: the video reaches past the audio
    assert [i.mm_hash for i in items] == ["v", "a", "v", "v"]
    sent = [msgspec.structs.replace(i, data=_data(i) if i.rows[0] == 0 else None) for i in items]
    store = ProcessorCacheStore(2**30)
    message = AddRequest("r", [TEXT] * (len(tokens) + 4), SamplingParams(), [1], 0.0, mm_items=sent)
    fill_mm_items(store, message, None, 2)
    assert [i.data for i in message.mm_items] == [sent[0].data, sent[1].data, sent[0].data, sent[0].data]
    store.put("x", 1, sent[0])
    keys = [msgspec.structs.replace(i, data=None) for i in items]  # a repeat: all key-only, the first ones looked up
    fill_mm_items(store, AddRequest("s", [TEXT] * (len(tokens) + 4), SamplingParams(), [1], 0.0, mm_items=keys),
                  None, 2)
    assert list(store._entries) == ["x", "v", "a"]
    with pytest.raises(InvalidRequestError, match="rows"):
        fill_mm_items(store, AddRequest("t", [TEXT] * (len(tokens) + 4), SamplingParams(), [1], 0.0,
                                        mm_items=keys[2:]), None, 2)


# ---- Qwen3-Omni: merged token by token in time order (13 time positions a second, one an audio row)
NAMES3 = {1: "<|vision_start|>", 2: "<|audio_start|>", 3: "<|audio_end|>", 4: "<|vision_end|>", 5: "<|video_pad|>",
          6: "<|audio_pad|>", 7: "<|image_pad|>"}
CASES3 = [([4, 4, 6], 1.0, 31), ([3, 4, 4], 4.0, 120), ([6, 2, 2], 2.0, 30), ([1, 16, 16], 1.0, 3),
          ([8, 2, 2], 2 / 2.6, 60)]
"""(video grid, seconds a temporal patch, audio rows): 2 fps with the video reaching past its audio, 0.5 fps, 1 fps
with the audio past the video, one temporal patch of 8 x 8 placeholders reaching higher than its 3 audio rows (the
prompt's largest position before its last), 2.6 fps (patches 10 apart: the processor's float64 times fall just below
a whole number, get_rope_index's float32 ones on it)."""


def _config3():
    return SimpleNamespace(vision_start_token_id=1, audio_start_token_id=2, audio_end_token_id=3, video_token_id=5,
                           audio_token_id=6, image_token_id=7, position_id_per_seconds=13,
                           vision_config=SimpleNamespace(spatial_merge_size=2), audio_config=SimpleNamespace(n_window=50))


SPEC3 = TimeOrderedAudioInVideo.of(_config3())


def _frames3(rows: int) -> int:
    """Mel frames of an audio of ``rows`` Qwen3-Omni encoder rows."""
    return next(n for n in range(1, 100 * rows + 100) if qwen3_asr_output_length(n, 50) == rows)


@pytest.mark.parametrize("grid, seconds, rows", CASES3)
def test_qwen3_omni_placeholders_are_transformers(grid, seconds, rows):
    ours, _ = _video_with_audio(grid, seconds, rows, 0, SPEC3)
    assert "".join(NAMES3[t] for t in ours) == hf_audio_in_video_text3(grid, seconds, rows)


def test_qwen3_omni_fractional_time_positions_are_refused():
    """4 fps: temporal patches 6.5 time positions apart, which transformers keeps as floats."""
    with pytest.raises(ValueError, match="fractional positions are not built"):
        SPEC3.pieces((4, 2, 2), 0.5, 30)


@pytest.mark.parametrize("videos", [CASES3[:2], CASES3[2:4], CASES3[4:] + CASES3[3:4]],
                         ids=["2-0.5fps", "1fps-one-patch", "2.6fps-one-patch"])
def test_qwen3_omni_positions_are_transformers_get_rope_index(videos):
    """Text, an image, two videos with their audio and a standalone audio between them: the start and end tokens on
    consecutive positions, the pieces in get_rope_index's order; decoding goes on from the largest position + 1
    (past the last when a video's rows reach higher than what follows)."""
    ids = [TEXT, TEXT, 1] + [7] * 4 + [4]
    items, frames = [MultiModalItem("i", 3, 4, shape=[1, 4, 4, 1176])], []
    for n, (grid, seconds, rows) in enumerate(videos):
        ids += [TEXT, 1]
        tokens, pieces = _video_with_audio(grid, seconds, rows, len(ids), SPEC3)
        ids += tokens + [4, TEXT]
        items += pieces
        frames.append(_frames3(rows))
        if n == 0:
            ids += [2]
            items.append(MultiModalItem("s", len(ids), 5, shape=[1, 17, 3000]))
            ids += [6] * 5 + [3, TEXT]
            frames.append(_frames3(5))
    want, want_delta = _hf_positions(ids, videos, frames, [1, 4, 4], qwen3=True)
    got, delta = interleaved_positions(len(ids), items, SPEC3, _plain3)
    np.testing.assert_array_equal(got, want)
    assert delta == want_delta
    if videos[-1] is CASES3[3]:
        assert delta != int(got[:, -1].max()) + 1 - len(ids)


_plain3 = functools.partial(Omni._plain_positions, SimpleNamespace(hf_config=_config3(), merge=2))


def test_qwen3_omni_pieces_pass_the_core_by_their_audio_window():
    """The core checks a Qwen3-Omni audio piece's whole by its encoder's windows (``n_window`` 50: 31 rows of 237
    frames), not Qwen2.5-Omni's pooling; a whole one row off is refused."""
    from asyncllm.errors import InvalidRequestError
    from asyncllm.mm.cache import fill_mm_items
    from asyncllm.protocol import AddRequest
    from asyncllm.sampling import SamplingParams

    tokens, items = _video_with_audio([4, 4, 6], 1.0, 31, 2, SPEC3)

    def fill(items, window):
        sent = []
        for item in items:
            values = np.zeros(item.shape, np.float32)
            if len(item.shape) == 3:  # its frames' mask: 237 frames
                values[0, -1, :_frames3(31)] = 1
            sent.append(msgspec.structs.replace(item, data=values.tobytes()))
        fill_mm_items(None, AddRequest("r", [TEXT] * (len(tokens) + 4), SamplingParams(), [1], 0.0, mm_items=sent),
                      None, 2, window)

    fill(items, 50)
    with pytest.raises(InvalidRequestError, match="an audio's: its frames'"):
        fill(items, 0)
    with pytest.raises(InvalidRequestError, match="an audio's: its frames'"):
        fill([msgspec.structs.replace(i, rows=[i.rows[0], 32]) if i.mm_hash == "a" else i for i in items], 50)
